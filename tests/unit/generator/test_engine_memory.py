"""Memory as the replica's load, never its fault: the KV-token budget (configured, or derived
from free memory at start), admission by it, out-of-memory, and what counts as out-of-memory.

The transformers engine in-process on the tiny model. Out-of-memory is injected (a CPU has
no CUDA allocator to exhaust): the engine's forward raises torch.OutOfMemoryError, or the
RuntimeError torch's CPU allocator really raises (captured from a real failed allocation), at
the step a test chooses, part-way through the model for a decode step (as a real OOM leaves
its keys and values appended to the cache). Independent computations: the same seeded groups
run alone, without any injection; KV bytes per token by hand from published model shapes and
measured on the real cache; allocation failures provoked from torch itself. Real allocation
failures in a capped process: tests/integration/generator/test_engine_memory_real_oom.py.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.engines import collect

from rollwire.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from rollwire.generator.engines.embedded import kv_memory
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.embedded.transformers_groups import Group, oom_victim, out_of_memory
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.types import GroupRequest, SamplingParams, TokenDelta

module_loop = pytest.mark.asyncio(loop_scope="module")  # the async tests share the engine fixture's loop


def group(rid: str, n: int = 2, tokens: int = 12, seed: int = 1, prompt: tuple[int, ...] = (5, 17, 33)) -> GroupRequest:
    return GroupRequest(rid, list(prompt), n, SamplingParams(max_new_tokens=tokens, seed=seed, ignore_eos=True))


async def until(condition, timeout: float = 10.0) -> None:
    """Wait for `condition` (a gauge the engine's worker thread sets after its step)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def cpu_allocation_failure() -> RuntimeError:
    """What torch's CPU allocator really raises when an allocation fails (2**50 bytes: more than
    any address space here)."""
    try:
        torch.empty(1 << 48, dtype=torch.float32)
    except RuntimeError as exc:
        return exc
    raise AssertionError("a 1 PiB allocation succeeded")


async def started(engine, g: GroupRequest):
    """Start `g` and return once its first tokens came (it is admitted and decoding), with a
    task that collects the rest: tokens per sample."""
    stream = engine.generate(g)
    first = await anext(stream)
    tokens: dict[int, list[int]] = {}

    async def rest() -> dict[int, list[int]]:
        for events in [first, *[e async for e in stream]]:
            for ev in events:
                if isinstance(ev, TokenDelta):
                    tokens.setdefault(ev.sample_index, []).extend(ev.token_ids)
        return tokens

    return asyncio.create_task(rest())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64, max_batch_tokens=200, threads=1)
    await eng.start()
    yield eng
    await eng.close()


@module_loop
async def test_a_group_that_can_never_fit_is_refused_up_front_and_others_wait_for_room(engine):
    with pytest.raises(InvalidArgument, match="KV cache") as err:
        await collect(engine, group("huge", n=8, tokens=40))  # 8 x 43 > 200
    assert err.value.reason == "KV_BUDGET"
    # 4 groups of 2 x 15 = 30 tokens each fit 6 at a time: all complete, whatever waits.
    results = await asyncio.gather(*(collect(engine, group(f"g{i}", seed=i)) for i in range(8)))
    assert all(len(r["tokens"][i]) == 12 for r in results for i in range(2))


