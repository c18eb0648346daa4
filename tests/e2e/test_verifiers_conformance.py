"""The door's conformance suite with verifiers as the real client (issue 50, "Must show"): verifiers
0.1.14's own environments and clients, unmodified, run in a subprocess from .venv-verifiers
(tests/support/verifiers_side.py) against the session's door fleet (support/door_fleet.py: hermes
calls parsed) on the tiny model's tool-calling adapter (support/tool_model.py):

- a SingleTurnEnv evaluation whose rubric checks the model's answer;
- a ToolEnv with the Python tool add(a, b): the model calls it, the env runs it and continues, the
  model answers;
- the same ToolEnv through verifiers' training client (the one prime-rl's orchestrator runs): each
  turn's prompt and sampled ids, masks and logprobs, held against the door's tokenizer and a
  teacher-forced PEFT forward (within 1e-4); its later turns go to /v1/chat/completions/tokens
  (prime-rl's vLLM extension, served by the door) with the stitched ids, sampled from exactly.

The same runs go against the run's one vLLM server (support.vllm: started with
`--enable-auto-tool-choice --tool-call-parser hermes`), given the door fleet's template per
request: the same answers, calls, rewards, tokens and logprobs, except where docs/http.md
("verifiers") lists the difference (stock vLLM has no /v1/chat/completions/tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.door_fleet import TEMPLATE, post
from support.tool_model import PAIRS, answer_prompt_text, call_text, prompt_text, tool_caller

ROOT = Path(__file__).resolve().parents[2]
VERIFIERS_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
VERIFIERS_STAMP = ROOT / ".venv-verifiers" / ".installed"
SIDE = ROOT / "tests" / "support" / "verifiers_side.py"
ADAPTER = "vf-tool-caller"
RUNS = ["single", "tool", "training"]


def require_verifiers() -> None:
    """Skip (or, under CI, fail) when verifiers' venv is not built."""
    if VERIFIERS_STAMP.is_file():
        return
    why = f"verifiers' environment is not built ({VERIFIERS_STAMP} missing): run `make .venv-verifiers` (~1.5 min)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; under CI `make test` must build it, so this is a failure, not a skip")
    pytest.skip(why)


