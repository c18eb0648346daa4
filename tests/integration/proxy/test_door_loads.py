"""Loads through the HTTP door as TRL's loop needs them (issue 31; docs/http.md "Loads").

- a load answers once the version is durable in the spool (`http.load_answer = "spooled"`),
  while a replica has not committed it; a request naming it right after the answer waits and
  is served by that version only (per-token versions, logprobs against a PEFT forward);
- a replica that missed the relay after the answer is reported (metrics) and healed (catch-up);
- a proxy killed right after the answer, restarted on its spool, serves the version;
- a version that left a replica's window (adapter_window 1) but not its adapter_keep is served,
  with logprobs within 1e-4 of a teacher-forced forward under that version; one beyond it is
  refused with a sentence naming adapter_keep; /server_info's max_loras is adapter_keep.
- a second run that loads `trl-policy-v1`, `-v2` again with its own weights gets a new lineage
  (no 409), is served by its own weights only by either door (logprobs against a PEFT forward),
  and a restarted proxy keeps the map (issue 38, item 4);
- an unload survives a proxy restart, refuses the bare name by either door, leaves /v1/models
  and GetStatus, and unloading what never existed is vLLM's 404;
- a /pause holds the caller's new requests at the door until /resume, and then they are served
  (http/pause.py; the per-tenant rule and the pacing of a lineage's samples are in
  tests/unit/proxy/test_door_pacing.py).

A replica is held mid-publication with SIGSTOP (a peer that vanishes without closing its
socket), so "not yet committed when the answer came" is a fact of the test, not a race.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import requests
from support.engines import forward_logprobs
from support.peft_folders import peft_folder
from support.processes import FAST_STOP, start_generators, start_proxy, stop_all, wait_routable, wait_until
from support.wire import generate, metric_value, peft_reference, status

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 33, 40, 12]


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    """Two replicas with a window of 1 and 4 versions kept, and a proxy with the door and a
    durable spool (this module stops and kills them: it shares them with nobody)."""
    work = tmp_path_factory.mktemp("door-loads")
    root = work / "adapters"
    root.mkdir()
    gens = start_generators(
        tiny_model, work, ["dl1", "dl2"], "--set", "adapter_window=1", "--set", "adapter_keep=4", *FAST_STOP
    )
    args = (
        "--http-port",
        "0",
        "--http-model",
        str(tiny_model),
        "--http-adapter-root",
        str(root),
        "--set",
        f"spool.dir={work / 'spool'}",
        "--set",
        "push.stall_timeout_s=3",
        "--set",
        "health.push_timeout_s=20",
        "--set",
        "routing.coalesce_window_ms=150",  # wide, so concurrent test requests surely meet
        "--set",
        "fairness.max_in_flight_per_client=3",
    )
    state = {"gens": gens, "root": root, "work": work, "args": args, "model": tiny_model}
    state["proxy"] = start_proxy(work, "dl", gens, *args)
    try:
        wait_routable(state["proxy"], gens)
        yield state
    finally:
        for g in gens:
            os.kill(g.proc.pid, signal.SIGCONT)
        stop_all([state["proxy"], *gens])


def load(fleet, name: str, seed: int):
    adapter = peft_folder(fleet["model"], fleet["root"] / name, seed)
    body = json.dumps({"lora_name": name, "lora_path": str(fleet["root"] / name)})
    reply = requests.post(
        fleet["proxy"].http_url + "/v1/load_lora_adapter",
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return adapter, reply.json()


def completion(fleet, model: str, **extra) -> requests.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, "logprobs": 0} | extra
    return requests.post(fleet["proxy"].http_url + "/v1/completions", json=body, timeout=60)


def versions_of(replica, name: str) -> list[int]:
    return next((list(a.versions) for a in status(replica.target).adapters if a.name == name), [])


def check_served_by(fleet, adapter, name: str, version: int) -> None:
    """A request naming the version, by either door, is served by it and no other."""
    reference = peft_reference(fleet["model"], adapter)
    choice = completion(fleet, f"{name}-v{version}", seed=11).json()["choices"][0]
    assert choice["adapter_version"] == version
    expected = forward_logprobs(reference, PROMPT, choice["token_ids"]).tolist()
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    group = generate(fleet["proxy"].target, PROMPT, n=2, adapter=(name, version), max_new_tokens=6, temperature=1.0)
    assert all(v == {version} for v in group.versions.values())  # every token of every sample
    for i, tokens in group.tokens.items():
        assert group.logprobs[i] == pytest.approx(forward_logprobs(reference, PROMPT, tokens).tolist(), abs=1e-4)


def trl_body(seed: int | None, max_tokens: int = 8) -> dict:
    """The request TRL's async rollout worker sends for one sample, field for field."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0}
    body |= {"top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0}
    return body | ({"seed": seed} if seed is not None else {})


def post_all(fleet, bodies: list[dict]) -> list[requests.Response]:
    url = fleet["proxy"].http_url + "/v1/completions"
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: requests.post(url, json=b, timeout=60), bodies))


