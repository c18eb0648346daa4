"""Routing one group: from admission to the last message a replica sends for it.

Layout: dispatch.py (admission, per-client limits, the bounded fair queue, placement through a
policy), failover.py (one group's attempts: relay, invisible retry, resume, restart), resume.py (what a
group's client holds, per sample: what a resumed attempt continues), faults.py (who is
at fault for a replica's error status), passthrough.py (a replica's refusal relayed unchanged),
sessions.py (session turns: the history kept here, sticky routing), coalesce.py (single-sample
requests for one prompt run as one group). It reads the fleet (rollwire.proxy.fleet) and the
policies; it never imports the publication (rollwire.proxy.publish), nor the fleet it.
Importing this package imports nothing.
"""
