"""`make demo-trl`: TRL's AsyncGRPOTrainer through the proxy's HTTP door (rollwire.demo.trl).

A short run of the whole demo (two replicas, the proxy's door, TRL's trainer and its spawned
rollout worker, a few steps) checks what the demo promises: TRL trained through the door,
every version it loaded reached both replicas, and step 1's ratio is 1 (the replicas' logprobs
are the trainer's own); a second run under the same names trains on its own weights; the
follower hands each new step of a writing process to on_step once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
@pytest.mark.slow
def test_a_short_demo_trains_through_the_door_and_both_replicas_serve_every_version(taught_model, tmp_path):
    pytest.importorskip("trl")
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "rollwire.demo.trl", "--budget-s", "30", "--max-steps", "5", "--timeout-s", "120",
        "--replicas", "2",
        "--runs-dir", str(runs), "--model-dir", str(taught_model),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    run = (runs / "latest").resolve()
    trainer_log = (run / "trainer.log").read_text(errors="replace") if (run / "trainer.log").exists() else ""
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{trainer_log[-3000:]}"

    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(line) for line in (run / "trl" / "steps.jsonl").read_text().splitlines()]
    assert 2 <= summary["steps"] == len(steps) <= 5  # max_steps 5 stops it first unless the machine crawls
    assert summary["versions"] == [1, summary["steps"] + 1]  # a cold sync, then one version per step
    assert [s["step"] for s in steps] == list(range(1, summary["steps"] + 1))
    assert steps[0]["ratio"] == pytest.approx(1.0, abs=1e-3)  # the replicas' logprobs are the trainer's
    assert steps[0]["sample/staleness_max"] == 0
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None

    replicas = summary["replicas"]
    assert len(replicas) == 2 and summary["every_version_on_every_replica"]
    for replica in replicas.values():
        assert replica["missed"] == [] and summary["versions"][1] in replica["loaded_now"]
    assert summary["pushes"] >= summary["versions"][1]  # each load through the door was one push
    door = summary["http"]
    assert door["/v1/load_lora_adapter"]["requests"] == summary["versions"][1]
    assert door["/v1/completions"]["requests"] >= summary["steps"] * 64  # one request per sample, as TRL sends
    assert not any(route["not_200"] for route in door.values())  # TRL's every call answered, none retried
    assert "rollwire.demo.trl_cpu's CPU stand-ins" in trainer_log
    assert "every version served  yes, on every replica" in result.stdout
    assert_door_saw_trl(Path(run / "proxy.log"), summary["versions"][1])


def assert_door_saw_trl(proxy_log: Path, last_version: int) -> None:
    """Every version TRL loaded was published by the proxy (one adapter_published line each)."""
    published = set()
    for line in proxy_log.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "adapter_published" and event.get("adapter") == "trl-policy":
            published.add(event["version"])
    assert published == set(range(1, last_version + 1))


def test_follow_hands_each_new_step_to_on_step_once(tmp_path):
    from rollwire.demo.trl import door_args, follow

    steps = tmp_path / "steps.jsonl"
    writer = (
        "import json, sys, time\n"
        "for step in (1, 2, 3):\n"
        "    with open(sys.argv[1], 'a') as fh: fh.write(json.dumps({'step': step, 'elapsed_s': step}) + '\\n')\n"
        "    time.sleep(0.4)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, str(steps)])
    seen: list[int] = []
    code = follow(proc, steps, 10, 30, progress=False, on_step=lambda s: seen.append(s["step"]), interval_s=0.05)
    assert code == 0 and seen[-1] == 3 and seen == sorted(set(seen))  # the newest, each once (a stall may skip one)
    flags = door_args(tmp_path / "lora", tmp_path / "model", "spool.keep_versions=9")
    assert flags[1::2] == (
        "http.port=0",
        f"http.adapter_root={tmp_path / 'lora'}",
        f"http.model_path={tmp_path / 'model'}",
        "spool.keep_versions=9",
    )
    assert set(flags[::2]) == {"--set"}


@pytest.mark.integration
@pytest.mark.slow
def test_a_second_trl_run_with_the_same_names_trains_on_its_own_weights(taught_model, tmp_path):
    """Issue 38, item 4: TRL's AsyncGRPOTrainer twice, one run after the other, against one
    long-lived proxy and replica: the second restarts at `trl-policy-v1` (TRL hard-codes the
    name) and trains, with no 409; its versions are a new lineage on the replica
    (`trl-policy.2`), and what the door serves under its last version's name is its own
    weights (logprobs of a PEFT model loaded from its folder, within 1e-4), not the first run's."""
    pytest.importorskip("trl")
    import requests
    from peft import PeftModel
    from support.engines import forward_logprobs
    from support.wire import status
    from transformers import AutoModelForCausalLM

    from rollwire.demo.stack import local_placement
    from rollwire.demo.trl import follow as follow_trainer
    from rollwire.demo.trl import start_door_stack, start_trainer, stop_trainer

    stack = start_door_stack(taught_model, tmp_path / "fleet", 1, tmp_path, local_placement(1))
    try:
        lasts = []
        for r in (1, 2):
            out = tmp_path / f"run{r}" / "trl"
            (out / ".vllm_lora").mkdir(parents=True)
            trainer = start_trainer(out.parent, out, stack.proxy.http_url, taught_model, 30, 3, seed=r)
            try:
                code = follow_trainer(trainer, out / "steps.jsonl", 30, 240, progress=False)
            finally:
                stop_trainer(trainer)
            assert code == 0, (out.parent / "trainer.log").read_text(errors="replace")[-3000:]
            lasts.append(json.loads((out / "summary.json").read_text())["last_version"])
        held = {a.name: list(a.versions) for a in status(stack.replicas[0].target).adapters}
        assert "trl-policy.2" in held and lasts[1] in held["trl-policy.2"], held  # run 2: a lineage of its own
        last = lasts[1]
        folder = tmp_path / "run2" / "trl" / ".vllm_lora" / f"trl-policy-v{last}"
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(taught_model), folder).eval()
        prompt = [5, 17, 33, 40, 12]
        body = {"model": f"trl-policy-v{last}", "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "top_p": 1.0}
        body |= {"n": 1, "return_token_ids": True, "logprobs": 0, "seed": 3}
        choice = requests.post(stack.proxy.http_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        expected = forward_logprobs(reference, prompt, choice["token_ids"]).tolist()
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    finally:
        stack.stop()