@module_loop
async def test_out_of_memory_among_equal_reservations_ends_only_the_oldest(engine, monkeypatch):
    alone = {seed: await collect(engine, group(f"alone{seed}", seed=seed, tokens=20)) for seed in (1, 2)}
    real_forward = engine._forward
    armed: dict[str, int | None] = {"decode_rows": None}

    def forward(adapters, **inputs):
        rows = len(adapters)
        if inputs["input_ids"].shape[1] == 1 and rows == armed["decode_rows"]:
            armed["decode_rows"] = None  # once
            # the step appends its keys and values to the cache, then memory runs out
            out = real_forward(adapters, **inputs)
            del out
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_forward(adapters, **inputs)

    monkeypatch.setattr(engine, "_forward", forward)
    armed["decode_rows"] = 4  # the first decode step that carries both groups' rows
    first = await started(engine, group("first", seed=1, tokens=20))  # admitted before the second, same size
    second = asyncio.create_task(collect(engine, group("second", seed=2, tokens=20)))
    with pytest.raises(ResourceExhausted) as err:
        await first
    assert err.value.reason == "ENGINE_OOM" and err.value.retry_after_s
    # The group admitted later went on as if nothing happened: the same tokens as alone.
    assert (await second)["tokens"] == alone[2]["tokens"]
    monkeypatch.setattr(engine, "_forward", real_forward)
    after = await collect(engine, group("after", seed=1, tokens=20))  # the engine is healthy
    assert after["tokens"] == alone[1]["tokens"]


@module_loop
async def test_out_of_memory_in_a_prefill_ends_the_newcomer_that_holds_the_most(engine, monkeypatch):
    real_forward = engine._forward

    def forward(adapters, **inputs):
        if inputs["input_ids"].shape[1] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_forward(adapters, **inputs)

    running = await started(engine, group("running", n=1, seed=3, tokens=30))  # 33 tokens reserved
    monkeypatch.setattr(engine, "_forward", forward)
    with pytest.raises(ResourceExhausted) as err:
        await collect(engine, group("doomed", n=2, seed=4, tokens=30))  # 66: the largest
    assert err.value.reason == "ENGINE_OOM" and "a prefill" in str(err.value)
    monkeypatch.setattr(engine, "_forward", real_forward)
    assert all(len(t) == 30 for t in (await running).values())


@module_loop
async def test_out_of_memory_in_a_prefill_ends_a_larger_running_group_and_the_newcomer_starts(engine, monkeypatch):
    """A small newcomer's prefill runs out of memory once while a larger group runs: the running
    group ends, the prefill is redone, and the newcomer gets exactly its tokens."""
    alone = (await collect(engine, group("alone", n=1, seed=8, tokens=12)))["tokens"]
    real_forward = engine._forward
    armed = {"prefills": 0}

    def forward(adapters, **inputs):
        if inputs["input_ids"].shape[1] > 1 and armed["prefills"] == 0:
            armed["prefills"] += 1
            raise cpu_allocation_failure()
        return real_forward(adapters, **inputs)

    running = await started(engine, group("large", n=2, seed=3, tokens=40))  # 86 tokens reserved
    monkeypatch.setattr(engine, "_forward", forward)
    newcomer = await collect(engine, group("small", n=1, seed=8, tokens=12))  # 15
    assert newcomer["tokens"] == alone and armed["prefills"] == 1
    with pytest.raises(ResourceExhausted) as err:
        await running
    assert err.value.reason == "ENGINE_OOM" and "largest KV reservation of the 2 groups" in str(err.value)


# -- the budget: derived from memory at start, or configured ------------------------------------


def test_kv_bytes_per_token_match_a_hand_computation_and_the_real_cache(reference_model):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    # The tiny model: 2 layers x (keys, values) x 4 KV heads x head dim 128 / 4 x float32.
    assert kv_memory.kv_bytes_per_token(reference_model.config, torch.float32) == 2 * 2 * 4 * 32 * 4 == 2048
    # Published shapes: Qwen2.5-0.5B (GQA, 2 KV heads of 896 / 14), Qwen3-0.6B (head_dim set
    # apart from hidden / heads), Llama-3-8B (8 KV heads of 128).
    qwen25 = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24)
    assert kv_memory.kv_bytes_per_token(qwen25, torch.float32) == 24 * 2 * 2 * 64 * 4 == 24576
    qwen3 = Qwen3Config(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=28
    )
    assert kv_memory.kv_bytes_per_token(qwen3, torch.bfloat16) == 28 * 2 * 8 * 128 * 2 == 114688
    llama3 = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32)
    assert kv_memory.kv_bytes_per_token(llama3, torch.bfloat16) == 32 * 2 * 8 * 128 * 2 == 131072
    # And the real cache: what a prefill of 37 tokens leaves in it, per token.
    with torch.inference_mode():
        out = reference_model(torch.arange(3, 40)[None], use_cache=True)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)
    assert held == 37 * kv_memory.kv_bytes_per_token(reference_model.config, torch.float32)


