"""Internal request and event types. Protos stay at the edge (convert.py converts requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-3  # smallest positive temperature; 0 means greedy
MAX_TEMPERATURE = 100.0  # a documented cap: hotter is close to uniform and buys nothing


@dataclass(frozen=True)
class SamplingParams:
    """How every sample of a group is drawn; validated at the edge (convert.py), which refuses
    anything outside these bounds with INVALID_ARGUMENT before an engine sees it:

    - temperature: 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-3, 100];
      a tinier one overflows logits / T to inf and NaN (see sampling.py).
    - top_p: finite, in (0, 1]; 1 = off.   top_k: 0 (off) up to the vocabulary size.
    - stop: at most limits.max_stop_strings strings, each 1 to 64 characters.
    - seed: any uint64 (None = a fresh random seed per group).
    - max_new_tokens: 1 up to limits.max_new_tokens, and prompt + it within the context.
    Engines still check what they sample from: a value that slips through fails its own
    group only."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    sample_seeds: tuple[int, ...] = ()
    """One seed per sample (then `seed` is None): sample i draws as sample 0 of a group seeded
    sample_seeds[i] would (a proxy's merged single-sample requests)."""
    ignore_eos: bool = False
    return_kept: bool = False
    """Report each token's kept set (TokenDelta.kept; rollwire.common.kept)."""


@dataclass(frozen=True)
class AdapterSelection:
    """A resolved adapter: the engine-level handle and the version it stands for."""

    name: str = ""  # "" = base model
    version: int = 0  # 0 for the base model
    handle: str | None = None  # engine's name for the loaded weights; None = base


@dataclass
class GroupRequest:
    """One GRPO group: `n` samples of one prompt, all generated on this replica."""

    request_id: str
    prompt_ids: list[int]
    n: int
    sampling: SamplingParams
    adapter: AdapterSelection = field(default_factory=AdapterSelection)
    """The version the group samples from; with `follow` the servicer replaces it (one
    assignment, read once per decode step by the engine) with each newer committed version."""
    follow: bool = False
    """Switch running samples to each newly committed version of the adapter (AdapterRef.follow)."""
    stream_interval: int = 0
    """New tokens of a sample per message (GenerateRequest.stream_interval); 0: the replica's own."""
    resume: dict[int, list[int]] = field(default_factory=dict)
    routed_experts: bool = False
    """GenerateRequest.return_routed_experts, checked (convert.py): each SampleDone carries the
    experts every forwarded position was routed to. Engines that can set `reports_routed_experts`."""
    """GenerateRequest.resume, checked (convert.py): the samples to run, by index, each with the
    tokens it already has; empty: all n from the start. A resumed sample keeps its index and
    seed, runs for max_new_tokens less what it has, and its events carry only new tokens (its
    SampleDone counts all of them). Engines that continue samples set `resumes_samples`."""

    @property
    def rows(self) -> int:
        """Samples this request runs: n, or those it resumes."""
        return len(self.resume) if self.resume else self.n

    def indices(self) -> list[int]:
        """The indices of the samples it runs, ascending."""
        return sorted(self.resume) if self.resume else list(range(self.n))


@dataclass
class TokenDelta:
    """New tokens of one sample."""

    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    version: int
    kept: list[bytes] = field(default_factory=list)
    """When the request asked for it: each token's kept set, encoded (rollwire.common.kept)."""


@dataclass
class SampleDone:
    """End of one sample; reason is "eos", "stop" or "length"."""

    sample_index: int
    reason: str
    prompt_tokens: int
    completion_tokens: int
    routed: RoutedExperts | None = None
    """When the request asked for it: the routing of the sample's forwarded positions."""


MAX_ROUTED_BYTES = 4 << 20
"""At most this many bytes of routed expert ids per sample (2 per id): the servicer sends each
sample's RoutedExperts in a message of its own when several would not fit one gRPC message,
whose limit is 8 MiB (serving/scaffold.py)."""


@dataclass(frozen=True)
class RoutedExperts:
    """A sample's MoE routing (pb.RoutedExperts): `positions` x `layers` x `top_k` expert ids as
    little-endian uint16, position-major; positions = prompt + completion tokens - 1."""

    positions: int
    layers: int
    top_k: int
    expert_ids: bytes


Event = TokenDelta | SampleDone


def coalesce(events: list[Event]) -> list[Event]:
    """Merge the token deltas of each sample that are ready together into one delta.

    Order within a sample is kept and its SampleDone stays after its tokens, so several
    tokens travel in one message when the client is slower than the engine.
    """
    merged: dict[int, TokenDelta] = {}
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, TokenDelta):
            prev = merged.get(ev.sample_index)
            if prev is not None and prev.version == ev.version:
                prev.token_ids.extend(ev.token_ids)
                prev.logprobs.extend(ev.logprobs)
                prev.text += ev.text
                prev.kept.extend(ev.kept)
                continue
            merged[ev.sample_index] = TokenDelta(
                ev.sample_index, list(ev.token_ids), list(ev.logprobs), ev.text, ev.version, list(ev.kept)
            )
            out.append(merged[ev.sample_index])
        else:
            merged.pop(ev.sample_index, None)
            out.append(ev)
    return out


def by_routed_size(events: list[Event], limit: int = MAX_ROUTED_BYTES) -> list[list[Event]]:
    """`events` in order, cut into runs each of whose finishes carry at most `limit` bytes of
    routed experts together (a finish over the limit alone still gets a run of its own), so
    each run fits one message. Without routing: one run."""
    runs: list[list[Event]] = [[]]
    held = 0
    for ev in events:
        size = len(ev.routed.expert_ids) if isinstance(ev, SampleDone) and ev.routed is not None else 0
        if size and held and held + size > limit:
            runs.append([])
            held = 0
        held += size
        runs[-1].append(ev)
    return runs


def worth_sending(events: list[Event], interval: int) -> bool:
    """Whether the events gathered for one stream make a message now: every batch when
    `interval` is 1, else once some sample ended or has `interval` new tokens waiting."""
    if interval <= 1:
        return bool(events)
    waiting: dict[int, int] = {}
    for ev in events:
        if not isinstance(ev, TokenDelta):
            return True
        waiting[ev.sample_index] = waiting.get(ev.sample_index, 0) + len(ev.token_ids)
        if waiting[ev.sample_index] >= interval:
            return True
    return False


@dataclass(frozen=True)
class ScoreJob:
    """One Score request as an engine runs it (validated at the edge, score.py): each sequence's
    continuation is scored teacher-forced after its prompt, under `adapter`."""

    request_id: str
    sequences: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    """(prompt ids, continuation ids) per sequence, each part at least one id."""
    top_k: int = 0
    """Also report the top_k most likely tokens at every scored position; 0: none."""
    adapter: AdapterSelection = field(default_factory=AdapterSelection)

    @property
    def tokens(self) -> int:
        """Tokens fed to the model, prompts and continuations together."""
        return sum(len(p) + len(c) for p, c in self.sequences)

    @property
    def scored(self) -> int:
        """Tokens scored (the continuations)."""
        return sum(len(c) for _, c in self.sequences)


@dataclass
class SequenceScore:
    """The logprob of each continuation token of one sequence (the model's raw log-softmax), and
    its top-k ids and logprobs per position when asked (empty otherwise)."""

    logprobs: list[float]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
