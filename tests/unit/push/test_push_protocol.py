"""The push protocol's pure parts (issue 10): the writer and the incremental reader, relay plans,
tree planning and its cost model, the streaming payload checks, and staging in the registry.

No processes and no sockets: a reader is fed an async iterator of messages; the registry a
fake engine whose loads and unloads are recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import struct

import grpc
import pytest
from support.wire import manifest_for, streamed

from rollwire.common import writer
from rollwire.common.errors import FailedPrecondition, InvalidArgument, RollwireError
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest, check_name, name_ok
from rollwire.common.writer import MAX_CHUNK, MAX_STRIPES, opening, stripe_layout, stripe_messages
from rollwire.generator.adapters import AdapterRegistry
from rollwire.push.assembly import Assembly, check_stripe
from rollwire.push.checks import PayloadInspector, check_tensors
from rollwire.push.plan import Target, choose_fanout, cost, depth, layout, plan_from_parents, split_plan
from rollwire.push.reader import PushReader
from rollwire.push.results import result, results_from_error, status_with_results
from rollwire.v1 import generator_pb2 as pb

BASE = {f"model.layers.{i}.self_attn.q_proj": (8, 8) for i in range(3)}
LORA = LoraShape(r=2, lora_alpha=4.0, target_modules=("q_proj",))


def adapter_bytes(values: dict[str, list[float]] | None = None) -> bytes:
    """A safetensors LoRA adapter for BASE (F32), values chosen per tensor or small randoms."""
    rng = random.Random(0)
    header, body = {}, b""
    for i in range(3):
        for kind, shape in (("lora_A", (2, 8)), ("lora_B", (8, 2))):
            name = f"base_model.model.model.layers.{i}.self_attn.q_proj.{kind}.weight"
            vals = (values or {}).get(name) or [rng.uniform(-1, 1) for _ in range(16)]
            data = struct.pack("<16f", *vals)
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(body), len(body) + len(data)]}
            body += data
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


async def read_all(messages, inspector=None, keep_chunks=False):
    reader = PushReader(streamed(messages), 5, "test", keep_chunks=keep_chunks)
    try:
        first = await reader.open()
        got = [c async for c in reader.chunks(inspector=inspector)]
        payload = await (reader.finish_chunks() if keep_chunks else reader.finish())
        return first, got, payload
    finally:
        reader.close()


# -- names, writer, reader ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a", "A-1.b_c", "x" * 64, "9lives"])
def test_good_names_pass_everywhere(name):
    assert check_name(name) == name and name_ok(name)


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "_x", "x" * 65, "a/b", "lora\n", "a b", "é"])
def test_bad_names_fail_in_the_sdk_and_on_the_server_alike(name):
    from rollwire.client._requests import check_adapter_name
    from rollwire.common.errors import RequestError

    with pytest.raises(InvalidArgument) as info:
        check_name(name)
    assert info.value.reason == "BAD_ADAPTER_NAME"
    with pytest.raises(RequestError):
        check_adapter_name(name)


async def test_the_writer_and_the_reader_agree_chunk_for_chunk():
    payload = adapter_bytes()
    plan = plan_from_parents([("h:1", "a", 0), ("h:2", "b", 1)])
    messages = list(writer.messages(manifest_for(payload), payload, 100, relay=plan, stage_only=True))
    assert messages[0].stage_only and list(messages[0].relay.nodes) == list(plan.nodes)
    assert all(len(m.chunk) <= 100 for m in messages[1:]) and b"".join(m.chunk for m in messages[1:]) == payload
    sent = [m.chunk for m in messages[1:]]
    first, got, received = await read_all(messages)
    assert first.stage_only and first.manifest.name == "pol"
    assert got == sent and received == payload
    _, _, kept = await read_all(messages, keep_chunks=True)
    assert b"".join(kept) == payload and len(kept) == len(sent)


@pytest.mark.parametrize(
    "change, reason",
    [
        ("digest", "DIGEST_MISMATCH"),
        ("short", "LENGTH_MISMATCH"),
        ("long", "LENGTH_MISMATCH"),
        ("big chunk", "CHUNK_TOO_LARGE"),
        ("no manifest", "NO_MANIFEST"),
        ("second manifest", "SECOND_MANIFEST"),
        ("late relay", "MISPLACED_FIELD"),
        ("empty", "NO_MANIFEST"),
    ],
)
async def test_the_reader_refuses_what_breaks_the_stream_contract(change, reason):
    payload = adapter_bytes()
    m = manifest_for(payload)
    messages = list(writer.messages(m, payload, 64))
    if change == "digest":
        messages[0].manifest.sha256 = "0" * 64
    elif change == "short":
        messages = messages[:-1]
    elif change == "long":
        messages.append(pb.PushAdapterRequest(chunk=b"x"))
    elif change == "big chunk":
        messages[0].manifest.byte_length = MAX_CHUNK + 1
        messages = [messages[0], pb.PushAdapterRequest(chunk=bytes(MAX_CHUNK + 1))]
    elif change == "no manifest":
        messages = messages[1:]
    elif change == "second manifest":
        messages.insert(2, pb.PushAdapterRequest(manifest=m))
    elif change == "late relay":
        messages[2].relay.nodes.add(address="h:1")
    elif change == "empty":
        messages = []
    with pytest.raises(InvalidArgument) as info:
        await read_all(messages)
    assert info.value.reason == reason


async def test_an_idle_sender_is_cut_off():
    async def stalled():
        yield opening(manifest_for(b"x" * 10))
        await asyncio.sleep(5)

    reader = PushReader(stalled(), 0.2, "test")
    await reader.open()
    with pytest.raises(RollwireError) as info:
        async for _ in reader.chunks():
            pass
    reader.close()
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "PUSH_IDLE")


async def test_the_reader_writes_the_store_as_it_hashes(tmp_path):
    payload = adapter_bytes()
    reader = PushReader(streamed(writer.messages(manifest_for(payload), payload, 7)), 5, "test")
    await reader.open()
    async for _ in reader.chunks(store=tmp_path / "p.part"):
        pass
    assert await reader.finish() == payload
    assert (tmp_path / "p.part").read_bytes() == payload


def test_a_refusal_carries_the_subtree_outcomes_and_they_come_back():
    results = [result("h:1", "a", grpc.StatusCode.OK, staged=True)]
    status = status_with_results(InvalidArgument("bad", reason="DIGEST_MISMATCH"), results)

    class Err(grpc.RpcError):
        def trailing_metadata(self):
            return status.trailing_metadata

        def code(self):
            return status.code

        def details(self):
            return status.details

    from rollwire.common.errors import from_rpc_error

    assert results_from_error(Err()) == results
    assert from_rpc_error(Err()).reason == "DIGEST_MISMATCH"  # the ErrorInfo is still there


# -- relay plans and trees --------------------------------------------------------------------
def test_split_plan_gives_each_child_its_own_subtree_reindexed():
    # receiver -> a -> (b -> d), c ; receiver -> e
    plan = plan_from_parents([("h:1", "a", 0), ("h:2", "b", 1), ("h:3", "c", 1), ("h:4", "d", 2), ("h:5", "e", 0)])
    children = split_plan(plan, max_children=2)
    assert [c.address for c in children] == ["h:1", "h:5"]
    a = children[0]
    assert [(n.address, n.parent) for n in a.plan.nodes] == [("h:2", 0), ("h:3", 0), ("h:4", 1)]
    below_a = split_plan(a.plan, max_children=2)
    assert [(c.address, [n.address for n in c.plan.nodes]) for c in below_a] == [("h:2", ["h:4"]), ("h:3", [])]
    assert children[1].plan.nodes == []
    with pytest.raises(InvalidArgument, match="more than 1 children"):
        split_plan(plan, max_children=1)


@pytest.mark.parametrize("n, k", [(1, 1), (5, 1), (7, 2), (10, 3), (64, 4), (9, 16)])
def test_layout_is_a_breadth_first_k_ary_tree_holding_every_target_once(n, k):
    targets = [Target(f"h:{i + 1}", f"r{i}") for i in range(n)]
    children = layout(targets, k)
    assert len(children) == min(k, n)

    def walk(plan_children, level):
        out = []
        for c in plan_children:
            out.append((c.address, level))
            out += walk(split_plan(c.plan, max_children=k), level + 1)
        return out

    seen = walk(children, 1)
    assert sorted(a for a, _ in seen) == sorted(t.address for t in targets)
    assert max(level for _, level in seen) == depth(n, k)
    # breadth first: a target never sits deeper than one later in the order
    levels = dict(seen)
    order = [levels[t.address] for t in targets]
    assert order == sorted(order)


def test_auto_fanout_follows_the_cost_model():
    chunks = 36  # a 37 MB adapter in 1 MiB chunks
    assert depth(1000, 2) == 9 and depth(8, 1) == 8 and depth(8, 8) == 1
    assert cost(8, 1, chunks) == chunks + 7  # a chain: the payload, plus one chunk per extra hop
    assert cost(8, 8, chunks) == 8 * chunks  # a star: the proxy's link carries every copy
    size = 37_000_000
    assert choose_fanout("auto", 8, size, 16) == 1  # fewer replicas than chunks: the chain wins
    best = choose_fanout("auto", 1000, size, 16)
    assert best == min(range(1, 17), key=lambda k: cost(1000, k, chunks)) == 2
    assert cost(1000, best, chunks) < cost(1000, 1, chunks) / 10
    assert choose_fanout(0, 5, size, 16) == 5 and choose_fanout(3, 2, size, 16) == 2


# -- the streaming payload checks ---------------------------------------------------------------
def check_in_pieces(payload: bytes, m: Manifest, piece: int) -> str:
    inspector = PayloadInspector(m, BASE)
    for i in range(0, len(payload), piece):
        inspector.feed(payload[i : i + piece])
    try:
        inspector.finish(payload)
    except InvalidArgument as exc:
        return exc.reason
    return ""


def check_whole(payload: bytes, m: Manifest) -> str:
    try:
        check_tensors(m, payload, BASE)
    except InvalidArgument as exc:
        return exc.reason
    return ""


@pytest.mark.parametrize("piece", [1, 3, 64, 1 << 20])
def test_the_inspector_reaches_the_verdict_of_the_whole_payload_check(piece):
    nan_name = "base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"
    cases = {
        "good": adapter_bytes(),
        "nan in the last tensor": adapter_bytes({nan_name: [0.0] * 15 + [math.nan]}),
        "inf first": adapter_bytes({nan_name.replace("2", "0").replace("B", "A"): [math.inf] + [0.0] * 15}),
        "garbage": b"\xff" * 100,
        "tiny": b"\x01\x00",
        "wrong tensors": adapter_bytes()[:8] + adapter_bytes()[8:].replace(b"layers.1", b"layers.7", 2),
    }
    for label, payload in cases.items():
        m = Manifest("a", 1, "fp", LORA, len(payload), hashlib.sha256(payload).hexdigest())
        assert check_in_pieces(payload, m, piece) == check_whole(payload, m), label


# -- staging in the registry ----------------------------------------------------------------------
class FakeEngine:
    def __init__(self) -> None:
        self.loaded: dict[str, int] = {}
        self.loads = 0

    async def load(self, handle, m, payload):
        self.loads += 1
        self.loaded[handle] = m.version

    async def unload(self, handle):
        self.loaded.pop(handle, None)


def m_of(version: int, sha: str = "a" * 64) -> Manifest:
    return Manifest("pol", version, "fp", LORA, 1, sha)


async def test_a_staged_version_is_served_only_after_its_commit():
    engine = FakeEngine()
    reg = AdapterRegistry(engine.load, engine.unload, window=2)
    out = await reg.stage(m_of(1), b"x")
    assert out.staged and reg.loaded() == {} and reg.staged() == {"pol": 1}
    with pytest.raises(RollwireError):
        reg.acquire("pol", 1)
    again = await reg.stage(m_of(1), b"x")  # the same bytes: not loaded twice
    assert again.staged and engine.loads == 1
    with pytest.raises(FailedPrecondition) as info:
        await reg.commit("pol", 1, "b" * 64)
    assert info.value.reason == "NOT_STAGED"
    done = await reg.commit("pol", 1, "a" * 64)
    assert (done.already_loaded, done.loaded_versions, reg.staged()) == (False, [1], {})
    assert reg.acquire("pol", 1).version == 1
    assert (await reg.commit("pol", 1, "a" * 64)).already_loaded  # a repeated commit is idempotent
    # a plain push of a staged version commits it without loading it again
    await reg.stage(m_of(2, "c" * 64), b"y")
    loads = engine.loads
    assert (await reg.push(m_of(2, "c" * 64), b"y")).loaded_versions == [1, 2] and engine.loads == loads


async def test_a_version_staged_by_its_blake3_is_committed_under_the_sha256_its_commit_names():
    """A relay's stage of a manifest that left its sha256 to the proxy: staged under its BLAKE3;
    a commit naming another BLAKE3, or only a sha256, finds nothing staged; the one naming its
    BLAKE3 serves it with the commit's sha256, which GetStatus then reports and a later push of
    the same version (sha256 or BLAKE3) finds held."""
    engine = FakeEngine()
    reg = AdapterRegistry(engine.load, engine.unload, window=2)
    sha, b3 = "a" * 64, "b" * 64
    deferred = Manifest("pol", 1, "fp", LORA, 1, "", blake3=b3)
    assert (await reg.stage(deferred, b"x")).staged
    assert (await reg.stage(deferred, b"x")).staged and engine.loads == 1  # the same stage again: loaded once
    for wrong in ((sha, "c" * 64), (sha, ""), (b3, "")):
        with pytest.raises(FailedPrecondition) as info:
            await reg.commit("pol", 1, *wrong)
        assert info.value.reason == "NOT_STAGED"
    done = await reg.commit("pol", 1, sha, b3)
    assert (done.already_loaded, done.loaded_versions, reg.staged()) == (False, [1], {})
    assert reg.digests() == {"pol": {1: sha}}
    assert (await reg.commit("pol", 1, sha, b3)).already_loaded
    assert (await reg.push(Manifest("pol", 1, "fp", LORA, 1, sha), b"x")).already_loaded
    assert (await reg.push(deferred, b"x")).already_loaded  # known by its BLAKE3 beside the sha256
    with pytest.raises(FailedPrecondition) as info:
        await reg.push(Manifest("pol", 1, "fp", LORA, 1, "", blake3="d" * 64), b"z")
    assert info.value.reason == "VERSION_CONFLICT"


async def test_a_staged_version_expires_and_a_newer_stage_replaces_it():
    engine = FakeEngine()
    reg = AdapterRegistry(engine.load, engine.unload, window=2, stage_timeout_s=0.1)
    await reg.stage(m_of(1), b"x")
    await asyncio.sleep(0.3)
    await reg.settle()
    assert reg.staged() == {} and engine.loaded == {}
    with pytest.raises(FailedPrecondition, match="expired after 0.1 s"):
        await reg.commit("pol", 1, "a" * 64)
    await reg.stage(m_of(2), b"x")
    await reg.stage(m_of(3, "d" * 64), b"y")  # replaces v2, which is unloaded
    await reg.settle()
    assert reg.staged() == {"pol": 3} and sorted(engine.loaded.values()) == [3]
    await reg.push(m_of(4, "e" * 64), b"z")  # a newer version served: the staged v3 can never be committed
    await reg.settle()
    assert reg.staged() == {} and sorted(engine.loaded.values()) == [4]
    with pytest.raises(FailedPrecondition):
        await reg.stage(m_of(3, "d" * 64), b"y")  # not above the newest


# -- what the proxy relays, and when ----------------------------------------------------------
async def test_the_gate_relays_nothing_before_a_good_header_and_holds_the_last_chunk():
    from rollwire.proxy.publish.header_gate import HeaderGate

    payload = adapter_bytes()
    m = Manifest("a", 1, "fp", LORA, len(payload), hashlib.sha256(payload).hexdigest())
    gate = HeaderGate(m, BASE)
    pieces = [payload[i : i + 50] for i in range(0, len(payload), 50)]
    header_end = 8 + struct.unpack("<Q", payload[:8])[0]
    released = []
    for i, piece in enumerate(pieces):
        out = await gate.feed(piece)
        if (i + 1) * 50 < header_end:
            assert out == [], "nothing leaves before the whole header arrived and passed"
        released += out
    assert released == pieces[:-1] and gate.held == pieces[-1]
    bad = adapter_bytes()[:8] + adapter_bytes()[8:].replace(b"layers.1", b"layers.7", 2)
    gate = HeaderGate(Manifest("a", 1, "fp", LORA, len(bad), "0" * 64), BASE)
    with pytest.raises(InvalidArgument) as info:
        for i in range(0, len(bad), 50):
            assert await gate.feed(bad[i : i + 50]) == []
    assert info.value.reason == "TENSOR_MISMATCH"


# -- stripes ------------------------------------------------------------------------------------
KiB = 1 << 10


def stripe(index: int, count: int, chunk: int = 64 * KiB) -> pb.Stripe:
    return pb.Stripe(index=index, count=count, chunk_bytes=chunk)


@pytest.mark.parametrize("seed", range(12))
def test_the_stripes_of_a_push_cover_every_byte_once_in_their_chunks(seed):
    rng = random.Random(seed)
    chunk = rng.choice([64 * KiB, 128 * KiB, MAX_CHUNK])
    size = rng.choice([1, chunk - 1, chunk, chunk + 1, rng.randrange(1, 9 * chunk)])
    count = rng.randrange(2, MAX_STRIPES + 1)
    cover = []
    for s in range(count):
        rows = stripe_layout(size, stripe(s, count, chunk))
        assert all(j % count == s for j, _ in rows) and [j for j, _ in rows] == sorted(j for j, _ in rows)
        cover += rows
    cover.sort()
    assert [j for j, _ in cover] == list(range(len(cover)))  # every chunk in exactly one stripe
    assert sum(n for _, n in cover) == size and all(n == chunk for _, n in cover[:-1]) and 0 < cover[-1][1] <= chunk


async def assemble(payload: bytes, count: int, chunk: int, rng: random.Random, m: pb.AdapterManifest | None = None):
    """Feed the stripes' streams to one Assembly, interleaved at random (each stripe in its own
    order, as one stream delivers it); returns (payload or the refusal, which stripes ended first)."""
    m = m or manifest_for(payload)
    assembly = Assembly(m, stripe(0, count, chunk), None)
    streams = []
    for s in range(count):
        assembly.join(stripe(s, count, chunk))
        rows = stripe_layout(len(payload), stripe(s, count, chunk))
        streams.append((s, [(j, payload[j * chunk : j * chunk + n]) for j, n in rows]))
    completing = []
    try:
        while streams:
            s, rows = rng.choice(streams)
            if rows:
                j, data = rows.pop(0)
                await assembly.add(j, data)
            else:
                streams.remove((s, rows))
                if assembly.end(s):
                    completing.append(s)
        assert len(completing) == 1  # one stream takes the verdict
        return bytes(await assembly.finish()), completing  # the payload buffer, as bytes to compare
    except RollwireError as exc:
        return exc, completing
    finally:
        assembly.fail(None)


@pytest.mark.parametrize("seed", range(16))
async def test_stripes_arriving_in_any_interleaving_assemble_the_exact_payload(seed):
    rng = random.Random(seed)
    chunk = rng.choice([64 * KiB, 128 * KiB])
    payload = rng.randbytes(rng.randrange(1, 7 * chunk))
    count = rng.randrange(2, 6)
    got, _ = await assemble(payload, count, chunk, rng)
    assert got == payload


async def test_an_assembly_refuses_bytes_that_do_not_match_the_digest():
    rng = random.Random(7)
    payload = rng.randbytes(300 * KiB)
    altered = bytearray(payload)
    altered[200 * KiB] ^= 1  # one bit of chunk 3 (stripe 1 of 2)
    got, _ = await assemble(bytes(altered), 2, 64 * KiB, rng, manifest_for(payload))
    assert isinstance(got, InvalidArgument) and got.reason == "DIGEST_MISMATCH"


async def test_an_assembly_takes_each_stripe_once_and_only_of_its_own_cut():
    payload = random.Random(1).randbytes(200 * KiB)
    assembly = Assembly(manifest_for(payload), stripe(0, 2), None)
    try:
        assembly.join(stripe(0, 2))
        for other in (stripe(0, 2), stripe(1, 3), stripe(1, 2, 128 * KiB)):
            with pytest.raises(FailedPrecondition) as info:
                assembly.join(other)
            assert info.value.reason == "STRIPE_CONFLICT"
        assembly.join(stripe(1, 2))
        # a stripe whose stream broke: the version cannot complete here, the others answer pending
        assembly.fail(None)
        await assembly.add(1, payload[64 * KiB : 128 * KiB])  # ignored, holds nothing
        assert assembly.buffer is None and assembly.end(0) is False and assembly.end(1) is False
    finally:
        assembly.fail(None)


@pytest.mark.parametrize(
    "fields, stage_only",
    [
        (dict(index=0, count=1, chunk_bytes=64 * KiB), True),
        (dict(index=0, count=MAX_STRIPES + 1, chunk_bytes=64 * KiB), True),
        (dict(index=2, count=2, chunk_bytes=64 * KiB), True),
        (dict(index=0, count=2, chunk_bytes=64 * KiB - 1), True),
        (dict(index=0, count=2, chunk_bytes=MAX_CHUNK + 1), True),
        (dict(index=0, count=2, chunk_bytes=0), True),
        (dict(index=0, count=2, chunk_bytes=64 * KiB), False),
    ],
)
def test_malformed_stripes_are_refused(fields, stage_only):
    with pytest.raises(InvalidArgument) as info:
        check_stripe(pb.Stripe(**fields), stage_only=stage_only)
    assert info.value.reason == "BAD_STRIPE"


@pytest.mark.parametrize(
    "change",
    ["short chunk", "long chunk", "extra chunk", "truncated", "late stripe"],
)
async def test_a_stripe_stream_that_breaks_its_layout_is_refused(change):
    payload = random.Random(2).randbytes(5 * 64 * KiB + 100)
    st = stripe(1, 2)
    messages = list(stripe_messages(manifest_for(payload), payload, st))
    if change == "short chunk":
        messages[1].chunk = messages[1].chunk[:-1]
    elif change == "long chunk":
        messages[1].chunk += b"x"
    elif change == "extra chunk":
        messages.append(pb.PushAdapterRequest(chunk=bytes(64 * KiB)))
    elif change == "truncated":
        messages = messages[:-1]
    elif change == "late stripe":
        messages[2].stripe.CopyFrom(st)
    reader = PushReader(streamed(messages), 5, "test")
    try:
        first = await reader.open()
        assert first.stripe == st
        with pytest.raises(InvalidArgument) as info:
            async for _ in reader.stripe_chunks(st):
                pass
    finally:
        reader.close()
    expected = {"truncated": "LENGTH_MISMATCH", "late stripe": "MISPLACED_FIELD"}.get(change, "BAD_STRIPE")
    assert info.value.reason == expected


@pytest.mark.parametrize("n", [*range(1, 40), 64, 255, 1000])
def test_every_stripe_tree_holds_every_replica_and_each_is_inner_in_at_most_one(n):
    from rollwire.push.plan import stripe_parents, striped_layout

    trees = stripe_parents(n, 2)
    inner = []
    for parent in trees:
        assert parent.count(-1) == 1  # one replica under the proxy: its uplink carries one copy in all
        kids = [parent.count(i) for i in range(n)]
        assert max(kids) <= 2
        inner.append({i for i in range(n) if kids[i]})
        # every replica reaches the proxy, within ~log2 n levels
        for i in range(n):
            hops, at = 0, i
            while parent[at] >= 0:
                at, hops = parent[at], hops + 1
                assert hops <= n
            assert hops <= max(1, math.ceil(math.log2(n + 1)))
    assert not inner[0] & inner[1]
    targets = [Target(f"h:{i + 1}", f"r{i}") for i in range(n)]
    for tree in striped_layout(targets, 2):
        assert len(tree) == 1
        held = [tree[0].address, *(a for a, _ in tree[0].subtree())]
        assert sorted(held) == sorted(t.address for t in targets)


def test_merged_stripe_reports_give_the_verdict_else_the_replicas_own_failure_else_not_reached():
    from rollwire.push.striped import merge_stripes

    def r(code="OK", reason="", pending=False, staged=False, message=""):
        return pb.ReplicaPushResult(
            replica="q", address="h:1", code=code, reason=reason, stripe_pending=pending, staged=staged, message=message
        )

    verdict = r(staged=True)
    assert merge_stripes([(0, r(pending=True)), (1, verdict)], 2) == verdict
    own = r("INVALID_ARGUMENT", "DIGEST_MISMATCH")
    assert merge_stripes([(0, r(pending=True)), (1, own)], 2) == own
    assert merge_stripes([(0, r("UNAVAILABLE", "RELAY_NOT_REACHED")), (1, own)], 2) == own
    missed = merge_stripes(
        [(0, r(pending=True)), (1, r("UNAVAILABLE", "RELAY_NOT_REACHED", message="its parent died"))], 2
    )
    assert (missed.code, missed.reason) == ("UNAVAILABLE", "RELAY_NOT_REACHED")
    assert "took stripes [0] of 2" in missed.message and "its parent died" in missed.message
    only_one = merge_stripes([(0, r(pending=True))], 2)  # a stripe that never reported it
    assert only_one.reason == "RELAY_NOT_REACHED" and "stripe 1: no report" in only_one.message


def test_stripe_chunks_are_about_eight_per_stripe_within_the_bounds():
    from rollwire.push.plan import stripe_chunk_bytes

    assert stripe_chunk_bytes(167_352, 2) == 64 * KiB
    assert stripe_chunk_bytes(37_000_000, 2) == MAX_CHUNK
    assert stripe_chunk_bytes(4_000_000, 2) == 256 * KiB  # 250 kB wanted, in 64 KiB steps


def test_replicas_trusted_least_hang_under_the_proxy_in_every_stripe_tree():
    from rollwire.push.plan import striped_layout

    trusted = [Target(f"h:{i + 1}", f"r{i}") for i in range(6)]
    doubtful = [Target("h:90", "bad1"), Target("h:91", "bad2")]
    trees = striped_layout(trusted, 2, leaves=doubtful)
    assert len(trees) == 2
    for tree in trees:
        root, *rest = tree
        assert [(c.address, len(c.plan.nodes)) for c in rest] == [("h:90", 0), ("h:91", 0)]  # leaves, no subtree
        below = [a for a, _ in root.subtree()]
        assert sorted([root.address, *below]) == sorted(t.address for t in trusted)  # inner places: the trusted
        assert not {"h:90", "h:91"} & set(below)
