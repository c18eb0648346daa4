"""The routing proxy: many generator replicas behind one GeneratorService address.

Layout: config.py (typed settings), app.py (assembly), servicer.py (GeneratorService),
admin.py (AdminService), failover.py (one group's attempts), dispatch.py (slots and queue),
replicas.py + replica.py (membership, health), catchup.py (catch-up), breaker.py (ejection), fanout.py +
header_gate.py + spool.py (adapter publication: relay tree, heal, commit; the spool; the push itself is
rollwire.push), discovery.py (DNS), policies/ (one routing policy per module). A generator joining by itself is rollwire.generator.registration. Importing this package imports nothing.
"""
