"""Reading one following Generate stream through the SDK while a push lands mid-generation."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rollwire.client import Client, Finished, Restarted, Tokens


@dataclass
class Followed:
    """A following group's samples as the client saw them: per sample, each token's id,
    logprob and version, and how it finished."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    versions: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    pushed_in_time: bool = True
    """The push had answered (the version committed) before the first sample finished. When it
    had not, the group could not switch: a slow push on a loaded machine, not a failure to follow."""

    def of_version(self, index: int, version: int) -> tuple[list[int], list[float]]:
        """The tokens and logprobs of one sample produced by `version`."""
        picked = [k for k, v in enumerate(self.versions[index]) if v == version]
        return [self.tokens[index][k] for k in picked], [self.logprobs[index][k] for k in picked]


def follow_with_push(target: str, prompt: list[int], n: int, push_next: Callable[[], object], **kw) -> Followed:
    """Stream a following group; `push_next` runs (in a thread) once every sample's first
    tokens arrived (an engine may start a group's samples apart: vLLM serves each as a request
    of its own, and a push after the first sample's tokens alone once came before the second
    sample's first token, which then had no token of the old version). Fails on a restarted
    group or a chunk that mixes versions."""
    out = Followed()
    first = threading.Event()

    def pusher() -> None:
        assert first.wait(60), "no tokens came"
        push_next()

    with Client(target, timeout=120) as client, ThreadPoolExecutor(1) as pool:
        pushed = pool.submit(pusher)
        for event in client.generate_stream(prompt, n, follow=True, **kw):
            assert not isinstance(event, Restarted), "a following group was restarted"
            if isinstance(event, Tokens):
                out.tokens.setdefault(event.index, []).extend(event.token_ids)
                if len(out.tokens) == n:
                    first.set()
                out.logprobs.setdefault(event.index, []).extend(event.logprobs)
                out.versions.setdefault(event.index, []).extend([event.adapter_version] * len(event.token_ids))
                out.text[event.index] = out.text.get(event.index, "") + event.text
            elif isinstance(event, Finished):
                if not out.finished:
                    out.pushed_in_time = pushed.done()
                out.finished[event.index] = event
        first.set()
        pushed.result()
    return out
