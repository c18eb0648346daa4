"""A version's behavioural proof on one replica (rollwire.generator.proof), in-process: the real
transformers engine and adapter registry, probes computed independently by a local PEFT model.

An honest engine passes within the documented 1e-4; an engine that serves other weights than
the published ones (a double whose loads scale the adapter's B matrices, as a mis-scaling server
would) is refused before the version is served, named, counted, and the replica keeps serving
what it served; a malformed probe is the client's fault, refused before any work.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from support.engines import forward_logprobs
from support.wire import make_adapter, peft_reference

from rollwire.common import probe as probes
from rollwire.common.errors import FailedPrecondition, Internal, InvalidArgument, RollwireError
from rollwire.common.manifest import Manifest, check_manifest
from rollwire.common.reasons import Reason
from rollwire.common.signing import SigningKey, sign, verify
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.served import sglang_protocol as sglang
from rollwire.generator.engines.served.vllm_score import ScoreGate, read_score, score_body
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.proof import Prover
from rollwire.generator.types import ScoreJob
from rollwire.push.buffers import as_bytes
from rollwire.v1 import generator_pb2 as pb

TOLERANCE = 1e-4
"""The transformers engine's documented default (rollwire.common.probe.DEFAULT_TOLERANCES)."""
SCALE = 0.1  # LoRA weights at the scale test_engine_score.py uses: float32 sums stay exact to ~1e-6


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64, threads=1)
    await eng.start()
    yield eng
    await eng.close()


@pytest.fixture(scope="module")
def adapters(tiny_model):
    """Two versions and the PEFT models that give their true numbers."""
    made = [make_adapter(tiny_model, seed=51 + v, r=4, scale=SCALE) for v in (1, 2)]
    return [(a, peft_reference(tiny_model, a)) for a in made]


def probe_of(engine, peft) -> pb.AdapterProbe:
    """The probe a publisher sends: fixed sequences and its own model's logprobs for them."""
    seqs = [(engine.tokenize(p), engine.tokenize(c)) for p, c in (("12+34=", "46"), ("abc", "defgh"), ("7*8", "=56"))]
    logprobs = [forward_logprobs(peft, p, c).tolist() for p, c in seqs]
    return probes.build_probe(seqs, logprobs, seed=7)


def manifest(adapter, version: int, probe: pb.AdapterProbe | None, signer: str = "") -> Manifest:
    return Manifest("pol", version, "fp", adapter.shape, len(adapter.payload), adapter.sha256, signer, probe=probe)


class ScalingEngine:
    """An engine double that serves other weights than the published ones: it loads every
    adapter with its lora_B matrices times `factor` (a server given another file, or one that
    mis-scales), through the real engine."""

    def __init__(self, engine, factor: float) -> None:
        self.engine, self.factor = engine, factor

    async def load(self, handle, m, payload) -> None:
        from safetensors.torch import load, save

        tensors = load(as_bytes(payload))
        scaled = {k: v * self.factor if "lora_B" in k else v for k, v in tensors.items()}
        await self.engine.load_adapter(handle, m, save(scaled))


def registry_for(engine, *, trusted: bool, factor: float = 1.0) -> tuple[AdapterRegistry, Prover, GeneratorMetrics]:
    metrics = GeneratorMetrics()
    prover = Prover(engine, metrics, trusted=trusted, replica="replica-a")
    load = ScalingEngine(engine, factor).load if factor != 1.0 else engine.load_adapter
    return AdapterRegistry(load, engine.unload_adapter, window=2, prove=prover.prove), prover, metrics


def count(metrics: GeneratorMetrics, outcome: str) -> float:
    return metrics.proofs.labels(outcome)._value.get()


async def test_an_honest_engine_passes_within_the_documented_tolerance(engine, adapters):
    (a1, peft1), _ = adapters
    registry, prover, metrics = registry_for(engine, trusted=True)
    assert prover.tolerance == TOLERANCE
    out = await registry.push(manifest(a1, 1, probe_of(engine, peft1), signer="k1"), a1.payload)
    assert out.loaded_versions == [1]
    proof = prover.of(registry.loaded())["pol"][1]
    assert proof.outcome == probes.PASSED and proof.max_abs_gap <= TOLERANCE and proof.reference == "publisher"
    assert count(metrics, probes.PASSED) == 1 and count(metrics, probes.FAILED) == 0
    for handle in list(engine._lora._order):
        await engine.unload_adapter(handle)


