"""Typed configuration of the learner (`rollwire learner --config FILE --set key.sub=value ...`).

Loaded by `rollwire.runtime.config.load_config(LearnerConfig, ...)`: a TOML (or YAML) file,
then ROLLWIRE_* environment variables, then dotted overrides, each winning over the one
before; every field has its help text and bounds, and cross-field rules that would deadlock
or silently misbehave are refused with a message naming the keys.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rollwire.learner.losses import LOSSES
from rollwire.runtime.config import Section
from rollwire.runtime.dialing import DialSection
from rollwire.runtime.security import AuthSection, TlsSection

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ClientSection(DialSection):
    """How the learner reaches the target (a proxy or one generator); its token needs the admin role (the learner
    pushes)."""

    timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of one Generate or PushAdapter call, in seconds."""
    max_attempts: int = Field(default=0, ge=0, le=10_000)
    """Attempts of a call whose connection fails (UNAVAILABLE before any reply); 0 = as many as timeout_s allows, so a
    proxy that restarts or dies (with another listed in target) is waited out."""


class TaskSection(Section):
    """Where prompts and their verifiable answers come from."""

    kind: Literal["addition", "chain", "jsonl"] = Field(default="addition")
    """Built-in two-digit addition, built-in chained addition (multi-turn, trained from ingested episodes
    only: needs ingest.exclusive; evaluation plays held-out episodes), or JSON lines."""
    train_path: str = Field(default="")
    """jsonl: file of {"prompt", "answer"} objects to train on."""
    held_out_path: str = Field(default="")
    """jsonl: held-out file; empty splits train_path by prompt hash."""
    held_out_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Share of prompts held out when splitting by hash."""
    eval_size: int = Field(default=200, ge=0)
    """Held-out prompts scored greedily at start and end; 0 = all."""


class RewardSpec(Section):
    """One reward function; a sample's reward is the weighted sum over all of them."""

    kind: Literal["exact_match", "numeric", "regex", "python"] = Field(default="exact_match")
    """exact_match | numeric (first number equals the answer) | regex | python."""
    name: str = Field(default="")
    """Label in metrics and logs; defaults to the kind."""
    weight: float = Field(default=1.0)
    """Multiplier of this reward in the sum."""
    pattern: str = Field(default="")
    """regex: the stripped completion must fully match this pattern."""
    function: str = Field(default="")
    """python: 'package.module:function' or 'path/to/file.py:function'."""

    @model_validator(mode="after")
    def _needs(self) -> RewardSpec:
        if self.kind == "regex" and not self.pattern:
            raise ValueError("a regex reward needs `pattern`")
        if self.kind == "python" and ":" not in self.function:
            raise ValueError("a python reward needs `function` = 'module:function' or 'file.py:function'")
        return self


class RolloutSection(Section):
    """What the producer asks the target for."""

    n: int = Field(default=8, ge=2)
    """Samples per group (GRPO needs at least 2 to compare)."""
    groups_in_flight: int = Field(default=16, ge=1)
    """Groups requested but not yet trained on (generating or buffered); bounds the work ahead."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Completion length limit."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the learner divides its logits by the same value."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 = off."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens; 0 = off."""
    follow: bool = Field(default=False)
    """Running samples switch to each newly committed version mid-generation (AdapterRef.follow): fresher tokens,
    each tagged with the version that produced it; the default pins a group to the version it started on."""
    exact_truncated_ratio: bool = Field(default=True)
    """With top_p or top_k on: ask the generators for each token's kept set and compute the learner's logprob over that
    same truncated set, so pi/mu is exact (docs/learner.md); false = over the whole vocabulary (biased)."""
    retry_backoff_s: float = Field(default=0.5, ge=0)
    """Pause after an UNAVAILABLE or busy target before asking again."""


class BufferSection(Section):
    """Which scored groups may reach the loss."""

    max_staleness: int = Field(default=1, ge=0)
    """Largest (trained version - sampling version) allowed; 0 is the synchronous mode (blocking push)."""
    max_token_staleness: int = Field(default=-1, ge=-1)
    """Token-level limit beside it: a token sampled by a version more than this many behind the trained one is masked
    from the loss (its group trains on its other tokens); -1 = off. With rollout.follow a group's tokens span several
    versions: keep max_staleness loose and bound the tokens here."""
    keep_zero_variance: bool = Field(default=False)
    """Train on groups whose rewards are all equal (they carry no advantage)."""


