"""HTTP front door vs gRPC: the same load through the proxy's two doors.

One scripted replica emits 100 tokens/s per sample (groups of n=8, 32 new tokens: ~0.31 s
of pure generation per group), so the model's cost does not hide the doors'. Each load is a
closed loop of W workers sending groups back to back, through the proxy's gRPC port (the
SDK's AsyncClient, streamed) and its HTTP door (/v1/completions with token-id prompts and
`return_token_ids`, as TRL's rollout worker sends them, streamed as server-sent events so
the first token's time is seen; aiohttp, one session per run); the modes alternate within
every repeat, so drift of this shared machine hits both alike.
  light  W=1: latency of a lone request
  busy   W=16: 16 groups in flight
  trl    TRL's worker shape over HTTP: 64 single-sample requests in flight, not streamed, in
         groups of 8 with one prompt each and a random seed per request (the proxy may serve
         a group's 8 as one: routing.coalesce_window_ms); over gRPC the same samples as
         rollwire's own grouped requests (8 workers, n=8)
Figures: tokens/s, p50/p99 latency and time to first token per door, the proxy's CPU time
per sample (utime + stime of its process over the run), and what HTTP adds (http - grpc,
per repeat). The physical floor is the scripted engine's own time.
Run: .venv/bin/python bench/http_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from common import closed_loop, percentile, scripted_model, spread, start_proxy, start_scripted, stop_all, write_result

TOKENS, RATE = 32, 100.0
LOADS = {"light": (1, 16, 8), "busy": (16, 8, 8), "trl": (64, 4, 1)}  # name -> (workers, requests each, n)
TRL_GROUP = 8
"""TRL's num_generations: its worker sends a group as this many n=1 requests for one prompt."""


async def http_loop(url: str, workers: int, requests_each: int, n: int, tokens: int, stream: bool = True) -> dict:
    """`workers` HTTP clients each sending completions back to back (streamed, or whole as TRL's
    worker asks: then the first token's time is the response's); same figures as closed_loop."""
    import aiohttp

    latencies, ttfts, counted = [], [], [0]

    async def worker(w: int, session) -> None:
        for i in range(requests_each):
            key = w // TRL_GROUP if n == 1 else w  # TRL's shape: a group's requests share their prompt
            body = {
                "model": "base",
                "prompt": [1 + key % 50, 2 + i % 50],
                "n": n,
                "max_tokens": tokens,
                "seed": w * 1000 + i,
                "logprobs": 0,
                "return_token_ids": True,
                "stream": stream,
            }
            sent, first = time.perf_counter(), None
            async with session.post(url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                if not stream:
                    choices = (await response.json())["choices"]
                    first = time.perf_counter()
                    counted[0] += sum(len(c["token_ids"]) for c in choices)
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("token_ids"):
                            first = first or time.perf_counter()
                            counted[0] += len(choice["token_ids"])
            latencies.append(time.perf_counter() - sent)
            ttfts.append((first or time.perf_counter()) - sent)

    connector = aiohttp.TCPConnector(limit=workers)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(w, session) for w in range(workers)))
        wall = time.perf_counter() - start
    return {"latencies": latencies, "ttfts": ttfts, "tokens": counted[0], "wall_s": wall}


def cpu_s(pid: int) -> float:
    """utime + stime of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def figures(run: dict) -> dict[str, float]:
    lat, ttft = run["latencies"], run["ttfts"]
    return {
        "proxy_cpu_ms_per_sample": 1e3 * run["proxy_cpu_s"] / run["samples"],
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
    replicas = start_scripted(model, 1, "http-overhead", f"scripted.tokens_per_s={RATE}", "limits.max_queue=1024")
    proxy = start_proxy(replicas, "http-overhead-proxy", "http.port=0", "routing.max_in_flight_per_replica=64")
    url = proxy.http_url
    runs: dict[str, dict[str, list[dict]]] = {load: {"grpc": [], "http": []} for load in LOADS}

    def run(mode: str, workers: int, each: int, n: int) -> dict:
        before = cpu_s(proxy.proc.pid)
        if mode == "grpc":
            if n == 1:  # the same samples as rollwire's own grouped requests
                workers, n = workers // TRL_GROUP, TRL_GROUP
            out = asyncio.run(closed_loop(proxy.target, workers, each, n, TOKENS))
        else:
            out = asyncio.run(http_loop(url, workers, each, n, TOKENS, stream=n > 1))
        return out | {"proxy_cpu_s": cpu_s(proxy.proc.pid) - before, "samples": workers * each * n}

    try:
        for mode in ("grpc", "http"):  # warm-up: connections, first-call paths
            run(mode, 4, 2, 8)
        for _ in range(args.repeats):
            for load, (workers, each, n) in LOADS.items():
                for mode in ("grpc", "http"):
                    runs[load][mode].append(figures(run(mode, workers, each, n)))
    finally:
        proxy.stop()
        stop_all(replicas)
    results = {}
    for load, modes in runs.items():
        keys = list(modes["grpc"][0])
        pairs = list(zip(modes["grpc"], modes["http"], strict=True))
        workers, each, n = LOADS[load]
        results[load] = {
            "workers": workers,
            "requests": workers * each,
            "n": n,
            **{mode: {k: spread([r[k] for r in rs]) for k in keys} for mode, rs in modes.items()},
            "added_p50_s": spread([h["p50_s"] - g["p50_s"] for g, h in pairs]),
            "added_p99_s": spread([h["p99_s"] - g["p99_s"] for g, h in pairs]),
            "added_ttft_p50_s": spread([h["ttft_p50_s"] - g["ttft_p50_s"] for g, h in pairs]),
            "throughput_ratio": spread([h["tokens_per_s"] / g["tokens_per_s"] for g, h in pairs]),
        }
        r = results[load]
        print(
            f"{load:6s} grpc {r['grpc']['tokens_per_s']['median']:8.0f} tok/s p50 {r['grpc']['p50_s']['median'] * 1e3:6.1f} ms | "
            f"http {r['http']['tokens_per_s']['median']:8.0f} tok/s p50 {r['http']['p50_s']['median'] * 1e3:6.1f} ms | "
            f"added p50 {r['added_p50_s']['median'] * 1e3:.1f} ms, ttft {r['added_ttft_p50_s']['median'] * 1e3:.1f} ms, "
            f"throughput http/grpc {r['throughput_ratio']['median']:.2f}"
        )
    write_result(
        "http_overhead",
        ".venv/bin/python bench/http_overhead.py",
        {
            "workload": {"new_tokens": TOKENS, "tokens_per_s_per_sample": RATE, "ideal_request_s": (TOKENS - 1) / RATE},
            "loads": results,
        },
    )


if __name__ == "__main__":
    main()
