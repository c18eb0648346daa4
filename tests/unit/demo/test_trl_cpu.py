"""The CPU stand-ins for TRL's GPU-only parts (rollwire.demo.trl_cpu), checked in isolation.

The attention kernel is checked against plain causal attention on unpacked sequences, and
through TRL's own tree packing: a row of samples sharing prefixes, forwarded once with
`tree_fa3`, gives every sample the logits an ordinary forward pass of that sample alone gives.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl.experimental.async_grpo")

from rollwire.demo import trl_cpu  # noqa: E402  (after the skips: needs the trl extra)
from rollwire.demo.trl_cpu import flash_attn_varlen_func  # noqa: E402


def reference(q, k, v, causal=True):
    """torch's own attention, one unpacked sequence: (L, H, D) each, K/V already repeated."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal
    )
    return out.transpose(0, 1)


def packed(lengths, heads, dim, generator):
    return torch.randn(sum(lengths), heads, dim, generator=generator), _offsets(lengths)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_segments_equal_causal_attention_on_each_sequence(kv_heads):
    g = torch.Generator().manual_seed(0)
    lengths, heads, dim = [5, 1, 9, 3], 4, 8
    q, cu = packed(lengths, heads, dim, g)
    k, _ = packed(lengths, kv_heads, dim, g)
    v, _ = packed(lengths, kv_heads, dim, g)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    assert out.shape == q.shape
    repeat = heads // kv_heads
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = reference(q[a:b], k[a:b].repeat_interleave(repeat, 1), v[a:b].repeat_interleave(repeat, 1))
        torch.testing.assert_close(out[a:b], want, rtol=1e-5, atol=1e-6)


def test_a_short_segment_is_aligned_with_the_end_of_its_keys():
    """FA's causal rule when a segment has fewer queries than keys (a tree segment under its
    shared prefix): the queries are the LAST rows of causal attention over all the keys."""
    g = torch.Generator().manual_seed(1)
    lk, lq, heads, dim = 7, 3, 2, 4
    q_full = torch.randn(lk, heads, dim, generator=g)
    k = torch.randn(lk, heads, dim, generator=g)
    v = torch.randn(lk, heads, dim, generator=g)
    out = flash_attn_varlen_func(q_full[lk - lq :], k, v, _offsets([lq]), _offsets([lk]), lq, lk, causal=True)
    torch.testing.assert_close(out, reference(q_full, k, v)[lk - lq :], rtol=1e-5, atol=1e-6)


def test_without_causal_every_key_of_the_segment_is_seen_and_none_of_the_next():
    g = torch.Generator().manual_seed(2)
    lengths = [4, 6]
    q, cu = packed(lengths, 2, 4, g)
    k, _ = packed(lengths, 2, 4, g)
    v, _ = packed(lengths, 2, 4, g)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=False)
    torch.testing.assert_close(out[4:], reference(q[4:], k[4:], v[4:], causal=False), rtol=1e-5, atol=1e-6)


def test_sliding_window_and_softcap():
    g = torch.Generator().manual_seed(3)
    length, heads, dim, window, cap = 8, 2, 4, 3, 5.0
    q, cu = packed([length], heads, dim, g)
    k, _ = packed([length], heads, dim, g)
    v, _ = packed([length], heads, dim, g)
    out = flash_attn_varlen_func(q, k, v, cu, cu, length, length, causal=True, window_size=(window - 1, 0), softcap=cap)
    scores = cap * torch.tanh(torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5 / cap)
    i, j = torch.arange(length).unsqueeze(1), torch.arange(length).unsqueeze(0)
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_gradients_flow_and_a_query_that_sees_nothing_gets_zeros():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 4, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 4, generator=g, requires_grad=True)
    # 3 queries against 2 keys, bottom-right: query 0 sits before the first key and sees none.
    out = flash_attn_varlen_func(q, k, v, _offsets([3]), _offsets([2]), 3, 2, causal=True)
    assert torch.equal(out[0], torch.zeros(2, 4))
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_unsupported_arguments_are_refused_by_name():
    x = torch.zeros(1, 1, 4)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(x, x, x, _offsets([1]), _offsets([1]), 1, 1, dropout_p=0.1)


def test_trl_tree_packing_with_the_stand_in_equals_unpacked_forward_passes():
    """TRL's TreeRow folds samples with shared prefixes into one row; its `tree_fa3` attention
    with our kernel must give each sample what a plain forward of that sample alone gives."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention

    trl_cpu.install()
    register_tree_attention()
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    eager = LlamaForCausalLM(config).eval()
    eager.set_attn_implementation("eager")
    tree = LlamaForCausalLM(config.__class__(**config.to_dict())).eval()  # its own config: the attention is set on it
    tree.load_state_dict(eager.state_dict())
    tree.set_attn_implementation(TREE_ATTENTION)

    sequences = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [1, 2, 7], [8, 8, 8, 8]]  # shared prefixes and a stranger
    row = TreeRow()
    for group, ids in enumerate(sequences):
        row.add(
            {
                "input_ids": torch.tensor(ids),
                "completion_mask": torch.tensor([0] + [1] * (len(ids) - 1)),
                "old_log_probs": torch.zeros(len(ids)),
                "advantage": 0.0,
                "group_id": group // 3,
            }
        )
    p = row.pack()
    assert len(p["input_ids"]) < sum(map(len, sequences))  # the prefixes really are shared
    with torch.no_grad():
        logits = tree(
            input_ids=p["input_ids"].unsqueeze(0),
            position_ids=p["position_ids"].unsqueeze(0),
            tree_kv_index=p["tree_kv_index"],
            tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(p["tree_max_seqlens"][1]),
        ).logits[0]
        # token_index: for every trained token (positions 1.. of each sample, in order), the packed
        # position whose prediction scores it: the logits at positions 0..L-2 of each sample.
        want = torch.cat([eager(input_ids=torch.tensor([ids])).logits[0, :-1] for ids in sequences])
    torch.testing.assert_close(logits[p["token_index"]], want, rtol=1e-4, atol=1e-5)


def test_install_replaces_exactly_the_three_gpu_only_parts():
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    if not trl_cpu.needed():
        pytest.skip("CUDA is present: the stand-ins are not installed")
    assert trl_cpu.install() and trl_cpu.install()  # idempotent
    assert async_rollout_worker.is_vllm_available() is True  # pyright: ignore[reportPrivateImportUsage]
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert async_grpo_trainer.get_peak_flops_per_device(cpu, "float32") is None  # pyright: ignore
    assert packing._flash_attn().flash_attn_varlen_func is flash_attn_varlen_func
