"""A rollwire generator replica: the GeneratorService in front of one engine.

Layout: config.py (typed settings), app.py (assembly), servicer.py (the wire edge),
convert.py (a GenerateRequest validated and converted into the group an engine runs), intake.py
(PushAdapter and CommitAdapter), adapters.py (the adapter window and push checks), engines/ (one module per engine),
registration.py (joining a proxy by itself), sampling.py and types.py (internal types).
Importing this package imports nothing heavy.
"""
