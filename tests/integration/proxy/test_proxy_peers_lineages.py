"""Peer proxies share the lineage map and the unloads (proxy/lineages.py, publish/peers.py;
docs/http.md "A new run, the same names"), with real processes: two peered proxies with
the HTTP door over one replica.

- a new lineage started through A's door (a second run's `pol-v1`) is what B serves under
  `pol`, by both doors, with the second run's weights (logprobs against a PEFT forward), and
  B's /v1/models lists it under the client's name;
- an unload through A answers once B holds it: B refuses the version at once, 404
  ADAPTER_UNLOADED by the door and NOT_FOUND over gRPC;
- B stopped while A unloads does not fail or hold up the unload; B restarted on its spool
  converges (A's catch-up sends it the map) and refuses the version too.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
import requests
from support.engines import forward_logprobs
from support.peft_folders import peft_folder
from support.processes import FAST_STOP, free_port, start_generators, start_service, stop_all, wait_routable, wait_until
from support.wire import generate, metric_value, peft_reference

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 33, 40, 12]


def start_proxy(work, name: str, port: int, replica, peers: list[str], model):
    args = ["proxy", "--port", str(port), "--metrics-port", "0", "--proxy-id", name, "--generator", replica.target]
    args += ["--http-port", "0", "--http-model", str(model), "--http-adapter-root", str(work / "adapters")]
    args += ["--spool-dir", str(work / f"{name}-spool"), "--set", "health.interval_s=0.2"]
    args += ["--set", "peers=" + json.dumps(peers), "--set", "peering.interval_s=0.2"]
    return start_service(args, work, name)


def load(proxy, work, model, name: str, folder: str, seed: int):
    adapter = peft_folder(model, work / "adapters" / folder, seed)
    reply = requests.post(
        proxy.http_url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(work / "adapters" / folder)},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return adapter, reply.json()


def unload(proxy, name: str) -> requests.Response:
    return requests.post(proxy.http_url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def completion(proxy, model: str) -> requests.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, "logprobs": 0, "seed": 3}
    return requests.post(proxy.http_url + "/v1/completions", json=body, timeout=60)


def model_ids(proxy) -> set[str]:
    return {m["id"] for m in requests.get(proxy.http_url + "/v1/models", timeout=10).json()["data"]}


def refused_as_unloaded(proxy, model: str) -> None:
    reply = completion(proxy, model)
    assert reply.status_code == 404 and reply.json()["error"]["reason"] == "ADAPTER_UNLOADED", reply.text


def synced(a, peer: str) -> bool:
    return metric_value(a.metrics(), "rollwire_proxy_peer_synced", f'peer="{peer}"') == 1


def test_peers_share_new_lineages_and_unloads_and_a_restarted_peer_converges(tiny_model, tmp_path):
    (tmp_path / "adapters").mkdir()
    (replica,) = start_generators(tiny_model, tmp_path, ["pl1"], *FAST_STOP)
    a_port, b_port = free_port(), free_port()
    both = [f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"]
    a = start_proxy(tmp_path, "a", a_port, replica, both, tiny_model)
    b = start_proxy(tmp_path, "b", b_port, replica, both, tiny_model)
    services = [replica, a, b]
    try:
        for proxy in (a, b):
            wait_routable(proxy, [replica])
        wait_until(lambda: synced(a, both[1]) and synced(b, both[0]), 30, "a and b synced with each other")
        for v in (1, 2):  # run 1, through a
            load(a, tmp_path, tiny_model, f"pol-v{v}", f"run1-v{v}", seed=40 + v)
        # b lists run 1 whole first: {"tiny", "pol-v1"} alone is also run 1 before b saw its v2
        wait_until(lambda: model_ids(b) == {"tiny", "pol-v1", "pol-v2"}, 30, "b lists run 1's two versions")
        run2, answer = load(a, tmp_path, tiny_model, "pol-v1", "run2-v1", seed=50)  # run 2 starts again at v1
        assert answer["new_lineage"] and answer["lineage"] == "pol.2"

        # b serves the new lineage under the client's name, by both doors, with run 2's weights
        moved = {"tiny", "pol-v1"}  # run 2's v1 under the client's name, run 1's versions gone, no internal name
        wait_until(
            lambda: model_ids(b) == moved, 30, "b's /v1/models moved pol to its new lineage (once b sees it served)"
        )
        reference = peft_reference(tiny_model, run2)
        choice = completion(b, "pol").json()["choices"][0]
        assert choice["adapter_version"] == 1
        expected = forward_logprobs(reference, PROMPT, choice["token_ids"]).tolist()
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
        group = generate(b.target, PROMPT, adapter=("pol", 0), max_new_tokens=6, temperature=1.0)
        assert group.versions[0] == {1}
        assert group.logprobs[0] == pytest.approx(
            forward_logprobs(reference, PROMPT, group.tokens[0]).tolist(), abs=1e-4
        )

        # an unload through a holds at b as soon as a answers
        load(a, tmp_path, tiny_model, "pol-v2", "run2-v2", seed=51)
        wait_until(lambda: "pol-v2" in model_ids(b), 30, "b serves pol-v2 (the load answered once spooled)")
        started = time.monotonic()
        gone = unload(a, "pol-v1")
        took_up = time.monotonic() - started
        assert gone.status_code == 200 and gone.json()["unloaded"] == ["pol-v1"], gone.text
        refused_as_unloaded(b, "pol-v1")
        with pytest.raises(grpc.RpcError) as err:
            generate(b.target, PROMPT, adapter=("pol", 1), max_new_tokens=3)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        after = completion(b, "pol")
        assert after.status_code == 200, after.text  # the bare name serves the newest version not unloaded
        assert "pol-v1" not in model_ids(b) and after.json()["choices"][0]["adapter_version"] == 2

        # b is down while a unloads; restarted, it converges
        b.stop()
        started = time.monotonic()
        gone = unload(a, "pol-v2")
        took = time.monotonic() - started
        assert gone.status_code == 200, gone.text
        assert took < 10, f"the unload waited {took:.1f}s for a peer that is down"
        assert not synced(a, both[1])
        b = start_proxy(tmp_path, "b", b_port, replica, both, tiny_model)  # its own spool, from before
        services.append(b)
        started = time.monotonic()
        wait_until(lambda: synced(a, both[1]), 30, "a caught b up")
        caught_up = time.monotonic() - started
        for model in ("pol-v2", "pol"):  # every version of the lineage is unloaded now
            refused_as_unloaded(b, model)
        assert not any(i.startswith("pol") for i in model_ids(b))
        sends = metric_value(a.metrics(), "rollwire_proxy_peer_lineage_sends_total", f'peer="{both[1]}",code="OK"')
        received = metric_value(b.metrics(), "rollwire_proxy_lineage_changes_received_total")
        print(
            f"unload answered in {took_up:.3f}s with b up, {took:.3f}s with b down; b caught up {caught_up:.2f}s after"
        )
        print(f"it answered; a sent b its map {sends:g} times; b's map changed {received:g} times by a's")
        assert received >= 1  # b's own spool did not have the unload: a's map brought it
    finally:
        stop_all(services)