def run_verifiers(work: Path, url: str, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """verifiers' runs (verifiers_side.py) against the server at `url`, as JSON."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"url": url, "model": ADAPTER, "pairs": PAIRS, "runs": RUNS, "extra_body": extra_body or {}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "ROLLWIRE_VF_KEY": "unused"}
    env |= {"HF_DATASETS_CACHE": str(work / "datasets"), "HF_HUB_OFFLINE": "1"}
    argv = [str(VERIFIERS_PYTHON), str(SIDE), str(work / "spec.json"), str(work / "out.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=work)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def adapter(tiny_model) -> Path:
    return tool_caller(tiny_model)


@pytest.fixture(scope="module")
def door_runs(door, adapter, tmp_path_factory) -> dict[str, Any]:
    """The adapter loaded through the door as `vf-tool-caller`, and verifiers' runs against it."""
    require_verifiers()
    folder = door["root"] / ADAPTER
    shutil.copytree(adapter, folder)
    loaded = post(door["proxy"].http_url, "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(folder)})
    assert loaded.status_code == 200, loaded.text
    return run_verifiers(tmp_path_factory.mktemp("verifiers-door"), door["proxy"].http_url)


def ids(door, text: str) -> list[int]:
    reply = post(door["proxy"].http_url, "/tokenize", {"model": ADAPTER, "prompt": text, "add_special_tokens": False})
    return reply.json()["tokens"]


def calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A message's calls as (name, arguments); verifiers keeps each as a JSON string of its ToolCall."""
    parsed = [json.loads(c) if isinstance(c, str) else c for c in message.get("tool_calls") or []]
    return [(c["name"], json.loads(c["arguments"])) for c in parsed]


def test_a_single_turn_env_evaluation_scores_the_answers(door_runs):
    """Each prompt holds the tool exchange (an assistant turn of calls with null content, the
    tool's result); the model answers A+B and the rubric gives 1."""
    for (a, b), out in zip(PAIRS, door_runs["single"], strict=True):
        assert out["error"] is None, out["error"]
        assert [m["content"] for m in out["completion"]] == [str(a + b)]
        assert out["reward"] == 1.0 and out["metrics"]["answered"] == 1.0


def test_a_tool_env_calls_the_python_tool_and_answers(door_runs):
    """The model's call, parsed by the door, is run by the env as a Python function; its result
    goes back as a tool message and the model's next turn answers it."""
    for (a, b), out in zip(PAIRS, door_runs["tool"], strict=True):
        assert out["error"] is None, out["error"]
        call, result, answer = out["completion"]
        assert call["role"] == "assistant" and calls(call) == [("add", {"a": a, "b": b})]
        assert result == {**result, "role": "tool", "content": str(a + b)}
        assert answer["role"] == "assistant" and answer["content"] == str(a + b) and not answer.get("tool_calls")
        assert out["reward"] == 1.0 and out["stop_condition"] == "no_tools_called"
        assert out["metrics"]["add_calls"] == 1.0 and out["metrics"]["num_turns"] == 2.0


def test_the_training_path_collects_the_sampled_ids_and_their_logprobs(door_runs, door, adapter, tiny_model):
    """verifiers' training client (prime-rl's): turn 1 on /v1/chat/completions, turn 2 on
    /v1/chat/completions/tokens with the ids it stitched (turn 1's prompt and sampled ids, then the
    tool's turn as the template renders it: no retokenization). Each turn's ids are the door's
    (the prompt as the template renders it, the call's text and EOS), its masks a trainer's, its
    logprobs a teacher-forced forward's on exactly those ids."""
    import torch
    from peft import PeftModel
    from support.engines import forward_logprobs
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), adapter).eval()
    eos = ids(door, "</s>")
    for (a, b), out in zip(PAIRS, door_runs["training"], strict=True):
        assert out["error"] is None, out["error"]
        assert out["reward"] == 1.0
        first, second = (step["tokens"] for step in out["trajectory"])
        assert [step["finish_reason"] for step in out["trajectory"]] == ["tool_calls", "stop"]
        assert first["prompt_ids"] == ids(door, prompt_text(a, b))
        assert first["completion_ids"] == ids(door, call_text(a, b)) + eos  # the sampled ids, EOS included
        stitched = first["prompt_ids"] + first["completion_ids"] + ids(door, f"t:{a + b}\na:")
        assert second["prompt_ids"] == stitched  # sampled from as sent
        assert second["completion_ids"] == ids(door, str(a + b)) + eos
        for step in (first, second):
            assert step["prompt_mask"] == [0] * len(step["prompt_ids"])
            assert step["completion_mask"] == [1] * len(step["completion_ids"])
            want = forward_logprobs(reference, step["prompt_ids"], step["completion_ids"])
            got = torch.tensor(step["completion_logprobs"])
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_verifiers_gets_the_same_answers_from_vllm(door_runs, door, adapter, vllm_server, tmp_path):
    """The same runs against vLLM (hermes parser, the door fleet's template per request): the same
    completions, calls, rewards and metrics; the training client's first turn the same ids and
    logprobs within 1e-4; its second turn refused (404), for stock vLLM has no
    /v1/chat/completions/tokens (prime-rl's extension: docs/http.md). And the history verifiers
    sends back (a tool-call turn with null content) tokenizes alike on both."""
    loaded = post(vllm_server.url, "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": str(adapter)})
    assert loaded.status_code == 200, loaded.text
    theirs = run_verifiers(tmp_path, vllm_server.url, {"chat_template": TEMPLATE})
    for run in ("single", "tool"):
        for ours, vllm in zip(door_runs[run], theirs[run], strict=True):
            assert vllm["error"] is None, vllm["error"]
            assert [(m["role"], m["content"], calls(m)) for m in vllm["completion"]] == [
                (m["role"], m["content"], calls(m)) for m in ours["completion"]
            ]
            assert (vllm["reward"], vllm["metrics"], vllm["stop_condition"]) == (
                ours["reward"],
                ours["metrics"],
                ours["stop_condition"],
            )
    for ours, vllm in zip(door_runs["training"], theirs["training"], strict=True):
        mine, their = ours["trajectory"][0]["tokens"], vllm["trajectory"][0]["tokens"]
        assert their["prompt_ids"] == mine["prompt_ids"] and their["completion_ids"] == mine["completion_ids"]
        assert their["completion_logprobs"] == pytest.approx(mine["completion_logprobs"], abs=1e-4)
        assert len(vllm["trajectory"]) == 1 and "NotFoundError" in (vllm["error"] or "")
    a, b = PAIRS[0]
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    history = [
        {"role": "user", "content": f"{a}+{b}="},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": None},
        {"role": "tool", "tool_call_id": "c", "content": str(a + b)},
    ]
    ask = {"model": ADAPTER, "messages": history, "add_generation_prompt": True}
    door_ids = post(door["proxy"].http_url, "/tokenize", ask).json()["tokens"]
    vllm_ids = post(vllm_server.url, "/tokenize", {**ask, "chat_template": TEMPLATE}).json()["tokens"]
    assert door_ids == vllm_ids == ids(door, answer_prompt_text(a, b))  # null content renders "", not "None"
