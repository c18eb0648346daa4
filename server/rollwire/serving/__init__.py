"""What every rollwire server process shares: the version string and security (runtime.security).

The generator (`rollwire.generator`) and the proxy (`rollwire.proxy`) are separate processes
in sibling packages; anything both need to serve gRPC lives here, never in one of them.
"""

__version__ = "0.1.0"
