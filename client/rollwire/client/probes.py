"""A publisher's probe of its own weights (rollwire.common.probe), taken with torch: the learner's
model as it trains, or a base model folder and a PEFT folder as `rollwire push-adapter --probe`
reads them. One forward for both, so every publisher's numbers are taken the same way.

Invariant: the logprobs are the raw log-softmax of each continuation token in float32 and eval
mode (no dropout), as a replica's Score computes them; the sequences are
`fixed_sequences(seed=version)`, equal in length (no padding, no attention mask to get wrong).
torch, transformers and peft are imported only when a probe is taken (the `model` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollwire.common.errors import RequestError
from rollwire.common.probe import build_probe, fixed_sequences
from rollwire.v1 import generator_pb2 as pb

PROBE_COUNT, PROBE_PROMPT, PROBE_CONTINUATION = 4, 8, 8
"""A probe's shape by default: 4 sequences of 8 prompt and 8 continuation tokens."""


def model_probe(
    model: Any,
    version: int,
    count: int = PROBE_COUNT,
    prompt: int = PROBE_PROMPT,
    continuation: int = PROBE_CONTINUATION,
) -> pb.AdapterProbe:
    """The probe of the weights `model` (a causal LM, PEFT-wrapped or not) holds now. Call it
    where the payload is taken, before anything changes the weights."""
    import torch

    sequences = fixed_sequences(seed=version, count=count, prompt=prompt, continuation=continuation)
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([p + c for p, c in sequences], device=device)  # equal lengths: no padding
            lsm = torch.log_softmax(model(input_ids=ids).logits[:, prompt - 1 : -1].float(), -1)
            targets = torch.tensor([c for _, c in sequences], device=device)
            logprobs = lsm.gather(-1, targets[..., None])[..., 0].tolist()
    finally:
        model.train(training)
    return build_probe(sequences, logprobs, seed=version)


def peft_probe(base_model: str | Path, peft_dir: str | Path, version: int) -> pb.AdapterProbe:
    """The probe of the adapter saved in `peft_dir` over the base model folder `base_model`,
    loaded in float32 on the CPU."""
    try:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RequestError(
            f"--probe runs the adapter's own forward and needs torch, transformers and peft ({exc.name} is missing): "
            "pip install 'rollwire[model]' (torch first: pip install torch==2.13.0 for the CPU wheel)"
        ) from None
    base = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(peft_dir))
    return model_probe(model, version)


__all__ = ["PROBE_CONTINUATION", "PROBE_COUNT", "PROBE_PROMPT", "model_probe", "peft_probe"]