async def test_an_engine_serving_other_weights_is_refused_named_and_keeps_what_it_served(engine, adapters):
    (a1, _), (a2, peft2) = adapters
    registry, prover, metrics = registry_for(engine, trusted=True, factor=1.05)
    await registry.push(manifest(a1, 1, None), a1.payload)  # no probe: nothing to hold it to
    loaded_before = len(engine._lora)
    with pytest.raises(FailedPrecondition) as refused:
        await registry.push(manifest(a2, 2, probe_of(engine, peft2), signer="k1"), a2.payload)
    assert refused.value.reason == Reason.PROOF_FAILED
    assert "replica-a" in refused.value.message and "v2" in refused.value.message
    assert "differ by up to" in refused.value.message and "sequence" in refused.value.message
    # an independent gap: the true numbers against the same sequences scored by the engine as loaded
    recorded = prover.proofs[("pol", 2)]
    assert recorded.outcome == probes.FAILED and recorded.max_abs_gap > 10 * TOLERANCE
    assert registry.loaded() == {"pol": [1]}  # it keeps serving what it served
    await registry.settle()
    assert len(engine._lora) == loaded_before  # the refused version left the engine
    assert count(metrics, probes.FAILED) == 1
    assert metrics.proof_gap.labels("pol")._value.get() == pytest.approx(recorded.max_abs_gap)
    for handle in list(engine._lora._order):
        await engine.unload_adapter(handle)


async def test_an_unsigned_probe_that_fails_is_disputed_not_the_replicas_fault(engine, adapters):
    (a1, peft1), _ = adapters
    registry, _, metrics = registry_for(engine, trusted=True, factor=1.05)
    with pytest.raises(FailedPrecondition) as refused:
        await registry.push(manifest(a1, 1, probe_of(engine, peft1)), a1.payload)  # unsigned
    assert refused.value.reason == Reason.PROOF_DISPUTED and "unsigned" in refused.value.message
    assert count(metrics, probes.DISPUTED) == 1 and count(metrics, probes.FAILED) == 0
    assert registry.loaded() == {}


async def test_a_staged_version_is_proved_at_commit_and_dropped_when_refused(engine, adapters):
    (a1, peft1), _ = adapters
    registry, _, _ = registry_for(engine, trusted=True, factor=0.9)
    m = manifest(a1, 1, probe_of(engine, peft1), signer="k1")
    staged = await registry.stage(m, a1.payload)
    assert staged.staged and registry.staged() == {"pol": 1}
    with pytest.raises(FailedPrecondition) as refused:
        await registry.commit("pol", 1, a1.sha256)
    assert refused.value.reason == Reason.PROOF_FAILED
    assert registry.staged() == {} and registry.loaded() == {}
    await registry.settle()
    assert not len(engine._lora)