def test_cpu_memory_is_meminfo_or_the_cgroup_limits_remainder(tmp_path, monkeypatch):
    real = kv_memory.free_memory(torch.device("cpu"))
    meminfo_lines = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) * 1024 for line in meminfo_lines if line.startswith("MemTotal:"))
    assert 0 < real.free_bytes <= total
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(kv_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(kv_memory, "CGROUP_V1", (tmp_path / "absent", tmp_path / "absent"))
    monkeypatch.setattr(kv_memory, "CGROUP_V2", (limit, usage))
    assert kv_memory.free_memory(torch.device("cpu")) == kv_memory.Memory(20000000 * 1024, "/proc/meminfo MemAvailable")
    limit.write_text("max\n")  # cgroup v2's "no limit"
    usage.write_text("5000000000\n")
    assert kv_memory.free_memory(torch.device("cpu")).free_bytes == 20000000 * 1024
    limit.write_text("8589934592\n")  # an 8 GiB container, 5 GB used
    assert kv_memory.free_memory(torch.device("cpu")) == kv_memory.Memory(
        8589934592 - 5000000000, "cgroup memory.max - memory.current"
    )
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(FailedPrecondition, match="max_batch_tokens"):
        kv_memory.free_memory(torch.device("cpu"))
    with pytest.raises(FailedPrecondition, match="max_batch_tokens"):
        kv_memory.free_memory(torch.device("meta"))


@module_loop
async def test_the_budget_is_derived_from_free_memory_at_start_and_a_set_one_wins(
    tiny_model, reference_model, monkeypatch
):
    free = kv_memory.Memory(256 << 20, "a 256 MiB host")
    monkeypatch.setattr(kv_memory, "free_memory", lambda device: free)
    weights = sum(p.numel() * 4 for p in reference_model.parameters())  # float32, no buffers but rotary's
    weights += sum(b.numel() * b.element_size() for b in reference_model.buffers())
    # By hand: half of what the weights leave, less the prefix cache's 16384 tokens, per 2 KiB.
    expected = ((256 << 20) - weights) // 2 - 16384 * 2048
    metrics = GeneratorMetrics()
    derived = te.TransformersEngine(tiny_model, threads=1, metrics=metrics)
    await derived.start()
    try:
        assert derived.max_batch_tokens == expected // 2048
        assert derived.kv_budget is not None and derived.kv_budget.source == "a 256 MiB host"
        assert metrics.registry.get_sample_value("rollwire_generator_kv_budget_tokens") == expected // 2048
        # A group that can never fit is refused with the budget and how to raise it.
        too_big = group("too-big", n=64, tokens=1000)
        with pytest.raises(InvalidArgument) as err:
            derived.check(too_big)
        assert err.value.reason == "KV_BUDGET" and f"budget of {expected // 2048}" in str(err.value)
        assert "transformers.max_batch_tokens" in str(err.value) and "kv_memory_fraction" in str(err.value)
    finally:
        await derived.close()
    configured = te.TransformersEngine(tiny_model, max_batch_tokens=200, threads=1)
    await configured.start()
    try:
        assert configured.max_batch_tokens == 200 and configured.kv_budget
        assert configured.kv_budget.source == "config"
    finally:
        await configured.close()
    # Weights and the prefix cache leave nothing: the replica refuses to start, and says how to fix it.
    monkeypatch.setattr(kv_memory, "free_memory", lambda device: kv_memory.Memory(8 << 20, "a full host"))
    starved = te.TransformersEngine(tiny_model, threads=1)
    with pytest.raises(FailedPrecondition, match="kv_memory_fraction"):
        await starved.start()


@module_loop
async def test_the_real_derived_budget_admits_the_tiny_model_as_before(tiny_model):
    """On this host's real memory, the default admits what the old static 1 M budget did."""
    engine = te.TransformersEngine(tiny_model, threads=1)
    await engine.start()
    try:
        budget = engine.kv_budget
        assert budget is not None and budget.source.startswith(("/proc/meminfo", "cgroup"))
        room = int((budget.free_bytes - budget.weights_bytes) * 0.5) - 16384 * 2048
        assert engine.max_batch_tokens == room // 2048
        if budget.free_bytes < 6 << 30:
            pytest.skip(f"this host has {budget.free_bytes >> 20} MiB free; the check needs 6 GiB")
        assert engine.max_batch_tokens >= 1 << 20
        assert (await collect(engine, group("fits", n=4, tokens=8)))["done"].keys() == {0, 1, 2, 3}
    finally:
        await engine.close()


# -- a decode step out of memory: the largest reservation goes ----------------------------------


def test_the_oom_victim_is_the_largest_reservation_then_the_oldest():
    loop = asyncio.new_event_loop()
    try:

        def g(rid: str, n: int, tokens: int, admitted_at: int) -> Group:
            return Group(group(rid, n=n, tokens=tokens), loop, asyncio.Queue(), admitted_at=admitted_at)

        old_small, big, new_small = g("old", 1, 12, 1), g("big", 4, 200, 2), g("new", 1, 12, 3)
        assert oom_victim([old_small, big, new_small]) is big
        twin_old, twin_new = g("twin-old", 2, 50, 4), g("twin-new", 2, 50, 5)
        assert oom_victim([new_small, twin_new, twin_old]) is twin_old
    finally:
        loop.close()


@module_loop
async def test_a_decode_oom_ends_the_large_old_group_and_every_small_newcomer_finishes(tiny_model, monkeypatch):
    """Memory holds 6 rows: a large group of 4 admitted first, then 6 small groups of 1 row.
    When the decode step over all of them fails to allocate, the large one ends (ENGINE_OOM) and
    no small one is collateral: each finishes with the tokens it has alone."""
    metrics = GeneratorMetrics()
    engine = te.TransformersEngine(tiny_model, max_batch_rows=64, max_batch_tokens=4000, threads=1, metrics=metrics)
    await engine.start()
    reserved = lambda: metrics.registry.get_sample_value("rollwire_generator_kv_reserved_tokens")  # noqa: E731
    try:
        smalls = [group(f"small{s}", n=1, tokens=12, seed=s) for s in range(10, 16)]
        alone = [(await collect(engine, g))["tokens"] for g in smalls]
        allocation_failure = cpu_allocation_failure()
        real_forward = engine._forward
        failures = []

        def forward(adapters, **inputs):
            out = real_forward(adapters, **inputs)  # the step appends its keys and values, then memory runs out
            if inputs["input_ids"].shape[1] == 1 and len(adapters) > 6:
                failures.append(len(adapters))
                del out
                raise allocation_failure
            return out

        monkeypatch.setattr(engine, "_forward", forward)
        big = await started(engine, group("big", n=4, tokens=240, seed=1))  # 4 x 243 reserved, admitted first
        await until(lambda: reserved() == 4 * 243)
        results = await asyncio.gather(*(collect(engine, g) for g in smalls), return_exceptions=True)
        with pytest.raises(ResourceExhausted) as err:
            await big
        assert err.value.reason == "ENGINE_OOM" and "largest KV reservation" in str(err.value)
        collateral = [r for r in results if isinstance(r, BaseException)]
        assert collateral == []
        assert [r["tokens"] for r in results if not isinstance(r, BaseException)] == alone
        assert failures and all(rows > 6 for rows in failures)
        await until(lambda: reserved() == 0)
    finally:
        await engine.close()


@module_loop
async def test_an_allocation_failure_in_a_prefill_is_out_of_memory_not_a_replica_fault(engine, monkeypatch):
    real_forward = engine._forward
    allocation_failure = cpu_allocation_failure()

    def forward(adapters, **inputs):
        if inputs["input_ids"].shape[1] > 1:
            raise allocation_failure
        return real_forward(adapters, **inputs)

    monkeypatch.setattr(engine, "_forward", forward)
    with pytest.raises(ResourceExhausted) as err:
        await collect(engine, group("cpu-oom", seed=5))
    assert err.value.reason == "ENGINE_OOM"


@module_loop
@pytest.mark.parametrize("newcomer_tokens, ends", [(40, "newcomer"), (8, "running")])
async def test_memory_running_out_while_newcomers_join_ends_the_largest(engine, monkeypatch, newcomer_tokens, ends):
    """The running batch's cache grows layer by layer as a prefill's rows join it; when that
    fails part-way (after the first layer), the batch is put back, the larger of the two groups
    ends, and the other goes on with exactly its tokens."""
    from rollwire.generator.engines.embedded import kv_batch

    running_req, newcomer_req = group("running", seed=6, tokens=30), group("newcomer", seed=7, tokens=newcomer_tokens)
    alone = {
        "running": (await collect(engine, running_req))["tokens"],
        "newcomer": (await collect(engine, newcomer_req))["tokens"],
    }
    real_pad_left = kv_batch.pad_left
    calls = {"armed": False, "n": 0}
    allocation_failure = cpu_allocation_failure()

    def pad_left(t, width):
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] == 5:  # layer 0 joined (keys, values), layer 1's keys not yet
                calls["armed"] = False
                raise allocation_failure
        return real_pad_left(t, width)

    monkeypatch.setattr(kv_batch, "pad_left", pad_left)
    running = await started(engine, running_req)
    calls["armed"] = True
    newcomer = asyncio.create_task(collect(engine, newcomer_req))
    outcomes = {}
    for name, task in (("running", running), ("newcomer", newcomer)):
        try:
            result = await task
            outcomes[name] = result if name == "running" else result["tokens"]
        except ResourceExhausted as exc:
            assert exc.reason == "ENGINE_OOM" and "joining the batch" in str(exc)
            outcomes[name] = "ENGINE_OOM"
    assert calls["n"] == 5
    survivor = "running" if ends == "newcomer" else "newcomer"
    assert outcomes == {ends: "ENGINE_OOM", survivor: alone[survivor]}


