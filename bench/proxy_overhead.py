"""Proxy overhead: the same load sent straight to a scripted replica and through the proxy.

One scripted replica emits 100 tokens/s per sample (groups of n=8, 32 new tokens: ~0.31 s
of pure generation per group), so the model's cost does not hide the proxy's. Each load is
a closed loop of W workers sending groups back to back; the direct and proxied runs
alternate within every repeat, so drift of this shared machine hits both alike.
  light  W=1: latency of a lone request
  busy   W=16: 16 groups in flight, ~1,600 response messages/s through the proxy
Figures: tokens/s, p50/p99 latency and time to first token, and the latency the proxy adds
per request (proxied p50 - direct p50, per repeat).
Run: .venv/bin/python bench/proxy_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio

from common import closed_loop, percentile, scripted_model, spread, start_proxy, start_scripted, stop_all, write_result

N, TOKENS, RATE = 8, 32, 100.0
LOADS = {"light": (1, 16), "busy": (16, 12)}  # name -> (workers, requests per worker)


def figures(run: dict) -> dict[str, float]:
    lat, ttft = run["latencies"], run["ttfts"]
    return {
        "tokens_per_s": run["tokens"] / run["wall_s"],
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = scripted_model()
    replicas = start_scripted(model, 1, "overhead", f"scripted.tokens_per_s={RATE}")
    proxy = start_proxy(replicas, "overhead-proxy")
    targets = {"direct": replicas[0].target, "proxy": proxy.target}
    runs: dict[str, dict[str, list[dict]]] = {load: {mode: [] for mode in targets} for load in LOADS}
    try:
        for target in targets.values():  # warm-up: channels, first-call paths
            asyncio.run(closed_loop(target, 4, 2, N, TOKENS))
        for _ in range(args.repeats):
            for load, (workers, each) in LOADS.items():
                for mode, target in targets.items():
                    runs[load][mode].append(figures(asyncio.run(closed_loop(target, workers, each, N, TOKENS))))
    finally:
        proxy.stop()
        stop_all(replicas)
    results = {}
    for load, modes in runs.items():
        keys = list(modes["direct"][0])
        pairs = list(zip(modes["direct"], modes["proxy"], strict=False))
        results[load] = {
            "workers": LOADS[load][0],
            "requests": LOADS[load][0] * LOADS[load][1],
            **{mode: {k: spread([r[k] for r in rs]) for k in keys} for mode, rs in modes.items()},
            "added_p50_s": spread([p["p50_s"] - d["p50_s"] for d, p in pairs]),
            "added_p99_s": spread([p["p99_s"] - d["p99_s"] for d, p in pairs]),
            "added_ttft_p50_s": spread([p["ttft_p50_s"] - d["ttft_p50_s"] for d, p in pairs]),
            "throughput_ratio": spread([p["tokens_per_s"] / d["tokens_per_s"] for d, p in pairs]),
        }
        r = results[load]
        print(
            f"{load:6s} direct {r['direct']['tokens_per_s']['median']:8.0f} tok/s p50 {r['direct']['p50_s']['median'] * 1e3:6.1f} ms | "
            f"proxy {r['proxy']['tokens_per_s']['median']:8.0f} tok/s p50 {r['proxy']['p50_s']['median'] * 1e3:6.1f} ms | "
            f"added p50 {r['added_p50_s']['median'] * 1e3:.1f} ms, ttft {r['added_ttft_p50_s']['median'] * 1e3:.1f} ms"
        )
    write_result(
        "proxy_overhead",
        ".venv/bin/python bench/proxy_overhead.py",
        {
            "workload": {
                "n": N,
                "new_tokens": TOKENS,
                "tokens_per_s_per_sample": RATE,
                "ideal_request_s": (TOKENS - 1) / RATE,
            },
            "loads": results,
        },
    )


if __name__ == "__main__":
    main()
