"""An agent harness outside the learner: multi-turn episodes through rollwire, scored and submitted.

It plays the built-in chained-addition task (rollwire.learner.tasks.chain): the model answers
`12+30=`, the environment turns its answer into the next question (`|42+05=`), and so on for
three turns; an episode succeeds when every turn is right and is rewarded with its share of
right turns. Each turn is sent through the proxy with the episode's whole token history as
prompt token ids (exact ids: the model's replies are never re-tokenized, only the
environment's own text is encoded), so any replica can serve any turn. Every episode is
submitted to the learner's LearnerService (docs/sessions.md, "The ingestion contract") with
its token ids, a loss mask that is false on every environment token, the behaviour logprobs
and versions the replica reported, its reward, and the id of its group (the n episodes of one
chain); a pushed-back group is sent again after the learner's hint, a stale one is dropped.

    python examples/agent_producer.py --target 127.0.0.1:50050 --learner 127.0.0.1:50070 \\
        --model PATH/TO/BASE_MODEL --token-file admin.token --seconds 120

It runs until --seconds pass, --groups groups are submitted, or the learner stops taking
trajectories; the last line is a JSON object of counts (--stats-file writes it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rollwire.client import AsyncClient
from rollwire.learner.tasks.chain import Episode, Play, chain_examples, from_example, play_group
from rollwire.v1 import learner_pb2 as lpb
from rollwire.v1 import learner_pb2_grpc

BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
STOPPING = "LEARNER_STOPPING"


def trajectories(group_id: str, prompt: list[int], episodes: list[Episode]) -> list[lpb.Trajectory]:
    """The group's episodes as LearnerService trajectories."""
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
            correct=e.success,
            trajectory_id=f"{group_id}/{i}",
        )
        for i, e in enumerate(episodes)
    ]


async def submit(
    stub, batch: list[lpb.Trajectory], metadata=(), deadline_s: float = 60.0
) -> list[lpb.TrajectoryStatus]:
    """Submit over one stream; trajectories pushed back (RESOURCE_EXHAUSTED) are sent again after
    the learner's hint until `deadline_s`. Returns each trajectory's final status, in order."""
    answers: dict[int, lpb.TrajectoryStatus] = {}
    waiting, give_up = list(range(len(batch))), time.monotonic() + deadline_s
    while waiting:
        call = stub.SubmitTrajectories(
            iter([lpb.SubmitTrajectoriesRequest(trajectory=batch[i]) for i in waiting]), metadata=metadata, timeout=60
        )
        replies = [r.status async for r in call]
        answers.update((i, s) for i, s in zip(waiting, replies, strict=True))
        busy = [(i, s) for i, s in zip(waiting, replies, strict=True) if s.code == BUSY]
        if not busy or time.monotonic() > give_up:
            break
        await asyncio.sleep(max(s.retry_after_ms for _, s in busy) / 1000)
        waiting = [i for i, _ in busy]
    return [answers[i] for i in range(len(batch))]


@dataclass
class Stats:
    """What the producer did: groups played and each trajectory's outcome, by reason."""

    groups: int = 0
    episodes: int = 0
    successes: int = 0
    outcomes: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def record(self, episodes: list[Episode], statuses: list[lpb.TrajectoryStatus]) -> None:
        self.groups += 1
        self.episodes += len(episodes)
        self.successes += sum(e.success for e in episodes)
        self.outcomes.update(s.reason or "accepted" for s in statuses)

    def as_dict(self) -> dict:
        return {
            "groups": self.groups,
            "episodes": self.episodes,
            "sampled_success": round(self.successes / self.episodes, 4) if self.episodes else None,
            "trajectories": dict(self.outcomes),
            "accepted": self.outcomes["accepted"],
            "seconds": round(time.monotonic() - self.started, 1),
        }


async def produce(args, token: str | None) -> Stats:
    """Play and submit groups from `args.concurrency` workers until the time, the groups or the learner run out."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    metadata = [("authorization", f"Bearer {token}")] if token else []
    train, _ = chain_examples(args.held_out_fraction)
    stats, stop_at, started = Stats(), time.monotonic() + args.seconds, [0]
    stopped = asyncio.Event()
    async with (
        grpc.aio.insecure_channel(args.learner) as channel,
        AsyncClient(args.target, token=token, timeout=60) as client,
    ):
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        status = await stub.GetIngestStatus(lpb.GetIngestStatusRequest(), metadata=metadata, timeout=30)
        play = Play(f"{status.adapter_name}@latest", temperature=args.temperature, sessions=args.sessions)

        async def worker(w: int) -> None:
            rng = random.Random(f"{args.seed}/{w}")
            while not stopped.is_set() and time.monotonic() < stop_at and (not args.groups or started[0] < args.groups):
                started[0] += 1
                example = rng.choice(train)
                prompt, episodes = await play_group(client, from_example(example), args.n, encode, play)
                group_id = f"chain-{args.seed}-{w}-{started[0]}-{example.id}"
                try:
                    statuses = await submit(stub, trajectories(group_id, prompt, episodes), metadata)
                except grpc.aio.AioRpcError as err:  # the learner is gone: its run ended
                    print(f"learner unreachable ({err.code().name}); stopping", file=sys.stderr)
                    stopped.set()
                    return
                stats.record(episodes, statuses)
                if any(s.reason == STOPPING for s in statuses):
                    stopped.set()
                if args.verbose:
                    print(json.dumps({"group": group_id, "rewards": [e.reward for e in episodes]}), flush=True)

        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    return stats


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--target", required=True, help="proxy (or generator) address, host:port")
    parser.add_argument("--learner", required=True, help="the learner's LearnerService address, host:port")
    parser.add_argument("--model", required=True, help="folder of the base model (its tokenizer)")
    parser.add_argument("--token-file", default="", help="file holding a bearer token (the learner's admin role)")
    parser.add_argument("--seconds", type=float, default=60.0, help="stop starting groups after this long")
    parser.add_argument("--groups", type=int, default=0, help="stop after this many groups (0: no limit)")
    parser.add_argument("--n", type=int, default=8, help="episodes per group")
    parser.add_argument("--concurrency", type=int, default=8, help="groups played at once")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--sessions",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="play later turns as session turns (client.session; default) or resend the whole history (--no-sessions)",
    )
    parser.add_argument("--held-out-fraction", type=float, default=0.1, help="the learner's task.held_out_fraction")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats-file", default="", help="also write the final counts here (JSON)")
    parser.add_argument("--verbose", action="store_true", help="print one line per group")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    stats = asyncio.run(produce(args, token)).as_dict()
    line = json.dumps(stats)
    if args.stats_file:
        Path(args.stats_file).write_text(line + "\n")
    print(line, flush=True)
    refused = sum(v for k, v in stats["trajectories"].items() if k not in ("accepted", STOPPING, "STALE_TRAJECTORY"))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