# -- what counts as out of memory ---------------------------------------------------------------

# Messages torch raises on CUDA, which a CPU host cannot provoke: the caching allocator's, a CUDA
# call's own cudaErrorMemoryAllocation, and the CUDA libraries' allocation statuses (torch's
# c10/cuda and ATen/cuda check macros; the text of a real H100 OOM).
CUDA_ALLOCATION_FAILURES = [
    torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 3.94 GiB "
        "is free. Including non-PyTorch memory, this process has 75.24 GiB memory in use."
    ),
    RuntimeError(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"
    ),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
    OSError(errno.ENOMEM, "Cannot allocate memory"),
]
NOT_ALLOCATION_FAILURES = [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`"),
    RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx( handle, opa, opb, m, n, k)`"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"),
    RuntimeError("injected device error"),
    ValueError("out of memory"),  # only torch's RuntimeErrors are read by their text
    OSError(errno.EIO, "Input/output error"),
]


@pytest.mark.parametrize("exc", CUDA_ALLOCATION_FAILURES, ids=lambda e: type(e).__name__)
def test_cuda_and_library_allocation_failures_are_out_of_memory(exc):
    assert out_of_memory(exc)


@pytest.mark.parametrize("exc", NOT_ALLOCATION_FAILURES, ids=lambda e: str(e)[:40])
def test_other_errors_are_not_out_of_memory(exc):
    assert not out_of_memory(exc)


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(min_value=1 << 48, max_value=1 << 62),
    dtype=st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64]),
    make=st.sampled_from(["empty", "zeros", "ones", "full"]),
)
def test_real_cpu_allocation_failures_are_out_of_memory(size, dtype, make):
    numel = size // torch.empty(0, dtype=dtype).element_size()
    with pytest.raises(RuntimeError) as err:
        {"empty": torch.empty, "zeros": torch.zeros, "ones": torch.ones}.get(
            make, lambda n, dtype: torch.full((n,), 1, dtype=dtype)
        )(numel, dtype=dtype)
    assert type(err.value) is RuntimeError  # not torch.OutOfMemoryError: the text is all there is
    assert out_of_memory(err.value), str(err.value)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), cols=st.integers(1, 8), other=st.integers(1, 8), case=st.integers(0, 3))
