"""Real LoRA adapters for the tiny model, raw-stub calls over the wire, and reading a
Generate stream while checking the protocol."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from rollwire.common.lora import LoraShape
from rollwire.v1 import admin_pb2, admin_pb2_grpc, generator_pb2_grpc, learner_pb2
from rollwire.v1 import generator_pb2 as pb

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

    @property
    def shape(self) -> LoraShape:
        return LoraShape(self.r, self.lora_alpha, self.targets)

    def manifest(self, name: str, version: int, fingerprint: str, **changes) -> pb.AdapterManifest:
        fields = dict(
            name=name,
            version=version,
            base_model_fingerprint=fingerprint,
            lora_config=self.shape.to_pb(),
            byte_length=len(self.payload),
            sha256=self.sha256,
        )
        fields.update(changes)
        return pb.AdapterManifest(**fields)


def make_adapter(
    model_dir, seed: int, r: int = 8, targets=TARGETS, scale: float = 0.5, lora_alpha: int | None = None
) -> Adapter:
    """Random, clearly non-zero LoRA weights (PEFT zero-inits B, which would change nothing);
    lora_alpha defaults to 2r."""
    alpha = 2 * r if lora_alpha is None else lora_alpha
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return Adapter(save(state), r, float(alpha), tuple(targets), state)


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


def manifest_for(payload: bytes, name: str = "pol", version: int = 1, r: int = 2, **changes) -> pb.AdapterManifest:
    """A manifest that matches `payload` (length, sha256) for base model "fp" and a rank-`r`
    LoRA on q_proj; `changes` override any field (to build a bad one)."""
    fields = dict(
        name=name,
        version=version,
        base_model_fingerprint="fp",
        lora_config=pb.LoraConfig(r=r, lora_alpha=2.0 * r, target_modules=["q_proj"]),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    fields.update(changes)
    return pb.AdapterManifest(**fields)


async def streamed(messages):
    """`messages` as the async iterator a servicer's request stream is."""
    for m in messages:
        yield m


def push_messages(manifest: pb.AdapterManifest, payload: bytes, chunk: int = 1 << 20):
    yield pb.PushAdapterRequest(manifest=manifest)
    for i in range(0, len(payload), chunk):
        yield pb.PushAdapterRequest(chunk=payload[i : i + chunk])


def stub(target: str) -> generator_pb2_grpc.GeneratorServiceStub:
    return generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(target))


def push(target: str, manifest: pb.AdapterManifest, payload: bytes, chunk: int = 1 << 20) -> pb.PushAdapterResponse:
    return stub(target).PushAdapter(push_messages(manifest, payload, chunk), timeout=60)


def bulk_push(target: str, manifest: pb.AdapterManifest, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """A push whose bytes go over the receiver's bulk endpoint, its connection made by hand (so a
    receiver that refuses mid-way closes that connection: no fallback to chunks can follow):
    its (code, reason)."""
    import threading

    from rollwire.common.bulk import close, connect, parse_offer, token
    from rollwire.common.errors import from_rpc_error
    from rollwire.common.writer import opening

    release = threading.Event()

    def requests():
        yield opening(manifest, bulk=True)
        release.wait(60)

    with grpc.insecure_channel(target) as channel:
        call = generator_pb2_grpc.GeneratorServiceStub(channel).PushAdapter.future(requests(), timeout=60)
        offer = parse_offer(call.initial_metadata())
        assert offer is not None, "the receiver offered no bulk endpoint"
        sock = connect("127.0.0.1", offer, token(offer.secret, manifest, None), 3.0)  # ACKed: it took it
        try:
            sock.sendall(payload)
            close(sock)  # returns once the receiver has every byte
        except OSError:
            sock.close()  # the receiver refused the bytes and closed the connection
        release.set()
        try:
            call.result()
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            return err.code, err.reason
    return grpc.StatusCode.OK, ""


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


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: \S+)?$")
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"'
_LABELS = re.compile(rf"(?:{_LABEL}\s*,?\s*)*")
_ABSENT = object()


def _labels(written: str) -> frozenset[tuple[str, str]]:
    written = written.strip()
    assert _LABELS.fullmatch(written), f'labels must read name="value",...: {written!r}'
    return frozenset(re.findall(_LABEL, written))


