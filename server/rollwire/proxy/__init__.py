"""The routing proxy: many generator replicas behind one GeneratorService address.

Layout (README.md walks a group from either door to a replica and back): two doors, servicer.py
(gRPC GeneratorService) and http/ (vLLM's and OpenAI's HTTP API), over one core, core.py (admit a
group, run it, account it: accounting.py; the fleet's status); routing/ (dispatch, failover,
faults, passthrough, sessions, coalesce), publish/ (fanout, header_gate, peers; the push itself is
rollwire.push), fleet/ (replicas, replica, breaker, catchup, canary, basemodel, discovery, admin:
AdminService); spool.py + lineages.py (versions at rest), config.py + upstream.py (settings),
metrics.py, policies/ (one routing policy per module); app.py assembles, cli.py parses. A
generator joining by itself is rollwire.generator.registration. Importing this package imports
nothing.
"""
