"""Two tenants through one proxy, over gRPC and over the HTTP door (issue 35, item 1;
proxy/tenants.py, docs/deploy.md "Tenants"): each sees only its own names and the shared ones,
the same name in both is two adapters with their own weights, neither can generate with,
overwrite or unload the other's (a refusal never confirms the other's names), a publish token
does nothing of the fleet's, TRL's clients carry the token in the base URL as Basic auth, and
who published what is in the audit log and the tenant metrics, never a token.

One replica and one proxy (auth on, two tenants, the door), shared by this module's tests in
order: the gRPC test publishes first, the HTTP test after it, the hostile test (audit
2026-12-07 S7, S8, S13) last, on what both left."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import requests
from support.peft_folders import peft_folder
from support.processes import GENERATOR_ARGS, start_generator, start_proxy, stop_all, wait_until
from support.wire import make_adapter, metric_value, push_messages

from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc, generator_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration

TOKENS = {
    "admin": "tok-admin-91c2",
    "gen": "tok-fleet-gen-77e1",  # the fleet's generate role (no tenant's)
    "a-pub": "tok-a-pub-4e7d",
    "a-gen": "tok-a-gen-0b3f",
    "b-pub": "tok-b-pub-c5a8",
}
PROMPT = [5, 17, 33, 40, 12]


def meta(who: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[who]}"),)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants")
    for who, token in TOKENS.items():
        (work / f"{who}.token").write_text(token + "\n")
    root = work / "adapters"
    root.mkdir()
    tenants = [
        {"name": "team-a", "publish_tokens_file": str(work / "a-pub.token"), "generate_tokens_file": str(work / "a-gen.token")},
        {"name": "team-b", "publish_tokens_file": str(work / "b-pub.token"), "weight": 2, "quotas": {"max_spool_versions": 2}},
    ]  # fmt: skip
    gen = start_generator(tiny_model, work, "tn1", *GENERATOR_ARGS, "--replica-id", "tn1")
    proxy = start_proxy(
        work, "tn", [gen],
        "--http-port", "0", "--http-model", str(tiny_model), "--http-adapter-root", str(root),
        "--set", f"auth.admin_tokens_file={work / 'admin.token'}",
        "--set", f"auth.generate_tokens_file={work / 'gen.token'}",
        "--set", f"tenants={json.dumps(tenants)}",
        "--set", "http.load_answer=committed",
    )  # fmt: skip
    try:
        stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(proxy.target))
        wait_until(
            lambda: any(r.healthy for r in stub.GetStatus(pb.GetStatusRequest(), metadata=meta("admin")).replicas),
            30,
            "the proxy routes to its replica",
        )
        fp = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(gen.target))
        fingerprint = fp.GetStatus(pb.GetStatusRequest(), timeout=10).model_fingerprint
        yield {"proxy": proxy, "gen": gen, "stub": stub, "model": tiny_model, "root": root, "fp": fingerprint}
    finally:
        stop_all([proxy, gen])


def push(fleet, who: str, name: str, version: int, seed: int):
    adapter = make_adapter(fleet["model"], seed, r=4)
    manifest = adapter.manifest(name, version, fleet["fp"])
    reply = fleet["stub"].PushAdapter(push_messages(manifest, adapter.payload), metadata=meta(who), timeout=60)
    return reply, adapter


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def reason(err: grpc.RpcError) -> str:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    for detail in rpc_status.from_call(err).details:  # pyright: ignore[reportArgumentType, reportOptionalMemberAccess]
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def greedy(fleet, who: str, name: str, version: int = 0) -> tuple[pb.GenerationStarted, list[float]]:
    req = pb.GenerateRequest(n=1, sampling=pb.SamplingParams(max_new_tokens=6, temperature=0.0))
    req.token_ids.ids.extend(PROMPT)
    req.adapter.name, req.adapter.version = name, version
    started, logprobs = None, []
    for message in fleet["stub"].Generate(req, metadata=meta(who), timeout=60):
        started = message.started if message.HasField("started") else started
        logprobs += [lp for chunk in message.tokens for lp in chunk.logprobs]
    assert started is not None
    return started, logprobs


def seen(fleet, who: str) -> dict[str, dict[int, str]]:
    reply = fleet["stub"].GetStatus(pb.GetStatusRequest(), metadata=meta(who), timeout=10)
    return {a.name: dict(a.digests) for a in reply.adapters}


def test_over_grpc_each_tenant_has_its_own_names_and_cannot_touch_the_others(fleet):
    shared, _ = push(fleet, "admin", "shared-sft", 1, seed=1)
    a_reply, a = push(fleet, "a-pub", "policy", 1, seed=2)
    b_reply, b = push(fleet, "b-pub", "policy", 1, seed=3)  # the same name: no conflict, another adapter
    assert (shared.name, a_reply.name, b_reply.name) == ("shared-sft", "policy", "policy")

    assert seen(fleet, "a-gen") == {"policy": {1: a.sha256}, "shared-sft": {1: shared_digest(fleet)}}
    assert seen(fleet, "b-pub") == {"policy": {1: b.sha256}, "shared-sft": {1: shared_digest(fleet)}}
    assert set(seen(fleet, "admin")) == {"team-a:policy", "team-b:policy", "shared-sft"}  # the fleet's view

    a_started, a_logprobs = greedy(fleet, "a-gen", "policy")
    b_started, b_logprobs = greedy(fleet, "b-pub", "policy")
    assert (a_started.adapter.name, a_started.adapter.version) == ("policy", 1) == (b_started.adapter.name, 1)
    assert a_logprobs != b_logprobs  # two adapters' weights under one name
    assert greedy(fleet, "a-gen", "shared-sft")[0].adapter.name == "shared-sft"  # shared: seen by every tenant

    err = refused(lambda: greedy(fleet, "a-gen", "team-b:policy"))  # another tenant's name cannot be spelled
    assert (err.code(), reason(err)) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_ADAPTER_NAME")
    err = refused(lambda: greedy(fleet, "a-gen", "nothing", 1))  # not found as its own; no prefix in the sentence
    assert err.code() == grpc.StatusCode.NOT_FOUND and "team-a" not in (err.details() or ""), err.details()

    other = make_adapter(fleet["model"], 4, r=4)  # A overwriting its v1: a conflict, in its own namespace only
    manifest = other.manifest("policy", 1, fleet["fp"])
    err = refused(lambda: fleet["stub"].PushAdapter(push_messages(manifest, other.payload), metadata=meta("a-pub")))
    assert (err.code(), reason(err)) == (grpc.StatusCode.FAILED_PRECONDITION, "VERSION_CONFLICT")
    assert "team-" not in (err.details() or "")
    push(fleet, "a-pub", "shared-sft", 1, seed=5)  # a tenant's "shared-sft" is its own, never the shared one
    assert seen(fleet, "b-pub")["policy"] == {1: b.sha256} and seen(fleet, "admin")["shared-sft"] == {
        1: shared_digest(fleet)
    }
    assert seen(fleet, "a-gen")["shared-sft"] != seen(fleet, "b-pub")["shared-sft"]  # A's own now shadows it for A

    err = refused(lambda: push(fleet, "a-gen", "policy", 2, seed=6))  # generate: no pushes
    assert (err.code(), reason(err)) == (grpc.StatusCode.PERMISSION_DENIED, "WRONG_ROLE")
    admin_stub = admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(fleet["proxy"].target))
    for call in (
        lambda: admin_stub.ListGenerators(apb.ListGeneratorsRequest(), metadata=meta("a-pub"), timeout=10),
        lambda: admin_stub.DrainGenerator(
            apb.DrainGeneratorRequest(address=fleet["gen"].target), metadata=meta("a-pub"), timeout=10
        ),
        lambda: fleet["stub"].CommitAdapter(pb.CommitAdapterRequest(name="policy", version=1), metadata=meta("a-pub")),
    ):
        assert refused(call).code() == grpc.StatusCode.PERMISSION_DENIED
    assert (
        not fleet["stub"].GetStatus(pb.GetStatusRequest(), metadata=meta("a-pub"), timeout=10).replicas
    )  # no topology


def shared_digest(fleet) -> str:
    reply = fleet["stub"].GetStatus(pb.GetStatusRequest(), metadata=meta("admin"), timeout=10)
    return next(a for a in reply.adapters if a.name == "shared-sft").digests[1]


def test_over_http_trls_clients_carry_each_tenants_token_in_the_base_url(fleet):
    """TRL's own clients (its VLLMClient's `requests`, its rollout worker's `aiohttp`) with
    `http://TENANT:TOKEN@host:port`: both load `trl-policy-v1` (no 409), each is served its own
    weights, one's unload leaves the other's served, and /v1/models lists each tenant's own."""
    pytest.importorskip("trl")
    import aiohttp
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    proxy = fleet["proxy"]
    base = {
        t: proxy.http_url.replace("http://", f"http://{t}:{TOKENS[k]}@")
        for t, k in (("team-a", "a-pub"), ("team-b", "b-pub"))
    }
    for seed, tenant in enumerate(("team-a", "team-b"), start=10):
        folder = fleet["root"] / tenant / "trl-policy-v1"
        peft_folder(fleet["model"], folder, seed)
        VLLMClient(base[tenant]).load_lora_adapter("trl-policy-v1", str(folder))  # raises on any non-200

    async def complete(url: str, model: str) -> tuple[int, dict]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 0}
        async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as reply:
            return reply.status, await reply.json()

    answers = {t: asyncio.run(complete(base[t], "trl-policy-v1")) for t in base}
    assert all(code == 200 for code, _ in answers.values()), answers
    lps = {t: body["choices"][0]["logprobs"]["token_logprobs"] for t, (_, body) in answers.items()}
    assert lps["team-a"] != lps["team-b"]  # one name, two tenants' weights

    models = {t: {m["id"] for m in requests.get(f"{base[t]}/v1/models", timeout=10).json()["data"][1:]} for t in base}
    assert models["team-a"] == {"trl-policy-v1", "policy-v1", "shared-sft-v1"}
    assert models["team-b"] == {"trl-policy-v1", "policy-v1", "shared-sft-v1"}

    unload = requests.post(f"{base['team-b']}/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"}, timeout=30)
    assert unload.status_code == 200 and unload.json()["unloaded"] == ["trl-policy-v1"], unload.text
    assert asyncio.run(complete(base["team-a"], "trl-policy-v1"))[0] == 200  # A's is untouched
    code, body = asyncio.run(complete(base["team-b"], "trl-policy-v1"))
    assert code == 404 and body["error"]["code"] == 404 and "team-" not in body["error"]["message"], body
    missing = requests.post(f"{base['team-a']}/v1/unload_lora_adapter", json={"lora_name": "never-v1"}, timeout=30)
    assert missing.status_code == 404 and "team-a" not in missing.text
    spelled = requests.post(
        f"{base['team-a']}/v1/unload_lora_adapter", json={"lora_name": "team-b:policy-v1"}, timeout=30
    )
    assert spelled.status_code == 400 and spelled.json()["error"]["type"] == "BadRequestError", spelled.text
    assert seen(fleet, "b-pub")["policy"]  # B's gRPC-pushed policy is still there

    info = requests.get(f"{base['team-a']}/server_info", timeout=10).json()
    assert info["rollwire"]["replicas"] == [] and info["vllm_config"]["lora_config"]["max_loras"] >= 1  # no topology
    bad = requests.get(proxy.http_url.replace("http://", "http://team-a:wrong@") + "/v1/models", timeout=10)
    assert bad.status_code == 401

    # team-b's spool quota: 2 versions (its policy v1, its trl-policy v1, unloaded but spooled), by either door
    err = refused(lambda: push(fleet, "b-pub", "extra", 1, seed=20))
    assert (err.code(), reason(err)) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUOTA")
    assert "max_spool_versions" in (err.details() or "") and "team-b" in (err.details() or "")
    folder = fleet["root"] / "team-b" / "extra-v1"
    peft_folder(fleet["model"], folder, 21)
    body = {"lora_name": "extra-v1", "lora_path": str(folder)}
    over = requests.post(f"{base['team-b']}/v1/load_lora_adapter", json=body, timeout=30)
    assert over.status_code == 429 and over.json()["error"]["reason"] == "TENANT_QUOTA", over.text
    push(fleet, "a-pub", "extra", 1, seed=22)  # team-a has no such quota

    text = proxy.metrics()
    assert (
        metric_value(text, "rollwire_proxy_tenant_publishes_total", 'action="load",outcome="ok",tenant="team-a"') == 1
    )
    assert (
        metric_value(text, "rollwire_proxy_tenant_publishes_total", 'action="unload",outcome="ok",tenant="team-b"') == 1
    )
    assert (
        metric_value(text, "rollwire_proxy_tenant_publishes_total", 'action="push",outcome="ok",tenant="team-a"') == 3
    )
    refusals = 'action="load",outcome="refused",tenant="team-b"'
    assert metric_value(text, "rollwire_proxy_tenant_publishes_total", refusals) == 1
    assert metric_value(text, "rollwire_proxy_tenant_tokens_total", 'tenant="team-a"') >= 12
    assert metric_value(text, "rollwire_proxy_tenant_tokens_total", 'tenant="_fleet"') == 0

    log = proxy.log_path.read_text()
    assert not any(token in log for token in TOKENS.values())  # never a secret in the log
    audits = [e for e in map(_json, log.splitlines()) if e and e.get("event") == "adapter_audit"]
    loads = {(e["tenant"], e["role"], e["action"], e["adapter"], e["outcome"]) for e in audits}
    assert ("team-a", "publish", "load", "trl-policy", "ok") in loads
    assert ("team-b", "publish", "unload", "trl-policy", "ok") in loads
    assert ("_fleet", "admin", "push", "shared-sft", "ok") in loads
    assert ("team-a", "publish", "push", "policy", "refused") in loads  # the conflicting overwrite
    held = {(e["tenant"], e["action"], e["adapter"], e["internal"], e["outcome"]) for e in audits}
    assert ("team-b", "load", "extra", "team-b:extra", "refused") in held  # the quota's refusal, by its held name


