"""verifiers' side of the door's conformance suite (tests/e2e/test_verifiers_conformance.py): run by
.venv-verifiers' Python (`make .venv-verifiers`: verifiers 0.1.14, which rollwire's .venv cannot hold),
never imported by the suite. It builds verifiers' own environments and clients, unmodified, on the
tiny model's tool-calling adapter (support/tool_model.py), runs them against one server (the door or
vLLM) and writes what they collected as JSON:

- `single`: a SingleTurnEnv evaluation (OpenAIChatCompletionsClient): each prompt holds a finished
  tool exchange for A+B=, the rubric checks the model's answer against A+B;
- `tool`: a ToolEnv with the Python tool `add(a, b)` (the same client): the model calls it, the env
  runs it and sends the result back, the model answers, the rubric checks the answer;
- `training`: the same ToolEnv through verifiers' training client (OpenAIChatCompletionsTokenClient,
  the one prime-rl's orchestrator uses) via `run_group`, each trajectory step's tokens kept (prompt
  and completion ids, masks, logprobs), as a trainer reads them.

argv: a JSON file of {url, model, pairs, extra_body, runs} and the JSON file to write.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import verifiers as vf
from datasets import Dataset
from verifiers.types import ClientConfig


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def answered(completion, answer: str) -> float:
    """1 when the model's last message is the answer."""
    text = vf.Parser().parse_answer(completion) or ""
    return 1.0 if text.strip() == answer else 0.0


def _plain(value: Any) -> Any:
    """Pydantic messages and responses as JSON."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump())
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _output(out: dict) -> dict:
    steps = []
    for step in out.get("trajectory") or []:
        response = step.get("response")
        message = getattr(response, "message", None) if response is not None else None
        steps.append(
            {
                "tokens": _plain(step.get("tokens")),
                "finish_reason": getattr(message, "finish_reason", None),
                "prompt": _plain(step.get("prompt")),
                "completion": _plain(step.get("completion")),
            }
        )
    error = out.get("error")
    return {
        "prompt": _plain(out.get("prompt")),
        "completion": _plain(out.get("completion")),
        "answer": out.get("answer"),
        "reward": out.get("reward"),
        "metrics": _plain(out.get("metrics")),
        "error": repr(error) if error else None,
        "stop_condition": out.get("stop_condition"),
        "trajectory": steps,
    }


def _exchange(a: int, b: int) -> list[dict]:
    call = {"id": "call-0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return [
        {"role": "user", "content": f"{a}+{b}="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-0", "content": str(a + b)},
    ]


async def main(spec: dict) -> dict:
    pairs = [tuple(p) for p in spec["pairs"]]
    answers = [str(a + b) for a, b in pairs]
    sampling = {"temperature": 0, "max_tokens": 100, "extra_body": spec.get("extra_body") or {}}
    rubric = vf.Rubric(funcs=[answered])
    quiet = {"on_progress": lambda *a, **k: None}
    results: dict[str, Any] = {}

    def client(kind: str) -> ClientConfig:
        return ClientConfig(
            client_type=kind,
            api_base_url=spec["url"] + "/v1",
            api_key_var="ROLLWIRE_VF_KEY",
            max_retries=0,
            timeout=120,
        )

    if "single" in spec["runs"]:
        rows = Dataset.from_dict({"prompt": [_exchange(a, b) for a, b in pairs], "answer": answers})
        env = vf.SingleTurnEnv(eval_dataset=rows, rubric=rubric)
        got = await env.evaluate(client("openai_chat_completions"), spec["model"], sampling, **quiet)
        results["single"] = [_output(o) for o in got["outputs"]]
    questions = Dataset.from_dict({"question": [f"{a}+{b}=" for a, b in pairs], "answer": answers})
    if "tool" in spec["runs"]:
        env = vf.ToolEnv(tools=[add], eval_dataset=questions, rubric=rubric, max_turns=3)
        got = await env.evaluate(client("openai_chat_completions"), spec["model"], sampling, **quiet)
        results["tool"] = [_output(o) for o in got["outputs"]]
    if "training" in spec["runs"]:
        env = vf.ToolEnv(tools=[add], eval_dataset=questions, rubric=rubric, max_turns=3)
        group = env.get_eval_dataset().to_list()
        got = await env.run_group(
            group, client("openai_chat_completions_token"), spec["model"], sampling, state_columns=["trajectory"]
        )
        results["training"] = [_output(o) for o in got]
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(asyncio.run(main(spec)), f)
