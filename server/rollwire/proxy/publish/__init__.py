"""Publishing an adapter version: a client's push through the proxy to every replica and peer.

Layout: fanout.py (one publication: relay trees while the bytes arrive, stage, heal, commit),
intake.py (a client's upload checked, spooled and relayed as it arrives, by either path),
header_gate.py (which chunks may go on to the replicas, and when), peers.py (every version in
every peer proxy's spool before its push returns; a peer's copy received), lineage_share.py
(the door's lineage map and unloads in every peer proxy's). The push itself is
rollwire.push (push/README.md walks it); the versions at rest are the spool (../spool.py). It
reads the fleet (rollwire.proxy.fleet) and never imports routing (rollwire.proxy.routing).
Importing this package imports nothing.
"""
