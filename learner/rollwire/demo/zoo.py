"""A zoo of tiny random models of common Hugging Face architectures, built locally (no hub).

Each model is what a user would bring, shrunk: the architecture's own config class and model
class from transformers, random weights from a fixed seed, and one shared tokenizer: a
byte-level BPE trained here on a small corpus of 1- to 4-byte UTF-8 text (so characters split
across tokens, and tokens that end inside a character, are the rule, as with GPT-2, Llama 3
or Qwen tokenizers), with ChatML's special tokens and chat template.

What the zoo is for: the engine contract, the push, the door and the learner run over real
tokenization and over every layer type PEFT wraps (nn.Linear, GPT-2's Conv1D, fused qkv and
gate_up projections, MoE routers and experts, sliding-window attention), not only over the
character-level Llama of `tiny_model.py`.

Built twice with the same arguments, the files are byte-identical (seeded weights, a
deterministic BPE trainer over a fixed corpus).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML: each message as `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`, then the assistant's
opening when a generation prompt is asked for; the model stops at `<|im_end|>` (its EOS)."""

VOCAB_SIZE = 512
"""The 256 byte symbols, the specials and ~250 merges: small enough for tiny models, large
enough that common words and multi-byte characters are single tokens while rarer ones split."""

_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(intermediate_size=128),
    "qwen2": dict(intermediate_size=128),
    "qwen3": dict(intermediate_size=128, head_dim=32),
    "mistral": dict(intermediate_size=128, sliding_window=8),
    "gemma2": dict(intermediate_size=128, head_dim=32, sliding_window=8),
    "gemma3_text": dict(intermediate_size=128, head_dim=32, sliding_window=8),
    "phi3": dict(intermediate_size=128),
    "olmo2": dict(intermediate_size=128),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=2),
    "gpt_neox": dict(intermediate_size=128, num_key_value_heads=None),
    "qwen3_moe": dict(
        intermediate_size=128, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
}
"""model_type -> what its tiny config sets beside the shared shape (hidden 64, 2 layers, 2 heads of
32 dimensions, 1 KV head: grouped-query attention, and a head size vLLM's CPU attention takes,
which has no kernel for 16). Sliding windows of 8 tokens, so a prompt of a few words already
crosses them."""


WORDS = (
    "the of and to in is that for it as with was on be at by this had not are but from or have an they "
    "which one you were all we her she there would their will when who him been has more if no out so said "
    "café naïve résumé über straße jalapeño façade crème brûlée déjà vu coöperate "
    "αβγ δέλτα λόγος κόσμος привет мир спасибо да нет "
    "日本 東京 中文 你好 世界 学习 模型 数据 こんにちは ありがとう 한국어 안녕 "
    "€ → ∑ ∞ ≈ ✓ ★ ♥ 😀 😂 🚀 🎉 👍 🔥 🌍 🤖 🧠 👩‍💻"
)
"""The corpus's words: ASCII, accented Latin (2 bytes), Greek and Cyrillic (2), CJK and symbols
(3) and emoji (4 bytes, one joined by a zero-width joiner)."""


def corpus(seed: int = 0, lines: int = 400) -> list[str]:
    """Training text for the tokenizer: words of ASCII, accented Latin (2 bytes), Greek and
    Cyrillic (2), CJK and symbols (3) and emoji (4 bytes), in sentences."""
    rng = random.Random(seed)
    words = WORDS.split()
    weights = [8 if w.isascii() else 2 for w in words]
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choices(words, weights, k=rng.randint(3, 12)))
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ",", ":", ""]))
    return out


def build_tokenizer():
    """The zoo's byte-level BPE, trained on `corpus()`: no prefix space added, ChatML specials
    (`<|im_end|>` ends a turn and is EOS, `<|pad|>` pads on the left), no BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )


def new_model(arch: str, tokenizer, seed: int = 0):
    """A tiny random model of `arch` (a key of ARCHITECTURES) for `tokenizer`, in memory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; the zoo has {', '.join(ARCHITECTURES)}")
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    if arch == "gpt2":
        config = AutoConfig.for_model(arch, n_positions=512, **ids, **ARCHITECTURES[arch])
    else:
        shape = {**_SHAPE, "max_position_embeddings": 512, **ARCHITECTURES[arch]}
        config = AutoConfig.for_model(arch, **{k: v for k, v in shape.items() if v is not None}, **ids)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def build_model(arch: str, out_dir: str | Path, seed: int = 0, tokenizer=None) -> Path:
    """Write a tiny random `arch` model and the zoo's tokenizer to `out_dir`; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_tokenizer()
    new_model(arch, tokenizer, seed).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return out


def build_zoo(out_dir: str | Path, archs: list[str] | None = None, seed: int = 0) -> dict[str, Path]:
    """Every architecture (or `archs`) in `out_dir/<arch>`, one tokenizer trained for all."""
    tokenizer = build_tokenizer()
    return {a: build_model(a, Path(out_dir) / a, seed, tokenizer) for a in archs or list(ARCHITECTURES)}
