"""Test helpers: real LoRA adapters for the tiny model and raw-stub calls over the wire."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grpc

from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Adapter:
    """A LoRA adapter as a learner would push it: PEFT state dict in safetensors bytes."""

    payload: bytes
    r: int
    lora_alpha: float
    targets: tuple[str, ...]
    state_dict: dict

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    def manifest(self, name: str, version: int, fingerprint: str, **changes) -> pb.AdapterManifest:
        fields = dict(
            name=name,
            version=version,
            base_model_fingerprint=fingerprint,
            lora_config=pb.LoraConfig(r=self.r, lora_alpha=self.lora_alpha, target_modules=list(self.targets)),
            byte_length=len(self.payload),
            sha256=self.sha256,
        )
        fields.update(changes)
        return pb.AdapterManifest(**fields)


def make_adapter(model_dir, seed: int, r: int = 8, targets=TARGETS, scale: float = 0.5) -> Adapter:
    """Random, clearly non-zero LoRA weights (PEFT zero-inits B, which would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return Adapter(save(state), r, 2.0 * r, tuple(targets), state)


def peft_reference(model_dir, adapter: Adapter):
    """A local PeftModel carrying `adapter`: what the replica must reproduce."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(
        base, LoraConfig(r=adapter.r, lora_alpha=adapter.lora_alpha, target_modules=list(adapter.targets))
    )
    set_peft_model_state_dict(model, adapter.state_dict)
    return model.eval()


def push_messages(manifest: pb.AdapterManifest, payload: bytes, chunk: int = 1 << 20):
    yield pb.PushAdapterRequest(manifest=manifest)
    for i in range(0, len(payload), chunk):
        yield pb.PushAdapterRequest(chunk=payload[i : i + chunk])


def stub(target: str) -> generator_pb2_grpc.GeneratorServiceStub:
    return generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(target))


def push(target: str, manifest: pb.AdapterManifest, payload: bytes, chunk: int = 1 << 20) -> pb.PushAdapterResponse:
    return stub(target).PushAdapter(push_messages(manifest, payload, chunk), timeout=60)


@dataclass
class Group:
    """A whole Generate stream, assembled per sample."""

    started: pb.GenerationStarted
    tokens: dict[int, list[int]]
    logprobs: dict[int, list[float]]
    versions: dict[int, set[int]]
    text: dict[int, str]
    finished: dict[int, pb.SampleFinished]


def generate(
    target: str, prompt, n: int = 1, adapter: tuple[str, int] | None = None, timeout: float = 60, **sampling
) -> Group:
    req = pb.GenerateRequest(n=n, sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    if adapter:
        req.adapter.name, req.adapter.version = adapter
    g = Group(None, {}, {}, {}, {}, {})
    for msg in stub(target).Generate(req, timeout=timeout):
        if msg.HasField("started"):
            g.started = msg.started
        for t in msg.tokens:
            g.tokens.setdefault(t.sample_index, []).extend(t.token_ids)
            g.logprobs.setdefault(t.sample_index, []).extend(t.logprobs)
            g.versions.setdefault(t.sample_index, set()).add(t.adapter_version)
            g.text[t.sample_index] = g.text.get(t.sample_index, "") + t.text
        for f in msg.finished:
            g.finished[f.sample_index] = f
    return g


def fingerprint(target: str) -> str:
    return stub(target).GetStatus(pb.GetStatusRequest(), timeout=10).model_fingerprint


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample line of a Prometheus text exposition (0 when absent)."""
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0
