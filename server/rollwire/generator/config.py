"""Typed configuration of a generator replica (`rollwire generator --config FILE`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rollwire.common.config import Section
from rollwire.generator.engines import ENGINES
from rollwire.serving.keepalive import KeepaliveSection
from rollwire.serving.security import AuthSection, TlsSection

MiB = 1 << 20


class Limits(Section):
    """Sizes a replica accepts; requests beyond them are refused before any work."""

    max_n: int = Field(default=64, ge=1, description="Largest number of samples in one group.")
    max_new_tokens: int = Field(default=1024, ge=1, description="Largest max_new_tokens of a request.")
    max_prompt_tokens: int = Field(default=4096, ge=1, description="Longest prompt, in tokens.")
    max_adapter_bytes: int = Field(
        default=1024 * MiB, ge=1, description="Largest adapter payload accepted by PushAdapter."
    )
    max_queue: int = Field(
        default=256, ge=0, description="Groups that may wait for a batch slot; more get RESOURCE_EXHAUSTED."
    )
    max_stop_strings: int = Field(default=8, ge=0, description="Most stop strings per request.")
    max_concurrent_pushes: int = Field(
        default=2,
        ge=1,
        description="PushAdapter streams received at once (each buffers its payload); more get RESOURCE_EXHAUSTED.",
    )
    push_idle_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A push that sends no message for this long is cancelled with DEADLINE_EXCEEDED.",
    )
    max_version_step: int = Field(
        default=1_000_000,
        ge=1,
        description="A pushed version may be at most this far above the newest of its name (0 for a new name).",
    )
    stage_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="A version staged by a stage_only push and not committed within this long is dropped; keep it "
        "above the proxy's health.push_timeout_s.",
    )


class RelaySection(Section):
    """Forwarding a relayed push to this replica's children (the proxy sends the plan).

    The caller's authorization travels on to the children, so they must accept the same
    admin token; the TLS settings say how to dial them when they listen with TLS."""

    enabled: bool = Field(
        default=True, description="Forward relayed pushes; false refuses a push that carries a relay plan."
    )
    max_children: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Most children a plan may give this replica (its uplink carries one copy each).",
    )
    queue_chunks: int = Field(default=8, ge=1, description="Chunks queued per child before the relay waits for it.")
    stall_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="A child that takes no chunk for this long is cut off and reported (the proxy heals it).",
    )
    settle_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Per level of its subtree (plus one): how long after the last chunk a child may take to verify, "
        "stage and answer before it is cut off and reported.",
    )
    timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Deadline of the streams to the children when the relayed push itself has none.",
    )
    tls: bool = Field(
        default=False, description="Dial the children over TLS (trusting the system roots unless ca_file is set)."
    )
    ca_file: str = Field(default="", description="PEM roots that sign the other replicas' certificates; implies tls.")
    cert_file: str = Field(default="", description="PEM client certificate for replicas that require mutual TLS.")
    key_file: str = Field(default="", description="PEM private key of cert_file.")
    server_name: str = Field(
        default="", description="Name to check the children's certificates against, if not their host."
    )


class TransformersSection(Section):
    """Settings of the embedded transformers+PEFT engine."""

    max_batch_rows: int = Field(default=64, ge=1, description="Sequences decoded together in one forward pass.")
    threads: int = Field(default=0, ge=0, description="torch CPU threads; 0 keeps torch's default.")
    device: str = Field(default="cpu", description="torch device, e.g. cpu or cuda:0.")


class SGLangSection(Section):
    """Settings of the sglang engine: an SGLang server this replica launches, or one at `url`.

    Secrets are read from files named here, never from the environment, and never logged.
    """

    url: str = Field(
        default="",
        description="Use the SGLang server at this URL (e.g. http://127.0.0.1:30000) instead of launching one; it must see adapter_dir (same host or shared volume).",
    )
    launch_command: list[str] = Field(
        default_factory=list,
        description="Command that starts SGLang; empty = [this python, -m, sglang.launch_server]. rollwire appends --model-path, --host, --port and the LoRA flags.",
    )
    extra_args: list[str] = Field(
        default_factory=list, description='More SGLang flags, e.g. ["--mem-fraction-static", "0.5"].'
    )
    host: str = Field(default="127.0.0.1", description="Address the launched SGLang server binds.")
    port: int = Field(default=0, ge=0, le=65535, description="Port of the launched SGLang server; 0 picks a free one.")
    max_lora_rank: int = Field(
        default=64, ge=1, description="Largest LoRA rank SGLang reserves memory for; pushes of a larger r are refused."
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["all"], description="Modules SGLang prepares LoRA buffers for (--lora-target-modules)."
    )
    max_loaded_adapters: int = Field(
        default=0,
        ge=0,
        description="Adapter versions SGLang holds at once; 0 = adapter_window + 1 (the window plus one for the swap).",
    )
    deterministic: bool = Field(
        default=False,
        description="Start SGLang with --enable-deterministic-inference; required to honour request seeds.",
    )
    random_seed: int | None = Field(default=None, description="SGLang's --random-seed.")
    api_key_file: str = Field(default="", description="File holding SGLang's --api-key (generate endpoints).")
    admin_api_key_file: str = Field(
        default="", description="File holding SGLang's --admin-api-key (adapter load/unload and abort)."
    )
    adapter_dir: str = Field(
        default="",
        description="Where pushed adapters are written for SGLang to load; empty = a fresh temporary folder.",
    )
    adapter_dir_on_server: str = Field(
        default="",
        description="adapter_dir as the SGLang server sees it, when it mounts it elsewhere; empty = the same path.",
    )
    startup_timeout_s: float = Field(
        default=900.0, gt=0, description="How long a launched SGLang may take to become healthy."
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest wait for the next chunk of a generation or for an adapter call."
    )
    health_interval_s: float = Field(default=5.0, gt=0, description="How often an SGLang given by url is probed.")
    max_restarts: int = Field(
        default=5, ge=0, description="Restarts of a crashed, launched SGLang before the replica gives up."
    )
    max_concurrent_groups: int = Field(
        default=256, ge=1, description="Groups streamed from SGLang at once; more wait in rollwire's queue."
    )


class ScriptedSection(Section):
    """Settings of the scripted benchmark engine: tokens at a set rate, no model (engines/scripted.py)."""

    tokens_per_s: float = Field(
        default=100.0,
        ge=0,
        description="Tokens per second per sample, all n samples of a group together; 0 = as fast as the event loop runs.",
    )
    logprob: float = Field(default=-1.0, le=0, description="The logprob reported for every token.")
    max_concurrent_groups: int = Field(
        default=256, ge=1, description="Groups generating at once; more wait in the engine's queue."
    )


class RegisterSection(Section):
    """Self-registration with a routing proxy (heartbeats); off unless `proxy` is set."""

    proxy: str = Field(default="", description="HOST:PORT of the proxy to join; empty = do not register.")
    ttl_seconds: int = Field(
        default=15, ge=3, description="The proxy forgets this replica this long after its last heartbeat."
    )
    advertise: str = Field(
        default="", description="HOST:PORT the proxy dials to reach this replica; defaults to host:port."
    )
    token_file: str = Field(default="", description="Admin-role bearer token for a proxy that requires tokens.")
    tls_ca_file: str = Field(
        default="", description="PEM roots of the proxy's certificate, for a proxy that listens with TLS."
    )


class GeneratorConfig(Section):
    """One generator replica: the model, where it listens, and its limits."""

    model: str = Field(
        default="", description="Local Hugging Face model folder (config.json + *.safetensors + tokenizer)."
    )
    engine: Annotated[str, ENGINES] = Field(
        default="transformers",
        description="Model backend, a name registered in rollwire.generator.engines (docs/engines.md); scripted is a "
        "benchmark engine with no model (needs only config.json).",
    )
    host: str = Field(
        default="127.0.0.1", description="Address the gRPC server binds; 0.0.0.0 to accept remote clients."
    )
    port: int = Field(default=50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int = Field(default=9400, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    replica_id: str = Field(default="", description="Name in logs and status; defaults to host:port.")
    adapter_window: int = Field(default=3, ge=1, description="Newest versions of each adapter kept loaded.")
    log_level: str = Field(default="info", description="debug, info, warning or error.")
    grace_seconds: float = Field(default=10.0, ge=0, description="On shutdown, how long in-flight requests may finish.")
    limits: Limits = Field(default_factory=Limits)
    transformers: TransformersSection = Field(default_factory=TransformersSection)
    sglang: SGLangSection = Field(default_factory=SGLangSection)
    scripted: ScriptedSection = Field(default_factory=ScriptedSection)
    auth: AuthSection = Field(default_factory=AuthSection)
    tls: TlsSection = Field(default_factory=TlsSection)
    registration: RegisterSection = Field(default_factory=RegisterSection)
    relay: RelaySection = Field(default_factory=RelaySection)
    keepalive: KeepaliveSection = Field(default_factory=KeepaliveSection)
