"""Turn latency of an 8-turn agent episode with and without the transformers engine's prefix
KV cache, the way a sessionless harness (TRL's rollout worker, an OpenAI-style agent) drives
it: every turn resends the whole history (prompt, replies, environment tokens) as
prompt_token_ids, straight to one replica, so only the engine's work differs.

Two replicas of the same model, one with the cache (defaults) and one with it off
(transformers.prefix_cache.max_tokens=0), one torch thread each; episodes alternate between
them (the order flips every repeat). Each turn: greedy, REPLY new tokens, then ENV
environment tokens appended. Two models: the tiny one (PROMPT 32, ENV 24, REPLY 4, so turn 8
sees ~230 of its 256 positions) and a wider random Llama (hidden 512, 6 layers, 2048
positions; PROMPT 256, ENV 128, REPLY 16, turn 8 conditioned on ~1270 tokens), where a
prefill costs what it costs on a real model. Figures: each arm's median latency at turns 1,
4 and 8, the ratio with reuse over without, and the reuse arm's hit rate (prompt tokens
reused over prompt tokens, from its scraped counters).
Run: .venv/bin/python bench/prefix_cache.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import time

from common import WORK, spread, tiny_model, write_result

from rollwire.client import Client
from rollwire.demo.stack import start_generators, stop_all

TURNS = 8
SHAPES = {
    "tiny": {"prompt": 32, "env": 24, "reply": 4},
    "wide": {"prompt": 256, "env": 128, "reply": 16},
}
REPLICA = ("--set", "transformers.threads=1", "--set", "limits.max_new_tokens=64")
ARMS = {"reuse": (), "no_reuse": ("--set", "transformers.prefix_cache.max_tokens=0")}


def wide_model():
    from rollwire.demo.tiny_model import TinyModelSpec, build_tiny_model

    path = WORK / "models" / "wide-llama"
    if not (path / "config.json").exists():
        spec = TinyModelSpec(
            hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1536,
            max_position_embeddings=2048,
        )  # fmt: skip
        build_tiny_model(path, spec)
    return path


def counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def episode(client: Client, seed: int, shape: dict) -> list[float]:
    """One episode: per turn, the seconds from sending the whole history to the last token."""
    rng = random.Random(seed)
    history = [rng.randrange(3, 100) for _ in range(shape["prompt"])]
    latencies = []
    for _ in range(TURNS):
        start = time.perf_counter()
        result = client.generate(history, max_new_tokens=shape["reply"], temperature=0.0, ignore_eos=True, timeout=60)
        latencies.append(time.perf_counter() - start)
        history += list(result.samples[0].token_ids) + [rng.randrange(3, 100) for _ in range(shape["env"])]
    return latencies


def measure(name: str, model, repeats: int) -> dict:
    shape = SHAPES[name]
    replicas = {arm: start_generators(model, WORK, [f"prefix-{name}-{arm}"], *REPLICA, *extra)[0] for arm, extra in ARMS.items()}  # fmt: skip
    per_turn: dict[str, list[list[float]]] = {arm: [[] for _ in range(TURNS)] for arm in ARMS}
    try:
        clients = {arm: Client(svc.target) for arm, svc in replicas.items()}
        for arm in ARMS:  # warm-up episode each, not counted
            episode(clients[arm], 0, shape)
        for index in range(repeats):
            for arm in ARMS if index % 2 == 0 else reversed(list(ARMS)):
                for turn, seconds in enumerate(episode(clients[arm], 1000 + index, shape)):
                    per_turn[arm][turn].append(seconds)
        text = replicas["reuse"].metrics()
        reused = counter(text, "rollwire_generator_prefix_cache_hit_tokens_total")
        computed = counter(text, "rollwire_generator_prefill_tokens_total")
        for c in clients.values():
            c.close()
    finally:
        stop_all(list(replicas.values()))
    turns = {arm: {str(t + 1): spread(per_turn[arm][t]) for t in range(TURNS)} for arm in ARMS}
    ratio = {t: turns["reuse"][t]["median"] / turns["no_reuse"][t]["median"] for t in ("1", "4", str(TURNS))}
    return {"shape": shape, "turns": turns, "ratio": ratio, "hit_rate": reused / (reused + computed)}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="tiny,wide")
    args = parser.parse_args()
    models = {"tiny": tiny_model, "wide": wide_model}
    results = {}
    for name in args.models.split(","):
        results[name] = r = measure(name, models[name](), args.repeats)
        for t in ("1", "4", str(TURNS)):
            on, off = r["turns"]["reuse"][t]["median"], r["turns"]["no_reuse"][t]["median"]
            print(f"{name} turn {t}: reuse {on * 1e3:.1f} ms, no reuse {off * 1e3:.1f} ms, ratio {r['ratio'][t]:.2f}")
        print(f"{name} hit rate {r['hit_rate']:.3f}")
    write_result(
        "prefix_cache",
        f".venv/bin/python bench/prefix_cache.py --repeats {args.repeats} --models {args.models}",
        {"models": results, "turns": TURNS},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
