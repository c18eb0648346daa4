"""SGLang's native HTTP API as rollwire uses it: request bodies, stream parsing, errors.

Pure functions and one small state machine, no I/O, so every byte rollwire sends and every
chunk it accepts is pinned by unit tests. Written against SGLang 0.5.23
(python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py,
managers/tokenizer_manager.py); docs/engines.md lists the calls.

Invariants:
- a group of n samples is one /generate request: `sampling_params.n` (SGLang's parallel
  sampling, which prefills the prompt once and shares it) unless the group is seeded, then
  the prompt repeated n times with one `sampling_seed` per sample, because SGLang's seeded
  sampler hashes (seed, position), so n copies of one seed would be n identical samples;
- each streamed chunk is read the same way whether SGLang streams cumulative output (its
  default) or deltas (`--incremental-streaming-output`): the new tokens of a sample are the
  last `completion_tokens - seen` entries, and a chunk that would skip tokens is an error;
- every SGLang failure becomes a RollwireError that keeps SGLang's own message;
- a Score reads each continuation token's logprob by its own id from its own position of
  `input_token_logprobs` (the reply's ids checked against the sequence), and a reply with an entry
  missing or misplaced fails the Score (INTERNAL ENGINE_FAILED) instead of scoring with a gap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rollwire.common.errors import Internal, RollwireError
from rollwire.common.reasons import Reason
from rollwire.generator.detokenize import TextStream
from rollwire.generator.engines.served import http as served
from rollwire.generator.engines.served.http import DONE as DONE  # the `data: [DONE]` sentinel, re-exported
from rollwire.generator.engines.served.http import ServerKind
from rollwire.generator.types import (
    Event,
    GroupRequest,
    SampleDone,
    SamplingParams,
    ScoreJob,
    SequenceScore,
    TokenDelta,
)

TARGET_VERSION = "0.5.23"

SGLANG = ServerKind(
    label="SGLang",
    key="sglang",
    hints={
        401: "check sglang.api_key_file / sglang.admin_api_key_file against the keys SGLang was started with",
        403: "SGLang refuses this call without an admin key; set sglang.admin_api_key_file",
        404: "the server does not have this route; is it SGLang 0.5 or newer?",
    },
)
"""SGLang in sentences, config keys and log events (served.ServerKind)."""


# -- requests ------------------------------------------------------------------------------
def sampling_params(s: SamplingParams) -> dict:
    """Our sampling params in SGLang's vocabulary (top_k 0 = off is SGLang's -1).

    `no_stop_trim` keeps a matched stop string in the text, as the transformers engine does;
    the tokens that spelled it are generated either way.
    """
    params = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "ignore_eos": s.ignore_eos,
        "no_stop_trim": True,
        "skip_special_tokens": True,
    }
    if s.stop:
        params["stop"] = list(s.stop)
    return params


def generate_body(
    group: GroupRequest, lora_name: str | None, seeds: list[int] | None, rid: str
) -> tuple[dict, list[str] | None]:
    """The /generate body for a group, and the request ids SGLang will use (None when SGLang
    assigns them itself, as it does for the samples of `n`).

    `seeds` holds one sampling seed per sample for a seeded group, None otherwise; `rid` is
    unique per call, since SGLang keys its request state by it.
    """
    params = sampling_params(group.sampling)
    body: dict = {"return_logprob": True, "logprob_start_len": -1, "stream": True}
    if group.n == 1:
        if seeds:
            params["sampling_seed"] = seeds[0]
        body.update(input_ids=list(group.prompt_ids), sampling_params=params, rid=rid)
        rids: list[str] | None = [rid]
        if lora_name:
            body["lora_path"] = lora_name
    elif seeds is None:
        body.update(input_ids=list(group.prompt_ids), sampling_params={**params, "n": group.n}, rid=rid)
        rids = None
        if lora_name:
            body["lora_path"] = lora_name
    else:
        rids = [f"{rid}-{i}" for i in range(group.n)]
        body.update(
            input_ids=[list(group.prompt_ids)] * group.n,
            sampling_params=[{**params, "sampling_seed": seed} for seed in seeds],
            rid=rids,
        )
        if lora_name:
            body["lora_path"] = [lora_name] * group.n
    return body, rids


def load_lora_body(lora_name: str, lora_path: str) -> dict:
    """/load_lora_adapter: a PEFT folder on the server's disk under a name never used before."""
    return {"lora_name": lora_name, "lora_path": lora_path, "pinned": False}


def unload_lora_body(lora_name: str) -> dict:
    return {"lora_name": lora_name}


def abort_body(rid: str) -> dict:
    return {"rid": rid}


# -- scoring (Score, and so the proofs) ------------------------------------------------------
# SGLang's prompt logprobs, as read in its 0.5 source (managers/schedule_batch.py,
# scheduler_output_processor_mixin.py, tokenizer_manager.py, layers/logits_processor.py): with
# `return_logprob` and `logprob_start_len` s >= 0, `meta_info.input_token_logprobs` holds one
# [logprob, token id, text or null] entry for each input position from s to the end, in order; the
# entry at s carries no logprob (null), since what is reported at a position is its token's logprob
# given the tokens before it, and SGLang computes those from s on. So the first continuation token's
# logprob needs s = len(prompt) - 1. `max_new_tokens: 0` makes the request prefill-only (nothing is
# sampled). The values are log-softmax of the logits, scaled by the request's temperature and
# renormalised over top_p only when those differ from 1, which they do not here: a Score asks for
# the raw distribution (score.py's contract).
SCORE_PARAMS = {"max_new_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": -1}


