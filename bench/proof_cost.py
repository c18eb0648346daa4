"""The cost of proving a version on every replica (issue 52): a push with a probe against the same
push without, as a share of the push.

Two stacks, each a proxy in front of 2 replicas, every version signed (trust.keys_file on every
receiver, so a probe is the replica's to pass or fail):
  tiny     the tiny model on the transformers engine (1 thread each): every replica scores the
           probe through its engine before it commits the version (a real forward pass);
  1.5b     the scripted engine on a config-only Qwen2.5-1.5B, a rank-16 LoRA (36.9 MB bf16):
           every byte is received, hashed and checked; the probe's Score costs the wire and the
           checks only (the scripted engine has no model), so this arm is the proof's overhead
           beside a push of a real adapter's size.
The probe: 4 sequences of 8 prompt + 8 continuation tokens. Pushes alternate with and without a
probe (same payload, next version), each timed from the push call until the proxy's reply (the
version committed on both replicas: a replica's proof is part of its commit). Beside them: the
publisher's own cost of the probe's numbers on the tiny model (one PEFT forward per sequence),
and the replicas' proof histogram (rollwire_generator_adapter_proof_duration_seconds).
Run: .venv/bin/python bench/proof_cost.py [--repeats 6]
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request

from common import QWEN25, WORK, config_only_model, spread, start_proxy, tiny_model, write_result
from weight_push import RANK, TARGETS, lora_shapes, safetensors_bytes

from rollwire.client import Client
from rollwire.common import probe as probes
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.signing import SigningKey
from rollwire.demo.stack import start_generators, stop_all

REPLICAS = 2
SEQUENCES, PROMPT, CONTINUATION = 4, 8, 8
COMMAND = ".venv/bin/python bench/proof_cost.py"


def proof_seconds(replicas) -> dict:
    """Sum and count of the replicas' proof histogram, scraped from their /metrics."""
    total, count = 0.0, 0.0
    for r in replicas:
        text = urllib.request.urlopen(f"http://127.0.0.1:{r.metrics_port}/metrics", timeout=10).read().decode()
        for name in ("sum", "count"):
            m = re.search(rf"^rollwire_generator_adapter_proof_duration_seconds_{name} (\S+)$", text, re.M)
            value = float(m.group(1)) if m else 0.0
            total, count = (total + value, count) if name == "sum" else (total, count + value)
    return {"proofs": count, "mean_s": total / count if count else 0.0}


def tiny_arm(key: SigningKey, trusted: str):
    """The tiny model's stack, a real adapter and its probe as its publisher computes it."""
    from support.engines import forward_logprobs
    from support.wire import make_adapter, peft_reference

    model = tiny_model()
    adapter = make_adapter(model, seed=5, r=8, scale=0.1)
    peft = peft_reference(model, adapter)
    sequences = probes.fixed_sequences(seed=1, count=SEQUENCES, prompt=PROMPT, continuation=CONTINUATION)
    start = time.perf_counter()
    logprobs = [forward_logprobs(peft, p, c).tolist() for p, c in sequences]
    publisher_s = time.perf_counter() - start
    probe = probes.build_probe(sequences, logprobs)
    extra = ["--set", "transformers.threads=1", "--set", trusted]
    replicas = start_generators(model, WORK, [f"proof-tiny-{i}" for i in range(REPLICAS)], *extra)
    proxy = start_proxy(replicas, "proof-tiny-proxy", trusted)
    lora = LoraShape(adapter.r, adapter.lora_alpha, adapter.targets)
    return replicas, proxy, adapter.payload, lora, model_fingerprint(model), probe, publisher_s


def large_arm(trusted: str):
    """The 1.5B-shaped stack on the scripted engine and a probe of its constant logprob."""
    model = config_only_model("qwen2.5-1.5b", QWEN25["1.5B"])
    payload = safetensors_bytes(lora_shapes(json.loads((model / "config.json").read_text()), RANK))
    sequences = probes.fixed_sequences(seed=1, count=SEQUENCES, prompt=PROMPT, continuation=CONTINUATION)
    probe = probes.build_probe(sequences, [[-1.0] * len(c) for _, c in sequences])  # scripted.logprob
    extra = ["--set", "engine=scripted", "--set", "scripted.tokens_per_s=0", "--set", trusted]
    replicas = start_generators(model, WORK, [f"proof-1.5b-{i}" for i in range(REPLICAS)], *extra)
    proxy = start_proxy(replicas, "proof-1.5b-proxy", trusted)
    lora = LoraShape(RANK, 2 * RANK, tuple(sorted(TARGETS)))
    return replicas, proxy, payload, lora, model_fingerprint(model, config_only=True), probe


def measure(proxy, payload: bytes, lora, fingerprint: str, probe, key: SigningKey, repeats: int) -> dict:
    """Pushes alternating without and with the probe (the first pair opens channels: untimed)."""
    client = Client(proxy.target, timeout=600)
    runs: dict[str, list[float]] = {"plain": [], "probed": []}
    try:
        version = 0
        for i in range(repeats + 1):
            order = ("plain", "probed") if i % 2 else ("probed", "plain")
            for arm in order:
                version += 1
                start = time.perf_counter()
                result = client.push_adapter(
                    "policy",
                    version,
                    payload,
                    lora,
                    fingerprint,
                    signing_key=key,
                    probe=probe if arm == "probed" else None,
                )
                seconds = time.perf_counter() - start
                assert all(r.code == "OK" for r in result.replicas), result.replicas
                if i:
                    runs[arm].append(seconds)
    finally:
        client.close()
    out = {arm: spread(values) for arm, values in runs.items()}
    plain, probed = out["plain"]["median"], out["probed"]["median"]
    out["share_of_push"] = (probed - plain) / plain
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    key = SigningKey.generate("bench")
    trust = WORK / "proof-cost-trust.json"
    WORK.mkdir(parents=True, exist_ok=True)
    trust.write_text(json.dumps({"keys": [key.trust_entry()]}))
    trusted = f"trust.keys_file={trust}"
    results: dict = {}
    processes: list = []
    try:
        replicas, proxy, payload, lora, fp, probe, publisher_s = tiny_arm(key, trusted)
        processes += [*replicas, proxy]
        results["tiny"] = measure(proxy, payload, lora, fp, probe, key, args.repeats)
        results["tiny"] |= {"payload_bytes": len(payload), "publisher_probe_s": publisher_s}
        results["tiny"]["replica_proof"] = proof_seconds(replicas)
        stop_all(processes)
        processes = []
        replicas, proxy, payload, lora, fp, probe = large_arm(trusted)
        processes += [*replicas, proxy]
        results["1.5b"] = measure(proxy, payload, lora, fp, probe, key, args.repeats)
        results["1.5b"] |= {"payload_bytes": len(payload), "replica_proof": proof_seconds(replicas)}
    finally:
        stop_all(processes)
    for arm, r in results.items():
        print(
            f"{arm}: push {r['plain']['median'] * 1e3:.1f} ms, with probe {r['probed']['median'] * 1e3:.1f} ms "
            f"({r['share_of_push'] * 100:+.1f}%); replica proof {r['replica_proof']['mean_s'] * 1e3:.2f} ms",
            flush=True,
        )
    write_result(
        "proof_cost",
        COMMAND,
        {"replicas": REPLICAS, "repeats": args.repeats, "probe": [SEQUENCES, PROMPT, CONTINUATION], "arms": results},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
