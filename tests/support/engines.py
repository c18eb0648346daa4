"""Engines driven in-process: running a group to the end, a manifest for a test adapter,
and the independent computation of the logprobs an engine must report."""

from __future__ import annotations

import torch

from rollwire.common.manifest import Manifest
from rollwire.generator.types import GroupRequest, SampleDone, TokenDelta


def forward_logprobs(model, prompt: list[int], completion: list[int], temperature=1.0, top_k=0, top_p=1.0):
    """Log-probs of `completion` under the documented sampling transform, from one forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        probs = torch.softmax(logits, -1)
        out = logits.clone()
        for row in range(len(logits)):
            order = torch.argsort(probs[row], descending=True)
            mass = 0.0
            for rank, tok in enumerate(order.tolist()):
                if rank > 0 and mass >= top_p:
                    out[row, tok] = float("-inf")
                mass += float(probs[row, tok])
        logits = out
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


async def collect(engine, g: GroupRequest) -> dict:
    """Run a group to the end: tokens, logprobs, versions and the SampleDone of each sample."""
    out = {"tokens": {}, "logprobs": {}, "versions": {}, "text": {}, "done": {}}
    async for events in engine.generate(g):
        for ev in events:
            if isinstance(ev, TokenDelta):
                assert ev.sample_index not in out["done"], "tokens after the sample finished"
                out["tokens"].setdefault(ev.sample_index, []).extend(ev.token_ids)
                out["logprobs"].setdefault(ev.sample_index, []).extend(ev.logprobs)
                out["versions"].setdefault(ev.sample_index, set()).add(ev.version)
                out["text"][ev.sample_index] = out["text"].get(ev.sample_index, "") + ev.text
            else:
                assert isinstance(ev, SampleDone) and ev.sample_index not in out["done"]
                out["done"][ev.sample_index] = ev
    return out


def manifest_for(adapter, name: str, version: int) -> Manifest:
    lora = adapter.shape
    return Manifest(name, version, "sha256:test", lora, len(adapter.payload), adapter.sha256)
