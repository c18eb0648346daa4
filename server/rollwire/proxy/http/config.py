"""The `[http]` section of the proxy's config: the HTTP front door (docs/http.md)."""

from __future__ import annotations

from pydantic import Field

from rollwire.runtime.config import Section


class HttpSection(Section):
    """The vLLM/OpenAI-compatible HTTP front door; off unless `port` is set. It binds the proxy's `host`, takes the
    proxy's `[auth]` tokens as `Authorization: Bearer` (generate role for sampling, admin for adapters) and serves TLS
    with the proxy's `[tls]` certificate."""

    port: int = Field(default=-1, ge=-1, le=65535)
    """HTTP port; -1 = no HTTP door (the default), 0 = a free port (written to the ready file as http_port)."""
    model_path: str = Field(default="")
    """The base model's local folder: its tokenizer renders chat templates and names tokens in logprobs, its config
    gives max_model_len, and its path string is accepted as a `model` name (TRL sends it). Empty: text and token-id
    completions still work (the replicas tokenize); chat completions are refused with a sentence."""
    served_model_name: str = Field(default="")
    """The base model's id in /v1/models and responses; empty = the model folder's name (or "base" without one)."""
    adapter_root: str = Field(default="")
    """The only folder whose adapter folders /v1/load_lora_adapter may read by `lora_path` (symlinks resolved); empty =
    loading by path is refused (403) and adapters come by upload (POST /v1/upload_lora_adapter)."""
    max_model_len: int = Field(default=0, ge=0)
    """Longest prompt + completion reported in /v1/models; 0 = the smaller of the model's max_position_embeddings and
    the replicas' max_prompt_tokens + max_new_tokens."""
    dtype: str = Field(default="float32")
    """The weights' dtype /server_info reports when some replica runs an engine server whose dtype the proxy cannot
    see (sglang, vllm); transformers replicas always run float32."""
    max_lora_rank: int = Field(default=512, ge=1)
    """The largest LoRA rank /server_info reports (TRL checks its adapter against it): transformers replicas take any
    rank within spool.max_adapter_bytes; set it to the engine servers' own limit (--max-lora-rank) for sglang or vllm
    replicas."""
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    """Largest JSON request body; a larger one is refused (413) before it is read."""
    max_prompts: int = Field(default=16, ge=1)
    """Prompts one /v1/completions request may batch (each becomes one group)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one HTTP generation request (the proxy's routing.request_timeout_s still caps it)."""
