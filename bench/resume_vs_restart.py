"""Generation lost per replica death: resume vs restart (issue 37, item 1).

Two replicas of the tiny model behind two proxies over the same replicas: one resumes a group
whose replica fails mid-stream (routing.resume, the default), one restarts it
(routing.resume=false, as before). Per repeat, one seeded group (n samples, max_new tokens
each, EOS ignored) is run three ways, the order of the arms alternating repeat by repeat:
uninterrupted (`none`), and through each proxy with the replica serving it SIGKILLed once
sample 0 holds half its tokens (an event of the stream); the killed replica is started again
on its port before the next run.

Figures per arm: the client-seen time to finish the group, and from the kill to its end;
tokens generated twice per death (what the dead replica relayed, which is the tokens the
client discarded at `restarted` or those the proxy kept to resume, plus the survivor's
completion tokens for the group from its own counter, less the group's total: a lower bound,
since tokens the dead replica sampled but never relayed are not seen); the continuation's
prefill tokens (the survivor's prefill counter); and whether the group's tokens equal the
uninterrupted run's.
Run: .venv/bin/python bench/resume_vs_restart.py [--repeats 4] [--n 16] [--max-new 224]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import grpc
from common import WORK, spread, tiny_model, write_result

from rollwire.demo.stack import generator_args, routing, start, start_proxy, stop_all
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

REPLICA = ("--set", "transformers.threads=1", "--set", "limits.max_new_tokens=512", "--set", "limits.max_n=16")
PROXY = ("--set", "health.interval_s=0.2")


def counter(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def survivor_counts(service) -> tuple[float, float]:
    text = service.metrics()
    return (
        counter(text, "rollwire_generator_tokens_total", '{kind="completion"}'),
        counter(text, "rollwire_generator_prefill_tokens_total"),
    )


def kept_by_proxy(proxy) -> int:
    """Tokens the proxy had relayed when it resumed the last group (its attempt_failed log line)."""
    lines = [json.loads(x) for x in proxy.log_path.read_text().splitlines() if x.startswith("{")]
    return [e for e in lines if e.get("event") == "attempt_failed" and e.get("then") == "resume"][-1]["tokens_kept"]


def run(proxy, replicas: dict, seed: int, args, kill: bool) -> dict:
    """One group through `proxy`; with `kill`, SIGKILL its replica once sample 0 has half its tokens."""
    req = pb.GenerateRequest(
        text="resume bench: ",
        n=args.n,
        sampling=pb.SamplingParams(max_new_tokens=args.max_new, seed=seed, temperature=1.0, ignore_eos=True),
    )
    tokens: dict[int, list[int]] = {}
    out = {"killed": None, "discarded": 0, "restarts": 0, "sent_before_kill": 0}
    before: dict = {}
    killed_at = 0.0
    start_t = time.perf_counter()
    with grpc.insecure_channel(proxy.target) as channel:
        for msg in generator_pb2_grpc.GeneratorServiceStub(channel).Generate(req, timeout=300):
            if msg.HasField("restarted"):
                out["restarts"] += 1
                out["discarded"] += sum(len(t) for t in tokens.values())
                tokens = {}
            if msg.HasField("started") and out["killed"] is None:
                out["replica"] = msg.started.replica
            for t in msg.tokens:
                tokens.setdefault(t.sample_index, []).extend(t.token_ids)
            if kill and out["killed"] is None and len(tokens.get(0, ())) >= args.max_new // 2:
                victim = replicas[out["replica"]]
                others = [r for r in replicas.values() if r is not victim]
                before = {r.name: survivor_counts(r) for r in others}
                victim.proc.kill()
                killed_at = time.perf_counter()
                out["killed"] = victim.name
                out["sent_before_kill"] = sum(len(t) for t in tokens.values())
    out["seconds"] = time.perf_counter() - start_t
    out["after_kill_s"] = time.perf_counter() - killed_at if killed_at else 0.0
    out["tokens"] = tokens
    if kill:
        (name, (done0, prefill0)), *_ = before.items()
        done1, prefill1 = survivor_counts(next(r for r in replicas.values() if r.name == name))
        total = args.n * args.max_new
        out["survivor_completion"] = done1 - done0
        out["survivor_prefill"] = prefill1 - prefill0
        # what the victim relayed (the client's discarded tokens, or what the proxy kept to resume) plus what
        # the survivor generated, less what the group needed: tokens sampled twice (those the victim sampled
        # but never relayed are not seen, so it is a lower bound)
        out["from_victim"] = out["discarded"] if out["restarts"] else kept_by_proxy(proxy)
        out["generated_twice"] = out["from_victim"] + out["survivor_completion"] - total
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=224)
    args = ap.parse_args()
    model, work = tiny_model(), WORK / "resume_vs_restart"
    names = ["r0", "r1"]
    replicas = {n: start(generator_args(model, *REPLICA, "--replica-id", n), work, n, probe=True) for n in names}
    proxies = {}
    try:
        proxies["resume"] = routing(
            start_proxy(work, "px-resume", list(replicas.values()), *PROXY), list(replicas.values())
        )
        proxies["restart"] = routing(
            start_proxy(work, "px-restart", list(replicas.values()), *PROXY, "--set", "routing.resume=false"),
            list(replicas.values()),
        )
        results: dict[str, list[dict]] = {"none": [], "resume": [], "restart": []}
        for rep in range(args.repeats):
            seed = 100 + rep
            baseline = run(proxies["resume"], replicas, seed, args, kill=False)
            results["none"].append(baseline)
            for arm in ("resume", "restart") if rep % 2 == 0 else ("restart", "resume"):
                r = run(proxies[arm], replicas, seed, args, kill=True)
                r["exact"] = r["tokens"] == baseline["tokens"]
                results[arm].append(r)
                victim = replicas[r["killed"]]
                victim.proc.wait(10)
                replicas[victim.name] = start(
                    generator_args(model, *REPLICA, "--replica-id", victim.name, "--port", str(victim.port)),
                    work,
                    victim.name,
                    probe=True,
                )
                for p in proxies.values():
                    routing(p, list(replicas.values()), timeout=60)
                print(
                    f"rep {rep} {arm}: {r['seconds']:.2f}s, twice {r['generated_twice']:.0f}, "
                    f"discarded {r['discarded']}, exact {r['exact']}",
                    file=sys.stderr,
                )
    finally:
        stop_all([*proxies.values(), *replicas.values()])
    arms = {}
    for arm, runs in results.items():
        figures = {"seconds": spread([r["seconds"] for r in runs])}
        if arm != "none":
            figures |= {
                "generated_twice": spread([r["generated_twice"] for r in runs]),
                "discarded": spread([float(r["discarded"]) for r in runs]),
                "sent_before_kill": spread([float(r["sent_before_kill"]) for r in runs]),
                "survivor_prefill": spread([r["survivor_prefill"] for r in runs]),
                "after_kill_s": spread([r["after_kill_s"] for r in runs]),
                "restarts": sum(r["restarts"] for r in runs),
                "exact": sum(r["exact"] for r in runs),
            }
        arms[arm] = figures
    command = (
        f".venv/bin/python bench/resume_vs_restart.py --repeats {args.repeats} --n {args.n} --max-new {args.max_new}"
    )
    write_result(
        "resume_vs_restart",
        command,
        {"n": args.n, "max_new_tokens": args.max_new, "repeats": args.repeats, "arms": arms},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