def test_single_sample_requests_for_one_prompt_share_a_group_and_keep_their_own_samples(fleet, reference_model):
    """TRL's n = 1 requests of one group, sent together, are served as one group (one
    prefill) and each is what it would be alone: the same tokens for its seed, logprobs
    within a few ulps, and both equal to a teacher-forced forward of the model."""
    before = metric_value(fleet["proxy"].metrics(), "rollwire_proxy_coalesced_requests_total")
    seeds = [(1 << 62) + 1, 77, None]
    together = post_all(fleet, [trl_body(s) for s in seeds])
    merged = metric_value(fleet["proxy"].metrics(), "rollwire_proxy_coalesced_requests_total") - before
    assert merged == 3, merged
    for seed, reply in zip(seeds, together, strict=True):
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        expected = forward_logprobs(reference_model, PROMPT, choice["token_ids"]).tolist()
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
        if seed is not None:
            alone = requests.post(fleet["proxy"].http_url + "/v1/completions", json=trl_body(seed), timeout=60)
            assert alone.json()["choices"][0]["token_ids"] == choice["token_ids"]
            assert alone.json()["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
                choice["logprobs"]["token_logprobs"], abs=1e-5
            )
    limited = post_all(fleet, [trl_body(None, 60) for _ in range(4)])  # one client, 3 requests open at most
    assert sorted(r.status_code for r in limited) == [200, 200, 200, 429]  # each request counts, merged or not


def test_a_merged_request_that_goes_away_ends_only_itself(fleet):
    """Two gRPC callers' single-sample requests share a group; one cancels after its first
    tokens; the other's sample runs to its end."""
    import grpc

    from rollwire.v1 import generator_pb2 as pb
    from rollwire.v1 import generator_pb2_grpc

    channel = grpc.insecure_channel(fleet["proxy"].target)
    stub = generator_pb2_grpc.GeneratorServiceStub(channel)

    def call(seed: int):
        req = pb.GenerateRequest(n=1, sampling=pb.SamplingParams(max_new_tokens=120, ignore_eos=True, seed=seed))
        req.token_ids.ids.extend(PROMPT)
        return stub.Generate(req, timeout=60)

    before = metric_value(fleet["proxy"].metrics(), "rollwire_proxy_coalesced_requests_total")
    quitter, stayer = call(1), call(2)
    assert next(quitter).HasField("started") and next(stayer).HasField("started")
    assert metric_value(fleet["proxy"].metrics(), "rollwire_proxy_coalesced_requests_total") - before == 2
    quitter.cancel()
    tokens = sum(len(c.token_ids) for m in stayer for c in m.tokens)
    assert tokens == 120
    channel.close()


def test_a_load_answers_once_spooled_and_its_version_is_waited_for(fleet):
    held, other = fleet["gens"]
    os.kill(other.proc.pid, signal.SIGSTOP)  # it will not stage: the commit round waits for it
    try:
        adapter, answer = load(fleet, "pol-v1", seed=1)
        assert answer["state"] == "spooled" and answer["replicas"] == []
        assert versions_of(held, "pol") == []  # no replica had committed it when the answer came
        assert "pol-v1" in [
            m["id"] for m in requests.get(fleet["proxy"].http_url + "/v1/models", timeout=10).json()["data"]
        ]
        check_served_by(fleet, adapter, "pol", 1)  # waits for the commit, which follows the stalled replica's timeout
    finally:
        os.kill(other.proc.pid, signal.SIGCONT)
    metrics = fleet["proxy"].metrics()
    assert metric_value(metrics, "rollwire_proxy_replica_pushes_total", f'code="OK",replica="{held.target}"') >= 1
    failed = [
        line
        for line in metrics.splitlines()
        if line.startswith("rollwire_proxy_replica_pushes_total") and other.target in line and 'code="OK"' not in line
    ]
    assert any(float(line.rsplit(" ", 1)[1]) >= 1 for line in failed), failed  # the miss is reported
    wait_until(lambda: versions_of(other, "pol") == [1], 60, "catch-up heals the replica that missed v1")
    assert (
        metric_value(fleet["proxy"].metrics(), "rollwire_proxy_catchup_pushes_total", f'replica="{other.target}"') >= 1
    )


