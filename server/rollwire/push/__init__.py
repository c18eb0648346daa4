"""The adapter push, whoever receives it: the proxy, a replica, a relaying replica.

Layout: reader.py + sink.py (reading one stream, hashing and storing its bytes), assembly.py
(stripes put back together), checks.py (payload checks), forward.py (relay children),
plan.py (trees, stripes, grants), results.py (a subtree's outcomes). The SDK's part, the
manifest rules and the writer, is the client-facing contract: rollwire.common.manifest and
rollwire.common.writer; nothing here re-exports it. README.md walks the four routes by which
a version reaches a replica. Importing this package imports nothing.
"""