def test_hostile_a_tenant_reads_no_other_tenants_names_nor_the_topology_and_writes_no_shared_name(fleet):
    """Audit 2026-12-07: S7 (a tenant loaded versions under the base model's id, which every
    tenant was then served), S8 (an unknown name's NOT_FOUND listed every adapter, another
    tenant's too, and the trailer's google.rpc.Status carried the unscrubbed sentence) and S13
    (the replicas' addresses in /server_info for the fleet's generate token and in `started`,
    every tenant's names in a metrics label) and S6's serving half (a version pushed to a replica
    behind the proxy's back under a tenant's name was served to that tenant). Collateral: the other
    tenant's requests and pushes succeed around it."""
    from grpc_status import rpc_status

    proxy = fleet["proxy"]
    url = {who: proxy.http_url.replace("http://", f"http://{who}:{TOKENS[who]}@") for who in TOKENS}
    base = requests.get(f"{url['a-pub']}/v1/models", timeout=10).json()["data"][0]["id"]
    folder = fleet["root"] / "team-a" / "as-base"
    peft_folder(fleet["model"], folder, 30)
    for who in ("a-pub", "admin"):  # S7: the base model's id names the base model, for everyone
        load = requests.post(
            f"{url[who]}/v1/load_lora_adapter", json={"lora_name": base, "lora_path": str(folder)}, timeout=30
        )
        assert load.status_code == 400 and load.json()["error"]["reason"] == "BAD_ADAPTER_NAME", load.text
    assert base not in seen(fleet, "admin") and base not in seen(fleet, "b-pub")

    score = pb.ScoreRequest(sequences=[pb.ScoreSequence(prompt_token_ids=PROMPT, continuation_token_ids=[7, 8])])
    for who in ("b-pub", "gen"):  # S8: neither the sentence nor its Status detail names another tenant's adapter
        for version in (0, 1):  # unpinned: the proxy's own answer; pinned: the replica's, relayed
            score.adapter.name, score.adapter.version = "no-such-name", version
            for call in (
                lambda v=version, w=who: greedy(fleet, w, "no-such-name", v),
                lambda w=who: fleet["stub"].Score(score, metadata=meta(w), timeout=30),
            ):
                err = refused(call)
                assert (err.code(), reason(err)) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND"), err.details()
                status = rpc_status.from_call(err)  # pyright: ignore[reportArgumentType]
                assert status is not None and status.message == err.details()  # one sentence, both places
                for shown in (err.details() or "", status.message):
                    assert "extra" not in shown and "team-a" not in shown and "policy" not in shown, shown
                    assert fleet["gen"].target not in shown, shown

    started, _ = greedy(fleet, "a-gen", "policy")  # S13: the replica is an admin's to know
    assert started.replica == "" and started.adapter.name == "policy"
    assert greedy(fleet, "admin", "team-a:policy")[0].replica == "tn1"
    for who in ("gen", "a-gen"):
        info = requests.get(f"{url[who]}/server_info", timeout=10).json()
        assert info["rollwire"]["replicas"] == [], info
    assert requests.get(f"{url['admin']}/server_info", timeout=10).json()["rollwire"]["replicas"]
    reply, _ = push(fleet, "a-pub", "extra", 2, seed=31)  # collateral: a tenant's push goes on
    assert [(r.code, r.address) for r in reply.replicas] == [("OK", "")]
    text = proxy.metrics()
    versions = [line for line in text.splitlines() if line.startswith("rollwire_proxy_replica_adapter_version{")]
    assert versions and not any("team-a:policy" in v or "team-b:policy" in v for v in versions), versions
    labels = f'adapter="team-a:*",replica="{fleet["gen"].target}"'
    assert metric_value(text, "rollwire_proxy_replica_adapter_version", labels) == 2

    # S6's serving half: versions pushed to a replica behind the proxy's back, under a tenant's name and a shared
    # one; a tenant's is never shown nor routed (its names reach replicas only through the spool)
    direct = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(fleet["gen"].target))
    for name, version in (("team-b:policy", 5), ("rogue", 1)):
        rogue = make_adapter(fleet["model"], 40 + version, r=4)
        direct.PushAdapter(push_messages(rogue.manifest(name, version, fleet["fp"]), rogue.payload), timeout=60)
    wait_until(lambda: "rogue" in seen(fleet, "admin"), 30, "the proxy read the replica's status again")
    for who, name in (("admin", "team-b:policy"), ("b-pub", "policy")):
        status = fleet["stub"].GetStatus(pb.GetStatusRequest(), metadata=meta(who), timeout=10)
        assert [list(a.versions) for a in status.adapters if a.name == name] == [[1]], status.adapters
    assert "rogue" not in seen(fleet, "b-pub")  # nor a shared name no spool holds, by either door
    assert not any(
        m["id"].startswith("rogue") for m in requests.get(f"{url['b-pub']}/v1/models", timeout=10).json()["data"]
    )
    err = refused(lambda: greedy(fleet, "b-pub", "rogue"))
    assert (err.code(), reason(err)) == (grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")

    b_started, _ = greedy(fleet, "b-pub", "policy")  # collateral: the other tenant is served its own
    assert (b_started.adapter.name, b_started.adapter.version) == ("policy", 1)


def _json(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
