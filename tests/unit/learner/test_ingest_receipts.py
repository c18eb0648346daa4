"""Ingestion's provenance check (ingest/receipts.py, audit S11) over generated trajectories.

Receipts are made as a replica makes them (rollwire.generator.receipts over the events it
sends); random multi-turn trajectories with their receipts are taken, and every single forgery
of a generated trajectory is refused with its reason: a token, logprob, version or context
byte changed, a trained token outside every receipt, another adapter's or an untrusted
replica's receipt, a signed field changed after signing, an old or reused receipt, spans out of
order or out of range.
"""

from __future__ import annotations

import random

import pytest

from rollwire.common import receipts as common
from rollwire.common.errors import InvalidArgument
from rollwire.common.manifest import TENANT_SEPARATOR
from rollwire.common.reasons import Reason
from rollwire.common.signing import SigningKey, TrustedKeys
from rollwire.generator.receipts import Receipts
from rollwire.generator.types import AdapterSelection, GroupRequest, SampleDone, SamplingParams, TokenDelta
from rollwire.learner.ingest.receipts import MAX_RECEIPTS, ReceiptCheck
from rollwire.v1 import learner_pb2 as lpb

KEY = SigningKey.generate("replica-a")
OTHER = SigningKey.generate("replica-b")
TRUSTED = TrustedKeys({KEY.key_id: KEY.private.public_key()})
ADAPTER = "policy"


def turn(
    receipts: Receipts,
    context: list[int],
    ids: list[int],
    logprobs: list[float],
    version: int,
    rid: str,
    adapter=ADAPTER,
):
    """The receipt a replica sends for one sample of `ids` after `context`, in two chunks."""
    group = GroupRequest(rid, context, 1, SamplingParams(max_new_tokens=64), AdapterSelection(adapter, version, "h"))
    stream = receipts.stream(group)
    assert stream is not None
    half = len(ids) // 2
    for part in (slice(0, half), slice(half, None)):
        stream.add(TokenDelta(0, ids[part], logprobs[part], "", version))
    return stream.finish(SampleDone(0, "length", len(context), len(ids)))


def episode(rng: random.Random, key: SigningKey = KEY, adapter: str = ADAPTER) -> lpb.Trajectory:
    """A random multi-turn trajectory: model turns (each with its receipt) and environment turns."""
    replica = Receipts(key)
    t = lpb.Trajectory(group_id="g", group_size=2, prompt_token_ids=[rng.randrange(100) for _ in range(5)], reward=1)
    for _ in range(rng.randint(1, 4)):
        ids = [rng.randrange(100) for _ in range(rng.randint(1, 9))]
        logprobs = [-rng.random() * 5 for _ in ids]
        version = rng.randint(1, 3)
        context = list(t.prompt_token_ids) + list(t.token_ids)
        receipt = turn(replica, context, ids, logprobs, version, f"r{rng.random()}", adapter)
        t.receipts.add(start=len(t.token_ids), receipt=receipt)
        t.token_ids.extend(ids)
        t.loss_mask.extend([True] * len(ids))
        t.logprobs.extend(logprobs)
        t.token_versions.extend([version] * len(ids))
        env = [rng.randrange(100) for _ in range(rng.randint(0, 4))]
        t.token_ids.extend(env)
        t.loss_mask.extend([False] * len(env))
        t.logprobs.extend([0.0] * len(env))
        t.token_versions.extend([0] * len(env))
    return t


def check() -> ReceiptCheck:
    return ReceiptCheck(TRUSTED, ADAPTER, max_age_s=60)


def refused(c: ReceiptCheck, t: lpb.Trajectory) -> str:
    with pytest.raises(InvalidArgument) as err:
        c.verify(t)
    assert err.value.message
    return err.value.reason


def trained(t: lpb.Trajectory, rng: random.Random) -> int:
    return rng.choice([j for j, m in enumerate(t.loss_mask) if m])


def test_honest_trajectories_are_taken_and_each_receipt_trains_once():
    rng = random.Random(1)
    c = check()
    for _ in range(100):
        t = episode(rng)
        claims = c.verify(t)
        assert len(claims) == len(t.receipts)
        c.claim(claims)
        assert refused(c, t) == Reason.BAD_RECEIPT  # the same receipts again
    t = episode(rng)
    c.claim(c.verify(t))
    c.release([r.receipt.sample_id for r in t.receipts])  # the buffer refused it: the producer may resend
    assert c.verify(t)


