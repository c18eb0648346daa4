"""Tenants' fair share at the proxy (issue 35's must-show): one tenant flooding beside two others.

One scripted replica (100 tokens/s per sample, no model) behind a proxy that runs at most
SLOTS groups on it, so the proxy's queue is the contended resource. Tenant A floods with
A_CLIENTS rollout workers, each with a token of its own (as a trainer's many workers), and
WORKERS_EACH groups in flight per token; tenants B and C each send from one token with as many
groups in flight, so all three always wait (each wants more than a third of the slots).
Two proxies over the same replica, used one at a time and alternated every repeat:
  flat     every token is the fleet's (no tenants): the queue is round robin per token, so A's
           A_CLIENTS tokens take A_CLIENTS/(A_CLIENTS+2) of the fleet;
  tenants  the three are tenants with weights WEIGHTS: weighted fair queueing between tenants.
Each window runs WINDOW_S seconds after a warm-up; a tenant's tokens/s are counted by its
clients as they arrive (and, with tenants, by the proxy's rollwire_proxy_tenant_tokens_total:
a check). Figures per
tenant: tokens/s, its weighted share of the window's total, the ratio of the two; Jain's index
over tokens/s divided by weight (1 = perfectly weighted-fair).
Run: .venv/bin/python bench/tenant_fairness.py [--repeats 3] [--weights 1,1,1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
from common import WORK, scripted_model, spread, start_scripted, stop_all, write_result

from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

SLOTS, N, TOKENS, RATE = 6, 4, 32, 100.0
A_CLIENTS, WORKERS_EACH = 6, 8
WARMUP_S, WINDOW_S = 2.0, 10.0
TENANTS: tuple[str, ...] = ("team-a", "team-b", "team-c")


def tokens_of() -> dict[str, list[str]]:
    """Each tenant's tokens: A has one per rollout worker, B and C one each."""
    return {
        "team-a": [f"tok-a-{i}-{'x' * 16}" for i in range(A_CLIENTS)],
        "team-b": ["tok-b-0-" + "y" * 16],
        "team-c": ["tok-c-0-" + "z" * 16],
    }


def start_proxies(replicas, weights: dict[str, float]):
    """The flat proxy and the tenants' proxy over the same replicas, with their token files."""
    from rollwire.demo.stack import start_proxy

    folder = WORK / "tenant-fairness"
    folder.mkdir(parents=True, exist_ok=True)
    tokens = tokens_of()
    (folder / "admin").write_text("tok-admin-" + "w" * 16 + "\n")
    for tenant, listed in tokens.items():
        (folder / tenant).write_text("\n".join(listed) + "\n")
    (folder / "all").write_text("\n".join(t for listed in tokens.values() for t in listed) + "\n")
    common = [
        f"routing.max_in_flight_per_replica={SLOTS}", "routing.coalesce_window_ms=0", "routing.max_queue=100000",
        "fairness.max_in_flight_per_client=100000", "fairness.max_queued_tokens_per_client=1000000000",
        f"auth.admin_tokens_file={folder / 'admin'}",
    ]  # fmt: skip
    tenants = [{"name": t, "generate_tokens_file": str(folder / t), "weight": weights[t]} for t in TENANTS]
    flat = [*common, f"auth.generate_tokens_file={folder / 'all'}"]
    shared = [*common, f"tenants={json.dumps(tenants)}"]
    proxies = {}
    for mode, settings in (("flat", flat), ("tenants", shared)):
        proxies[mode] = start_proxy(WORK, f"fair-{mode}", replicas, *(a for s in settings for a in ("--set", s)))
    for proxy in proxies.values():
        wait_routable(proxy.target, "tok-admin-" + "w" * 16)
    return proxies


def wait_routable(target: str, admin: str, timeout: float = 60) -> None:
    stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = stub.GetStatus(pb.GetStatusRequest(), metadata=(("authorization", f"Bearer {admin}"),), timeout=10)
        if any(r.healthy for r in reply.replicas):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{target} routes to no replica after {timeout}s")


