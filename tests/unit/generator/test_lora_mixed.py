"""Rows of several LoRA adapters in one forward pass (issue 35, item 3): the engine's batched
apply (lora.py, `_Mixed`) against an independent computation, a separate PEFT model per
adapter, with adapters of different ranks, alphas and target modules, base rows among them,
skewed and balanced mixes, and after unloads renumber the slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from support.wire import Adapter, make_adapter, peft_reference

from rollwire.generator.engines.embedded.lora import LoraSet

ATTENTION = ("q_proj", "v_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_model) -> dict[str, Adapter]:
    """Three adapters that differ in everything the stacks must pad or scale."""
    return {
        "a": make_adapter(tiny_model, seed=51, r=4, lora_alpha=8, scale=0.2),
        "b": make_adapter(tiny_model, seed=52, r=16, lora_alpha=4, targets=ATTENTION, scale=0.2),
        "c": make_adapter(tiny_model, seed=53, r=8, lora_alpha=32, targets=MLP, scale=0.1),
        "d": make_adapter(tiny_model, seed=54, r=2, lora_alpha=2, targets=("o_proj", "k_proj"), scale=0.4),
    }


@pytest.fixture(scope="module")
def references(tiny_model, adapters) -> dict[str | None, torch.Tensor]:
    """Each adapter's own PEFT model (and the plain base model) over the same inputs: the
    log-probabilities every row must reproduce."""
    from transformers import AutoModelForCausalLM

    out: dict[str | None, torch.Tensor] = {}
    with torch.inference_mode():
        out[None] = torch.log_softmax(AutoModelForCausalLM.from_pretrained(tiny_model).eval()(IDS).logits, -1)
        for name, adapter in adapters.items():
            out[name] = torch.log_softmax(peft_reference(tiny_model, adapter)(IDS).logits, -1)
    return out


IDS = torch.randint(3, 60, (9, 11), generator=torch.Generator().manual_seed(5))
TOL = 1e-5
"""Largest difference allowed in any log-probability (every position, the whole vocabulary): the
mixed path's batched matmuls sum in another order than PEFT's F.linear (the one-adapter path is
bit for bit). Rounding grows with the LoRA deltas: these adapters' are about the size of the base
layers' outputs; with weights ~N(0, 0.5²) (deltas ~10x those outputs) the worst was 1.05e-5."""


def loaded(tiny_model, adapters, names) -> tuple[torch.nn.Module, LoraSet]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    lora = LoraSet(model)
    for name in names:
        lora.load(name, adapters[name].shape, adapters[name].state_dict)
    return model, lora


def run(model, lora: LoraSet, handles: Sequence[str | None]) -> torch.Tensor:
    with torch.inference_mode(), lora.routed(handles):
        return torch.log_softmax(model(IDS[: len(handles)]).logits, -1)


@pytest.mark.parametrize(
    "handles",
    [
        ["c", "a", None, "b", "a", "a", "c", None, "d"],  # skewed blocks (padded), base rows among them
        ["a", "b", "c", "d", "d", "c", "b", "a"],  # every loaded adapter, equal blocks (no padding, no slot pick)
        ["b", None, "b"],  # one adapter among base rows
        ["d", "c", "c", "c", "c", "c", "c", "c"],  # a block of 7 beside a block of 1
    ],
)
def test_each_row_equals_its_own_adapters_peft_model(tiny_model, adapters, references, handles):
    model, lora = loaded(tiny_model, adapters, ["a", "b", "c", "d"])
    mixed = run(model, lora, handles)
    for i, h in enumerate(handles):
        assert (mixed[i] - references[h][i]).abs().max() < TOL, (i, h)
    for name in set(handles) - {None}:  # and the adapters really differ from the base and each other
        assert (references[name] - references[None]).abs().max() > 1e-2


def test_base_rows_are_the_base_model_bit_for_bit(tiny_model, adapters):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    model, lora = loaded(tiny_model, adapters, ["a", "b", "c"])
    handles = [None, "a", None, "b", "c", None]
    with torch.inference_mode():
        expected = base(IDS[: len(handles)]).logits
        with lora.routed(handles):
            got = model(IDS[: len(handles)]).logits
    for i in (0, 2, 5):
        assert torch.equal(got[i], expected[i])


def test_slots_follow_loads_and_unloads(tiny_model, adapters, references):
    """Unloading renumbers the stacks' slots; every remaining adapter still serves its rows, and
    an unloaded (or unknown) handle's rows are base rows."""
    model, lora = loaded(tiny_model, adapters, ["a", "b", "c"])
    lora.unload("a")
    lora.load("d", adapters["d"].shape, adapters["d"].state_dict)
    handles = ["c", "a", "d", "b", "zz", "c"]
    mixed = run(model, lora, handles)
    expect = ["c", None, "d", "b", None, "c"]
    for i, h in enumerate(expect):
        assert (mixed[i] - references[h][i]).abs().max() < TOL, (i, handles[i])
    assert len(lora) == 3 and "a" not in lora


def test_a_non_finite_adapter_stays_in_its_own_rows(tiny_model, adapters, references):
    """Rows never mix: an adapter whose weights hold NaN (a diverged run) poisons only its rows."""
    bad = Adapter(b"", 4, 8.0, adapters["a"].targets, {k: v.clone() for k, v in adapters["a"].state_dict.items()})
    for k in bad.state_dict:
        if k.endswith("lora_B.weight"):
            bad.state_dict[k][0, 0] = float("nan")
    model, lora = loaded(tiny_model, adapters, ["b", "c"])
    lora.load("bad", bad.shape, bad.state_dict)
    handles = ["b", "bad", None, "c", "bad"]
    mixed = run(model, lora, handles)
    assert torch.isnan(mixed[1]).any() and torch.isnan(mixed[4]).any()
    for i, h in [(0, "b"), (2, None), (3, "c")]:
        assert torch.isfinite(mixed[i]).all()
        assert (mixed[i] - references[h][i]).abs().max() < TOL


def test_one_adapter_for_every_row_is_peft_bit_for_bit(tiny_model, adapters):
    """The one-adapter path runs PEFT's own operations in its order (a Score, a replica serving
    one run): the numbers of a PeftModel exactly, not merely within rounding."""
    model, lora = loaded(tiny_model, adapters, ["a", "c"])
    for name in ("a", "c"):
        with torch.inference_mode(), lora.routed([name] * len(IDS)):
            got = model(IDS).logits
        with torch.inference_mode():
            assert torch.equal(got, peft_reference(tiny_model, adapters[name])(IDS).logits), name