FORGERIES = {
    "a sampled id": lambda t, rng: t.token_ids.__setitem__(j := trained(t, rng), t.token_ids[j] + 1),
    "a logprob": lambda t, rng: t.logprobs.__setitem__(j := trained(t, rng), t.logprobs[j] - 0.25),
    "a version": lambda t, rng: t.token_versions.__setitem__(j := trained(t, rng), t.token_versions[j] + 1),
    "the prompt": lambda t, rng: t.prompt_token_ids.__setitem__(0, t.prompt_token_ids[0] + 1),
    "the signed adapter": lambda t, rng: setattr(t.receipts[0].receipt, "adapter", "someone-else"),
    "the signed sample id": lambda t, rng: setattr(t.receipts[0].receipt, "sample_id", "x:0"),
    "the signed time": lambda t, rng: setattr(t.receipts[0].receipt, "issued_unix_ms", 1),
    "the signature": lambda t, rng: setattr(t.receipts[0].receipt, "signature", bytes(64)),
    "a span's start": lambda t, rng: setattr(t.receipts[-1], "start", t.receipts[-1].start + 1),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_every_single_forgery_is_refused(forgery):
    rng = random.Random(hash(forgery) % 1000)
    for _ in range(50):
        t = episode(rng)
        FORGERIES[forgery](t, rng)
        assert refused(check(), t) == Reason.BAD_RECEIPT, forgery


def test_a_trained_token_outside_every_receipt_is_refused_by_name():
    rng = random.Random(3)
    for _ in range(50):
        t = episode(rng)
        lost = rng.randrange(len(t.receipts))
        first = t.receipts[lost].start
        del t.receipts[lost]
        with pytest.raises(InvalidArgument) as err:
            check().verify(t)
        assert err.value.reason == Reason.RECEIPT_MISSING and f"token {first} " in err.value.message
    marked = 0
    while marked < 20:  # an environment token marked trained: no receipt covers it
        t = episode(rng)
        env = [j for j, m in enumerate(t.loss_mask) if not m]
        if env:
            t.loss_mask[env[0]] = True
            assert refused(check(), t) == Reason.RECEIPT_MISSING
            marked += 1


def test_receipts_of_an_untrusted_replica_another_adapter_or_too_old_are_refused():
    rng = random.Random(4)
    assert refused(check(), episode(rng, OTHER)) == Reason.BAD_RECEIPT
    assert "not signed by a replica this learner trusts" in _message(check(), episode(rng, OTHER))
    t = episode(rng)
    assert refused(ReceiptCheck(TRUSTED, "another-run", 60), t) == Reason.BAD_RECEIPT
    assert check().verify(episode(rng, adapter=f"team-a{TENANT_SEPARATOR}{ADAPTER}"))  # as a tenant's replica names it
    assert refused(check(), episode(rng, adapter=f"team-a{TENANT_SEPARATOR}x{ADAPTER}")) == Reason.BAD_RECEIPT
    old = ReceiptCheck(TRUSTED, ADAPTER, max_age_s=1e-9)
    assert "ingest.receipt_max_age_s" in _message(old, t)


def test_spans_out_of_order_or_range_and_too_many_are_refused_before_any_signature():
    rng = random.Random(5)
    t = episode(rng)
    t.receipts[0].start = len(t.token_ids)  # past the end
    assert "lie within" in _message(check(), t)
    t = episode(rng)
    while len(t.receipts) < 2:
        t = episode(rng)
    t.receipts[1].start = 0  # overlaps the first
    assert "not overlap" in _message(check(), t)
    t.ClearField("receipts")
    for _ in range(MAX_RECEIPTS + 1):
        t.receipts.add(start=0)
    assert f"at most {MAX_RECEIPTS}" in _message(check(), t)


def test_a_receipt_signs_each_field_and_nothing_else_verifies():
    """rollwire.common.receipts: changing any signed field breaks the signature; the manifest
    domain's signature over the same bytes is not a receipt's."""
    r = turn(Receipts(KEY), [1, 2, 3], [4, 5], [-0.5, -1.0], 2, "rid")
    keys = TRUSTED.keys
    assert common.verify(r, keys)
    for name in ("adapter", "sample_id", "signer"):
        forged = type(r)()
        forged.CopyFrom(r)
        setattr(forged, name, getattr(r, name) + "x")
        assert not common.verify(forged, keys), name
    for name in ("context_sha256", "tokens_sha256", "logprobs_sha256", "versions_sha256"):
        forged = type(r)()
        forged.CopyFrom(r)
        setattr(forged, name, bytes(32))
        assert not common.verify(forged, keys), name
    for name in ("tokens", "issued_unix_ms"):
        forged = type(r)()
        forged.CopyFrom(r)
        setattr(forged, name, getattr(r, name) + 1)
        assert not common.verify(forged, keys), name
    stripped = type(r)()
    stripped.CopyFrom(r)
    stripped.signature = KEY.private.sign(common.canonical(r)[len(common.DOMAIN) :])  # without the domain
    assert not common.verify(stripped, keys)
    assert common.covers(r, [1, 2, 3], [4, 5], [-0.5, -1.0], [2, 2]) is None
    assert "not those the replica was given" in (common.covers(r, [1, 2], [4, 5], [-0.5, -1.0], [2, 2]) or "")


def _message(c: ReceiptCheck, t: lpb.Trajectory) -> str:
    with pytest.raises(InvalidArgument) as err:
        c.verify(t)
    return err.value.message