def test_real_non_allocation_runtime_errors_stay_replica_faults(rows, cols, other, case):
    a = torch.ones(rows, cols)
    attempts = [
        lambda: a @ torch.ones(cols + other, 2),  # shapes that do not multiply
        lambda: torch.cat([a, torch.ones(rows + other, cols + other)], 1),  # sizes that do not concatenate
        lambda: a.view(rows * cols + other),  # a view of another size
        lambda: a.to(torch.long) @ a,  # dtypes that do not multiply
    ]
    with pytest.raises(RuntimeError) as err:
        attempts[case]()
    assert not out_of_memory(err.value), str(err.value)


def test_the_config_takes_auto_or_a_positive_count_and_a_bounded_fraction(tiny_model):
    from rollwire.generator.config import GeneratorConfig
    from rollwire.generator.engines import ENGINES
    from rollwire.runtime.config import ConfigError, load_config

    default = load_config(GeneratorConfig, None, [f"model={tiny_model}"])
    assert (default.transformers.max_batch_tokens, default.transformers.kv_memory_fraction) == ("auto", 0.5)
    engine = ENGINES.load("transformers")(default, GeneratorMetrics())
    assert (engine.configured_tokens, engine.kv_memory_fraction) == (None, 0.5)
    overrides = [f"model={tiny_model}", "transformers.max_batch_tokens=200", "transformers.kv_memory_fraction=0.8"]
    engine = ENGINES.load("transformers")(load_config(GeneratorConfig, None, overrides), GeneratorMetrics())
    assert (engine.configured_tokens, engine.kv_memory_fraction) == (200, 0.8)
    for bad in ["max_batch_tokens=0", "max_batch_tokens=lots", "kv_memory_fraction=0", "kv_memory_fraction=0.99"]:
        with pytest.raises(ConfigError, match=f"transformers.{bad.split('=')[0]}"):
            load_config(GeneratorConfig, None, [f"transformers.{bad}"])


@module_loop
async def test_the_engine_thread_lives_when_reporting_a_failed_step_runs_out_of_memory(engine, monkeypatch):
    """Before: memory ran out, then again while the failure's traceback was formatted, the
    engine thread died and every request waited forever. Now each group still gets a status
    (within a deadline) and the next request is served."""
    from rollwire.generator.engines.embedded import transformers_groups

    class Starved:
        def __getattr__(self, name):
            def log(*args, **kwargs):
                raise MemoryError

            return log

    real_forward = engine._forward

    def forward(adapters, **inputs):
        if inputs["input_ids"].shape[1] == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_forward(adapters, **inputs)

    monkeypatch.setattr(transformers_groups, "log", Starved())
    monkeypatch.setattr(engine, "_forward", forward)
    with pytest.raises(ResourceExhausted) as err:
        await asyncio.wait_for(collect(engine, group("starved", seed=9)), 30)
    assert err.value.reason == "ENGINE_OOM"
    monkeypatch.undo()
    after = await asyncio.wait_for(collect(engine, group("after-starved", seed=9, tokens=4)), 30)
    assert all(len(t) == 4 for t in after["tokens"].values())
