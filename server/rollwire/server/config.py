"""Typed configuration of a generator replica (`rollwire generator --config FILE`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollwire.common.config import Section
from rollwire.server.security import AuthSection, TlsSection

MiB = 1 << 20


class Limits(Section):
    """Sizes a replica accepts; requests beyond them are refused before any work."""

    max_n: int = Field(64, ge=1, description="Largest number of samples in one group.")
    max_new_tokens: int = Field(1024, ge=1, description="Largest max_new_tokens of a request.")
    max_prompt_tokens: int = Field(4096, ge=1, description="Longest prompt, in tokens.")
    max_adapter_bytes: int = Field(1024 * MiB, ge=1, description="Largest adapter payload accepted by PushAdapter.")
    max_queue: int = Field(256, ge=0, description="Groups that may wait for a batch slot; more get RESOURCE_EXHAUSTED.")
    max_stop_strings: int = Field(8, ge=0, description="Most stop strings per request.")


class TransformersSection(Section):
    """Settings of the embedded transformers+PEFT engine."""

    max_batch_rows: int = Field(64, ge=1, description="Sequences decoded together in one forward pass.")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 keeps torch's default.")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0.")


class GeneratorConfig(Section):
    """One generator replica: the model, where it listens, and its limits."""

    model: str = Field("", description="Local Hugging Face model folder (config.json + *.safetensors + tokenizer).")
    engine: Literal["transformers", "sglang"] = Field("transformers", description="Model backend.")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds; 0.0.0.0 to accept remote clients.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus /metrics port; 0 picks a free one.")
    replica_id: str = Field("", description="Name in logs and status; defaults to host:port.")
    adapter_window: int = Field(3, ge=1, description="Newest versions of each adapter kept loaded.")
    log_level: str = Field("info", description="debug, info, warning or error.")
    grace_seconds: float = Field(10.0, ge=0, description="On shutdown, how long in-flight requests may finish.")
    limits: Limits = Field(default_factory=Limits)
    transformers: TransformersSection = Field(default_factory=TransformersSection)
    auth: AuthSection = Field(default_factory=AuthSection)
    tls: TlsSection = Field(default_factory=TlsSection)