def test_a_proxy_killed_after_the_answer_still_serves_the_version(fleet):
    gens = fleet["gens"]
    os.kill(gens[1].proc.pid, signal.SIGSTOP)
    try:
        adapter, answer = load(fleet, "pol-v2", seed=2)
        assert answer["state"] == "spooled"
        fleet["proxy"].kill()  # before any commit: the stopped replica holds the round
    finally:
        os.kill(gens[1].proc.pid, signal.SIGCONT)
    fleet["proxy"] = start_proxy(fleet["work"], "dl-again", gens, *fleet["args"])
    wait_routable(fleet["proxy"], gens, timeout=60)
    check_served_by(fleet, adapter, "pol", 2)
    wait_until(lambda: all(2 in versions_of(g, "pol") for g in gens), 60, "every replica serves pol v2")


def test_a_version_outside_the_window_is_served_and_one_beyond_keep_is_refused(fleet):
    info = requests.get(fleet["proxy"].http_url + "/server_info", timeout=10).json()
    assert info["vllm_config"]["lora_config"]["max_loras"] == 4  # adapter_keep, what a caller may name
    first, _ = load(fleet, "old-v1", seed=5)
    for v in (2, 3):
        load(fleet, f"old-v{v}", seed=5 + v)
    for g in fleet["gens"]:
        wait_until(lambda g=g: versions_of(g, "old") == [1, 2, 3], 60, f"{g.name} serves old v1-v3")
    check_served_by(fleet, first, "old", 1)  # v1 left the window of 1: loaded again from its kept bytes
    for v in (4, 5):
        load(fleet, f"old-v{v}", seed=5 + v)
    for g in fleet["gens"]:
        wait_until(lambda g=g: versions_of(g, "old") == [2, 3, 4, 5], 60, f"{g.name} lets old v1 go")
    gone = completion(fleet, "old-v1")
    assert gone.status_code == 400, gone.text
    assert "adapter_keep" in gone.json()["error"]["message"]


def test_the_answer_at_committed_is_kept_for_who_wants_it(tiny_model, fleet, tmp_path: Path):
    """`http.load_answer = "committed"`: today's behaviour, every healthy replica holds it."""
    proxy = start_proxy(
        fleet["work"],
        "dl-committed",
        fleet["gens"],
        *fleet["args"][:6],
        "--set",
        "http.load_answer=committed",
        "--set",
        f"spool.dir={tmp_path / 'spool'}",
    )
    try:
        wait_routable(proxy, fleet["gens"])
        peft_folder(tiny_model, fleet["root"] / "com-v1", seed=21)
        reply = requests.post(
            proxy.http_url + "/v1/load_lora_adapter",
            json={"lora_name": "com-v1", "lora_path": str(fleet["root"] / "com-v1")},
            timeout=60,
        ).json()
        assert reply["state"] == "committed" and {r["code"] for r in reply["replicas"]} == {"OK"}
        assert all(versions_of(g, "com") == [1] for g in fleet["gens"])
    finally:
        stop_all([proxy])


# -- runs that restart their names (issue 38, item 4; docs/http.md "A new run, the same names") ----
def load_from(fleet, name: str, folder: str, seed: int):
    """Load `name` from a new folder of seed `seed` (a run's own weights)."""
    adapter = peft_folder(fleet["model"], fleet["root"] / folder, seed)
    reply = requests.post(
        fleet["proxy"].http_url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(fleet["root"] / folder)},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return adapter, reply.json()


def model_ids(fleet) -> list[str]:
    return [m["id"] for m in requests.get(fleet["proxy"].http_url + "/v1/models", timeout=10).json()["data"]]


def restart_proxy(fleet, name: str) -> None:
    fleet["proxy"].kill()
    fleet["proxy"] = start_proxy(fleet["work"], name, fleet["gens"], *fleet["args"])
    wait_routable(fleet["proxy"], fleet["gens"], timeout=60)


