"""The kept-token sets of truncated sampling, on the wire (TokenChunk.kept_tokens).

When top-k or top-p truncates the distribution a token was sampled from, a learner needs
that set to compute the token's logprob under the same truncated distribution (the ratio
pi/mu is biased otherwise). One set is encoded as its token ids ascending, as unsigned
LEB128 varints of the first id and then of each gap to the next: a top-k of 20 over a
150k vocabulary costs about 30-45 bytes, a tight top-p a few bytes; an empty encoding means
the whole vocabulary. Torch-free: the SDK and the learner decode, the generator encodes.
"""

from __future__ import annotations

from collections.abc import Iterable


def encode(ids: Iterable[int]) -> bytes:
    """The varint-gap encoding of a set of non-negative token ids."""
    out = bytearray()
    previous = 0
    for i, token in enumerate(sorted(set(ids))):
        if token < 0:
            raise ValueError(f"token id {token} is negative")
        value = token if i == 0 else token - previous
        previous = token
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def decode(data: bytes, vocab_size: int | None = None) -> list[int]:
    """The ascending ids of an encoded set; ValueError for a truncated varint or an id not
    below `vocab_size`."""
    ids: list[int] = []
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte & 0x80:
            if shift > 63:
                raise ValueError("a kept-token varint is longer than 9 bytes")
            continue
        ids.append(value if not ids else ids[-1] + value)
        if len(ids) > 1 and value == 0:
            raise ValueError("a kept-token set repeats an id")
        value = shift = 0
    if shift:
        raise ValueError("the kept-token set ends inside a varint")
    if vocab_size is not None and ids and ids[-1] >= vocab_size:
        raise ValueError(f"kept token id {ids[-1]} is not below the vocabulary size {vocab_size}")
    return ids
