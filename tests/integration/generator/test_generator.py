"""A real generator process with the tiny model, checked over real sockets.

Numbers are compared with an independent computation: a teacher-forced forward pass of the
same model (and adapter) in this process.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from support.engines import forward_logprobs
from support.processes import start_generator
from support.wire import fingerprint, generate, make_adapter, metric_value, peft_reference, push, request, stub

from rollwire.v1 import generator_pb2 as pb


def test_base_logprobs_equal_forward_pass(generator, reference_model):
    g = generate(generator.target, "The cat sat", n=4, max_new_tokens=24, seed=11)
    prompt = list(g.started.prompt_token_ids)
    assert g.started.adapter.version == 0 and len(g.finished) == 4
    for i in range(4):
        assert len(g.tokens[i]) == g.finished[i].completion_tokens == len(g.logprobs[i])
        expected = forward_logprobs(reference_model, prompt, g.tokens[i])
        assert torch.allclose(torch.tensor(g.logprobs[i]), expected, atol=1e-4), i


def test_logprobs_follow_the_documented_transform(generator, reference_model):
    params = dict(temperature=0.7, top_k=12, top_p=0.8)
    g = generate(generator.target, "xyz", n=3, max_new_tokens=16, seed=5, **params)
    prompt = list(g.started.prompt_token_ids)
    for i in range(3):
        expected = forward_logprobs(reference_model, prompt, g.tokens[i], **params)
        assert torch.isfinite(expected).all()  # every sampled token was inside the kept set
        assert torch.allclose(torch.tensor(g.logprobs[i]), expected, atol=1e-4)


def test_seed_makes_samples_reproducible(generator):
    a = generate(generator.target, "seeded", n=3, max_new_tokens=20, seed=42)
    b = generate(generator.target, "seeded", n=3, max_new_tokens=20, seed=42)
    c = generate(generator.target, "seeded", n=3, max_new_tokens=20, seed=43)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.tokens[0] != a.tokens[1]  # samples of one group differ from each other


def test_a_caller_that_reads_whole_samples_gets_one_message_per_sample(generator, reference_model):
    """GenerateRequest.stream_interval: 4096 gathers each sample's tokens into the message
    that ends it (the HTTP door's unstreamed requests); the tokens and logprobs are those of
    a token-per-message stream of the same seed; above 4096 it is refused."""

    def messages(interval: int) -> list[pb.GenerateResponse]:
        req = pb.GenerateRequest(n=2, stream_interval=interval, sampling=pb.SamplingParams(max_new_tokens=12, seed=5))
        req.token_ids.ids.extend([5, 6, 7])
        return list(stub(generator.target).Generate(req, timeout=60))

    whole, each = messages(4096), messages(0)
    chunks = [c for m in whole for c in m.tokens]
    assert sorted(c.sample_index for c in chunks) == [0, 1]  # one chunk per sample, all its tokens
    assert sum(1 for m in each for c in m.tokens) > 2
    for i in (0, 1):
        alone = [t for m in each for c in m.tokens if c.sample_index == i for t in c.token_ids]
        chunk = next(c for c in chunks if c.sample_index == i)
        assert list(chunk.token_ids) == alone
        assert list(chunk.logprobs) == pytest.approx(
            [lp for m in each for c in m.tokens if c.sample_index == i for lp in c.logprobs], abs=1e-5
        )
    with pytest.raises(grpc.RpcError) as err:
        messages(4097)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_interval" in err.value.details()


def test_greedy_equals_hf_generate(generator, reference_model):
    g = generate(generator.target, "greedy", n=2, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = list(g.started.prompt_token_ids)
    with torch.no_grad():
        ref = reference_model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert g.tokens[0] == g.tokens[1] == ref


def test_pushed_adapter_matches_local_peft_model(generator, tiny_model):
    adapter = make_adapter(tiny_model, seed=1)
    fp = fingerprint(generator.target)
    reply = push(generator.target, adapter.manifest("match", 1, fp), adapter.payload)
    assert reply.version == 1 and not reply.already_loaded and list(reply.loaded_versions) == [1]
    reference = peft_reference(tiny_model, adapter)

    greedy = generate(
        generator.target, "adapt", n=1, adapter=("match", 1), max_new_tokens=20, temperature=0.0, ignore_eos=True
    )
    prompt = list(greedy.started.prompt_token_ids)
    with torch.no_grad():
        ref = reference.generate(
            torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0
        )
    assert greedy.tokens[0] == ref[0, len(prompt) :].tolist()
    base = generate(generator.target, "adapt", n=1, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    assert base.tokens[0] != greedy.tokens[0]  # the adapter really changes the policy

    sampled = generate(generator.target, "adapt", n=3, adapter=("match", 0), max_new_tokens=20, seed=3)
    assert sampled.started.adapter.version == 1
    for i in range(3):
        assert sampled.versions[i] == {1}
        expected = forward_logprobs(reference, prompt, sampled.tokens[i])
        assert torch.allclose(torch.tensor(sampled.logprobs[i]), expected, atol=1e-4)


def test_idempotent_repush_and_version_window(generator, tiny_model):
    """A replica at its defaults keeps the 3 newest versions loaded (adapter_window) and serves
    the 8 newest (adapter_keep): an older one is loaded again when named; the 9th push lets
    v1 go, with a sentence naming adapter_keep."""
    fp = fingerprint(generator.target)
    adapters = {v: make_adapter(tiny_model, seed=100 + v, r=4) for v in range(1, 10)}
    push(generator.target, adapters[1].manifest("win", 1, fp), adapters[1].payload)
    again = push(generator.target, adapters[1].manifest("win", 1, fp), adapters[1].payload)
    assert again.already_loaded and list(again.loaded_versions) == [1]
    for v in range(2, 9):
        push(generator.target, adapters[v].manifest("win", v, fp), adapters[v].payload)
    assert generate(generator.target, "p", adapter=("win", 1), max_new_tokens=4).versions[0] == {1}  # kept
    push(generator.target, adapters[9].manifest("win", 9, fp), adapters[9].payload)  # 8 kept: v1 leaves
    with pytest.raises(grpc.RpcError) as err:
        generate(generator.target, "p", adapter=("win", 1), max_new_tokens=4)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "adapter_keep" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(generator.target, "p", adapter=("win", 19), max_new_tokens=4)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert generate(generator.target, "p", adapter=("win", 2), max_new_tokens=4).versions[0] == {2}
    assert generate(generator.target, "p", adapter=("win", 0), max_new_tokens=4).started.adapter.version == 9
    status = stub(generator.target).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert {a.name: list(a.versions) for a in status.adapters}["win"] == list(range(2, 10))


def test_pinned_request_finishes_on_its_version_while_it_leaves_the_window(generator, tiny_model):
    fp = fingerprint(generator.target)
    adapters = {v: make_adapter(tiny_model, seed=200 + v, r=4) for v in range(1, 10)}
    push(generator.target, adapters[1].manifest("lease", 1, fp), adapters[1].payload)
    request = pb.GenerateRequest(
        text="long",
        n=2,
        adapter=pb.AdapterRef(name="lease", version=1),
        sampling=pb.SamplingParams(max_new_tokens=120, ignore_eos=True, seed=1),
    )
    stream = stub(generator.target).Generate(request, timeout=60)
    first = [next(stream), next(stream)]  # started + first tokens: the request holds v1
    assert first[0].started.adapter.version == 1
    for v in range(2, 10):  # past adapter_keep (8): v1 stops being servable while it runs
        push(generator.target, adapters[v].manifest("lease", v, fp), adapters[v].payload)
    rest = list(stream)
    chunks = [t for m in first[1:] + rest for t in m.tokens]
    finished = [f for m in rest for f in m.finished]
    assert {c.adapter_version for c in chunks} == {1}
    assert sorted(f.completion_tokens for f in finished) == [120, 120]
    with pytest.raises(grpc.RpcError) as err:  # and once it finished, v1 is gone
        generate(generator.target, "p", adapter=("lease", 1), max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_stop_strings_and_finish_reasons(generator):
    g = generate(generator.target, "abc", n=4, max_new_tokens=60, seed=9, stop=["e"])
    for i in range(4):
        reason = g.finished[i].finish_reason
        if reason == pb.FINISH_REASON_STOP:
            assert g.text[i].endswith("e") and "e" not in g.text[i][:-1]
        else:
            assert reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS) and "e" not in g.text[i]
    # the branch above is taken: a stop string ended a sample (seeded, so always the same ones)
    assert any(f.finish_reason == pb.FINISH_REASON_STOP for f in g.finished.values()), g.text


def test_cancel_mid_stream_frees_the_slot(generator):
    # 16 samples x 200 tokens take far longer than the cancel takes to arrive.
    request = pb.GenerateRequest(
        text="cancel me", n=16, sampling=pb.SamplingParams(max_new_tokens=200, ignore_eos=True)
    )
    control = stub(generator.target)
    stream = control.Generate(request, timeout=60)
    assert next(stream).HasField("started")
    assert control.GetStatus(pb.GetStatusRequest(), timeout=5).in_flight == 1
    stream.cancel()
    # The server learns of the cancel asynchronously; bounded wait. One scrape reads the
    # families one after another while the servicer updates them, so wait for all three.
    for _ in range(200):
        metrics = generator.metrics()
        if (
            metric_value(metrics, "rollwire_generator_in_flight_requests")
            == 0
            == metric_value(metrics, "rollwire_generator_running_groups")
            and metric_value(metrics, "rollwire_generator_requests_total", 'code="CANCELLED"') >= 1
        ):
            break
        threading.Event().wait(0.02)
    assert metric_value(metrics, "rollwire_generator_in_flight_requests") == 0
    assert metric_value(metrics, "rollwire_generator_requests_total", 'code="CANCELLED"') >= 1
    assert metric_value(metrics, "rollwire_generator_running_groups") == 0
    assert generate(generator.target, "after", max_new_tokens=3, ignore_eos=True).finished[0].completion_tokens == 3


def test_concurrent_groups_share_forward_passes(generator):
    before = metric_value(generator.metrics(), "rollwire_generator_forward_passes_total")
    barrier = threading.Barrier(4)
    results = []

    def one(i):
        barrier.wait()
        results.append(generate(generator.target, f"group {i}", n=4, max_new_tokens=32, ignore_eos=True, seed=i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    passes = metric_value(generator.metrics(), "rollwire_generator_forward_passes_total") - before
    assert all(len(r.tokens) == 4 and all(len(t) == 32 for t in r.tokens.values()) for r in results)
    # One at a time, each group needs 1 prefill + 31 decode passes: 128 in all.
    assert passes < 4 * 32 * 0.75, passes


def test_health_and_reflection(generator):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(generator.target)
    resp = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="rollwire.v1.GeneratorService")
    )
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "rollwire.v1.GeneratorService" in names


def test_metrics_count_requests_tokens_and_latency(generator):
    before = generator.metrics()
    generate(generator.target, "count", n=2, max_new_tokens=5, ignore_eos=True)
    after = generator.metrics()
    ok = 'code="OK"'
    assert (
        metric_value(after, "rollwire_generator_requests_total", ok)
        == metric_value(before, "rollwire_generator_requests_total", ok) + 1
    )
    delta = metric_value(after, "rollwire_generator_tokens_total", 'kind="completion"') - metric_value(
        before, "rollwire_generator_tokens_total", 'kind="completion"'
    )
    assert delta == 10
    assert metric_value(after, "rollwire_generator_time_to_first_token_seconds_count") > metric_value(
        before, "rollwire_generator_time_to_first_token_seconds_count"
    )
    assert "rollwire_generator_request_duration_seconds_bucket" in after


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast


def test_stream_interval_sends_fewer_larger_messages_with_the_same_samples(generator, tiny_model, tmp_path):
    """`stream_interval=8`: every message but the last carries 8 or more new tokens of some
    sample (or a sample's end), and the seeded group is token for token and logprob for
    logprob the one the per-token stream gives."""
    gathered = start_generator(tiny_model, tmp_path, "gathered", "--set", "stream_interval=8")
    try:
        req = request("interval", n=3, max_new_tokens=20, seed=9, ignore_eos=True)
        streams = {name: list(stub(svc.target).Generate(req, timeout=60)) for name, svc in
                   (("per-token", generator), ("gathered", gathered))}  # fmt: skip
    finally:
        gathered.stop()
    samples = {name: _samples(msgs) for name, msgs in streams.items()}
    assert samples["gathered"] == samples["per-token"]
    assert all(len(ids) == 20 for ids, _ in samples["gathered"].values())
    body = streams["gathered"][1:]  # after `started`
    assert len(body) <= 3 < len(streams["per-token"]) - 1, [len(m.tokens) for m in body]
    for msg in body[:-1]:
        assert msg.finished or max(len(c.token_ids) for c in msg.tokens) >= 8, msg


def _samples(messages) -> dict[int, tuple[list[int], list[float]]]:
    out: dict[int, tuple[list[int], list[float]]] = {}
    for msg in messages:
        for chunk in msg.tokens:
            ids, logprobs = out.setdefault(chunk.sample_index, ([], []))
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
    return out
