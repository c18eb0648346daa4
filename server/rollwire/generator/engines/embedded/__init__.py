"""Engines that run in the replica's own process: no server beside it.

Layout: transformers_engine.py (the transformers + PEFT engine: one batch, every adapter in each
forward pass), with its parts transformers_groups.py (groups, the mailbox, failure statuses),
transformers_sampling.py (the batch's sampling), kv_batch.py (the batch's KV cache surgery),
kv_memory.py (the KV-token budget from free memory), transformers_memory.py (what ends when
memory runs out), prefix_cache.py (prefix KV reuse) and lora.py (LoRA deltas by forward hooks);
scripted.py (the benchmark engine: tokens at a set rate, no model). Nothing here imports the
engines served by a server (rollwire.generator.engines.served). Importing this package imports
nothing.
"""