def tenant_tokens(proxy) -> dict[str, float]:
    """rollwire_proxy_tenant_tokens_total by tenant, read from the proxy's /metrics."""
    out = {}
    for line in proxy.metrics().splitlines():
        if line.startswith("rollwire_proxy_tenant_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('tenant="', 1)[1].split('"', 1)[0]] = float(value)
    return out


async def flood(target: str, stop_at: float, received: dict[str, int]) -> None:
    """Every tenant's workers sending groups back to back until `stop_at`, adding the tokens
    they receive to `received` per tenant as they arrive."""
    channel = grpc.aio.insecure_channel(target)
    stub = generator_pb2_grpc.GeneratorServiceStub(channel)
    request = pb.GenerateRequest(n=N, sampling=pb.SamplingParams(max_new_tokens=TOKENS, temperature=1.0))
    request.token_ids.ids.extend([1, 2, 3, 4])

    async def worker(tenant: str, token: str) -> None:
        metadata = (("authorization", f"Bearer {token}"),)
        while time.monotonic() < stop_at:
            async for message in stub.Generate(request, metadata=metadata, timeout=120):
                received[tenant] += sum(len(c.token_ids) for c in message.tokens)

    workers = [worker(t, tok) for t, listed in tokens_of().items() for tok in listed for _ in range(WORKERS_EACH)]
    await asyncio.gather(*workers)
    await channel.close()


def window(proxy, weights: dict[str, float]) -> dict:
    """One measured window through `proxy`: each tenant's tokens/s as its clients received them
    (after a warm-up), and as the proxy's tenant metrics count them (tenants only: a check)."""

    async def run() -> dict:
        received = dict.fromkeys(TENANTS, 0)
        task = asyncio.ensure_future(flood(proxy.target, time.monotonic() + WARMUP_S + WINDOW_S, received))
        await asyncio.sleep(WARMUP_S)
        before, metered, t0 = dict(received), tenant_tokens(proxy), time.monotonic()
        await asyncio.sleep(WINDOW_S)
        after, metered_after, t1 = dict(received), tenant_tokens(proxy), time.monotonic()
        await task
        per_s = {t: (after[t] - before[t]) / (t1 - t0) for t in TENANTS}
        proxy_per_s = {t: (metered_after.get(t, 0) - metered.get(t, 0)) / (t1 - t0) for t in TENANTS}
        return {"per_s": per_s, "proxy_per_s": proxy_per_s}

    measured = asyncio.run(run())
    rates = measured["per_s"]
    total, weight_sum = sum(rates.values()), sum(weights.values())
    share = {t: total * weights[t] / weight_sum for t in TENANTS}
    normalized = [rates[t] / weights[t] for t in TENANTS]
    jain = sum(normalized) ** 2 / (len(normalized) * sum(x * x for x in normalized))
    return {
        "tokens_per_s": rates,
        "total_tokens_per_s": total,
        "ratio_to_share": {t: rates[t] / share[t] for t in TENANTS},
        "jain": jain,
        "proxy_metered_tokens_per_s": measured["proxy_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weights", default="1,1,1", help="weights of team-a,team-b,team-c")
    args = ap.parse_args()
    weights = dict(zip(TENANTS, map(float, args.weights.split(",")), strict=True))
    replicas = start_scripted(scripted_model(), 1, "fair", f"scripted.tokens_per_s={RATE}")
    proxies = {}
    runs: dict[str, list[dict]] = {"flat": [], "tenants": []}
    try:
        proxies = start_proxies(replicas, weights)
        for _ in range(args.repeats):
            for mode, proxy in proxies.items():
                runs[mode].append(window(proxy, weights))
                r = runs[mode][-1]
                print(
                    f"{mode:8s} total {r['total_tokens_per_s']:7.0f} tok/s | "
                    + " ".join(f"{t} {r['tokens_per_s'][t]:6.0f} ({r['ratio_to_share'][t]:.2f}x)" for t in TENANTS)
                    + f" | Jain {r['jain']:.3f}",
                    flush=True,
                )
    finally:
        stop_all([*proxies.values(), *replicas])
    summary = {
        mode: {
            "total_tokens_per_s": spread([r["total_tokens_per_s"] for r in rs]),
            "ratio_to_share": {t: spread([r["ratio_to_share"][t] for r in rs]) for t in TENANTS},
            "jain": spread([r["jain"] for r in rs]),
        }
        for mode, rs in runs.items()
    }
    write_result(
        "tenant_fairness" + ("" if args.weights == "1,1,1" else "-" + args.weights.replace(",", "-")),
        f".venv/bin/python bench/tenant_fairness.py --repeats {args.repeats} --weights {args.weights}",
        {
            "workload": {"slots": SLOTS, "n": N, "new_tokens": TOKENS, "tokens_per_s_per_sample": RATE,
                         "a_clients": A_CLIENTS, "groups_in_flight_per_token": WORKERS_EACH,
                         "warmup_s": WARMUP_S, "window_s": WINDOW_S, "weights": weights},
            "summary": summary,
            "runs": runs,
        },
    )  # fmt: skip


if __name__ == "__main__":
    main()
