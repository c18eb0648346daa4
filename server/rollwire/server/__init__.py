"""rollwire generator replicas and the routing proxy."""

__version__ = "0.1.0"
