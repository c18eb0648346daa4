"""The bulk path (issue 36): what a hop costs to take in and forward a copy, and a large adapter
through the proxy to two relaying replicas, beside a raw TCP copy over the same hops.

A proxy and two scripted replicas on loopback, planned as a chain (push.fanout=1, one tree:
proxy -> relay -> leaf), so the relay takes in every byte and forwards it while the leaf only takes it in; every
server has bulk.enabled. The payload is a synthetic bf16 LoRA adapter shaped like Qwen2.5-0.5B
at the rank that makes it --size-mb, checked tensor by tensor (header, shapes, finiteness) and
hashed on every hop. Each push is made by the SDK (`Client.push_adapter(bulk=...)`) and timed
until every replica serves it; the CPU seconds of the proxy and of each replica are read from
/proc around it, so "relay CPU per GB" is the per-hop cost of taking in and forwarding a copy (which
replica relays is the proxy's choice: each replica's log says whether it relayed).

  grpc   the bytes as 1 MiB gRPC chunks on every hop (the client does not ask for bulk)
  bulk   the bytes over each hop's bulk connection (rollwire.push.bulk)
  tcp    the same bytes over the same hops with nothing but recv_into and sendall: a sender,
         two relaying threads (cut-through, 1 MiB at a time) and a receiver: the floor

With --tls the replicas' hops (proxy -> relay -> leaf) use TLS with mutual TLS (certificates made
with openssl here), and so do their bulk connections; the client's hop to the proxy stays
plaintext. Repeats alternate the paths; the fleet is started once per TLS setting, and one
untimed push per path warms it (three on the bulk path: a replica alternates between two receive
buffers, the one the version it serves holds and the one it receives the next into), and every
timed push follows an untimed one by the same path, so that it replaces a version its own path
delivered. The sha256 and the finiteness scan each hop runs are timed
alone on this machine beside them (`checks`). Writes bench/results/bulk_push.json.
Run: .venv/bin/python bench/bulk_push.py [--size-mb 2048] [--repeats 3] [--tls-size-mb 512]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from blake3 import blake3
from common import (
    QWEN25,
    WORK,
    config_only_model,
    cpu_seconds,
    spread,
    start_proxy,
    start_scripted,
    stop_all,
    write_result,
)
from weight_push import TARGETS, lora_shapes, safetensors_bytes

from rollwire.client import Client
from rollwire.client._push import build_manifest
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import manifest_from_pb
from rollwire.push.buffers import payload_buffer
from rollwire.push.checks import PayloadInspector

GiB, MiB = 1 << 30, 1 << 20
MODEL = "0.5B"
REPLICA = (
    "scripted.tokens_per_s=0",
    f"limits.max_adapter_bytes={3 * GiB}",
    "bulk.enabled=true",
    f"bulk.reuse_bytes={3 * GiB}",
)
REPLICA += ("adapter_window=1", "adapter_keep=1", "adapter_keep_bytes=0")
PROXY = (f"spool.max_adapter_bytes={3 * GiB}", f"spool.max_bytes={8 * GiB}", "spool.keep_versions=1")
PROXY += (
    "health.push_timeout_s=900",
    "push.fanout=1",
    "push.stripes=1",
    "bulk.enabled=true",
    f"bulk.reuse_bytes={3 * GiB}",  # as the replicas: a push of the same size reuses the last one's buffer
)
PROXY += ("grace_seconds=1",)


def adapter_of(config: dict, size: int) -> tuple[bytes, int]:
    """A bf16 LoRA adapter of about `size` bytes (the rank that gives it) and its rank."""
    per_rank = len(safetensors_bytes(lora_shapes(config, 2))) / 2
    r = max(1, round(size / per_rank))
    return safetensors_bytes(lora_shapes(config, r)), r


def make_pki(folder: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl), as the tests' pki."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=bench-ca")  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return folder


def tls_settings(pki: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(replica, proxy) settings for mutual TLS on the replicas' hops."""
    client = (f"ca_file={pki / 'ca.pem'}", f"cert_file={pki / 'client.pem'}", f"key_file={pki / 'client.key'}")
    server = (f"tls.cert_file={pki / 'server.pem'}", f"tls.key_file={pki / 'server.key'}")
    replica = (*server, f"tls.client_ca_file={pki / 'ca.pem'}", *(f"relay.{c}" for c in client))
    return replica, tuple(f"upstream.{c}" for c in client)


