"""Each engine's settings, beside the engines: the generator config's [transformers] (with its
[transformers.prefix_cache]), [sglang], [vllm] and [scripted] sections.

GeneratorConfig (generator/config.py) holds one of each; an engine module reads only its own,
so this module imports nothing of the generator's and an engine never imports the config.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rollwire.runtime.config import Section


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
    max_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(default="auto")
    """KV-cache tokens the running groups may reserve together: a group reserves n x (prompt + max_new_tokens) while
    it runs, and waits for room beyond it; one that could never fit alone is refused up front (INVALID_ARGUMENT,
    KV_BUDGET). "auto" derives it once at start: (free memory before the weights - the weights) x kv_memory_fraction,
    less the prefix cache's max_tokens on CPU, divided by the bytes of one token's keys and values (2 x layers x
    kv_heads x head_dim x dtype bytes); free memory is CUDA's mem_get_info, or on CPU MemAvailable (or the cgroup
    limit's remainder when smaller). The replica logs it (engine_kv_budget, with its inputs) and exports it
    (rollwire_generator_kv_budget_tokens). A number you set wins."""
    kv_memory_fraction: float = Field(default=0.5, gt=0, le=0.95)
    """With max_batch_tokens "auto": the share of the memory left after the weights that the groups' KV reservations
    may take; the rest is headroom for activations, the per-layer copies a decode step makes of the cache, and the
    process. 0.5 suits a CPU host shared with other processes; on an accelerator the replica has to itself, 0.8."""
    threads: int = Field(default=0, ge=0)
    """torch CPU threads; 0 keeps torch's default."""
    device: str = Field(default="cpu")
    """torch device, e.g. cpu or cuda:0."""
    prefix_cache: PrefixCacheSection = Field(default_factory=PrefixCacheSection)
    """Reuse of prompt-prefix keys and values across requests ([transformers.prefix_cache])."""
    score_batch_tokens: int = Field(default=4096, ge=1)
    """Tokens one Score forward pass takes at most (its sequences x the longest, padding included; never more than the
    KV budget): a larger Score is split into several passes, with decode steps between them. A single sequence over
    the KV budget is refused (INVALID_ARGUMENT, KV_BUDGET)."""


class ServedSection(Section):
    """What every served engine's section has ([sglang], [vllm]): where its server listens, how
    adapters reach it, and how long rollwire waits on it. Each engine's section adds its own
    server's flags; engines/served/engine.py reads only these."""

    url: str = Field(default="")
    """Use the server at this URL (e.g. http://127.0.0.1:30000) instead of launching one; it must see adapter_dir
    (same host or shared volume). A vLLM must run with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1."""
    host: str = Field(default="127.0.0.1")
    """Address the launched server binds."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of the launched server; 0 picks a free one."""
    max_lora_rank: int = Field(default=64, ge=1)
    """Largest LoRA rank the server reserves memory for (its --max-lora-rank); pushes of a larger r are refused."""
    adapter_names: int = Field(default=1, ge=1)
    """Adapter names (training runs, tenants) the replica serves at once: the server's LoRA slots are sized for them,
    adapter_names x (adapter_window + 1), so their rows share its batches (issue 35). Beyond the slots the replica
    unloads a version no request holds (its bytes kept, loaded again when named), as the replica's tenant_slots
    decide (generator/eviction.py: names of no tenant first, then the loader's own tenant, then the least recently
    used)."""
    max_loaded_adapters: int = Field(default=0, ge=0)
    """Adapter versions the server holds at once (SGLang's --max-loaded-loras, vLLM's --max-loras and --max-cpu-loras);
    0 = adapter_names x (adapter_window + 1) (each name's window plus one for the swap, which an older kept version a
    request names also uses; when every slot serves a request such a request is refused as busy and retried
    elsewhere). The server reserves memory for each slot at max_lora_rank."""
    api_key_file: str = Field(default="")
    """File holding the server's API key (its --api-key: SGLang's generate endpoints; vLLM's every endpoint, passed to
    a launched vLLM as VLLM_API_KEY); empty = a server rollwire launches gets a random key of its own at each launch,
    which never leaves the replica (so no other local process can load adapters into it)."""
    adapter_dir: str = Field(default="")
    """Where pushed adapters are written for the server to load; empty = a fresh temporary folder."""
    adapter_dir_on_server: str = Field(default="")
    """adapter_dir as the server sees it, when it mounts it elsewhere; empty = the same path."""
    startup_timeout_s: float = Field(default=900.0, gt=0)
    """How long a launched server may take to become healthy."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for the next chunk of a generation or for an adapter call."""
    health_interval_s: float = Field(default=5.0, gt=0)
    """How often a server given by url is probed."""
    max_restarts: int = Field(default=5, ge=0)
    """Restarts of a crashed, launched server within restart_window_s before the replica gives up (marked failed)."""
    restart_window_s: float = Field(default=600.0, gt=0)
    """The window max_restarts counts restarts in: a server that crashes now and then is restarted for the replica's
    whole life; one that crashes max_restarts times within it is given up."""
    max_concurrent_groups: int = Field(default=256, ge=1)
    """Groups streamed from the server at once; more wait in rollwire's queue."""


