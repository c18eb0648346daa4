"""The proxy's HTTP front door: vLLM's server API (the calls TRL makes) and OpenAI's
completions and chat completions, in the proxy process (docs/http.md).

Three layers, each importing only those below: the routes (app.py, server.py, door.py,
stream.py, tokens.py, loads.py, adapters.py), edge/ (connections, bodies, uploads) and dialect/
(OpenAI's and vLLM's shapes, conversion, errors).

Invariants:
- a thin edge: every request is converted once (dialect/convert.py) into the gRPC core's own
  messages and handed to the same dispatch, limits, failover and push path a gRPC call
  takes (the core's verbs in ../core.py: group_events, score, load, unload, status); the door
  reaches the fleet, the spool and publishing through them only; nothing behind the edge knows
  which door a request came through;
- a field the core cannot honour is refused here, by name, with a 400; nothing is silently
  ignored except the documented no-op fields (dialect/openai.py);
- an adapter load is one rollwire push: checked, spooled, relayed, healed, caught up and
  shared with peers, so it reaches every replica (loads.py over the core's load, ../publish/loads.py);
- every error is an OpenAI-style JSON body with the status its gRPC code maps to
  (dialect/errors.py); a caller's mistake is never a 500.
"""
