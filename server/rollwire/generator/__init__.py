"""A rollwire generator replica: the GeneratorService in front of one engine.

Layout: config.py (typed settings), app.py (assembly), servicer.py (the wire edge and its
checks), adapters.py (the adapter window and push checks), engines/ (one module per engine),
registration.py (joining a proxy by itself), sampling.py and types.py (internal types).
Importing this package imports nothing heavy.
"""
