"""Keeping the fleet: which replicas the proxy routes to, and whether each may take work.

Layout: replicas.py (the set: membership, health monitors, the fleet's limits) + replica.py (one
replica as the proxy sees it), breaker.py (ejection on consecutive failures), catchup.py
(bringing a replica to the spool's newest versions), canary.py (the check a self-registered
member passes), basemodel.py (the one base model the fleet serves), discovery.py (DNS);
AdminService, which registers, refreshes and drains members, is a door of its own above the
core (../admin.py). It reads the spool and the
policies and imports neither routing nor publishing (rollwire.proxy.routing,
rollwire.proxy.publish). Importing this package imports nothing.
"""
