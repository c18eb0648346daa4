"""Issue 35's must-show: two TRL `AsyncGRPOTrainer` runs, unmodified and with TRL's default
names (`trl-policy-vN`), train at the same time through one proxy, each with its own tenant's
publish token in its base URL (`http://team-a:TOKEN@host:port`, sent by TRL's `requests` and
`aiohttp` clients as Basic auth), and both reach a held-out gain; neither sees the other's
versions, and the fleet holds both runs under their qualified names (docs/deploy.md, "Tenants").

Heavy (two trainers, their rollout workers, a replica and the proxy on this machine's cores):
about 4 minutes on 2 cores."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import requests

from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

TOKENS = {"admin": "tok-admin-5d1e", "team-a": "tok-team-a-8c2b", "team-b": "tok-team-b-3f9a"}
BUDGET_S, MAX_STEPS, MIN_GAIN = 90, 60, 0.15


def accuracy(target: str, token: str, adapter: str | None) -> float:
    """Greedy held-out accuracy of `adapter` (as the tenant names it) through the proxy's gRPC door."""
    from rollwire.client import AsyncClient
    from rollwire.demo.trl import ROLLOUT, SEED, TASK
    from rollwire.learner.tasks.evaluate import held_out_accuracy
    from rollwire.learner.tasks.task import addition_examples, eval_subset

    _train, held = addition_examples(TASK.held_out_fraction)
    examples = eval_subset(held, TASK.eval_size, SEED)

    async def run() -> float:
        async with AsyncClient(target, timeout=60, token=token) as client:
            result = await held_out_accuracy(client, examples, adapter, ROLLOUT.max_new_tokens)
            assert result.accuracy is not None and not result.failed, result
            return result.accuracy

    return asyncio.run(run())


@pytest.mark.integration
@pytest.mark.slow
def test_two_trl_runs_of_two_tenants_train_at_once_with_default_names_through_one_proxy(taught_model, tmp_path):
    pytest.importorskip("trl")
    from support.processes import GENERATOR_ARGS, start_generator, start_proxy, stop_all, wait_until

    from rollwire.demo.trl import door_args, follow, start_trainer, stop_trainer, wait_healthy

    for who, token in TOKENS.items():
        (tmp_path / f"{who}.token").write_text(token + "\n")
    tenants = [{"name": t, "publish_tokens_file": str(tmp_path / f"{t}.token")} for t in ("team-a", "team-b")]
    settings = (f"auth.admin_tokens_file={tmp_path / 'admin.token'}", f"tenants={json.dumps(tenants)}")
    replica = start_generator(taught_model, tmp_path, "tt1", *GENERATOR_ARGS, "--replica-id", "tt1")
    proxy = start_proxy(tmp_path, "tt", [replica], *door_args(tmp_path, taught_model, *settings))
    trainers = {}
    try:
        admin = (("authorization", f"Bearer {TOKENS['admin']}"),)
        fleet_stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(proxy.target))
        wait_until(
            lambda: any(r.healthy for r in fleet_stub.GetStatus(pb.GetStatusRequest(), metadata=admin).replicas),
            60,
            "the proxy routes to its replica",
        )
        wait_healthy(proxy.http_url, 30)
        before = accuracy(proxy.target, TOKENS["team-a"], None)
        for seed, tenant in enumerate(("team-a", "team-b"), start=1):
            out = tmp_path / tenant / "trl"
            (out / ".vllm_lora").mkdir(parents=True)
            url = proxy.http_url.replace("http://", f"http://{tenant}:{TOKENS[tenant]}@")
            trainers[tenant] = (start_trainer(out.parent, out, url, taught_model, BUDGET_S, MAX_STEPS, seed=seed), out)
        for proc, out in trainers.values():
            code = follow(proc, out / "steps.jsonl", BUDGET_S, BUDGET_S + 240, progress=False)
            assert code == 0, (out.parent / "trainer.log").read_text(errors="replace")[-3000:]
        last = {t: json.loads((out / "summary.json").read_text())["last_version"] for t, (_, out) in trainers.items()}
        assert all(v >= 3 for v in last.values()), last  # both ran: a cold sync and a version per step

        stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(proxy.target))
        views = {}
        for tenant in trainers:
            reply = stub.GetStatus(pb.GetStatusRequest(), metadata=(("authorization", f"Bearer {TOKENS[tenant]}"),))
            views[tenant] = {a.name: dict(a.digests) for a in reply.adapters}
            assert set(views[tenant]) == {"trl-policy"}, views  # its own name, unqualified, and nothing else
            assert last[tenant] in views[tenant]["trl-policy"]
            models = requests.get(
                proxy.http_url.replace("http://", f"http://{tenant}:{TOKENS[tenant]}@") + "/v1/models", timeout=10
            ).json()["data"][1:]
            assert {m["id"].rsplit("-v", 1)[0] for m in models} == {"trl-policy"}
        shared = set(views["team-a"]["trl-policy"]) & set(views["team-b"]["trl-policy"])
        assert all(
            views["team-a"]["trl-policy"][v] != views["team-b"]["trl-policy"][v] for v in shared
        )  # two runs' bytes
        held = {a.name for a in generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(replica.target))
                .GetStatus(pb.GetStatusRequest(), timeout=10).adapters}  # fmt: skip
        assert {"team-a:trl-policy", "team-b:trl-policy"} <= held, held  # the fleet's names; no lineage restarted

        after = {t: accuracy(proxy.target, TOKENS[t], f"trl-policy@{last[t]}") for t in trainers}
        print(f"held-out accuracy: base {before:.3f}, after {after} (versions {last})")
        assert all(a >= before + MIN_GAIN for a in after.values()), (before, after)
        log = proxy.log_path.read_text()
        assert not any(token in log for token in TOKENS.values())
    finally:
        for proc, _ in trainers.values():
            stop_trainer(proc)
        stop_all([proxy, replica])
