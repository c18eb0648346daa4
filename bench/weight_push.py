"""Weight push: a LoRA adapter through the proxy to 1, 2 and 4 replicas, against the alternatives.

Synthetic rank-16 adapters on all linear layers with the shapes of Qwen2.5-0.5B, 1.5B and 7B
(bf16: 17.6, 36.9, 80.7 MB) go through `rollwire proxy` to scripted replicas serving a
config-only folder of that model, so every byte is received, hashed and checked against the
model's layer shapes as in production, and no multi-GB weights are needed. A push is timed
from the push call (which hashes the payload) until every replica serves the version: the
proxy's reply, then a 1-token Generate pinned to the version on each replica directly.
Side by side, in the same run:
  disk      the adapter written with safetensors save_file and read back with load_file
            (one learner, one replica, page cache: the best case of a shared filesystem)
  full      the full model's bytes pushed the same way: what a non-LoRA sync moves. PushAdapter
            accepts only LoRA-shaped tensors, so the payload is an adapter of the rank whose
            size reaches the full bf16 weights (0.5B: r=899, 0.989 GB). Measured for 0.5B only
            (RAM); 1.5B and 7B are extrapolated from the measured bytes/s, labelled as such.
  tcp       the same bytes over loopback TCP to N receivers at once (sendall/recv_into):
            the physical limit of this machine.
Run: .venv/bin/python bench/weight_push.py [--repeats 5] [--full-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import tempfile
import threading
import time

from common import QWEN25, WORK, Timer, config_only_model, spread, start_proxy, start_scripted, stop_all, write_result

from rollwire.client import Client
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.generator.shapes import config_linear_shapes
from rollwire.push.checks import expected_lora_shapes

RANK, REPLICAS = 16, (1, 2, 4)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GiB = 1 << 30


def full_params(c: dict) -> int:
    """Parameters of a Qwen2 model from its config: embeddings, layers (q/k/v biases), norms."""
    h, heads, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attn = h * heads * d + heads * d + 2 * (h * kv * d + kv * d) + heads * d * h
    layer = attn + 3 * h * c["intermediate_size"] + 2 * h
    embed = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
    return embed + c["num_hidden_layers"] * layer + h


def lora_shapes(config: dict, r: int) -> dict[str, tuple[int, int]]:
    return expected_lora_shapes(LoraShape(r, 2 * r, TARGETS), config_linear_shapes(config))


def safetensors_bytes(shapes: dict[str, tuple[int, int]]) -> bytes:
    """A bf16 safetensors file of zeros (content does not change any cost measured here)."""
    header, offset = {}, 0
    for name, (a, b) in shapes.items():
        header[name] = {"dtype": "BF16", "shape": [a, b], "data_offsets": [offset, offset + 2 * a * b]}
        offset += 2 * a * b
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + bytes(offset)


class Pusher:
    """Pushes versions of one adapter name through a proxy and confirms them on each replica."""

    def __init__(self, proxy, replicas, fingerprint: str, bulk: bool = False) -> None:
        self.proxy = Client(proxy.target, timeout=600)
        self.direct = [Client(r.target, timeout=60) for r in replicas]
        self.fingerprint, self.bulk = fingerprint, bulk
        """`bulk`: ask for the bulk path (servers with bulk.enabled), every hop then takes it."""

    def push(self, name: str, version: int, payload: bytes, r: int, direct: bool = False) -> dict[str, float]:
        """Seconds until the push call returned and until every replica served the version;
        `direct` pushes straight to the first replica instead of through the proxy."""
        lora = LoraShape(r, 2 * r, tuple(sorted(TARGETS)))
        client, replicas = (self.direct[0], self.direct[:1]) if direct else (self.proxy, self.direct)
        start = time.perf_counter()
        client.push_adapter(name, version, payload, lora, self.fingerprint, bulk=self.bulk)
        replied = time.perf_counter() - start
        for c in replicas:
            result = c.generate([1], n=1, max_new_tokens=1, adapter=f"{name}@{version}")
            assert result.samples[0].adapter_version == version
        return {"served_s": time.perf_counter() - start, "reply_s": replied}

    def close(self) -> None:
        for c in (self.proxy, *self.direct):
            c.close()


def disk_roundtrip(shapes: dict[str, tuple[int, int]], repeats: int) -> dict:
    """safetensors save_file + load_file of the adapter's tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    times = []
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        path = f"{tmp}/adapter.safetensors"
        for _ in range(repeats + 1):  # the first round warms the page cache and allocator
            with Timer() as t:
                save_file(tensors, path)
                load_file(path)
            times.append(t.seconds)
    return spread(times[1:])


def tcp_copy(size: int, receivers: int, repeats: int) -> dict:
    """`size` bytes sent over loopback TCP to each of `receivers` at once; seconds until all arrived."""
    payload = memoryview(bytes(size))
    times = []
    for _ in range(repeats + 1):
        servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(receivers)]
        done = threading.Barrier(2 * receivers + 1)

        def receive(server: socket.socket) -> None:
            conn, _ = server.accept()
            buf, got = memoryview(bytearray(1 << 20)), 0
            while got < size:
                got += conn.recv_into(buf, min(len(buf), size - got))
            conn.close()
            done.wait()

        def send(port: int) -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(payload)
            done.wait()

        threads = [threading.Thread(target=receive, args=(s,)) for s in servers]
        for t in threads:
            t.start()
        start = time.perf_counter()
        threads += [threading.Thread(target=send, args=(s.getsockname()[1],)) for s in servers]
        for t in threads[receivers:]:
            t.start()
        done.wait()
        times.append(time.perf_counter() - start)
        for t in threads:
            t.join()
        for s in servers:
            s.close()
    return spread(times[1:])