class TrainSection(Section):
    """The GRPO step: LoRA, optimiser and loss."""

    groups_per_step: int = Field(default=8, ge=1)
    """Groups in one optimiser step."""
    micro_batch_groups: int = Field(default=0, ge=0)
    """Groups per forward/backward; 0 = the whole step at once; fewer accumulates gradients."""
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm."""
    lora_r: int = Field(default=8, ge=1)
    """LoRA rank."""
    lora_alpha: float = Field(default=16.0, gt=0)
    """LoRA alpha (scale alpha/r)."""
    target_modules: list[str] = Field(default_factory=list)
    """Linear layers that get LoRA, by name; [] (the default): every linear layer of the base model (trainer.
    linear_targets: PEFT's all-linear, the output head and a MoE model's experts and routers left out), so GPT-2's
    c_attn, Phi-3's qkv_proj and GPT-NeoX's query_key_value are trained as a Llama's q_proj is."""
    loss: Annotated[str, LOSSES] = Field(default="clipped")
    """Policy loss, a name registered in rollwire.learner.losses (docs/learner.md); clipped is the clipped, truncated
    surrogate below."""
    normalize_std: bool = Field(default=True)
    """Divide group-relative advantages by the group's reward std."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """Ratio below 1 - clip_low is clipped (for negative advantages)."""
    clip_high: float = Field(default=0.28, ge=0)
    """Ratio above 1 + clip_high is clipped (for positive advantages)."""
    ratio_cap: float = Field(default=4.0, gt=1, le=1e6)
    """Importance weights are truncated at this value (dual clip for negative advantages); at most 1e6, below the
    ratio the loss clamps at (grpo.LOG_RATIO_BOUND)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the per-token KL to the base model (adapter disabled); 0 = off."""
    kl_reference: Literal["learner", "replicas"] = Field(default="learner")
    """Where the KL term's base-model logprobs come from: "learner" runs a second forward pass here with the adapter
    disabled; "replicas" asks the replicas (one Score call per step, base model) so the learner keeps no second
    forward. "replicas" needs rollout.temperature 1 and no top_k/top_p: Score returns the untempered, untruncated
    log-softmax."""
    threads: int = Field(default=0, ge=0)
    """torch CPU threads of the learner; 0 keeps torch's default."""
    device: str = Field(default="cpu")
    """torch device, e.g. cpu or cuda:0."""

    @model_validator(mode="after")
    def _accumulation(self) -> TrainSection:
        if self.micro_batch_groups > self.groups_per_step:
            raise ValueError("train.micro_batch_groups must be <= train.groups_per_step")
        if self.ratio_cap <= 1 + self.clip_high:
            raise ValueError("train.ratio_cap must be > 1 + train.clip_high")
        return self


class EvalSection(Section):
    """Greedy held-out accuracy through the target."""

    at_start: bool = Field(default=True)
    """Score the starting policy before training."""
    at_end: bool = Field(default=True)
    """Score the final policy after training."""
    every_steps: int = Field(default=0, ge=0)
    """Also score every this many steps; 0 = never."""
    concurrency: int = Field(default=32, ge=1)
    """Held-out requests in flight at once."""


BYTES_PER_TOKEN = 17
"""A held ingested token (ingest/room.py): int32 id, float32 logprob, int64 version, int8 mask."""
SAMPLE_OVERHEAD = 1024
"""A held sample's objects (the sample, its four arrays: ~620 bytes measured), in bytes, rounded up."""


def sample_bytes(tokens: int) -> int:
    """What a held ingested sample of `tokens` tokens is charged (ingest/room.py's byte budget)."""
    return SAMPLE_OVERHEAD + BYTES_PER_TOKEN * tokens


def group_reservation(group_size: int, prompt_tokens: int, max_tokens: int) -> int:
    """What an ingested group reserves when it opens: its prompt and `group_size` samples of the largest
    size. Here, below every room, so IngestSection checks its sizes by the rule the room charges."""
    return 4 * prompt_tokens + group_size * sample_bytes(max_tokens)


