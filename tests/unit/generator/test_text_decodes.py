"""Text that decodes (issue 49, item 3): a sample's streamed text, concatenated, is exactly
`tokenizer.decode(ids, skip_special_tokens=True)` (vLLM's rule), over the zoo's byte-level BPE
(rollwire.demo.zoo), where tokens end inside characters and specials come mid-stream.

Checked against the tokenizer's own decode, on generated ids (uniform over the vocabulary: bytes
that are no UTF-8, characters split across tokens, specials anywhere), on adversarial strings
(random 1- to 4-byte characters, emoji with joiners, specials between them) and across a resume
seam (a stream primed with the tokens another replica spelled). The engines over real models:
test_zoo_models.py.
"""

from __future__ import annotations

import random

import pytest

from rollwire.demo.zoo import SPECIALS, build_tokenizer
from rollwire.generator.detokenize import TextStream, backend

ALPHABETS = [
    "abcdefghijklmnopqrstuvwxyz ABC.,!?\n\t",  # 1 byte
    "éèàüöñçßøåæœαβγδλπσωжщыюя",  # 2 bytes
    "日本東京中文你好世界学习模型数据こんにちは한국어€→∑∞≈✓★♥",  # 3 bytes
    "😀😂🚀🎉👍🔥🌍🤖🧠𝄞𐍈",  # 4 bytes
]
JOINED = ["👩\u200d💻", "🏳\ufe0f\u200d🌈", "e\u0301", "👍🏽"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def streamed(tok, ids: list[int], rng: random.Random, keep: int = 0) -> str:
    """The deltas of a sample fed in random slices (engines feed 1 token, a server a chunk), and its finish."""
    stream, out, i = TextStream(backend(tok), keep), "", 0
    while i < len(ids):
        k = rng.randint(1, 4)
        out += stream.add(ids[i : i + k])
        i += k
        # what was sent is a function of the tokens so far, however they were fed
        assert out == tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd")
    return out + stream.finish()


def adversarial(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 20)):
        roll = rng.random()
        if roll < 0.1:
            parts.append(rng.choice(SPECIALS))
        elif roll < 0.2:
            parts.append(rng.choice(JOINED))
        else:
            parts.append("".join(rng.choices(rng.choice(ALPHABETS), k=rng.randint(1, 6))))
    return "".join(parts)


def test_generated_ids_stream_to_their_decode(tok):
    rng = random.Random(49)
    for _ in range(1500):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        assert streamed(tok, ids, rng) == tok.decode(ids, skip_special_tokens=True), ids


def test_adversarial_strings_stream_to_their_decode(tok):
    rng = random.Random(50)
    widths = set()
    for _ in range(1500):
        ids = tok(adversarial(rng), add_special_tokens=False).input_ids
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert streamed(tok, ids, rng, keep=8) == decoded, ids
        widths |= {len(c.encode()) for c in decoded}
    assert widths >= {1, 2, 3, 4}


def test_a_token_may_end_inside_a_character_and_the_character_comes_whole():
    tok = build_tokenizer()
    ids = tok("🧠", add_special_tokens=False).input_ids
    if len(ids) < 2:  # the corpus merged it: split it into its bytes
        ids = [tok.convert_tokens_to_ids(t) for t in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🧠")[0][0]]
    stream = TextStream(backend(tok))
    assert [stream.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)  # nothing half-spelled goes out
    assert stream.add(ids[-1]) == "🧠" and stream.finish() == ""


def test_a_sample_ending_inside_a_character_ends_with_the_decodes_replacement():
    tok = build_tokenizer()
    first_byte = tok.convert_tokens_to_ids(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("😀")[0][0][0])
    ids = [*tok("ok ", add_special_tokens=False).input_ids, first_byte]
    stream = TextStream(backend(tok))
    sent = "".join(stream.add(i) for i in ids)
    assert sent == "ok " and sent + stream.finish() == tok.decode(ids, skip_special_tokens=True) == "ok \ufffd"


def test_a_resumed_stream_goes_on_as_the_unsplit_one(tok):
    """A replica that continues a sample primes its stream with the tokens another one spelled;
    the text the first sent (before its failure, no finish) plus what the second sends is the decode."""
    rng = random.Random(51)
    for _ in range(500):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(2, 40))]
        cut = rng.randint(1, len(ids) - 1)
        first = TextStream(backend(tok))
        before = "".join(first.add(i) for i in ids[:cut])
        second = TextStream(backend(tok))
        second.add(ids[:cut])  # already sent, by the replica that spelled them
        after = "".join(second.add(i) for i in ids[cut:]) + second.finish()
        assert before + after == tok.decode(ids, skip_special_tokens=True)


def test_a_stop_string_is_found_where_a_delta_completes_it_not_only_at_its_end(tok):
    stream = TextStream(backend(tok), keep=64)
    delta = stream.add(tok("say hello world", add_special_tokens=False).input_ids)
    assert stream.found(("lo w",), delta) == "lo w"  # inside the delta
    assert stream.found(("xyz",), delta) is None
    assert (
        stream.found(("ld",), stream.add(tok(" more", add_special_tokens=False).input_ids)) is None
    )  # not completed now


def _trained(kind: str):
    """Tokenizers of the other common decoder families, trained here: SentencePiece-style
    (Metaspace: a leading space dropped at the text's start) with byte fallback, and WordPiece
    (continuation prefixes, cleanup of spaces before punctuation)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from rollwire.demo.zoo import corpus

    if kind == "metaspace":
        core = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Metaspace()
        core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "</s>", *bytes_], show_progress=False)
    else:
        core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        core.normalizer = normalizers.NFC()
        core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        core.decoder = decoders.WordPiece(cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "[SEP]"], show_progress=False)
    core.train_from_iterator(corpus(), trainer=trainer)
    return core


@pytest.mark.parametrize("kind", ["metaspace", "wordpiece"])
def test_other_decoder_families_stream_to_their_decode(kind):
    core = _trained(kind)
    rng = random.Random(52)
    for _ in range(800):
        ids = [rng.randrange(core.get_vocab_size()) for _ in range(rng.randint(1, 30))]
        stream, out, i = TextStream(core), "", 0
        while i < len(ids):
            k = rng.randint(1, 3)
            out += stream.add(ids[i : i + k])
            i += k
        assert out + stream.finish() == core.decode(ids, skip_special_tokens=True), ids
