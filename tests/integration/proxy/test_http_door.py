"""The proxy's HTTP front door against real replicas, called as its users call it: the
official `openai` client, TRL's own `VLLMClient`, and a request shaped exactly like TRL's
async rollout worker's (docs/http.md).

Independent computations: the gRPC path's tokens and logprobs for the same seed (the door
must add nothing and lose nothing), Hugging Face's `apply_chat_template` for chat prompts,
and a teacher-forced PEFT forward pass for the logprobs of a loaded adapter.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
from support.door_fleet import GENERATE_TOKEN, openai_client, post  # the `door` and `chat_model` fixtures: conftest.py
from support.engines import forward_logprobs
from support.peft_folders import peft_folder
from support.processes import start_generator, stop_all, wait_until
from support.wire import generate, metric_value, peft_reference, status

from rollwire.v1 import generator_pb2 as pb

pytestmark = pytest.mark.integration


def versions_of(replica, name: str) -> list[int]:
    """The versions of `name` a replica serves, by its own GetStatus."""
    return next((list(a.versions) for a in status(replica.target).adapters if a.name == name), [])


# The two doors run the same seeded samples in separate requests, which a replica may batch
# with different neighbours: the tokens and text are equal, the float32 logprobs agree to a few
# ulps (a CI run saw 4.8e-7 apart at -4.78), never more than this.
SAME_LOGPROB = 1e-5


# -- the same samples through either door -------------------------------------------------------
@pytest.mark.parametrize("prompt", [[5, 17, 33, 40, 12], "12+34="], ids=["token-ids", "text"])
def test_completions_equal_the_grpc_path(door, prompt):
    proxy = door["proxy"]
    want = generate(proxy.target, prompt, n=3, seed=11, max_new_tokens=12, temperature=1.0)
    client = openai_client(proxy.http_url)
    got = client.completions.create(
        model=door["model"].name,
        prompt=prompt,
        n=3,
        seed=11,
        max_tokens=12,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    assert len(got.choices) == 3
    for choice in got.choices:
        i = choice.index
        extra = choice.model_extra or {}
        assert extra["token_ids"] == want.tokens[i]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs == pytest.approx(
            want.logprobs[i], abs=SAME_LOGPROB
        )
        assert choice.text == want.text[i]
        assert choice.finish_reason == (
            "length" if want.finished[i].finish_reason == pb.FINISH_REASON_LENGTH else "stop"
        )
    completion_tokens = sum(len(t) for t in want.tokens.values())
    assert got.usage is not None and got.usage.completion_tokens == completion_tokens
    stream = client.completions.create(
        model=door["model"].name,
        prompt=prompt,
        n=3,
        seed=11,
        max_tokens=12,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    texts: dict[int, str] = {}
    usage = None
    for event in stream:
        usage = event.usage or usage
        for choice in event.choices:
            ids.setdefault(choice.index, []).extend((choice.model_extra or {}).get("token_ids", []))
            if choice.logprobs is not None:
                lps.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs or [])
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert ids == want.tokens and texts == want.text
    assert lps.keys() == want.logprobs.keys()
    assert all(lps[i] == pytest.approx(want.logprobs[i], abs=SAME_LOGPROB) for i in want.logprobs)
    assert usage is not None and usage.completion_tokens == completion_tokens


def test_chat_renders_the_template_as_transformers_does(door):
    from transformers import AutoTokenizer

    proxy, model = door["proxy"], door["model"]
    messages: Any = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+34="}]
    prompt_ids = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = generate(proxy.target, list(prompt_ids), n=2, seed=5, max_new_tokens=10, temperature=1.0)
    client = openai_client(proxy.http_url)
    got = client.chat.completions.create(
        model=model.name,
        messages=messages,
        n=2,
        seed=5,
        max_tokens=10,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    assert (got.model_extra or {})["prompt_token_ids"] == list(prompt_ids)
    for choice in got.choices:
        assert (choice.model_extra or {})["token_ids"] == want.tokens[choice.index]
        assert choice.message.content == want.text[choice.index]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(
            want.logprobs[choice.index], abs=SAME_LOGPROB
        )
    content: dict[int, str] = {}
    for event in client.chat.completions.create(
        model=model.name, messages=messages, n=2, seed=5, max_tokens=10, stream=True
    ):
        for choice in event.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
    assert content == want.text


# -- TRL -----------------------------------------------------------------------------------
def test_trl_vllm_client_loads_an_adapter_every_replica_serves(door, chat_model, tmp_path):
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # TRL logs through accelerate, which the trainer sets up before the client

    proxy, gens, root = door["proxy"], door["gens"], door["root"]
    client = VLLMClient(proxy.http_url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.2)
    info = client.get_server_info()
    assert info["lora_config"]["max_loras"] == 8  # the replicas' adapter_keep (default 8): versions TRL may name
    assert info["parallel_config"]["data_parallel_size"] == 1  # a load reaches every replica: one rank to TRL
    assert client.get_dtype() == "torch.float32"
    assert client.get_max_model_len() == 256  # the tiny model's max_position_embeddings
    folder = root / "out" / ".vllm_lora" / "trl-policy-v1"
    adapter = peft_folder(chat_model, folder, seed=3)
    client.pause()
    client.load_lora_adapter("trl-policy-v1", str(folder))  # answered once spooled (http.load_answer)
    client.resume()
    for g in gens:  # the relay and commit finish behind the answer
        wait_until(lambda g=g: 1 in versions_of(g, "trl-policy"), 30, f"{g.name} serves trl-policy v1")
    # The request TRL's async rollout worker sends, field for field.
    prompt = [5, 17, 33, 40, 12]
    body = {
        "model": "trl-policy-v1",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": random.getrandbits(63),
    }
    reference = peft_reference(chat_model, adapter)
    for _ in range(2):  # both replicas, whichever the proxy picks
        choice = post(proxy.http_url, "/v1/completions", body).json()["choices"][0]
        assert choice["adapter_version"] == 1
        expected = forward_logprobs(reference, prompt, choice["token_ids"]).tolist()
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    models = requests.get(proxy.http_url + "/v1/models", timeout=10).json()["data"]
    assert "trl-policy-v1" in [m["id"] for m in models]
    # A replica that joins later catches the version up before it takes traffic.
    late = start_generator(chat_model, door["work"], "h3", "--replica-id", "h3", "--register", proxy.target)
    try:
        wait_until(
            lambda: late.target in {r.address for r in status(proxy.target).replicas if r.healthy}, 60, "h3 joins"
        )
        held = {a.name: list(a.versions) for a in status(late.target).adapters}
        assert held.get("trl-policy") == [1]
    finally:
        stop_all([late])
    client.unload_lora_adapter("trl-policy-v1")
    gone = post(proxy.http_url, "/v1/completions", body)
    assert gone.status_code == 404 and gone.json()["error"]["reason"] == "ADAPTER_UNLOADED"
    assert "trl-policy-v1" not in [
        m["id"] for m in requests.get(proxy.http_url + "/v1/models", timeout=10).json()["data"]
    ]


def test_upload_needs_no_shared_filesystem(door, chat_model, tmp_path):
    proxy, gens = door["proxy"], door["gens"]
    versions = []
    for seed in (7, 8):
        folder = tmp_path / f"up{seed}"
        peft_folder(chat_model, folder, seed)
        files = {
            name: (name, (folder / name).read_bytes()) for name in ("adapter_config.json", "adapter_model.safetensors")
        }
        reply = requests.post(
            proxy.http_url + "/v1/upload_lora_adapter", data={"lora_name": "uploaded"}, files=files, timeout=60
        )
        assert reply.status_code == 200, reply.text
        versions.append(reply.json()["version"])
    assert versions == [1, 2]  # a plain name gets its next version
    for g in gens:
        wait_until(lambda g=g: versions_of(g, "uploaded") == [1, 2], 30, f"{g.name} serves uploaded v1, v2")
    choice = post(proxy.http_url, "/v1/completions", {"model": "uploaded", "prompt": [5, 6], "max_tokens": 3}).json()
    assert choice["choices"][0]["adapter_version"] == 2  # a plain name serves its newest version
    same = post(
        proxy.http_url, "/v1/load_lora_adapter", {"lora_name": "uploaded-v1", "lora_path": str(tmp_path / "up8")}
    )
    assert same.status_code == 403  # outside the adapter root: never read


# -- hostile callers harm nobody else ----------------------------------------------------------
def hostile_requests(door, outside: Path, link: Path) -> list[tuple[str, int, str, dict | bytes | str]]:
    """(what, expected HTTP status, path, body) for requests that must each be refused."""
    model = door["model"].name
    ok = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4}
    return [
        ("path outside the root", 403, "/v1/load_lora_adapter", {"lora_name": "evil-v1", "lora_path": str(outside)}),
        ("symlink out of the root", 403, "/v1/load_lora_adapter", {"lora_name": "evil-v1", "lora_path": str(link)}),
        (
            "dot-dot out of the root",
            403,
            "/v1/load_lora_adapter",
            {"lora_name": "evil-v1", "lora_path": str(door["root"] / ".." / "x")},
        ),
        (
            "load in place",
            400,
            "/v1/load_lora_adapter",
            {"lora_name": "evil-v1", "lora_path": str(door["root"]), "load_inplace": True},
        ),
        ("bad json", 400, "/v1/completions", b'{"model": "x", "prompt": [1, 2'),
        ("not an object", 400, "/v1/completions", b"[1, 2, 3]"),
        ("body too large", 413, "/v1/completions", json.dumps({**ok, "prompt": "x" * (9 << 20)})),
        ("prompt too long", 400, "/v1/completions", {**ok, "prompt": [5] * 5000}),
        ("unknown model", 404, "/v1/completions", {**ok, "model": "nobody-v3"}),
        ("n=0", 400, "/v1/completions", {**ok, "n": 0}),
        ("n too large", 400, "/v1/completions", {**ok, "n": 500}),
        ("tiny temperature", 400, "/v1/completions", {**ok, "temperature": 1e-9}),
        ("negative seed", 400, "/v1/completions", {**ok, "seed": -1}),
        ("token id out of vocabulary", 400, "/v1/completions", {**ok, "prompt": [10**9]}),
        ("repetition penalty", 400, "/v1/completions", {**ok, "repetition_penalty": 1.3}),
        ("min_p", 400, "/v1/completions", {**ok, "min_p": 0.1}),
        ("top alternatives", 400, "/v1/completions", {**ok, "logprobs": 5}),
        ("unknown field", 400, "/v1/completions", {**ok, "frobnicate": True}),
        ("bad model name", 400, "/v1/completions", {**ok, "model": "../../etc"}),
        ("empty messages", 400, "/v1/chat/completions", {"model": model, "messages": []}),
        (
            "top_logprobs",
            400,
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "1"}], "top_logprobs": 3},
        ),
    ]


def test_hostile_http_callers_harm_nobody_else(door, tmp_path):
    proxy = door["proxy"]
    url = proxy.http_url
    outside = tmp_path / "outside"
    peft_folder(door["model"], outside, seed=1)
    link = door["root"] / "link"
    link.symlink_to(outside)
    stop = threading.Event()
    good: list[int] = []

    def well_behaved() -> None:
        while not stop.is_set():
            r = post(
                url, "/v1/completions", {"model": door["model"].name, "prompt": [5, 6, 7], "max_tokens": 6, "n": 2}
            )
            good.append(r.status_code)

    with ThreadPoolExecutor(3) as pool:
        runners = [pool.submit(well_behaved) for _ in range(2)]
        try:
            for what, code, path, body in hostile_requests(door, outside, link):
                r = post(url, path, body)
                assert r.status_code == code, f"{what}: {r.status_code} {r.text[:300]}"
                error = r.json()["error"]
                assert error["code"] == code and error["message"] and error["reason"], what
        finally:
            stop.set()
        for f in runners:
            f.result()
    assert good and set(good) == {200}, f"well-behaved requests got {sorted(set(good))}"
    assert len(routable_replicas(proxy)) == 2  # no client's fault counted against a replica
    metrics = proxy.metrics()
    assert metric_value(metrics, "rollwire_proxy_http_requests_total", 'code="200",route="/v1/completions"') >= len(
        good
    )
    assert metric_value(metrics, "rollwire_proxy_http_requests_total", 'code="403",route="/v1/load_lora_adapter"') >= 3
    assert "evil" not in {a.name for g in door["gens"] for a in status(g.target).adapters}


def routable_replicas(proxy) -> list[str]:
    return [r.address for r in status(proxy.target).replicas if r.healthy]


def test_tokens_roles_and_per_client_limits(door):
    url = door["guarded"].http_url
    body = {"model": door["model"].name, "prompt": [5, 6, 7], "max_tokens": 4}
    assert post(url, "/v1/completions", body).status_code == 401
    assert post(url, "/v1/completions", body, token="wrong").status_code == 401
    assert post(url, "/v1/completions", body, token=GENERATE_TOKEN).status_code == 200
    refused = post(url, "/v1/load_lora_adapter", {"lora_name": "x-v1", "lora_path": "/x"}, token=GENERATE_TOKEN)
    assert refused.status_code == 403 and refused.json()["error"]["reason"] == "WRONG_ROLE"
    assert requests.get(url + "/health", timeout=10).status_code == 200  # probes need no token
    # One request at a time per client here: a second one while a stream is open is refused at once.
    slow = {**body, "max_tokens": 120, "ignore_eos": True, "stream": True}
    with post(url, "/v1/completions", slow, token=GENERATE_TOKEN, stream=True) as first:
        events = first.iter_lines()
        assert next(line for line in events if line).startswith(b"data: ")  # admitted and running
        r = post(url, "/v1/completions", body, token=GENERATE_TOKEN)
        assert r.status_code == 429 and r.json()["error"]["reason"] == "CLIENT_LIMIT"
        assert int(r.headers["Retry-After"]) >= 1
        assert [line for line in events if line][-1] == b"data: [DONE]"
    assert post(url, "/v1/completions", body, token=GENERATE_TOKEN).status_code == 200


def test_trl_on_another_host_uploads_instead_of_naming_a_path(door, chat_model, tmp_path, monkeypatch):
    """With use_uploads_in_trl, TRL's own load call sends the folder's bytes: a folder the
    proxy could never read (outside its adapter root) still reaches every replica."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    from rollwire.client.http_upload import use_uploads_in_trl

    PartialState()
    monkeypatch.setattr(VLLMClient, "load_lora_adapter", VLLMClient.load_lora_adapter)  # restored after the test
    use_uploads_in_trl()
    folder = tmp_path / "elsewhere" / "remote-policy-v1"
    peft_folder(chat_model, folder, seed=9)
    VLLMClient(door["proxy"].http_url).load_lora_adapter("remote-policy-v1", str(folder))
    for g in door["gens"]:
        wait_until(lambda g=g: versions_of(g, "remote-policy") == [1], 30, f"{g.name} serves remote-policy v1")