def test_malformed_or_oversized_probes_are_the_clients_fault_before_any_work(engine, adapters):
    (a1, peft1), _ = adapters
    good = probe_of(engine, peft1)
    cases = []
    uneven = pb.AdapterProbe()
    uneven.CopyFrom(good)
    del uneven.expected[-1]
    cases.append((uneven, Reason.BAD_PROBE))
    positive = pb.AdapterProbe()
    positive.CopyFrom(good)
    positive.expected[0].logprobs[0] = 0.5
    cases.append((positive, Reason.BAD_PROBE))
    nan = pb.AdapterProbe()
    nan.CopyFrom(good)
    nan.expected[0].logprobs[0] = float("nan")
    cases.append((nan, Reason.BAD_PROBE))
    many = probes.build_probe([([3], [4])] * probes.MAX_PROBE_SEQUENCES, [[-1.0]] * probes.MAX_PROBE_SEQUENCES)
    many.sequences.append(pb.ScoreSequence(prompt_token_ids=[3], continuation_token_ids=[4]))
    many.expected.append(pb.SequenceScore(logprobs=[-1.0]))
    cases.append((many, Reason.PROBE_TOO_LARGE))
    long = [3] * (probes.MAX_PROBE_TOKENS // 2)
    cases.append((pb.AdapterProbe(sequences=[pb.ScoreSequence(prompt_token_ids=long, continuation_token_ids=[*long, 3])], expected=[pb.SequenceScore(logprobs=[-1.0] * (len(long) + 1))]), Reason.PROBE_TOO_LARGE))  # fmt: skip
    for probe, reason in cases:
        with pytest.raises(InvalidArgument) as refused:
            check_manifest(manifest(a1, 1, probe), fingerprint="fp", max_bytes=1 << 30)
        assert refused.value.reason == reason, refused.value.message
    outside = pb.AdapterProbe()
    outside.CopyFrom(good)
    outside.sequences[0].prompt_token_ids[0] = engine.vocab_size
    prover = Prover(engine, GeneratorMetrics(), trusted=True, replica="r")
    with pytest.raises(InvalidArgument) as refused:
        prover.check(manifest(a1, 1, outside))
    assert refused.value.reason == Reason.BAD_PROBE and "vocabulary" in refused.value.message
    assert not engine._scores  # no Score was queued for any of them


def test_the_signature_covers_the_probe(engine, adapters):
    (a1, peft1), _ = adapters
    key = SigningKey.generate("k1")
    signed = sign(a1.manifest("pol", 1, "fp", probe=probe_of(engine, peft1)), key)
    public = key.private.public_key()
    assert verify(signed, public)
    altered = pb.AdapterManifest()
    altered.CopyFrom(signed)
    altered.probe.expected[0].logprobs[0] -= 0.01  # a hop "corrects" the publisher's numbers
    assert not verify(altered, public)
    stripped = pb.AdapterManifest()
    stripped.CopyFrom(signed)
    stripped.ClearField("probe")
    assert not verify(stripped, public)


def test_compare_names_the_largest_gap_and_never_passes_a_nan():
    gap = probes.compare([[-1.0, -2.0], [-0.5]], [[-1.0, -2.25], [-0.4]])
    assert gap.max_abs == pytest.approx(0.25) and gap.where == "sequence 0 token 1"
    assert not probes.compare([[-1.0]], [[float("nan")]]).within(1.0)
    assert not probes.compare([[-1.0, -1.0]], [[-1.0]]).within(1.0)
    assert torch.isfinite(torch.tensor(probes.compare([[-1.0]], [[-1.0]]).max_abs))


def test_vllm_prompt_logprobs_are_read_by_token_id_at_their_own_position():
    job = ScoreJob("s", (((5, 6), (7, 8)),))
    entries = [
        None,
        {"6": {"logprob": -0.1}},
        {"7": {"logprob": -0.2}, "9": {"logprob": -0.05}},
        {"8": {"logprob": -0.3}},
    ]
    assert read_score(job, 0, {"choices": [{"index": 0, "prompt_logprobs": entries}]}).logprobs == [-0.2, -0.3]
    del entries[2]["7"]  # vLLM left the token out: never scored from a neighbour
    with pytest.raises(Internal):
        read_score(job, 0, {"choices": [{"index": 0, "prompt_logprobs": entries}]})
    assert score_body((5, 6), (7, 8), "lora", "r")["prompt"] == [5, 6, 7, 8]


def test_sglang_input_logprobs_are_read_by_token_id_at_their_own_position():
    """SGLang's input_token_logprobs start at logprob_start_len (the prompt's last token, no logprob),
    then one [logprob, id, text] per later position: each continuation token is read at its own place."""
    job = ScoreJob("s", (((5, 6), (7, 8)),))
    body = sglang.score_body((5, 6), (7, 8), "lora-v1", "r")
    assert body["input_ids"] == [5, 6, 7, 8] and body["logprob_start_len"] == 1 and body["lora_path"] == "lora-v1"
    assert body["sampling_params"] == {"max_new_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert body["return_logprob"] is True and body["stream"] is False
    assert "lora_path" not in sglang.score_body((5,), (7,), None, "r")  # the base model

    def reply(entries):
        return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": entries}}

    entries = [[None, 6, None], [-0.2, 7, None], [-0.3, 8, "x"]]
    assert sglang.read_score(job, 0, reply(entries)).logprobs == [-0.2, -0.3]
    for broken in (
        entries[1:],  # one position late: the first entry is not the prompt's last token
        [[None, 6, None], [-0.2, 9, None], [-0.3, 8, None]],  # another token at a continuation position
        [[None, 6, None], [None, 7, None], [-0.3, 8, None]],  # a continuation token without its logprob
        entries[:2],  # a position missing
    ):
        with pytest.raises(Internal) as missing:
            sglang.read_score(job, 0, reply(broken))
        assert missing.value.reason == Reason.ENGINE_FAILED
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "overloaded", "status_code": 503}}}
    with pytest.raises(RollwireError, match="overloaded"):
        sglang.read_score(job, 0, aborted)


async def test_a_vllm_score_runs_alone_and_new_segments_wait_for_it():
    gate, order = ScoreGate(), []
    segment_open, release = asyncio.Event(), asyncio.Event()

    async def running_segment():
        async with gate.segment():
            order.append("segment")
            segment_open.set()
            await release.wait()
        order.append("segment done")

    async def scoring():
        async with gate.score():
            order.append("score")

    async def late_segment():
        async with gate.segment():
            order.append("late segment")

    first = asyncio.create_task(running_segment())
    await segment_open.wait()
    score = asyncio.create_task(scoring())
    await asyncio.sleep(0)  # the score is waiting now
    late = asyncio.create_task(late_segment())
    await asyncio.sleep(0)
    assert order == ["segment"]  # the score waits for the running segment; the late one for the score
    release.set()
    await asyncio.gather(first, score, late)
    assert order == ["segment", "segment done", "score", "late segment"]