def measure_model(label: str, config: dict, args, version: dict[str, int]) -> dict:
    """Every figure of one model shape: LoRA pushes, disk, TCP, and (0.5B) full-size pushes."""
    model = config_only_model(f"qwen2.5-{label.lower()}", config)
    full_config = json.loads((model / "config.json").read_text())
    lora = safetensors_bytes(lora_shapes(full_config, RANK))
    full_bytes = 2 * full_params(full_config)
    per_rank = 2 * sum(a * b for a, b in lora_shapes(full_config, 1).values())  # bf16 bytes of rank 1
    out: dict = {
        "lora_bytes": len(lora),
        "full_bytes": full_bytes,
        "disk_s": disk_roundtrip(lora_shapes(full_config, RANK), args.repeats),
    }
    measure_full = label in args.full_models
    full_rank = math.ceil(full_bytes / per_rank) if measure_full else 0
    full = safetensors_bytes(lora_shapes(full_config, full_rank)) if measure_full else b""
    if measure_full:
        out["full_payload"] = {"rank": full_rank, "bytes": len(full)}
    limit = f"limits.max_adapter_bytes={2 * GiB}"
    replicas = start_scripted(model, max(REPLICAS), f"push-{label}", "scripted.tokens_per_s=0", limit)
    fingerprint = model_fingerprint(model, config_only=True)
    try:
        for count in REPLICAS:
            proxy = start_proxy(
                replicas[:count],
                f"push-proxy-{label}-{count}",
                f"spool.max_adapter_bytes={2 * GiB}",
                "spool.keep_versions=1",
                "health.push_timeout_s=600",
            )
            pusher = Pusher(proxy, replicas[:count], fingerprint)
            try:
                row: dict = {}
                pushes = [("lora", lora, RANK, False)] + [("full", full, full_rank, False)] * measure_full
                if count == 1:  # no proxy: what the proxy's store-and-forward adds
                    pushes += [("direct-lora", lora, RANK, True)] + [
                        ("direct-full", full, full_rank, True)
                    ] * measure_full
                for name, payload, r, direct in pushes:
                    repeats = args.full_repeats if "full" in name else args.repeats
                    runs = []
                    for _i in range(repeats + (name == "lora")):  # the very first push opens channels
                        version[name] = version.get(name, 0) + 1
                        runs.append(pusher.push(name, version[name], payload, r, direct))
                    runs = runs[1:] if name == "lora" else runs
                    row[name] = {k: spread([run[k] for run in runs]) for k in ("served_s", "reply_s")}
                row["tcp_lora_s"] = tcp_copy(len(lora), count, args.repeats)
                if measure_full:
                    row["tcp_full_s"] = tcp_copy(len(full), count, args.full_repeats)
                out[str(count)] = row
                print(
                    f"{label} x{count}: lora {row['lora']['served_s']['median']:.3f}s"
                    + (f", full {row['full']['served_s']['median']:.2f}s" if measure_full else ""),
                    flush=True,
                )
            finally:
                pusher.close()
                proxy.stop()
    finally:
        stop_all(replicas)
    return out


def summarise(models: dict) -> dict:
    """Ratios per model and replica count; full-weight times for unmeasured sizes extrapolated
    from the measured full-size push's bytes/s at the same replica count."""
    measured = {label: m for label, m in models.items() if "full_payload" in m}
    table = {}
    for label, m in models.items():
        for count in map(str, REPLICAS):
            row = m[count]
            lora = row["lora"]["served_s"]["median"]
            tcp_lora = row["tcp_lora_s"]["median"]
            if "full" in row:
                full, full_kind = row["full"]["served_s"]["median"], "measured"
            elif measured:
                ref = next(iter(measured.values()))
                rate = ref["full_payload"]["bytes"] / ref[count]["full"]["served_s"]["median"]
                full, full_kind = m["full_bytes"] / rate, f"extrapolated from {next(iter(measured))}"
            else:
                full, full_kind = None, "not measured"
            table[f"{label} x{count}"] = {
                "lora_s": lora,
                "disk_s": m["disk_s"]["median"],
                "tcp_lora_s": tcp_lora,
                "full_s": full,
                "full_kind": full_kind,
                "full_over_lora": full / lora if full else None,
                "lora_over_tcp": lora / tcp_lora,
                "lora_over_disk": lora / m["disk_s"]["median"],
                "lora_MB_per_s": m["lora_bytes"] * int(count) / lora / 1e6,
            }
            if "direct-lora" in row:
                table[f"{label} x{count}"]["direct_lora_s"] = row["direct-lora"]["served_s"]["median"]
                table[f"{label} x{count}"]["lora_over_direct"] = lora / row["direct-lora"]["served_s"]["median"]
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--full-repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=list(QWEN25), choices=list(QWEN25))
    ap.add_argument("--full-models", nargs="*", default=["0.5B"], help="shapes whose full-size push is measured")
    args = ap.parse_args()
    version: dict[str, int] = {}  # newest version per adapter name: the replicas outlive each proxy
    models = {label: measure_model(label, QWEN25[label], args, version) for label in args.models}
    table = summarise(models)
    for key, row in table.items():
        full = f"{row['full_s']:.2f}s ({row['full_kind']})" if row["full_s"] else "-"
        print(
            f"{key:10s} lora {row['lora_s']:.3f}s  disk {row['disk_s']:.3f}s  tcp {row['tcp_lora_s']:.4f}s  full {full}"
        )
    write_result(
        "weight_push",
        ".venv/bin/python bench/weight_push.py",
        {
            "rank": RANK,
            "replicas": list(REPLICAS),
            "repeats": args.repeats,
            "full_repeats": args.full_repeats,
            "models": models,
            "table": table,
        },
    )


if __name__ == "__main__":
    main()