class Fleet:
    """The proxy and the two replicas of one TLS setting."""

    def __init__(self, model: Path, tls: Path | None) -> None:
        replica_tls, proxy_tls = tls_settings(tls) if tls is not None else ((), ())
        tag = "tls" if tls is not None else "plain"
        self.replicas = start_scripted(model, 2, f"bulk-{tag}", *REPLICA, *replica_tls)
        try:
            self.proxy = start_proxy(self.replicas, f"bulk-proxy-{tag}", *PROXY, *proxy_tls)
        except BaseException:
            stop_all(self.replicas)
            raise
        self.client = Client(self.proxy.target, timeout=900)
        self.version = 0

    def push(self, payload: bytes, r: int, fingerprint: str, path: str) -> dict:
        """One push by `path`, timed until the proxy's reply (every replica staged and committed
        it), with each process's CPU seconds and each replica's log line of how its bytes came."""
        self.version += 1
        lora = LoraShape(r, 2 * r, tuple(sorted(TARGETS)))
        pids = {"proxy": self.proxy.proc.pid, "r0": self.replicas[0].proc.pid, "r1": self.replicas[1].proc.pid}
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        own = time.process_time()
        start = time.perf_counter()
        reply = self.client.push_adapter(
            "big", self.version, payload, lora, fingerprint, timeout=900, bulk=path == "bulk"
        )
        took = time.perf_counter() - start
        client_cpu = time.process_time() - own
        cpu = {f"{k}_cpu_s": cpu_seconds(p) - before[k] for k, p in pids.items()}
        assert [r.code for r in reply.replicas] == ["OK", "OK"], reply.replicas
        staged = self.staged()
        relay = next(i for i, e in enumerate(staged) if e.get("relayed_to"))  # the proxy plans which replica relays
        roles = {"relay_cpu_s": cpu[f"r{relay}_cpu_s"], "leaf_cpu_s": cpu[f"r{1 - relay}_cpu_s"]}
        hops = [e.get("path", "?") for e in (staged[relay], staged[1 - relay])]
        return {"path": path, "push_s": took, "client_cpu_s": client_cpu, "proxy_cpu_s": cpu["proxy_cpu_s"], **roles,
                "hops": hops}  # fmt: skip

    def staged(self) -> list[dict]:
        """Each replica's last adapter_staged log line: how its bytes came (`path`), whether it relayed them."""
        out = []
        for r in self.replicas:
            lines = [json.loads(x) for x in r.log_path.read_text().splitlines() if '"adapter_staged"' in x]
            out.append(lines[-1] if lines else {})
        return out

    def stop(self) -> None:
        self.client.close()
        stop_all([self.proxy, *self.replicas])


def tcp_chain(payload: bytes, hops: int = 3) -> tuple[float, float]:
    """(seconds, CPU seconds of all its threads) to copy `payload` over `hops` loopback TCP hops
    (sender -> relay -> relay -> receiver), each relay forwarding every 1 MiB as it arrives
    (recv_into, then sendall of the same view)."""
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(hops)]
    size, done = len(payload), threading.Event()

    def relay(i: int) -> None:
        conn, _ = servers[i].accept()
        out = socket.create_connection(servers[i + 1].getsockname()) if i + 1 < hops else None
        buf, got = memoryview(bytearray(MiB)), 0
        while got < size:
            n = conn.recv_into(buf, min(MiB, size - got))
            if out is not None:
                out.sendall(buf[:n])
            got += n
        if out is not None:
            out.close()
        conn.close()
        if out is None:
            done.set()

    threads = [threading.Thread(target=relay, args=(i,), daemon=True) for i in range(hops)]
    for t in threads:
        t.start()
    start, cpu = time.perf_counter(), time.process_time()
    with socket.create_connection(servers[0].getsockname()) as s:
        s.sendall(payload)
    done.wait(600)
    took, cpu = time.perf_counter() - start, time.process_time() - cpu
    for t in threads:
        t.join(10)
    for s in servers:
        s.close()
    return took, cpu


