"""Multi-turn sessions through the proxy: sticky routing under load, and turn latency with and
without the transformers engine's prefix KV cache (issue 25).

Part 1, sticky routing: 32 concurrent 8-turn sessions (greedy, environment tokens between
turns) over 2 replicas of the tiny model behind one proxy; figures from the proxy's
rollwire_proxy_session_routes_total (sticky hit rate = sticky / turns after the first, and
the moves by cause) and the replicas' prefix-cache counters (prompt tokens reused / prompt
tokens).

Part 2, turn latency of the session path: one session at a time, 8 turns each, through a
proxy over one replica with the prefix cache on and through another over one replica with it
off (transformers.prefix_cache.max_tokens=0), the two alternating session by session after a
warm-up session each; the shapes and models of bench/prefix_cache.py (tiny: a 32-token
prompt, 24 environment and 4 model tokens a turn; wide: a random Llama of hidden 512, 6
layers, 256/128/16). Figures: each arm's median latency of turns 1, 4 and 8, and the ratio
with reuse over without.
Run: .venv/bin/python bench/sessions.py [--sessions 32] [--turns 8] [--latency-sessions 6] [--models tiny,wide]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time

from common import WORK, spread, tiny_model, write_result
from prefix_cache import SHAPES, wide_model

from rollwire.client import AsyncClient, Client
from rollwire.demo.stack import routing, start_generators, start_proxy, stop_all

REPLICA = ("--set", "transformers.threads=1", "--set", "limits.max_new_tokens=64")
MODELS = {"tiny": tiny_model, "wide": wide_model}


def scrape(text: str, name: str) -> dict[str, float]:
    """Every sample of one metric, by its label set."""
    found = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            found[m.group(1) or ""] = float(m.group(2))
    return found


def tokens(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(3, 100) for _ in range(k)]


def options(shape: dict) -> dict:
    return {"max_new_tokens": shape["reply"], "temperature": 0.0, "ignore_eos": True}


async def episode(client: AsyncClient, seed: int, turns: int, shape: dict) -> list[float]:
    rng = random.Random(seed)
    session = client.session(**options(shape))
    latencies = []
    for turn in range(turns):
        start = time.perf_counter()
        await session.turn(tokens(rng, shape["env"] if turn else shape["prompt"]), end=turn == turns - 1, timeout=120)
        latencies.append(time.perf_counter() - start)
    return latencies


def play(client: Client, seed: int, turns: int, shape: dict) -> list[float]:
    rng = random.Random(seed)
    session = client.session(**options(shape))
    latencies = []
    for turn in range(turns):
        start = time.perf_counter()
        session.turn(tokens(rng, shape["env"] if turn else shape["prompt"]), end=turn == turns - 1, timeout=120)
        latencies.append(time.perf_counter() - start)
    return latencies


def sticky(sessions: int, turns: int) -> dict:
    model = tiny_model()
    replicas = start_generators(model, WORK, ["sess-a", "sess-b"], *REPLICA)
    proxy = routing(start_proxy(WORK, "sess-proxy", replicas), replicas)
    try:

        async def run() -> list[list[float]]:
            async with AsyncClient(proxy.target) as client:
                return await asyncio.gather(*(episode(client, i, turns, SHAPES["tiny"]) for i in range(sessions)))

        start = time.perf_counter()
        latencies = asyncio.run(run())
        seconds = time.perf_counter() - start
        routes = {k.split('"')[1]: v for k, v in scrape(proxy.metrics(), "rollwire_proxy_session_routes_total").items()}
        reused = prefill = 0.0
        for replica in replicas:
            text = replica.metrics()
            reused += sum(scrape(text, "rollwire_generator_prefix_cache_hit_tokens_total").values())
            prefill += sum(scrape(text, "rollwire_generator_prefill_tokens_total").values())
    finally:
        stop_all([proxy, *replicas])
    later = sum(v for k, v in routes.items() if k != "first")
    return {
        "sessions": sessions,
        "turns": turns,
        "seconds": seconds,
        "routes": routes,
        "sticky_hit_rate": routes.get("sticky", 0.0) / later if later else None,
        "prompt_tokens_reused": reused,
        "prompt_tokens_computed": prefill,
        "turn_latency_s": spread([x for run in latencies for x in run]),
    }


def latency(name: str, count: int, turns: int) -> dict:
    model, shape = MODELS[name](), SHAPES[name]
    arms = {"reuse": (), "no_reuse": ("--set", "transformers.prefix_cache.max_tokens=0")}
    started = {}
    per_turn: dict[str, list[list[float]]] = {arm: [[] for _ in range(turns)] for arm in arms}
    try:
        for arm, extra in arms.items():
            replica = start_generators(model, WORK, [f"lat-{name}-{arm}"], *REPLICA, *extra)[0]
            started[arm] = (replica, routing(start_proxy(WORK, f"lat-proxy-{name}-{arm}", [replica]), [replica]))
        clients = {arm: Client(proxy.target) for arm, (_, proxy) in started.items()}
        for arm in arms:  # a warm-up session each, not counted
            play(clients[arm], 0, turns, shape)
        for index in range(count):
            for arm in arms if index % 2 == 0 else reversed(list(arms)):
                for turn, seconds in enumerate(play(clients[arm], 1000 + index, turns, shape)):
                    per_turn[arm][turn].append(seconds)
        for client in clients.values():
            client.close()
    finally:
        stop_all([s for pair in started.values() for s in pair])
    return {
        "shape": shape,
        "turns": {arm: {str(t + 1): spread(per_turn[arm][t]) for t in range(turns)} for arm in arms},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--latency-sessions", type=int, default=6)
    parser.add_argument("--models", default="tiny,wide")
    args = parser.parse_args()
    load = sticky(args.sessions, args.turns)
    print(f"sticky hit rate {load['sticky_hit_rate']:.3f}; routes {load['routes']}")
    models = {}
    for name in args.models.split(","):
        models[name] = latency(name, args.latency_sessions, args.turns)
        arms = models[name]["turns"]
        for turn in ("1", "4", str(args.turns)):
            on, off = arms["reuse"][turn]["median"], arms["no_reuse"][turn]["median"]
            print(f"{name} turn {turn}: reuse {on * 1e3:.1f} ms, no reuse {off * 1e3:.1f} ms, ratio {on / off:.2f}")
    command = (
        f".venv/bin/python bench/sessions.py --sessions {args.sessions} --turns {args.turns} "
        f"--latency-sessions {args.latency_sessions} --models {args.models}"
    )
    write_result("sessions", command, {"turns": args.turns, "load": load, "models": models})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
