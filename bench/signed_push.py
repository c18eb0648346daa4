"""Signed pushes: what signing a version and verifying it at every hop adds to a push (issue 37, item 3).

Two stacks side by side, each a proxy in front of 2 scripted replicas of a config-only
Qwen2.5-0.5B (so every byte is received, hashed and checked against the layer shapes):
  unsigned  today's stack: no trust.keys_file, versions pushed unsigned;
  signed    every replica and the proxy with trust.keys_file, versions pushed signed by the SDK
            (Ed25519 over the manifest; each receiver verifies it before reading the payload).
The same rank-16 LoRA payload (17.6 MB bf16) is pushed through each proxy, the two arms
alternating push by push, each timed from the push call (which hashes the payload) until both
replicas serve the version (the proxy's reply, then a 1-token Generate pinned to the version on
each replica). Beside them, the cost of one sign and one verify of a manifest, in microseconds.
Run: .venv/bin/python bench/signed_push.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import time

from common import QWEN25, WORK, config_only_model, spread, start_proxy, start_scripted, stop_all, write_result
from weight_push import RANK, TARGETS, lora_shapes, safetensors_bytes

from rollwire.client import Client
from rollwire.client._push import build_manifest
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.signing import SigningKey, TrustedKeys, sign

REPLICAS = 2
COMMAND = ".venv/bin/python bench/signed_push.py"


class Arm:
    """One stack: a proxy over its replicas, and the key its pushes are signed with (or None)."""

    def __init__(self, proxy, replicas, fingerprint: str, key: SigningKey | None) -> None:
        self.proxy = Client(proxy.target, timeout=600)
        self.direct = [Client(r.target, timeout=60) for r in replicas]
        self.fingerprint, self.key = fingerprint, key

    def push(self, version: int, payload: bytes) -> dict[str, float]:
        lora = LoraShape(RANK, 2 * RANK, tuple(sorted(TARGETS)))
        start = time.perf_counter()
        self.proxy.push_adapter("policy", version, payload, lora, self.fingerprint, signing_key=self.key)
        replied = time.perf_counter() - start
        for c in self.direct:
            result = c.generate([1], n=1, max_new_tokens=1, adapter=f"policy@{version}")
            assert result.samples[0].adapter_version == version
        return {"served_s": time.perf_counter() - start, "reply_s": replied}

    def close(self) -> None:
        for c in (self.proxy, *self.direct):
            c.close()


def crypto_cost(payload: bytes, fingerprint: str, key: SigningKey, repeats: int = 2000) -> dict:
    """Microseconds of one sign and one verify of the manifest (the payload is hashed either way)."""
    lora = LoraShape(RANK, 2 * RANK, tuple(sorted(TARGETS)))
    manifest = build_manifest("policy", 1, payload, lora, fingerprint)
    trust = TrustedKeys({key.key_id: key.private.public_key()})
    start = time.perf_counter()
    for _ in range(repeats):
        sign(manifest, key)
    signed = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeats):
        trust.check(manifest)
    verified = time.perf_counter() - start
    return {"sign_us": signed / repeats * 1e6, "verify_us": verified / repeats * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    model = config_only_model("qwen2.5-0.5b", QWEN25["0.5B"])
    fingerprint = model_fingerprint(model, config_only=True)
    payload = safetensors_bytes(lora_shapes(json.loads((model / "config.json").read_text()), RANK))
    key = SigningKey.generate("bench")
    trust = WORK / "signed-push-trust.json"
    trust.write_text(json.dumps({"keys": [key.trust_entry()]}))
    trusted = f"trust.keys_file={trust}"
    processes, arms = [], {}
    try:
        for arm, signing in (("unsigned", None), ("signed", key)):
            settings = ["scripted.tokens_per_s=0", *([trusted] if signing else [])]
            replicas = start_scripted(model, REPLICAS, f"signed-push-{arm}", *settings)
            processes += replicas
            proxy = start_proxy(replicas, f"signed-push-proxy-{arm}", "spool.keep_versions=2", *settings[1:])
            processes.append(proxy)
            arms[arm] = Arm(proxy, replicas, fingerprint, signing)
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for version in range(1, args.repeats + 2):  # the first push of each arm opens channels: untimed
            order = list(arms) if version % 2 else list(reversed(arms))  # alternate which arm goes first
            for arm in order:
                runs[arm].append(arms[arm].push(version, payload))
        out = {arm: {k: spread([r[k] for r in rs[1:]]) for k in ("served_s", "reply_s")} for arm, rs in runs.items()}
        ratio = out["signed"]["served_s"]["median"] / out["unsigned"]["served_s"]["median"]
        print(f"signed / unsigned push, until both replicas serve: {ratio:.3f}", flush=True)
    finally:
        for a in arms.values():
            a.close()
        stop_all(processes)
    write_result(
        "signed_push",
        COMMAND,
        {
            "payload_bytes": len(payload),
            "replicas": REPLICAS,
            "repeats": args.repeats,
            "arms": out,
            "signed_over_unsigned": ratio,
            "crypto": crypto_cost(payload, fingerprint, key),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
