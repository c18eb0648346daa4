"""An external producer: two-turn episodes through rollwire, scored and submitted to a learner.

The environment is chained addition. The model is asked `a+b=` and answers; the environment
then appends `+c=` (its own tokens) and the model answers again; the reward is 1 when the
second answer is a+b+c. Every episode keeps the exact token ids of every turn: the second
turn is generated from the token ids of the first (prompt, the model's reply, the
environment's tokens), never from re-tokenized text. Each sample is submitted to the
learner's LearnerService (docs/learner.md, "Ingesting scored trajectories") with a loss mask
that is true on the model's tokens and false on the environment's, the behaviour logprobs
and versions the replica reported, and its reward; the n episodes of one prompt form one
GRPO group.

    python examples/ingest_producer.py --target 127.0.0.1:50050 --learner 127.0.0.1:50070 \\
        --model PATH/TO/BASE_MODEL --token-file admin.token --groups 8

`--target` is a proxy (or one generator); `--learner` the learner's ingest.port. The learner
says which adapter to sample from (GetIngestStatus.adapter_name); the episodes ask for its
newest version.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rollwire.client import Client
from rollwire.v1 import learner_pb2 as lpb
from rollwire.v1 import learner_pb2_grpc

BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@dataclass
class Episode:
    """One sample: the tokens after the prompt, which are the model's, and what they scored."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    receipts: list[lpb.ReceiptSpan] = field(default_factory=list)
    """Each model turn's receipt (from a replica with a receipt key), placed where its tokens start."""

    def model_turn(self, token_ids, logprobs, versions, receipt=None) -> None:
        if receipt is not None:
            self.receipts.append(lpb.ReceiptSpan(start=len(self.token_ids), receipt=receipt))
        self.token_ids += token_ids
        self.loss_mask += [True] * len(token_ids)
        self.logprobs += logprobs
        self.token_versions += versions

    def environment_turn(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)  # ignored by the learner: not the model's tokens
        self.token_versions += [0] * len(token_ids)


def first_number(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def play(
    client: Client,
    tokenizer,
    adapter: str,
    a: int,
    b: int,
    c: int,
    n: int,
    seed: int,
    max_new_tokens: int = 4,
    temperature: float | None = None,
):
    """The n episodes of one prompt: (prompt token ids, episodes)."""
    first = client.generate(
        f"{a:02d}+{b:02d}=",
        n,
        max_new_tokens=max_new_tokens,
        adapter=adapter,
        seed=seed,
        ignore_eos=True,
        temperature=temperature,
    )
    prompt = list(first.prompt_token_ids)
    episodes = []
    environment = tokenizer.encode(f"+{c:02d}=", add_special_tokens=False)
    for sample in first.samples:
        episode = Episode()
        episode.model_turn(sample.token_ids, sample.logprobs, sample.token_versions, sample.receipt)
        episode.environment_turn(environment)
        second = client.generate(
            prompt + episode.token_ids,
            1,
            max_new_tokens=max_new_tokens,
            adapter=adapter,
            seed=seed + 1 + sample.index,
            temperature=temperature,
        ).samples[0]
        episode.model_turn(second.token_ids, second.logprobs, second.token_versions, second.receipt)
        episode.reward = float(first_number(second.text) == a + b + c)
        episodes.append(episode)
    return prompt, episodes


def trajectories(group_id: str, prompt: list[int], episodes: list[Episode]) -> list[lpb.Trajectory]:
    return [
        lpb.Trajectory(
            group_id=group_id,
            group_size=len(episodes),
            prompt_token_ids=prompt,
            token_ids=e.token_ids,
            loss_mask=e.loss_mask,
            logprobs=e.logprobs,
            token_versions=e.token_versions,
            reward=e.reward,
            correct=e.reward == 1.0,
            trajectory_id=f"{group_id}/{i}",
            receipts=e.receipts,
        )
        for i, e in enumerate(episodes)
    ]


def submit(
    stub, trajectories: list[lpb.Trajectory], metadata=(), max_waits: int = 60
) -> list[lpb.SubmitTrajectoriesResponse]:
    """Submit over one stream; the trajectories pushed back (RESOURCE_EXHAUSTED) are sent again
    after the learner's hint. Returns each trajectory's final answer, in order."""
    answers: dict[int, lpb.SubmitTrajectoriesResponse] = {}
    waiting = list(range(len(trajectories)))
    for _ in range(max_waits):
        requests = (lpb.SubmitTrajectoriesRequest(trajectory=trajectories[i]) for i in waiting)
        replies = list(stub.SubmitTrajectories(requests, metadata=metadata, timeout=60))
        pushed_back = [i for i, r in zip(waiting, replies, strict=True) if r.status.code == BUSY]
        answers.update((i, r) for i, r in zip(waiting, replies, strict=True) if r.status.code != BUSY)
        if not pushed_back:
            break
        time.sleep(max(r.status.retry_after_ms for r in replies) / 1000)
        waiting = pushed_back
    return [answers[i] for i in sorted(answers)]


def produce(
    target: str, learner: str, model: str | Path, groups: int, n: int = 4, token: str | None = None, seed: int = 0
) -> Iterator[tuple[str, list[lpb.SubmitTrajectoriesResponse]]]:
    """Play and submit `groups` groups of `n` episodes; yields (group id, answers) per group."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    rng = random.Random(seed)
    with grpc.insecure_channel(learner) as channel, Client(target, token=token, timeout=60) as client:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        status = stub.GetIngestStatus(lpb.GetIngestStatusRequest(), metadata=metadata, timeout=30)
        for g in range(groups):
            a, b, c = rng.randrange(50), rng.randrange(50), rng.randrange(10)
            prompt, episodes = play(client, tokenizer, f"{status.adapter_name}@latest", a, b, c, n, seed * 7919 + g)
            group_id = f"chain-{seed}-{g}"
            yield group_id, submit(stub, trajectories(group_id, prompt, episodes), metadata)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--target", required=True, help="proxy (or generator) address, host:port")
    parser.add_argument("--learner", required=True, help="the learner's LearnerService address, host:port")
    parser.add_argument("--model", required=True, help="folder of the base model (its tokenizer)")
    parser.add_argument("--token-file", default="", help="file holding a bearer token (the learner's admin role)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="episodes per group")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    refused = 0
    for group_id, answers in produce(args.target, args.learner, args.model, args.groups, args.n, token, args.seed):
        for answer in answers:
            if answer.status.code:
                refused += 1
                print(f"{group_id}: {answer.status.reason}: {answer.status.message}", file=sys.stderr)
        print(f"{group_id}: {len(answers)} submitted, group complete: {answers[-1].group_complete}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