def test_the_door_serves_tls_with_the_proxys_certificate(door, pki):
    """With [tls] set the door speaks only TLS (mutual TLS: a client certificate is required)."""
    from support.processes import start_service

    tls = [
        f"tls.cert_file={pki / 'server.pem'}",
        f"tls.key_file={pki / 'server.key'}",
        f"tls.client_ca_file={pki / 'ca.pem'}",
    ]
    args = ["proxy", "--port", "0", "--metrics-port", "0", "--http-port", "0", "--generator", door["gens"][0].target]
    proxy = start_service([*args, *(a for s in tls for a in ("--set", s))], door["work"], "tls-proxy", plaintext=False)
    try:
        url = f"https://127.0.0.1:{proxy.http_port}"
        cert = (str(pki / "client.pem"), str(pki / "client.key"))
        wait_until(
            lambda: requests.get(url + "/health", verify=pki / "ca.pem", cert=cert, timeout=5).ok, 30, "a replica"
        )
        body = {"model": "base", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        r = requests.post(url + "/v1/completions", json=body, verify=pki / "ca.pem", cert=cert, timeout=30)
        # three tokens served: not their text, which a sampled special token may leave empty
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text[:300]
        with pytest.raises(requests.exceptions.ConnectionError):  # TLS 1.3 may refuse it after the handshake
            requests.get(url + "/health", verify=pki / "ca.pem", timeout=5)  # no client certificate
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{proxy.http_port}/health", timeout=5)  # plaintext
    finally:
        proxy.stop()