def checks_alone(payload: bytes, fingerprint: str, r: int) -> dict:
    """The per-byte work a hop does besides moving the bytes, each timed alone on this machine
    in 1 MiB pieces (CPU s per GiB): the digest it verifies (BLAKE3; sha256 where a manifest has
    none, or both at the proxy), receiving into fresh memory (a populated mapping: its page
    faults) or into a reused buffer (the copy alone), and the payload checks (header, finiteness)."""
    pieces = [memoryview(payload)[i : i + MiB] for i in range(0, len(payload), MiB)]
    gib = len(payload) / GiB

    def timed(work) -> float:
        t = time.process_time()
        work()
        return (time.process_time() - t) / gib

    def fill(buf) -> None:
        view, at = memoryview(buf), 0
        for p in pieces:
            view[at : at + len(p)] = p
            at += len(p)

    sha, b3 = hashlib.sha256(), blake3()
    out = {"sha256_cpu_s_per_GiB": timed(lambda: [sha.update(p) for p in pieces])}
    out["blake3_cpu_s_per_GiB"] = timed(lambda: [b3.update(p) for p in pieces])
    fresh = timed(lambda: fill(payload_buffer(len(payload))))
    reused = payload_buffer(len(payload))
    fill(reused)
    out |= {"fresh_buffer_cpu_s_per_GiB": fresh, "reused_buffer_cpu_s_per_GiB": timed(lambda: fill(reused))}
    manifest = build_manifest("big", 1, payload, LoraShape(r, 2 * r, tuple(sorted(TARGETS))), fingerprint)
    inspector = PayloadInspector(manifest_from_pb(manifest), None)
    out["checks_cpu_s_per_GiB"] = timed(lambda: [inspector.feed(p) for p in pieces])
    assert inspector.error is None
    return out


