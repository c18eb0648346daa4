"""A pusher process for the fault suite: a learner on a slow uplink, so a test can kill or
freeze it mid-push. It writes one PushAdapter with the SDK's push protocol
(rollwire.common.writer: the very messages `Client.push_adapter` sends), pausing between
chunks, over a plain gRPC channel.

    python tests/support/pusher.py TARGET MANIFEST PAYLOAD CHUNK_BYTES PAUSE_S

MANIFEST is a file holding a serialized AdapterManifest, PAYLOAD the adapter's bytes. It
prints `sent I` once chunk I is handed to gRPC, then `reply CODE REASON` when the call ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from rollwire.common.errors import from_rpc_error
from rollwire.common.writer import chunks, opening
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc


def paced(manifest: pb.AdapterManifest, payload: bytes, chunk: int, pause_s: float) -> Iterator[pb.PushAdapterRequest]:
    yield opening(manifest)
    for i, piece in enumerate(chunks(payload, chunk), 1):
        yield pb.PushAdapterRequest(chunk=piece)
        print(f"sent {i}", flush=True)
        time.sleep(pause_s)  # the slow uplink this process stands for


def main(argv: list[str]) -> int:
    target, manifest_file, payload_file, chunk, pause_s = argv
    manifest = pb.AdapterManifest.FromString(Path(manifest_file).read_bytes())
    payload = Path(payload_file).read_bytes()
    with grpc.insecure_channel(target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        try:
            stub.PushAdapter(paced(manifest, payload, int(chunk), float(pause_s)), timeout=120)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            print(f"reply {err.code.name} {err.reason}", flush=True)
            return 1
    print("reply OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