def test_a_second_run_that_restarts_its_names_gets_a_new_lineage(fleet):
    for v in (1, 2):  # run 1
        _, answer = load_from(fleet, f"trl-policy-v{v}", f"run1-v{v}", seed=40 + v)
        assert answer["lineage"] == "trl-policy"
    again = requests.post(  # the same bytes again: idempotent, no new lineage
        fleet["proxy"].http_url + "/v1/load_lora_adapter",
        json={"lora_name": "trl-policy-v2", "lora_path": str(fleet["root"] / "run1-v2")},
        timeout=60,
    ).json()
    assert "new_lineage" not in again and again["lineage"] == "trl-policy"
    run2 = {}
    for v in (1, 2):  # run 2: TRL starts again at v1 with its own weights
        run2[v], answer = load_from(fleet, f"trl-policy-v{v}", f"run2-v{v}", seed=50 + v)
        assert answer["id"] == f"trl-policy-v{v}" and answer["lineage"] == "trl-policy.2"
        assert answer.get("new_lineage", False) == (v == 1)
    conflict = requests.post(  # within a run, v2 with other bytes is still a mistake
        fleet["proxy"].http_url + "/v1/load_lora_adapter",
        json={"lora_name": "trl-policy-v2", "lora_path": str(fleet["root"] / "run1-v2")},
        timeout=60,
    )
    assert conflict.status_code == 409, conflict.text
    for v in (1, 2):
        check_served_by(fleet, run2[v], "trl-policy", v)  # by either door, run 2's weights only
    assert completion(fleet, "trl-policy").json()["choices"][0]["adapter_version"] == 2
    ids = model_ids(fleet)
    assert {"trl-policy-v1", "trl-policy-v2"} <= set(ids) and not any(".2" in i for i in ids), ids
    restart_proxy(fleet, "dl-lineage")  # the map is in the spool
    check_served_by(fleet, run2[1], "trl-policy", 1)
    assert "trl-policy.2" in {a.name for a in status(fleet["proxy"].target).adapters}  # operators see it


def test_an_unload_is_durable_and_refuses_the_bare_name(fleet):
    for v in (1, 2):
        load_from(fleet, f"unl-v{v}", f"unl-v{v}", seed=60 + v)
    gone = requests.post(fleet["proxy"].http_url + "/v1/unload_lora_adapter", json={"lora_name": "unl-v2"}, timeout=10)
    assert gone.json()["unloaded"] == ["unl-v2"]
    assert completion(fleet, "unl-v2").status_code == 404
    assert completion(fleet, "unl").json()["choices"][0]["adapter_version"] == 1  # the newest not unloaded
    assert generate(fleet["proxy"].target, PROMPT, adapter=("unl", 0), max_new_tokens=3).versions[0] == {1}
    requests.post(fleet["proxy"].http_url + "/v1/unload_lora_adapter", json={"lora_name": "unl"}, timeout=10)
    restart_proxy(fleet, "dl-unload")
    for model in ("unl", "unl-v1", "unl-v2"):
        refused = completion(fleet, model)
        assert refused.status_code == 404 and refused.json()["error"]["reason"] == "ADAPTER_UNLOADED", refused.text
    with pytest.raises(grpc.RpcError) as err:
        generate(fleet["proxy"].target, PROMPT, adapter=("unl", 0), max_new_tokens=3)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert not any(i.startswith("unl-") for i in model_ids(fleet))
    assert "unl" not in {a.name for a in status(fleet["proxy"].target).adapters}
    ghost = requests.post(
        fleet["proxy"].http_url + "/v1/unload_lora_adapter", json={"lora_name": "ghost-v9"}, timeout=10
    )
    assert (
        ghost.status_code == 404 and ghost.json()["error"]["message"] == "The lora adapter 'ghost-v9' cannot be found."
    )


def test_a_pause_holds_the_callers_new_requests_until_resume(fleet):
    """TRL's sync pauses the door, saves and loads the next version, then resumes: what it asks
    after its pause waits at the door (http/pause.py), nothing is refused, and the resume lets it go."""
    url, proxy = fleet["proxy"].http_url, fleet["proxy"]
    held = metric_value(proxy.metrics(), "rollwire_proxy_http_paused_requests_total")
    bad = requests.post(url + "/pause", params={"mode": "freeze"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
    assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=30).json() == {"status": "paused"}
    try:
        assert requests.get(url + "/is_paused", timeout=30).json() == {"is_paused": True}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(requests.post, url + "/v1/completions", json=trl_body(5), timeout=60)
            wait_until(
                lambda: metric_value(proxy.metrics(), "rollwire_proxy_http_paused_requests_total") == held + 1,
                30,
                "the door holds the request",
            )
            assert not answer.done()
            assert requests.post(url + "/resume", timeout=30).json() == {"status": "resumed"}
            reply = answer.result(timeout=60)
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"][0]["token_ids"]) == 8
    finally:
        requests.post(url + "/resume", timeout=30)
    assert requests.get(url + "/is_paused", timeout=30).json() == {"is_paused": False}
