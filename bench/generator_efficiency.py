"""Generator efficiency: the transformers engine under concurrent load vs plain model.generate.

Same work in every mode: G groups of n samples, each exactly T new tokens (ignore_eos),
temperature 1, on the tiny model, 2 CPU cores.
  sequential  one group at a time through a real generator process (no batching possible)
  concurrent  all G groups at once through the same generator (continuous batching)
  hf-generate plain `model.generate` in one process, one group (n rows) per call
  hf-batch    plain `model.generate` with all G*n rows in one call (the static-batch ideal)
Run: .venv/bin/python bench/generator_efficiency.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio

from common import WORK, Timer, spread, tiny_model, write_result

from rollwire.client import AsyncClient, Client
from rollwire.common.services import start

GROUPS, N, TOKENS = 16, 8, 48


def hf_modes(model_dir) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    kwargs = dict(max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)
    prompts = [f"group {g}: 12+34=" for g in range(GROUPS)]
    out = {}
    with torch.no_grad(), Timer() as t:
        for p in prompts:
            ids = tok([p] * N, return_tensors="pt", padding=True)
            model.generate(**ids, **kwargs)
    out["hf-generate"] = GROUPS * N * TOKENS / t.seconds
    with torch.no_grad(), Timer() as t:
        ids = tok([p for p in prompts for _ in range(N)], return_tensors="pt", padding=True)
        model.generate(**ids, **kwargs)
    out["hf-batch"] = GROUPS * N * TOKENS / t.seconds
    return out


def served_modes(target: str) -> dict[str, float]:
    params = dict(n=N, max_new_tokens=TOKENS, ignore_eos=True, temperature=1.0)
    with Client(target, timeout=600) as c, Timer() as t:
        for g in range(GROUPS):
            c.generate(f"group {g}: 12+34=", seed=g, **params)
    sequential = GROUPS * N * TOKENS / t.seconds

    async def concurrent() -> float:
        async with AsyncClient(target, timeout=600) as c:
            with Timer() as t:
                await asyncio.gather(*(c.generate(f"group {g}: 12+34=", seed=g, **params) for g in range(GROUPS)))
        return GROUPS * N * TOKENS / t.seconds

    return {"sequential": sequential, "concurrent": asyncio.run(concurrent())}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = tiny_model()
    gen = start(["generator", "--model", str(model), "--port", "0", "--metrics-port", "0"], WORK, "bench-generator")
    runs: list[dict[str, float]] = []
    try:
        served_modes(gen.target)  # warm-up
        for _ in range(args.repeats):
            runs.append({**served_modes(gen.target), **hf_modes(model)})
    finally:
        gen.stop()
    modes = list(runs[0])
    tokens_per_s = {m: spread([r[m] for r in runs]) for m in modes}
    ratios = {
        "concurrent/sequential": spread([r["concurrent"] / r["sequential"] for r in runs]),
        "concurrent/hf-generate": spread([r["concurrent"] / r["hf-generate"] for r in runs]),
        "concurrent/hf-batch": spread([r["concurrent"] / r["hf-batch"] for r in runs]),
    }
    for m, s in tokens_per_s.items():
        print(f"{m:12s} {s['median']:9.0f} tokens/s  (min {s['min']:.0f}, max {s['max']:.0f})")
    for k, s in ratios.items():
        print(f"{k:24s} {s['median']:.2f}x  (min {s['min']:.2f}, max {s['max']:.2f})")
    write_result(
        "generator_efficiency",
        ".venv/bin/python bench/generator_efficiency.py",
        {"workload": {"groups": GROUPS, "n": N, "new_tokens": TOKENS}, "tokens_per_s": tokens_per_s, "ratios": ratios},
    )


if __name__ == "__main__":
    main()