def score_body(prompt: tuple[int, ...], continuation: tuple[int, ...], lora_name: str | None, rid: str) -> dict:
    """The /generate body that scores one sequence: prefill only, the input logprobs from the
    prompt's last position on (the module's scoring note), answered whole (not streamed)."""
    body: dict = {
        "input_ids": [*prompt, *continuation],
        "sampling_params": dict(SCORE_PARAMS),
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
        "stream": False,
        "rid": rid,
    }
    if lora_name:
        body["lora_path"] = lora_name
    return body


def read_score(job: ScoreJob, i: int, reply: dict) -> SequenceScore:
    """Sequence `i`'s continuation logprobs from SGLang's reply to `score_body` (the module's invariants)."""
    prompt, continuation = job.sequences[i]
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise error_from_body(
            finish.get("status_code") or 500, {"error": {"message": finish.get("message")}}, f"Score {job.request_id}"
        )
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) < len(continuation) + 1:
        raise _missing(job, f"the input logprobs of sequence {i}")
    if not _entry_of(entries[0], prompt[-1]):
        raise _missing(job, f"the prompt's last token {prompt[-1]} where sequence {i}'s input logprobs start")
    logprobs = []
    for k, token in enumerate(continuation):
        entry = entries[1 + k]
        if not _entry_of(entry, token) or not isinstance(entry[0], (int, float)):
            raise _missing(job, f"token {token}'s logprob at position {len(prompt) + k} of sequence {i}")
        logprobs.append(float(entry[0]))
    return SequenceScore(logprobs)


def _entry_of(entry, token: int) -> bool:
    """Whether an input_token_logprobs entry is [logprob, token, text] for `token`."""
    return isinstance(entry, (list, tuple)) and len(entry) >= 2 and entry[1] == token


def _missing(job: ScoreJob, what: str) -> Internal:
    return Internal(
        f"SGLang's reply to Score {job.request_id} lacks {what}; retry it, on another replica",
        reason=Reason.ENGINE_FAILED,
    )


# -- streamed responses --------------------------------------------------------------------
def parse_sse_line(line: str):
    """One line of SGLang's event stream: a chunk dict, DONE, or None for blank/other lines."""
    return served.parse_sse_line(line, SGLANG)


@dataclass
class _Sample:
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class StreamTracker:
    """Turns SGLang's streamed chunks of one group into rollwire events.

    `text_stream` makes each sample's incremental detokenizer (detokenize.TextStream over
    the replica's own tokenizer, so text deltas follow the same rules as the transformers
    engine's; O(new tokens) per chunk).
    """

    def __init__(self, group: GroupRequest, text_stream: Callable[[], TextStream]) -> None:
        self.group = group
        self.samples = [_Sample(text_stream()) for _ in range(group.n)]
        self.rids: set[str] = set()

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def feed(self, chunk: dict) -> list[Event]:
        """Events carried by one chunk; raises the mapped error for error and abort chunks."""
        if "error" in chunk:
            raise error_from_body(_status_of(chunk["error"]), chunk, "generation")
        meta = chunk.get("meta_info") or {}
        index = chunk.get("index", 0)
        if not isinstance(index, int) or not 0 <= index < self.group.n:
            raise Internal(f"SGLang sent a chunk for sample index {index!r} of a group of {self.group.n}")
        if meta.get("id"):
            self.rids.add(str(meta["id"]))
        sample = self.samples[index]
        if sample.done:
            raise Internal(f"SGLang sent more output for sample {index} after it finished")
        events: list[Event] = []
        delta = self._new_tokens(index, chunk, meta)
        if delta is not None:
            events.append(delta)
        finish = meta.get("finish_reason")
        if finish is not None:
            events.append(self._finish(index, finish, meta))
        return events

    def _new_tokens(self, index: int, chunk: dict, meta: dict) -> TokenDelta | None:
        sample = self.samples[index]
        total = int(meta.get("completion_tokens", len(sample.tokens)))
        new = total - len(sample.tokens)
        if new <= 0:
            return None
        ids = chunk.get("output_ids") or []
        logprobs = meta.get("output_token_logprobs") or []
        if len(ids) < new or len(logprobs) < new:
            raise Internal(
                f"SGLang reported {total} tokens for sample {index} but sent only {len(ids)} ids and "
                f"{len(logprobs)} logprobs after the {len(sample.tokens)} already received; output was lost"
            )
        tokens = [int(t) for t in ids[-new:]]
        entries = logprobs[-new:]
        if [int(e[1]) for e in entries] != tokens:
            raise Internal(f"SGLang's logprobs for sample {index} do not belong to its output tokens")
        sample.tokens.extend(tokens)
        return TokenDelta(
            index, tokens, [float(e[0]) for e in entries], sample.text.add(tokens), self.group.adapter.version
        )

    def _finish(self, index: int, finish: dict, meta: dict) -> SampleDone:
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind == "abort":
            raise error_from_body(
                finish.get("status_code") or 500, {"error": {"message": finish.get("message")}}, "generation"
            )
        if kind == "length":
            reason = "length"
        elif kind == "stop":
            reason = "stop" if isinstance(finish.get("matched"), str) else "eos"
        else:
            raise Internal(f"SGLang finished sample {index} for an unknown reason {finish!r}")
        sample = self.samples[index]
        sample.done = True
        prompt_tokens = int(meta.get("prompt_tokens", len(self.group.prompt_ids)))
        return SampleDone(index, reason, prompt_tokens, len(sample.tokens))


# -- errors --------------------------------------------------------------------------------
_status_of = served.status_of
sglang_message = served.server_message


def error_from_body(status: int, body, what: str) -> RollwireError:
    """A RollwireError for an SGLang error reply, with SGLang's message and an action."""
    return served.error_from_body(SGLANG, status, body, what)


def error_from_reply(status: int, raw: bytes, what: str) -> RollwireError:
    return served.error_from_reply(SGLANG, status, raw, what)