def tls_alone(payload: bytes, pki: Path) -> dict:
    """Python's `ssl` moving `payload` over one loopback connection (TLS 1.3, the bench's
    certificates; 4 MiB sends and reads, as a hop's): the CPU s per GiB of the sending thread
    (encrypt) and of the receiving one (decrypt), and whether this kernel offers kernel TLS
    (the `tls` upper-layer protocol) at all."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(pki / "server.pem", pki / "server.key")
    client = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    listener, size, took = socket.create_server(("127.0.0.1", 0)), len(payload), {}

    def receive() -> None:
        conn = server.wrap_socket(listener.accept()[0], server_side=True)
        buf, got, start = memoryview(bytearray(4 * MiB)), 0, time.thread_time()
        while got < size:
            got += conn.recv_into(buf, min(4 * MiB, size - got))
        took["decrypt"] = time.thread_time() - start
        conn.close()

    reader = threading.Thread(target=receive)
    reader.start()
    with client.wrap_socket(socket.create_connection(listener.getsockname()), server_hostname="127.0.0.1") as conn:
        view, start = memoryview(payload), time.thread_time()
        for at in range(0, size, 4 * MiB):
            conn.sendall(view[at : at + 4 * MiB])
        took["encrypt"] = time.thread_time() - start
        reader.join(120)
        cipher = conn.cipher()
    listener.close()
    ulp = Path("/proc/sys/net/ipv4/tcp_available_ulp")
    gib = size / GiB
    return {
        "tls_encrypt_cpu_s_per_GiB": took["encrypt"] / gib,
        "tls_decrypt_cpu_s_per_GiB": took["decrypt"] / gib,
        "cipher": cipher[0] if cipher else "",
        "cipher_alone_GB_per_s": cipher_speed(),
        "kernel_tls": ulp.exists() and "tls" in ulp.read_text().split(),
    }


def cipher_speed() -> float:
    """AES-256-GCM (TLS 1.3's cipher here) alone on one core, 16 KiB records, from `openssl speed`
    (GB/s): what any TLS hop, kernel TLS included, spends to encrypt or decrypt a byte."""
    out = subprocess.run(
        ["openssl", "speed", "-elapsed", "-seconds", "2", "-bytes", "16384", "-evp", "aes-256-gcm"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return float(out.strip().splitlines()[-1].split()[-1].removesuffix("k")) * 1000 / 1e9


def measure(model: Path, fingerprint: str, size: int, repeats: int, tls: Path | None) -> dict:
    config = json.loads((model / "config.json").read_text())
    payload, r = adapter_of(config, size)
    fleet = Fleet(model, tls)
    runs: list[dict] = []
    try:
        warm = ("grpc", "bulk", "bulk", "bulk")  # connections, page cache, the 2 buffers a receiver alternates
        for path in warm:
            fleet.push(payload, r, fingerprint, path)
        for rep in range(repeats):
            for path in ("grpc", "bulk") if rep % 2 == 0 else ("bulk", "grpc"):
                # untimed first, by the same path: the timed push then replaces a version its own path
                # delivered, so it never pays for freeing what the other path left (a 1.5 GB `bytes`)
                fleet.push(payload, r, fingerprint, path)
                row = {"repeat": rep, **fleet.push(payload, r, fingerprint, path)}
                runs.append(row)
                print(
                    f"{'tls' if tls else 'plain'} {path:4s} {len(payload) / MiB:.0f} MiB: {row['push_s']:.2f} s; CPU s "
                    f"proxy {row['proxy_cpu_s']:.2f} relay {row['relay_cpu_s']:.2f} leaf {row['leaf_cpu_s']:.2f}; "
                    f"hops {row['hops']}",
                    flush=True,
                )
    finally:
        fleet.stop()
    chains = [tcp_chain(payload) for _ in range(repeats)] if tls is None else []
    tcp = [took for took, _ in chains]
    gib = len(payload) / GiB
    paths = {}
    for path in ("grpc", "bulk"):
        mine = [x for x in runs if x["path"] == path]
        relay = statistics.median(x["relay_cpu_s"] for x in mine) / gib
        paths[path] = {
            "push_s": spread([x["push_s"] for x in mine]),
            "relay_cpu_s_per_GiB": relay,
            "relay_GiB_per_s_per_core": 1 / relay,
            "leaf_cpu_s_per_GiB": statistics.median(x["leaf_cpu_s"] for x in mine) / gib,
            "proxy_cpu_s_per_GiB": statistics.median(x["proxy_cpu_s"] for x in mine) / gib,
            "client_cpu_s_per_GiB": statistics.median(x["client_cpu_s"] for x in mine) / gib,
        }
    out: dict = {"payload_bytes": len(payload), "rank": r, "tls": tls is not None, "paths": paths, "runs": runs}
    out["bulk_pusher_digests"] = "blake3"  # the SDK's bulk push leaves the sha256 to the proxy (sha256_by_receiver)
    out["bulk_over_grpc"] = paths["bulk"]["push_s"]["median"] / paths["grpc"]["push_s"]["median"]
    if tcp:
        out["tcp_chain_s"] = spread(tcp)
        out["tcp_chain_cpu_s_per_GiB"] = statistics.median(cpu for _, cpu in chains) / gib
        out["bulk_over_tcp"] = paths["bulk"]["push_s"]["median"] / out["tcp_chain_s"]["median"]
        out["grpc_over_tcp"] = paths["grpc"]["push_s"]["median"] / out["tcp_chain_s"]["median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=2048, help="the plaintext run's adapter size, MiB")
    ap.add_argument("--tls-size-mb", type=int, default=512, help="the TLS run's adapter size, MiB (0: no TLS run)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = config_only_model(f"qwen2.5-{MODEL.lower()}", QWEN25[MODEL])
    fingerprint = model_fingerprint(model, config_only=True)
    load_before = os.getloadavg()
    data: dict = {"model": f"Qwen2.5-{MODEL} (config only, scripted replicas)", "repeats": args.repeats}
    data["plain"] = measure(model, fingerprint, args.size_mb * MiB, args.repeats, None)
    if args.tls_size_mb:
        pki = make_pki(WORK / "bulk-pki")
        data["tls"] = measure(model, fingerprint, args.tls_size_mb * MiB, args.repeats, pki)
    config = json.loads((model / "config.json").read_text())
    payload, r = adapter_of(config, 256 * MiB)
    data["checks"] = checks_alone(payload, fingerprint, r)
    data["tls_alone"] = tls_alone(payload, make_pki(WORK / "bulk-pki"))
    data["load_avg"] = {"before": load_before, "after": os.getloadavg()}
    data["cores"] = os.cpu_count()
    write_result("bulk_push", " ".join([".venv/bin/python bench/bulk_push.py", *sys.argv[1:]]), data)


if __name__ == "__main__":
    main()
