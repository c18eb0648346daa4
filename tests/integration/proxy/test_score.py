"""Score through a real proxy over two real transformers replicas (the session's shared fleet,
support.fleets; this module only sends requests and pushes a name of its own).

Independent computations: a teacher-forced forward pass of the tiny model and of a local PEFT
model carrying the pushed adapter (support.engines.forward_logprobs), and the logprobs the same
fleet reported while generating those tokens at temperature 1 with no top-k or top-p.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
import torch
from support.engines import forward_logprobs
from support.processes import start_proxy, stop_all, wait_routable
from support.wire import fingerprint, generate, make_adapter, metric_value, peft_reference, push, stub

from rollwire.client import Client
from rollwire.client.cli import main
from rollwire.common.errors import from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration
NAME = "score-pol"
EXACT = 1e-5
"""Score against the test's own PEFT forward pass."""
AS_GENERATED = 1e-4
"""Score against what the replica reported while generating (KV cache, other rows in the batch)."""


@pytest.fixture(scope="module")
def fleet(tiny_model, fleets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("score")
    replicas = fleets.replicas(tiny_model, 2)
    proxy = start_proxy(workdir, "score-proxy", replicas)
    wait_routable(proxy, replicas)
    yield proxy, replicas
    stop_all([proxy])


@pytest.fixture(scope="module")
def adapters(fleet, tiny_model):
    """Versions 1 and 2 of NAME, pushed through the proxy (so both replicas hold both)."""
    proxy, _ = fleet
    pushed = {v: make_adapter(tiny_model, seed=70 + v, r=4, scale=0.1) for v in (1, 2)}  # why 0.1: test_engine_score.py
    fp = fingerprint(proxy.target)
    for version, adapter in pushed.items():
        push(proxy.target, adapter.manifest(NAME, version, fp), adapter.payload)
    return pushed


def score_request(prompt: list[int], samples: dict[int, list[int]], version: int | None, top_k: int = 0):
    req = pb.ScoreRequest(top_k=top_k)
    for i in sorted(samples):
        req.sequences.add(prompt_token_ids=prompt, continuation_token_ids=samples[i])
    if version is not None:
        req.adapter.name, req.adapter.version = NAME, version
    return req


@pytest.mark.parametrize("version", [None, 1], ids=["base", "adapter-v1"])
def test_score_equals_a_peft_forward_and_the_generating_replicas_logprobs(
    fleet, adapters, tiny_model, reference_model, version
):
    proxy, replicas = fleet
    adapter = None if version is None else (NAME, version)
    group = generate(
        proxy.target,
        [5, 17, 33, 40, 12],
        n=3,
        adapter=adapter,
        seed=9,
        max_new_tokens=16,
        temperature=1.0,
        ignore_eos=True,
    )
    prompt = list(group.started.prompt_token_ids)
    reply = stub(proxy.target).Score(score_request(prompt, group.tokens, version, top_k=2), timeout=60)
    model = reference_model if version is None else peft_reference(tiny_model, adapters[version])
    assert len(reply.sequences) == 3
    for i, scored in zip(sorted(group.tokens), reply.sequences, strict=True):
        got = torch.tensor(list(scored.logprobs))
        assert torch.allclose(got, torch.tensor(group.logprobs[i]), atol=AS_GENERATED), i
        assert torch.allclose(got, forward_logprobs(model, prompt, group.tokens[i]), atol=EXACT), i
        assert len(scored.top) == len(group.tokens[i]) and all(len(t.token_ids) == 2 for t in scored.top)
        assert all(t.logprobs[0] >= lp - EXACT for t, lp in zip(scored.top, scored.logprobs, strict=True))
    assert (reply.adapter.name, reply.adapter.version) == (NAME if version else "", version or 0)
    assert reply.sha256 == (adapters[version].sha256 if version else "")
    assert reply.replica in {r.name for r in replicas} and reply.model_fingerprint == fingerprint(proxy.target)


def test_score_is_routed_by_version_and_names_the_version_that_scored(fleet, adapters, tiny_model):
    proxy, _ = fleet
    prompt, continuation = [3, 9, 27], [81, 4, 12, 36]
    with Client(proxy.target, timeout=60) as client:
        latest = client.score([(prompt, continuation)], adapter=NAME)
        first = client.score([(prompt, continuation)], adapter=f"{NAME}@1")
    assert (latest.version, latest.sha256) == (2, adapters[2].sha256)  # "latest" resolved once, at the proxy
    assert (first.version, first.sha256) == (1, adapters[1].sha256)
    assert not torch.allclose(torch.tensor(latest.logprobs[0]), torch.tensor(first.logprobs[0]), atol=1e-3)
    for result, version in ((latest, 2), (first, 1)):
        want = forward_logprobs(peft_reference(tiny_model, adapters[version]), prompt, continuation)
        assert type(result.logprobs[0]) is list and torch.allclose(torch.tensor(result.logprobs[0]), want, atol=EXACT)


def outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), from_rpc_error(exc).reason
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(("name", "version"), [(NAME, 99), ("score-nobody", 0), ("score-nobody", 3)])
def test_a_version_no_replica_holds_gets_the_status_generate_gets(fleet, adapters, name, version):
    proxy, _ = fleet
    s = stub(proxy.target)
    ref = pb.AdapterRef(name=name, version=version)
    seq = pb.ScoreSequence(prompt_token_ids=[1, 2], continuation_token_ids=[3])
    scored = outcome(lambda: s.Score(pb.ScoreRequest(adapter=ref, sequences=[seq]), timeout=30))
    gen = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2]), n=1, sampling=pb.SamplingParams(max_new_tokens=2), adapter=ref
    )
    generated = outcome(lambda: list(s.Generate(gen, timeout=30)))
    assert scored == generated and scored[0] != grpc.StatusCode.OK, (scored, generated)


def test_a_refusal_and_the_metrics_reach_the_caller_unchanged(fleet, adapters):
    proxy, replicas = fleet
    direct, through = stub(replicas[0].target), stub(proxy.target)
    bad = pb.ScoreRequest(sequences=[pb.ScoreSequence(prompt_token_ids=[1], continuation_token_ids=[10**6])])
    assert outcome(lambda: direct.Score(bad, timeout=30)) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_TOKEN_ID)
    assert outcome(lambda: through.Score(bad, timeout=30)) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_TOKEN_ID)
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert metric_value(text, "rollwire_proxy_score_requests_total", 'code="OK"') >= 1
    assert metric_value(text, "rollwire_proxy_score_requests_total", 'code="INVALID_ARGUMENT"') >= 1
    assert metric_value(text, "rollwire_proxy_scored_tokens_total") >= 1


def test_the_cli_prints_the_logprobs_and_the_version(fleet, adapters, tmp_path, capsys):
    proxy, _ = fleet
    seqs = tmp_path / "seqs.json"
    seqs.write_text(json.dumps([{"prompt": [3, 9], "continuation": [27, 81]}]))
    assert main(["score", "--target", proxy.target, "--adapter", f"{NAME}@2", "--top-k", "1", str(seqs)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["adapter"], out["version"], out["sha256"]) == (NAME, 2, adapters[2].sha256)
    assert len(out["logprobs"]) == 1 and len(out["logprobs"][0]) == 2 and len(out["top_ids"][0]) == 2