class IngestSection(Section):
    """LearnerService: scored trajectories from external producers (ingest/intake.py, docs/learner.md)."""

    enabled: bool = Field(default=False)
    """Serve LearnerService, so producers outside the learner submit scored trajectories to train on."""
    host: str = Field(default="127.0.0.1")
    """Address the service binds; loopback by default (set auth and TLS before binding another)."""
    port: int = Field(default=50070, ge=0, le=65535)
    """Port of the service; 0 picks a free one (the ready file says which)."""
    exclusive: bool = Field(default=False)
    """Train only on ingested groups: the learner's own producer requests nothing (evaluation still runs)."""
    max_pending_groups: int = Field(default=64, ge=1, le=100_000)
    """Ingested groups being assembled or buffered at once; a trajectory opening one more is pushed back
    (RESOURCE_EXHAUSTED INGEST_FULL)."""
    max_pending_bytes: int = Field(default=1 << 30, ge=1 << 16, le=1 << 40)
    """Memory the ingested groups being assembled, buffered or trained may hold, in bytes (17 per token and 1024 per
    sample, ingest/room.py): a group reserves group_size samples of ingest.max_tokens when it opens, so its later
    samples always fit, and holds what its samples take once complete. A trajectory opening a group past it is pushed
    back (RESOURCE_EXHAUSTED INGEST_FULL)."""
    producer_share: float = Field(default=0.5, gt=0, le=1)
    """Share of ingest.max_pending_groups and ingest.max_pending_bytes one producer may hold, so no producer can lock
    the others out; past it, RESOURCE_EXHAUSTED INGEST_QUOTA. A producer is its bearer token with auth on (give each
    producer its own), else its peer host. 1 lets a lone producer fill the learner."""
    group_idle_s: float = Field(default=120.0, gt=0)
    """An incomplete group that took no sample for this long is dropped (counted as expired), so a producer that
    went away frees its room before ingest.group_timeout_s; raise it for producers whose samples of one group end
    further apart."""
    max_abs_reward: float = Field(default=1e6, gt=0, le=1e30)
    """Largest |reward| a trajectory may carry (BAD_TRAJECTORY past it): group statistics stay finite in float32,
    whose largest number is 3.4e38, however many samples a group has."""
    min_logprob: float = Field(default=-50.0, ge=-80, lt=0)
    """Lowest behaviour logprob a trained token may carry (BAD_TRAJECTORY below it). A sampled token's probability is
    never e^-50 (~2e-22) in practice, and float32's exp overflows past 88.7: a floor far below that keeps the
    importance ratio of the loss meaningful (the loss also clamps it, grpo.LOG_RATIO_BOUND)."""
    max_logprob_gap: float = Field(default=0.0, ge=0, le=100)
    """0: off. Above 0, each trajectory's trained tokens are scored on the replicas (Score, under the version each
    names) before it is taken, and one whose claimed behaviour logprob is further than this from the scored one is
    refused (INVALID_ARGUMENT BEHAVIOUR_MISMATCH). Score's logprobs are temperature 1, untruncated: for producers that
    sample so (ingest/check.py); 1e-3 leaves room for float rounding."""
    receipt_keys_file: str = Field(default="")
    """The replicas' public receipt keys (a trust file: {"keys": [{"id", "public_key"}]}, each replica's entry from
    `rollwire keys generate`). When set, a trajectory is taken only if every trained token lies in a span a trusted
    replica signed (Trajectory.receipts; RECEIPT_MISSING / BAD_RECEIPT otherwise): provenance, not plausibility
    (ingest/receipts.py, docs/security.md "Sample receipts"). "": no receipts required."""
    receipt_max_age_s: float = Field(default=86400.0, gt=0)
    """Oldest receipt taken, in seconds since the replica signed it; each receipt trains once whatever its age."""
    max_group_size: int = Field(default=64, ge=2, le=4096)
    """Largest group_size a trajectory may declare."""
    max_prompt_tokens: int = Field(default=8192, ge=1, le=1_000_000)
    """Largest prompt of a trajectory, in tokens."""
    max_tokens: int = Field(default=32768, ge=1, le=1_000_000)
    """Largest number of tokens after the prompt (every turn, the model's and the environment's)."""
    group_timeout_s: float = Field(default=600.0, gt=0)
    """A group still incomplete this long after its first sample is dropped (counted as expired)."""
    retry_after_s: float = Field(default=1.0, gt=0, le=3600)
    """The retry hint sent with INGEST_FULL."""
    max_closed_ids: int = Field(default=100_000, ge=1)
    """Completed or expired group ids remembered, so a late sample of one is refused (GROUP_CLOSED)."""
    max_message_bytes: int = Field(default=8 << 20, ge=1 << 16, le=1 << 30)
    """Largest request message the service reads (gRPC refuses a larger one with RESOURCE_EXHAUSTED)."""
    auth: AuthSection = Field(default_factory=AuthSection)
    """Bearer tokens of this service; SubmitTrajectories and GetIngestStatus need the admin role."""
    tls: TlsSection = Field(default_factory=TlsSection)
    """Server TLS (and mutual TLS) of this service."""

    @model_validator(mode="after")
    def _sizes(self) -> IngestSection:
        if 4 * (self.max_prompt_tokens + 3 * self.max_tokens) > self.max_message_bytes:
            raise ValueError(
                "ingest.max_message_bytes is too small for ingest.max_prompt_tokens and ingest.max_tokens "
                "(about 4 bytes per prompt token and 12 per later token)"
            )
        largest = group_reservation(self.max_group_size, self.max_prompt_tokens, self.max_tokens)
        if largest > self.producer_share * self.max_pending_bytes:
            raise ValueError(
                f"a group of ingest.max_group_size samples of ingest.max_tokens reserves {largest} bytes, more than "
                "ingest.producer_share of ingest.max_pending_bytes: such a group could never open; raise "
                "max_pending_bytes or lower the sizes"
            )
        return self


