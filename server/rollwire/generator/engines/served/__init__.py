"""Engines whose model runs in a server beside the replica: SGLang and vLLM.

Layout: engine.py (`ServedEngine`, the skeleton both share: the one generate loop and the
window of adapter versions loaded in the server), with its parts http.py (who the server is,
its errors as statuses, the HTTP transport), process.py (launch and supervision), files.py
(adapter folders and keys on disk) and follow.py (following by continuation); then one
dialect per server: vllm_engine.py with vllm_score.py (Score), and sglang_engine.py with
sglang_process.py (launch) and sglang_protocol.py (bodies, the stream parser, reading a Score's
prompt logprobs). The shared parts never import a server's dialect, nor vLLM's and SGLang's
each other; nothing here imports the engines in the replica's own process
(rollwire.generator.engines.embedded). Importing this package imports nothing.
"""
