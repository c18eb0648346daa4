"""The SDK and the `rollwire` command line against a real generator process."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from support.processes import run_cli
from support.wire import make_adapter

from rollwire.client import AsyncClient, Client
from rollwire.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rollwire.common.reasons import Reason


def save_peft_dir(tiny_model, adapter, path):
    """A PEFT folder as save_pretrained writes it, carrying the test adapter's weights."""
    from support.wire import peft_reference

    peft_reference(tiny_model, adapter).save_pretrained(path)
    return path


def test_sync_client_generate_and_status(generator):
    with Client(generator.target, timeout=30) as c:
        result = c.generate("hi", n=3, max_new_tokens=6, seed=1, ignore_eos=True)
        status = c.get_status()
    assert [s.index for s in result.samples] == [0, 1, 2]
    assert all(len(s.token_ids) == len(s.logprobs) == 6 and s.finish_reason == "length" for s in result.samples)
    assert result.prompt_token_ids and result.replica == status.replica
    assert status.engine == "transformers" and status.model_fingerprint.startswith("sha256:")


def test_sdk_raises_typed_errors(generator):
    with Client(generator.target, timeout=30) as c:
        with pytest.raises(NotFound) as err:
            c.generate("hi", adapter="absent@latest", max_new_tokens=2)
        assert err.value.reason == Reason.ADAPTER_NOT_FOUND
        with pytest.raises(InvalidArgument):
            c.generate("hi", n=1000, max_new_tokens=2)


async def test_async_client_push_dir_then_generate(generator, tiny_model, tmp_path):
    adapter = make_adapter(tiny_model, seed=31, r=4)
    peft_dir = save_peft_dir(tiny_model, adapter, tmp_path / "peft")
    async with AsyncClient(generator.target, timeout=60) as c:
        fp = (await c.get_status()).model_fingerprint
        pushed = await c.push_adapter_dir(peft_dir, "sdk-async", 1, fp)
        assert pushed.version == 1 and not pushed.already_loaded
        results = await asyncio.gather(
            *(c.generate("go", n=2, max_new_tokens=5, adapter="sdk-async@latest", seed=i) for i in range(3))
        )
        with pytest.raises(FailedPrecondition):
            await c.push_adapter_dir(peft_dir, "sdk-async", 1, "sha256:" + "0" * 32)
    for r in results:
        assert all(s.adapter_version == 1 and set(s.token_versions) == {1} for s in r.samples)


def test_cli_generate_json(generator):
    proc = run_cli(
        "generate", "--target", generator.target, "-n", "2", "--max-new-tokens", "5", "--seed", "3", "--json", "ab"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["samples"]) == 2
    for s in out["samples"]:
        assert set(s) >= {"text", "token_ids", "logprobs", "finish_reason", "adapter_version"}
        assert len(s["token_ids"]) == len(s["logprobs"]) <= 5


def test_cli_generate_moves_past_a_dead_address(generator):
    """`--target a,b`: every call goes through, whichever address is down (the SDK's rotation)."""
    from support.processes import free_port

    targets = f"127.0.0.1:{free_port()},{generator.target}"  # a fresh process tries the dead one first
    proc = run_cli("generate", "--target", targets, "--max-new-tokens", "3", "--json", "ab")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["samples"]) == 1


def test_a_dns_target_is_balanced_over_what_the_name_resolves_to(generator):
    """dns:///localhost:PORT resolves to 127.0.0.1 and maybe ::1; round robin uses the one
    that answers (the generator listens on 127.0.0.1 only)."""
    with Client(f"dns:///localhost:{generator.port}", timeout=30) as c:
        assert all(c.get_status().role == "generator" for _ in range(3))


def test_cli_push_adapter_and_status(generator, tiny_model, tmp_path):
    adapter = make_adapter(tiny_model, seed=32, r=4)
    peft_dir = save_peft_dir(tiny_model, adapter, tmp_path / "peft")
    proc = run_cli(
        "push-adapter",
        "--target",
        generator.target,
        "--name",
        "cli",
        "--version",
        "1",
        "--base-model",
        str(tiny_model),
        str(peft_dir),
    )
    assert proc.returncode == 0, proc.stderr
    status = json.loads(run_cli("status", "--target", generator.target, "--json").stdout)
    assert {a["name"]: a["versions"] for a in status["adapters"]}["cli"] == [1]  # numbers, not protobuf's JSON strings
    proc = run_cli(
        "generate", "--target", generator.target, "--adapter", "cli@1", "--max-new-tokens", "3", "--json", "x"
    )
    assert json.loads(proc.stdout)["samples"][0]["adapter_version"] == 1
    # --bulk: the bytes by the bulk path where offered, and the sha256 named by the receiver and printed
    args = ["--target", generator.target, "--name", "cli", "--base-model", str(tiny_model), "--bulk", str(peft_dir)]
    proc = run_cli("push-adapter", "--version", "2", *args)
    assert proc.returncode == 0, proc.stderr
    digest = hashlib.sha256((peft_dir / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert f"sha256: {digest}" in proc.stdout.splitlines()


def test_cli_push_adapter_probe_is_proved_by_the_replica_and_a_probe_of_other_weights_is_refused(
    generator, tiny_model, tmp_path
):
    """`push-adapter --probe`: the adapter's own logprobs over the base model folder travel with
    the version and the replica proves them before serving it (issue 52: the CLI as a publisher);
    the same numbers attached to other weights are refused, so the probe is what was proved."""
    from rollwire.client.probes import peft_probe
    from rollwire.common.fingerprint import model_fingerprint

    ours, other = (make_adapter(tiny_model, seed=s, r=4) for s in (35, 36))
    ours_dir = save_peft_dir(tiny_model, ours, tmp_path / "ours")
    args = ["--target", generator.target, "--name", "cli-probe", "--base-model", str(tiny_model)]
    proc = run_cli("push-adapter", "--version", "1", "--probe", *args, str(ours_dir))
    assert proc.returncode == 0, proc.stderr
    assert "probe: 4 sequences" in proc.stdout
    with Client(generator.target, timeout=60) as c:
        (entry,) = [a for a in c.get_status().adapters if a.name == "cli-probe"]
        proof = entry.proofs[1]
        assert (proof.outcome, proof.reference) == ("passed", "publisher") and proof.max_abs_gap <= 1e-4
        probe = peft_probe(tiny_model, ours_dir, 2)  # ours' numbers, sent with the other adapter's bytes
        with pytest.raises(FailedPrecondition) as refused:
            c.push_adapter("cli-probe", 2, other.payload, other.shape, model_fingerprint(tiny_model), probe=probe)
        assert refused.value.reason == Reason.PROOF_DISPUTED  # an unsigned probe: one of the two is wrong
        assert [a.versions for a in c.get_status().adapters if a.name == "cli-probe"] == [[1]]


def test_cli_reports_status_code_and_exits_nonzero(generator):
    proc = run_cli("generate", "--target", generator.target, "--adapter", "nope@2", "x")
    assert proc.returncode == 1
    assert "NOT_FOUND" in proc.stderr and "nope" in proc.stderr
    proc = run_cli("status", "--target", "127.0.0.1:1", "--timeout", "2")
    assert proc.returncode == 1 and ("UNAVAILABLE" in proc.stderr or "DEADLINE_EXCEEDED" in proc.stderr)


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
