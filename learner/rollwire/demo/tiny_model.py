"""A tiny Hugging Face Llama with its own character-level tokenizer, built locally.

No hub: the vocabulary is the printable ASCII characters plus newline and four specials,
weights come from a fixed seed, and the folder is what `AutoModelForCausalLM` and
`AutoTokenizer` load. Built twice with the same arguments, the files are byte-identical, so
the base-model fingerprint is stable across machines with the same torch.

The tokenizer carries a chat template that renders a conversation as the bare text of its
messages, so a one-message chat is exactly the task's raw prompt, and chat clients (TRL,
OpenAI-style `/v1/chat/completions`) see the model as it was taught. The fingerprint covers
config.json and the weights only, so the template leaves it unchanged.
"""

from __future__ import annotations

import string
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable + "\n"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)
"""Each message's content, back to back, with EOS after an assistant turn (where the model stops);
no role markers and no generation prompt: one user message renders as exactly its text, the
prompt the built-in task teaches (`"07+45="`)."""
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"\Z",
    "fields": {"content": {"close_pattern": r"</s>\s*|$", "content": "text"}},
}
"""How transformers' `parse_response` reads a completion back into an assistant message: the
reply starts where the rendered prompt ends and is plain text up to EOS (TRL's rollout worker
refuses a chat template it cannot parse replies of)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model, in LlamaConfig's words, and the seed of its initial weights;
    the defaults train in seconds on a laptop CPU."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    seed: int = 0


def build_tokenizer():
    """A char-level fast tokenizer: one token per character, left padding, no BOS added, with
    CHAT_TEMPLATE and RESPONSE_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        response_template=RESPONSE_TEMPLATE,
    )


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write an untrained tiny Llama and its tokenizer to `out_dir`; returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = new_tiny_model(spec)
    save_model(model.eval(), tokenizer, out)
    return out


def new_tiny_model(spec: TinyModelSpec = TinyModelSpec()):
    """An untrained tiny Llama (initialised from `spec.seed`) and its tokenizer, in memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    shape = {key: value for key, value in asdict(spec).items() if key != "seed"}
    config = LlamaConfig(
        **shape,
        vocab_size=len(tokenizer),
        num_key_value_heads=spec.num_attention_heads,
        pad_token_id=tokenizer.pad_token_id,  # pyright: ignore[reportArgumentType]  # ints: the tokenizer defines them
        bos_token_id=tokenizer.bos_token_id,  # pyright: ignore[reportArgumentType]  # ints: the tokenizer defines them
        eos_token_id=tokenizer.eos_token_id,  # pyright: ignore[reportArgumentType]  # ints: the tokenizer defines them
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config), tokenizer


def save_model(model, tokenizer, out: Path) -> None:
    """Save weights (safetensors) and tokenizer in the standard HF layout."""
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)


def save_tokenizer(tokenizer, out: Path) -> None:
    """The tokenizer's files, its chat template inside tokenizer_config.json (not a
    chat_template.jinja beside it, which transformers would prefer to any template a user later
    writes into tokenizer_config.json)."""
    tokenizer.save_pretrained(out, save_jinja_files=False)
