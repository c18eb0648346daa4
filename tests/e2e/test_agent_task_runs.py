"""The multi-turn chain task (learner/tasks/chain.py) with its external producers, end to end.

Real episodes through a real replica of the taught chain model, whose loss masks are checked
against an independent reading of the tokens (the character tokenizer's text: the
environment's questions found by pattern), in both ways of playing (whole history resent,
sessions); then a real learner ingesting the Node.js producer's and the Python producer's
episodes over real sockets, which trains every accepted trajectory. The environment's pure
checks: tests/unit/learner/test_agent_task.py."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.learner import learner_args, taught_dir
from support.processes import start, start_generator

from rollwire.demo.teach_chain import CHAIN_SPEC
from rollwire.learner.tasks.chain import (
    TURNS,
    Play,
    chain,
    play_group,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import agent_producer  # examples/ is not a package

ROOT = Path(__file__).resolve().parents[2]


CHAIN_DIR = taught_dir(CHAIN_SPEC)


QUESTION = re.compile(r"\|\d\d\+\d\d=")


EOS_MARK = "\x00"


# -- real episodes through a real replica ------------------------------------------------------
@pytest.fixture(scope="module")
def replica(chain_model, workdir):
    svc = start_generator(chain_model, workdir, "chain-generator", "--set", "limits.max_n=16")
    yield svc
    svc.stop()


def environment_positions(tokenizer, prompt: list[int], token_ids: list[int]) -> set[int]:
    """Independently of the producer: where the environment's questions sit in token_ids, found
    by pattern in the text (the character tokenizer has one character per token; EOS one mark)."""
    eos = tokenizer.eos_token_id
    chars = [EOS_MARK if t == eos else tokenizer.decode([t]) for t in prompt + token_ids]
    assert all(len(c) == 1 for c in chars)
    text = "".join(chars)
    spans = [m for m in QUESTION.finditer(text) if m.start() > 0 and text[m.start() - 1] == EOS_MARK]
    return {i - len(prompt) for m in spans for i in range(m.start(), m.end())}


@pytest.mark.integration
@pytest.mark.parametrize("sessions", [False, True], ids=["history", "sessions"])
def test_loss_masks_exclude_exactly_the_environment_tokens(replica, chain_model, sessions):
    from transformers import AutoTokenizer

    from rollwire.client import AsyncClient

    tokenizer = AutoTokenizer.from_pretrained(chain_model)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    async def play() -> list:
        async with AsyncClient(replica.target, timeout=60) as client:
            groups = [play_group(client, chain(i), 4, encode, Play(None, seed=i, sessions=sessions)) for i in range(6)]
            return await asyncio.gather(*groups)

    multi_turn = 0
    for prompt, episodes in asyncio.run(play()):
        for e in episodes:
            env = environment_positions(tokenizer, prompt, e.token_ids)
            assert [not m for m in e.loss_mask] == [i in env for i in range(len(e.token_ids))]
            assert all(
                lp == 0.0 and v == 0
                for lp, v, m in zip(e.logprobs, e.token_versions, e.loss_mask, strict=True)
                if not m
            )
            assert all(lp < 0 for lp, m in zip(e.logprobs, e.loss_mask, strict=True) if m) or not any(e.loss_mask)
            assert 0 <= e.turns_right <= TURNS and e.reward == e.turns_right / TURNS
            multi_turn += len(env) > 0
    assert multi_turn >= 6  # the taught model keeps most episodes going past the first turn


# -- a real learner, both producers, real sockets ------------------------------------------------
ADMIN = "agent-admin-secret"


@pytest.fixture(scope="module")
def learner(replica, chain_model, workdir):
    (workdir / "admin.tokens").write_text(ADMIN + "\n")
    (workdir / "admin.token").write_text(ADMIN + "\n")
    run = workdir / "learner-run"
    args = learner_args(replica.target, chain_model, run, "policy-agent", "max_steps=4", "seed=1")
    args += [
        "task.kind=chain",
        "task.eval_size=8",
        "train.groups_per_step=2",
        "buffer.max_staleness=8",
        "buffer.keep_zero_variance=true",
        "ingest.enabled=true",
        "ingest.port=0",
        "ingest.exclusive=true",
        "ingest.max_pending_groups=2",
        "ingest.producer_share=1",  # both producers hold the one admin token: one producer to the learner
        "ingest.retry_after_s=0.2",
        f"ingest.auth.admin_tokens_file={workdir / 'admin.tokens'}",
    ]
    svc = start(args, workdir, "agent-learner", timeout=120)
    yield svc, run, workdir / "admin.token"
    svc.stop()


@pytest.mark.integration
def test_the_node_and_python_producers_episodes_are_all_trained(learner, replica, tmp_path):
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed")
    if not (ROOT / ".tools" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail("@grpc/grpc-js is missing: run `npm ci --prefix .tools` (make lint does)")
    svc, run, token = learner
    dump = tmp_path / "node.jsonl"
    cmd = [node, str(ROOT / "examples" / "agent_producer.js"), "--target", replica.target, "--learner", svc.target]
    cmd += ["--groups", "4", "--n", "4", "--seed", "2", "--token-file", str(token), "--dump", str(dump)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    node_counts = json.loads(out.stdout.splitlines()[-1])
    assert node_counts["trajectories"] == {"accepted": 16}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(CHAIN_DIR))
    for line in dump.read_text().splitlines():
        t = json.loads(line)["trajectory"]
        env = environment_positions(tokenizer, t["prompt_token_ids"], t["token_ids"])
        assert [not m for m in t["loss_mask"]] == [i in env for i in range(len(t["token_ids"]))]

    flags = ["--target", replica.target, "--learner", svc.target, "--model", str(CHAIN_DIR), "--groups", "4"]
    py = agent_producer.parse_args([*flags, "--n", "4", "--concurrency", "2", "--sessions", "--token-file", str(token)])
    py_counts = asyncio.run(agent_producer.produce(py, ADMIN)).as_dict()
    assert py_counts["trajectories"] == {"accepted": 16}

    assert svc.proc.wait(timeout=120) == 0  # max_steps 4 x 2 groups: every submitted group
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ingest"]["trajectories"]["accepted"] == 32
    assert summary["ingest"]["trajectories"]["trained"] == 32  # none lost between acceptance and the step
    assert summary["ingest"]["trajectories"].keys() <= {"accepted", "trained"}  # nothing dropped, expired or refused
    assert summary["steps"] == 4 and summary["accuracy_before"] is not None
