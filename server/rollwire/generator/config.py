"""Typed configuration of a generator replica (`rollwire generator --config FILE`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rollwire.generator.engines import ENGINES
from rollwire.runtime.config import Section
from rollwire.serving.config import ForwardSection, PushLimits, ServerConfig, port_field, push_idle_field
from rollwire.serving.dial import DialTlsSection


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


class RelaySection(DialTlsSection, ForwardSection):
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


class PrefixCacheSection(Section):
    """The transformers engine's prefix KV cache: the keys and values of recently prefilled prompts (and of finished
    one-sample turns, prompt plus reply), reused when a later prompt under the same adapter version extends them (a
    session's next turn, an agent harness resending its history). Held on CPU; see docs/sessions.md."""

    max_tokens: int = Field(default=16384, ge=0)
    """Tokens held at most, all entries together (least recently used evicted first); 0 turns reuse off. One token
    costs 2 x layers x kv_heads x head_dim x 4 bytes of CPU memory (2 KiB on the tiny model, 24 KiB on
    Qwen2.5-0.5B)."""
    ttl_s: float = Field(default=300.0, gt=0)
    """An entry unused this long is evicted."""
    block_tokens: int = Field(default=16, ge=1, le=4096)
    """Block size of the prefix hash index; prompts shorter than one block are neither stored nor reused."""


class TransformersSection(Section):
    """Settings of the embedded transformers+PEFT engine."""

    max_batch_rows: int = Field(default=64, ge=1)
    """Sequences decoded together in one forward pass."""
    max_batch_tokens: int = Field(default=1 << 20, ge=1)
    """KV-cache tokens the running groups may reserve together: a group reserves n x (prompt + max_new_tokens) while
    it runs, and waits for room beyond it; one that could never fit alone is refused up front (INVALID_ARGUMENT,
    KV_BUDGET). Size it from the accelerator's memory left after the weights, divided by the bytes of one token's
    keys and values (2 x layers x kv_heads x head_dim x dtype bytes)."""
    threads: int = Field(default=0, ge=0)
    """torch CPU threads; 0 keeps torch's default."""
    device: str = Field(default="cpu")
    """torch device, e.g. cpu or cuda:0."""
    prefix_cache: PrefixCacheSection = Field(default_factory=PrefixCacheSection)
    """Reuse of prompt-prefix keys and values across requests ([transformers.prefix_cache])."""


class SGLangSection(Section):
    """Settings of the sglang engine: an SGLang server this replica launches, or one at `url`.

    Secrets are read from files named here, never from the environment, and never logged.
    """

    url: str = Field(default="")
    """Use the SGLang server at this URL (e.g. http://127.0.0.1:30000) instead of launching one; it must see
    adapter_dir (same host or shared volume)."""
    launch_command: list[str] = Field(default_factory=list)
    """Command that starts SGLang; empty = [this python, -m, sglang.launch_server]. rollwire appends --model-path,
    --host, --port and the LoRA flags."""
    extra_args: list[str] = Field(default_factory=list)
    """More SGLang flags, e.g. ["--mem-fraction-static", "0.5"]."""
    host: str = Field(default="127.0.0.1")
    """Address the launched SGLang server binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the launched SGLang server; 0 picks a free one."""
    max_lora_rank: int = Field(default=64, ge=1)
    """Largest LoRA rank SGLang reserves memory for; pushes of a larger r are refused."""
    lora_target_modules: list[str] = Field(default_factory=lambda: ["all"])
    """Modules SGLang prepares LoRA buffers for (--lora-target-modules)."""
    max_loaded_adapters: int = Field(default=0, ge=0)
    """Adapter versions SGLang holds at once; 0 = adapter_window + 1 (the window plus one for the swap)."""
    deterministic: bool = Field(default=False)
    """Start SGLang with --enable-deterministic-inference; required to honour request seeds."""
    random_seed: int | None = Field(default=None)
    """SGLang's --random-seed."""
    api_key_file: str = Field(default="")
    """File holding SGLang's --api-key (generate endpoints)."""
    admin_api_key_file: str = Field(default="")
    """File holding SGLang's --admin-api-key (adapter load/unload and abort)."""
    adapter_dir: str = Field(default="")
    """Where pushed adapters are written for SGLang to load; empty = a fresh temporary folder."""
    adapter_dir_on_server: str = Field(default="")
    """adapter_dir as the SGLang server sees it, when it mounts it elsewhere; empty = the same path."""
    startup_timeout_s: float = Field(default=900.0, gt=0)
    """How long a launched SGLang may take to become healthy."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for the next chunk of a generation or for an adapter call."""
    health_interval_s: float = Field(default=5.0, gt=0)
    """How often an SGLang given by url is probed."""
    max_restarts: int = Field(default=5, ge=0)
    """Restarts of a crashed, launched SGLang before the replica gives up."""
    max_concurrent_groups: int = Field(default=256, ge=1)
    """Groups streamed from SGLang at once; more wait in rollwire's queue."""


class VLLMSection(Section):
    """Settings of the vllm engine: a vLLM OpenAI server this replica launches, or one at `url` (docs/engines.md).

    Secrets are read from files named here, never from the environment, and never logged.
    """

    url: str = Field(default="")
    """Use the vLLM server at this URL (e.g. http://127.0.0.1:8000) instead of launching one; it must run with
    --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and see adapter_dir (same host or shared volume)."""
    launch_command: list[str] = Field(default_factory=list)
    """Command that starts vLLM's OpenAI server; empty = [this python, -m, vllm.entrypoints.openai.api_server]. vLLM
    needs its own environment, e.g. [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]. rollwire
    appends --model, --host, --port, the LoRA flags and --logprobs-mode processed_logprobs."""
    extra_args: list[str] = Field(default_factory=list)
    """More vLLM flags, e.g. ["--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "2"]."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for the launched server only, e.g. {"VLLM_CPU_KVCACHE_SPACE": "1"} on CPU; rollwire
    always sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1. Never put secrets here (use api_key_file)."""
    host: str = Field(default="127.0.0.1")
    """Address the launched vLLM server binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the launched vLLM server; 0 picks a free one."""
    dtype: str = Field(default="auto")
    """vLLM's --dtype (auto, float32, bfloat16, float16)."""
    max_model_len: int = Field(default=0, ge=0)
    """vLLM's --max-model-len; 0 = the model's own limit."""
    max_lora_rank: int = Field(default=64, ge=1)
    """Largest LoRA rank vLLM reserves memory for (--max-lora-rank); pushes of a larger r are refused."""
    max_loaded_adapters: int = Field(default=0, ge=0)
    """Adapter versions loaded at once (vLLM's --max-loras); 0 = adapter_window + 1 (the window plus one for the
    swap)."""
    api_key_file: str = Field(default="")
    """File holding vLLM's API key (its --api-key; passed to a launched server as VLLM_API_KEY)."""
    adapter_dir: str = Field(default="")
    """Where pushed adapters are written for vLLM to load; empty = a fresh temporary folder."""
    adapter_dir_on_server: str = Field(default="")
    """adapter_dir as the vLLM server sees it, when it mounts it elsewhere; empty = the same path."""
    startup_timeout_s: float = Field(default=900.0, gt=0)
    """How long a launched vLLM may take to become healthy."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for the next chunk of a generation or for an adapter call."""
    health_interval_s: float = Field(default=5.0, gt=0)
    """How often a vLLM given by url is probed."""
    max_restarts: int = Field(default=5, ge=0)
    """Restarts of a crashed, launched vLLM before the replica gives up."""
    max_concurrent_groups: int = Field(default=256, ge=1)
    """Groups streamed from vLLM at once; more wait in rollwire's queue."""
    max_logprobs: int = Field(default=64, ge=-1)
    """vLLM's --max-logprobs (-1: the vocabulary): the most top logprobs a request may ask for, which bounds
    return_kept_tokens: a top-k group needs top_k + 1, a top-p-only group the whole vocabulary. Give a server at
    `url` the value it was started with."""


class ScriptedSection(Section):
    """Settings of the scripted benchmark engine: tokens at a set rate, no model (engines/scripted.py)."""

    tokens_per_s: float = Field(default=100.0, ge=0)
    """Tokens per second per sample, all n samples of a group together; 0 = as fast as the event loop runs."""
    logprob: float = Field(default=-1.0, le=0)
    """The logprob reported for every token."""
    max_concurrent_groups: int = Field(default=256, ge=1)
    """Groups generating at once; more wait in the engine's queue."""


class RegisterSection(Section):
    """Self-registration with a routing proxy (heartbeats); off unless `proxy` is set."""

    proxy: str = Field(default="")
    """HOST:PORT of the proxy to join; empty = do not register."""
    ttl_seconds: int = Field(default=15, ge=3)
    """The proxy forgets this replica this long after its last heartbeat."""
    advertise: str = Field(default="")
    """HOST:PORT the proxy dials to reach this replica; defaults to host:port."""
    token_file: str = Field(default="")
    """Bearer token with the `register` role (its own address only; admin works too) for a proxy that requires tokens."""
    tls_ca_file: str = Field(default="")
    """PEM roots of the proxy's certificate, for a proxy that listens with TLS."""


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
    adapter_window: int = Field(default=3, ge=1)
    """Newest versions of each adapter kept loaded."""
    stream_interval: int = Field(default=1, ge=1, le=4096)
    """New tokens of a sample gathered before they are sent (a sample's end is always sent at once); 1 streams
    every token as it is made. Larger values cut the per-message cost of gRPC, the proxy and the caller when the
    callers want whole groups (a learner), at the price of later first tokens."""
    limits: Limits = Field(default_factory=Limits)
    transformers: TransformersSection = Field(default_factory=TransformersSection)
    sglang: SGLangSection = Field(default_factory=SGLangSection)
    vllm: VLLMSection = Field(default_factory=VLLMSection)
    scripted: ScriptedSection = Field(default_factory=ScriptedSection)
    registration: RegisterSection = Field(default_factory=RegisterSection)
    relay: RelaySection = Field(default_factory=RelaySection)