class CheckpointSection(Section):
    """Checkpoints: adapter, optimiser, step, version, data cursor, RNG."""

    every_steps: int = Field(default=10, ge=0)
    """Save every this many steps (and always at exit); 0 = only at exit."""
    keep: int = Field(default=2, ge=1)
    """Newest checkpoints kept on disk."""


class LearnerConfig(Section):
    """The asynchronous GRPO learner."""

    target: str = Field(default="127.0.0.1:50050")
    """Address of the proxy (or of one generator) as host:port; several proxies comma-separated (a:1,b:2) or
    dns:///NAME:PORT for all the addresses a name resolves to (the SDK balances over them)."""
    base_model: str = Field(default="")
    """Local folder of the base model the replicas serve (same files)."""
    adapter_name: str = Field(default="policy")
    """Name the adapter versions are pushed under."""
    signing_key_file: str = Field(default="")
    """A signing key (`rollwire keys generate`) every pushed version is signed with: required where the replicas and
    proxies set trust.keys_file (docs/security.md). Empty: versions are pushed unsigned."""
    publish_probe: bool = Field(default=False)
    """Push every version with its probe (publisher.probe_of: this learner's logprobs of 4 fixed sequences of 16
    tokens under the weights pushed), which every replica holds its engine to before serving the version
    (docs/protocol.md, "Proof"). Off by default: a learner that trains in bf16 against float32 replicas differs from
    them by more than their tolerance (raise proof.tolerance there first)."""
    run_dir: str = Field(default="runs/learner")
    """Folder for checkpoints, steps.jsonl and summary.json."""
    seed: int = Field(default=0, ge=0)
    """Seed of the data order and of every sampling request."""
    max_steps: int = Field(default=0, ge=0)
    """Stop after this many optimiser steps in this run; 0 = no limit."""
    max_seconds: float = Field(default=0.0, ge=0)
    """Stop training after this many seconds; 0 = no limit."""
    metrics_host: str = Field(default="127.0.0.1")
    """Address the Prometheus /metrics endpoint (plain HTTP, no auth) binds; loopback by default, 0.0.0.0 where a
    Prometheus on another host (or pod) scrapes it."""
    metrics_port: int = Field(default=9402, ge=0, le=65535)
    """Prometheus /metrics port; 0 picks a free one."""
    log_level: str = Field(default="info")
    """debug, info, warning or error."""
    progress: bool = Field(default=True)
    """Print a progress line per step when stdout is a terminal."""
    client: ClientSection = Field(default_factory=ClientSection)
    """Connection to the target."""
    task: TaskSection = Field(default_factory=TaskSection)
    """Prompts and answers."""
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec()])
    """Reward functions, summed."""
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    """Sampling requests."""
    buffer: BufferSection = Field(default_factory=BufferSection)
    """Staleness and zero-variance rules."""
    train: TrainSection = Field(default_factory=TrainSection)
    """The GRPO step."""
    eval: EvalSection = Field(default_factory=EvalSection)
    """Held-out evaluation."""
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    """Checkpointing."""
    ingest: IngestSection = Field(default_factory=IngestSection)
    """Scored trajectories from external producers (off by default)."""

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if not self.base_model:
            raise ValueError("base_model is required: the folder of the model the replicas serve")
        if self.rollout.groups_in_flight < self.train.groups_per_step:
            raise ValueError(
                "rollout.groups_in_flight must be >= train.groups_per_step, or a step could never fill its batch"
            )
        r = self.rollout
        if self.train.kl_reference == "replicas" and (r.temperature != 1.0 or r.top_k or r.top_p < 1.0):
            raise ValueError(
                "train.kl_reference = 'replicas' needs rollout.temperature = 1 and no rollout.top_k/top_p (Score's "
                "logprobs are the untempered, untruncated log-softmax); use train.kl_reference = 'learner'"
            )
        if self.task.kind == "jsonl" and not self.task.train_path:
            raise ValueError("task.kind = 'jsonl' needs task.train_path")
        if self.task.kind == "chain" and not (self.ingest.enabled and self.ingest.exclusive):
            raise ValueError(
                "task.kind = 'chain' is multi-turn: its episodes come from a producer through ingestion "
                "(set ingest.enabled and ingest.exclusive, and run e.g. examples/agent_producer.py)"
            )
        if not self.rewards:
            raise ValueError("rewards must list at least one reward function")
        return self

    @property
    def sync(self) -> bool:
        """The synchronous baseline: on-policy batches and a blocking push."""
        return self.buffer.max_staleness == 0