class SGLangSection(ServedSection):
    """Settings of the sglang engine: an SGLang server this replica launches, or one at `url`.

    Secrets are read from files named here, never from the environment, and never logged.
    """

    launch_command: list[str] = Field(default_factory=list)
    """Command that starts SGLang; empty = [this python, -m, sglang.launch_server]. rollwire appends --model-path,
    --host, --port and the LoRA flags."""
    extra_args: list[str] = Field(default_factory=list)
    """More SGLang flags, e.g. ["--mem-fraction-static", "0.5"]."""
    lora_target_modules: list[str] = Field(default_factory=lambda: ["all"])
    """Modules SGLang prepares LoRA buffers for (--lora-target-modules)."""
    deterministic: bool = Field(default=False)
    """Start SGLang with --enable-deterministic-inference; required to honour request seeds."""
    random_seed: int | None = Field(default=None)
    """SGLang's --random-seed."""
    admin_api_key_file: str = Field(default="")
    """File holding SGLang's --admin-api-key (adapter load/unload and abort)."""


class VLLMSection(ServedSection):
    """Settings of the vllm engine: a vLLM OpenAI server this replica launches, or one at `url` (docs/engines.md).

    Secrets are read from files named here, never from the environment, and never logged.
    """

    launch_command: list[str] = Field(default_factory=list)
    """Command that starts vLLM's OpenAI server; empty = [this python, -m, vllm.entrypoints.openai.api_server]. vLLM
    needs its own environment, e.g. [".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]. rollwire
    appends --model, --host, --port, the LoRA flags and --logprobs-mode processed_logprobs."""
    extra_args: list[str] = Field(default_factory=list)
    """More vLLM flags, e.g. ["--gpu-memory-utilization", "0.8", "--tensor-parallel-size", "2"]."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for the launched server only, e.g. {"VLLM_CPU_KVCACHE_SPACE": "1"} on CPU; rollwire
    always sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1. Never put secrets here (use api_key_file)."""
    dtype: str = Field(default="auto")
    """vLLM's --dtype (auto, float32, bfloat16, float16)."""
    max_model_len: int = Field(default=0, ge=0)
    """vLLM's --max-model-len; 0 = the model's own limit."""
    max_logprobs: int = Field(default=64, ge=-1)
    """vLLM's --max-logprobs (-1: the vocabulary): the most top logprobs a request may ask for, which bounds
    return_kept_tokens: a top-k group needs top_k + 1, a top-p-only group the whole vocabulary. Give a server at
    `url` the value it was started with."""


class ScriptedSection(Section):
    """Settings of the scripted benchmark engine: tokens at a set rate, no model (engines/embedded/scripted.py)."""

    tokens_per_s: float = Field(default=100.0, ge=0)
    """Tokens per second per sample, all n samples of a group together; 0 = as fast as the event loop runs."""
    logprob: float = Field(default=-1.0, le=0)
    """The logprob reported for every token."""
    max_concurrent_groups: int = Field(default=256, ge=1)
    """Groups generating at once; more wait in the engine's queue."""


__all__ = [
    "PrefixCacheSection",
    "SGLangSection",
    "ScriptedSection",
    "ServedSection",
    "TransformersSection",
    "VLLMSection",
]