def metric_value(text: str, name: str, labels: str = "", *, default: float | object = _ABSENT) -> float:
    """The value of one series of a Prometheus text exposition.

    `labels` ('code="OK",replica="..."', or written in `name` as `name{...}`) match as a set,
    in whatever order they are written (prometheus_client writes them sorted). A series that
    does not exist fails, naming the series the family has, so a misspelt name or label can
    never read as a zero; pass `default=` only where absence is a legitimate value (a
    labelled counter prometheus_client has not created because nothing incremented it yet).
    """
    if "{" in name:
        assert not labels, f"labels given twice: {name} and {labels}"
        name, _, labels = name.partition("{")
        labels = labels.removesuffix("}")
    want = _labels(labels)
    family = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        if _labels(m.group(2) or "") == want:
            return float(m.group(3))
        family.append(line)
    if default is not _ABSENT:
        return default  # type: ignore[return-value]
    if family:
        seen = "\n  ".join(family)
        raise AssertionError(f"no series {name}{{{labels}}}; the family has:\n  {seen}")
    prefix = "_".join(name.split("_")[:2]) + "_"
    names = sorted({m.group(1) for m in map(_SAMPLE.match, text.splitlines()) if m and m.group(1).startswith(prefix)})
    raise AssertionError(f"no series named {name}; names starting {prefix}: {', '.join(names) or 'none'}")


# -- Generate streams through a proxy ----------------------------------------------------------
def status(target: str) -> pb.GetStatusResponse:
    with grpc.insecure_channel(target) as ch:
        return generator_pb2_grpc.GeneratorServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)


def admin(target: str) -> admin_pb2_grpc.AdminServiceStub:
    return admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(target))


def request(
    prompt: str, n: int = 2, max_new_tokens: int = 8, adapter: str = "", request_id: str = "", **params
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, **params)
    req = pb.GenerateRequest(text=prompt, n=n, request_id=request_id, sampling=sampling)
    if adapter:
        req.adapter.name = adapter
    return req


@dataclass
class GroupResult:
    """One complete group as the client keeps it, and what happened on the way."""

    request_id: str
    replica: str
    version: int
    tokens: dict[int, list[int]]
    restarts: int
    attempts_started: list[str] = field(default_factory=list)
    sent_at: float = 0.0
    seconds: float = 0.0


def run_group(
    stub: generator_pb2_grpc.GeneratorServiceStub,
    req: pb.GenerateRequest,
    timeout: float = 30,
    on_event: Callable[[pb.GenerateResponse], None] | None = None,
    metadata=(),
) -> GroupResult:
    """Read one Generate stream, asserting the protocol: `started` first and again after
    every `restarted` (which discards what came before); each sample finished exactly once."""
    sent_at = time.monotonic()
    started, restarts, starts = None, 0, []
    tokens: dict[int, list[int]] = {}
    finished: dict[int, pb.SampleFinished] = {}
    versions: set[int] = set()
    for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
        if on_event:
            on_event(msg)
        if msg.HasField("restarted"):
            assert not (msg.HasField("started") or msg.tokens or msg.finished), "`restarted` must come alone"
            restarts += 1
            started, tokens, finished, versions = None, {}, {}, set()
            continue
        if msg.HasField("started"):
            assert started is None, "a second `started` without `restarted` before it"
            started = msg.started
            starts.append(started.replica)
        assert started is not None, "tokens or finishes before `started`"
        for t in msg.tokens:
            assert t.sample_index not in finished, "tokens after the sample finished"
            tokens.setdefault(t.sample_index, []).extend(t.token_ids)
            versions.add(t.adapter_version)
        for f in msg.finished:
            assert f.sample_index not in finished, "a sample finished twice"
            finished[f.sample_index] = f
    assert started is not None and sorted(finished) == list(range(req.n)), (
        "the stream ended before every sample finished"
    )
    for i, f in finished.items():
        assert len(tokens.get(i, [])) == f.completion_tokens
    assert versions <= {started.adapter.version}, "tokens from another adapter version than `started` announced"
    return GroupResult(
        started.request_id,
        started.replica,
        started.adapter.version,
        tokens,
        restarts,
        starts,
        sent_at,
        time.monotonic() - sent_at,
    )


def all_methods():
    """Every RPC of every rollwire.v1 service, read from the compiled protos."""
    for module in (pb, admin_pb2, learner_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield f"/{service.full_name}/{method.name}", method
