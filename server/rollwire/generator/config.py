"""Typed configuration of a generator replica (`rollwire generator --config FILE`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from rollwire.generator.engines import ENGINES
from rollwire.generator.engines.settings import ScriptedSection, SGLangSection, TransformersSection, VLLMSection
from rollwire.generator.eviction import TenantSlotsSection
from rollwire.runtime.dialing import DialSection
from rollwire.serving.config import ForwardSection, PushLimits, ServerConfig, port_field, push_idle_field


class ProofSection(BaseModel):
    """Behavioural proofs of adapter versions (generator/proof.py, docs/protocol.md "Proof")."""

    model_config = ConfigDict(extra="forbid")
    tolerance: float = Field(default=0.0, ge=0.0)
    """Largest |logprob - probe| a version's probe may show here and the version still be served; 0 takes the
    engine's default (transformers 1e-4, vllm and sglang 1e-3, scripted 1e-6: rollwire.common.probe)."""


class Limits(PushLimits):
    """Sizes a replica accepts; requests beyond them are refused before any work."""

    max_n: int = Field(default=64, ge=1)
    """Largest number of samples in one group."""
    max_new_tokens: int = Field(default=1024, ge=1)
    """Largest max_new_tokens of a request."""
    max_prompt_tokens: int = Field(default=4096, ge=1)
    """Longest prompt, in tokens."""
    max_queue: int = Field(default=256, ge=0)
    """Groups that may wait for a batch slot; more get RESOURCE_EXHAUSTED."""
    max_stop_strings: int = Field(default=8, ge=0)
    """Most stop strings per request."""
    max_score_sequences: int = Field(default=64, ge=1)
    """Most sequences in one Score request."""
    max_score_tokens: int = Field(default=32768, ge=1)
    """Most tokens (prompts and continuations together) in one Score request."""
    max_score_top_k: int = Field(default=20, ge=0)
    """Largest top_k of a Score request (0: top-k logprobs are refused)."""
    max_concurrent_pushes: int = Field(default=2, ge=1)
    """PushAdapter streams received at once (each buffers its payload); more get RESOURCE_EXHAUSTED."""
    push_idle_timeout_s: float = push_idle_field()
    stripe_linger_s: float = Field(default=10.0, gt=0, le=600)
    """A striped version being assembled waits at most this long, once none of its stripes' streams is open, for the
    stream of a missing stripe; then it is dropped and frees its push slot. A plain push that finds no slot takes the
    slot of such an assembly at once (heals and catch-ups always find one)."""
    stage_timeout_s: float = Field(default=300.0, gt=0)
    """A version staged by a stage_only push and not committed within this long is dropped; keep it above the proxy's
    health.push_timeout_s."""


class RelaySection(DialSection, ForwardSection):
    """Forwarding a relayed push to this replica's children (the proxy sends the plan).

    With auth on, a replica relays only to the nodes its proxy granted (each node of the plan
    carries the proxy's grant, keyed from its admin token, which this replica's admin tokens
    verify), never to itself, and dials them with a `relay` token: `token_file`, else the
    caller's token when that is a relay token (the proxy's upstream.relay_token_file). An
    admin token is never passed on. With auth off, plans are not checked (anyone may push
    anything) and no token travels. The TLS settings say how to dial the children when they
    listen with TLS (as the replicas' own [tls] does)."""

    enabled: bool = Field(default=True)
    """Forward relayed pushes; false refuses a push that carries a relay plan."""
    max_children: int = Field(default=16, ge=1, le=1024)
    """Most children a plan may give this replica (its uplink carries one copy each)."""
    timeout_s: float = Field(default=120.0, gt=0)
    """Deadline of the streams to the children when the relayed push itself has none."""
    token_file: str = Field(default="")
    """Bearer token with the `relay` role sent to the children; empty = the caller's, when it is a relay token."""


class RegisterSection(DialSection):
    """Self-registration with a routing proxy (heartbeats); off unless `proxy` is set. The dial settings say how to
    reach a proxy that requires tokens (the `register` role, for its own address only; admin works too) or TLS."""

    proxy: str = Field(default="")
    """HOST:PORT of the proxy to join; empty = do not register."""
    ttl_seconds: int = Field(default=15, ge=3)
    """The proxy forgets this replica this long after its last heartbeat."""
    advertise: str = Field(default="")
    """HOST:PORT the proxy dials to reach this replica; defaults to host:port."""


class GeneratorConfig(ServerConfig):
    """A generator replica: serves GeneratorService from a local Hugging Face model folder."""

    model: str = Field(default="")
    """Local Hugging Face model folder (config.json + *.safetensors + tokenizer)."""
    engine: Annotated[str, ENGINES] = Field(default="transformers")
    """Model backend, a name registered in rollwire.generator.engines (docs/engines.md); scripted is a benchmark engine
    with no model (needs only config.json)."""
    port: int = port_field(50051, "gRPC")
    metrics_port: int = port_field(9400, "Prometheus /metrics")
    replica_id: str = Field(default="")
    """Name in logs and status; defaults to host:port."""
    receipt_key_file: str = Field(default="")
    """This replica's Ed25519 signing key file (`rollwire keys generate`): with it every finished sample carries a
    SampleReceipt, the replica's signed word for what it was conditioned on and sampled, which a learner with
    ingest.receipt_keys_file requires of ingested trajectories (docs/security.md, "Sample receipts"). Its own key,
    never a publisher's: a receipt proves sampling, not publishing."""
    adapter_window: int = Field(default=3, ge=1)
    """Newest versions of each adapter kept loaded in the engine (a cache of the adapter_keep newest)."""
    adapter_keep: int = Field(default=8, ge=1)
    """Newest versions of each adapter a caller may name (taken as at least adapter_window): those outside the window
    are kept as their verified bytes and loaded again when a request names them. It is what the proxy's HTTP door
    reports as vLLM's max_loras, so the default covers TRL's max_staleness + 2 (6 at TRL's defaults)."""
    adapter_keep_bytes: int = Field(default=2 << 30, ge=0)
    """Bytes of adapter payloads kept in memory to load versions again, over all names; beyond it the oldest versions
    outside their window stop being servable first."""
    tenant_slots: TenantSlotsSection = Field(default_factory=TenantSlotsSection)
    stream_interval: int = Field(default=1, ge=1, le=4096)
    """New tokens of a sample gathered before they are sent (a sample's end is always sent at once); 1 streams
    every token as it is made. Larger values cut the per-message cost of gRPC, the proxy and the caller when the
    callers want whole groups (a learner), at the price of later first tokens."""
    limits: Limits = Field(default_factory=Limits)
    proof: ProofSection = Field(default_factory=ProofSection)
    transformers: TransformersSection = Field(default_factory=TransformersSection)
    sglang: SGLangSection = Field(default_factory=SGLangSection)
    vllm: VLLMSection = Field(default_factory=VLLMSection)
    scripted: ScriptedSection = Field(default_factory=ScriptedSection)
    registration: RegisterSection = Field(default_factory=RegisterSection)
    relay: RelaySection = Field(default_factory=RelaySection)
