"""Prefix-cache-aware routing: a prompt goes where its longest known prefix was served.

Callers that resend a whole conversation every turn (TRL's rollout worker, OpenAI-style agent
harnesses) send prompts that extend earlier ones; the replica that served the earlier prompt
holds its KV in its prefix cache (SGLang's radix cache, the transformers engine's prefix
cache). The routing key is the prompt cut into blocks of `block` tokens (`4 x block`
characters of a text prompt, which the proxy does not tokenize) and hashed as a chain, so the
i-th hash names the whole prefix up to block i. An approximate index maps each hash to the
replica that last served a prompt holding that prefix.

Invariants:
- the index holds at most `max_entries` hashes, least recently used forgotten first, and a
  prompt adds at most `max_blocks` of them: memory is bounded whatever the callers send;
- the longest prefix whose replica is a candidate wins, unless that replica runs more than
  `load_factor` x the average load and at least `min_gap` groups more than the least-loaded
  candidate (then the least-loaded one takes it, as the affinity policy spills);
- a prompt shorter than one block, or without a known prefix, goes to the least-loaded
  candidate; whatever is chosen is recorded for every block of the prompt;
- `outcome` names how the last choice was made ("hit", "miss", "overloaded") for the
  proxy's metrics; the policy stays pure otherwise (it sees only candidates and a key).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from rollwire.proxy.policies.base import Candidate

HASH_BYTES = 8
OUTCOMES = ("hit", "miss", "overloaded")


def prefix_key(group_key: str, text: str | None, token_ids: Sequence[int] | None, block: int, max_blocks: int) -> bytes:
    """The chained hashes of the prompt's whole blocks (HASH_BYTES each, at most max_blocks);
    a group_key is one block of its own, so groups sharing a key share a replica."""
    if group_key:
        return hashlib.blake2b(b"k:" + group_key.encode(), digest_size=HASH_BYTES).digest()
    if token_ids is not None:
        data, width, state = array("i", token_ids[: block * max_blocks]).tobytes(), 4 * block, b"t:"
    else:  # 4 characters a token, roughly; encoded after the cut, so the work is bounded
        data, width, state = (text or "")[: 4 * block * max_blocks].encode(), 4 * block, b"s:"
    out = bytearray()
    for end in range(width, len(data) + 1, width):
        state = hashlib.blake2b(state + data[end - width : end], digest_size=HASH_BYTES).digest()
        out += state
    return bytes(out)


class PrefixAware:
    name = "prefix"

    def __init__(
        self,
        block: int = 16,
        max_entries: int = 1 << 16,
        max_blocks: int = 512,
        load_factor: float = 1.25,
        min_gap: int = 4,
    ) -> None:
        if block < 1 or max_entries < 1 or max_blocks < 1 or load_factor < 1 or min_gap < 0:
            raise ValueError("block, max_entries and max_blocks must be >= 1, load_factor >= 1 and min_gap >= 0")
        self.block, self.max_entries, self.max_blocks = block, max_entries, max_blocks
        self.load_factor, self.min_gap = load_factor, min_gap
        self.index: OrderedDict[bytes, str] = OrderedDict()
        self.outcome = ""

    def key_for(self, group_key: str, text: str | None, token_ids: Sequence[int] | None) -> bytes:
        return prefix_key(group_key, text, token_ids, self.block, self.max_blocks)

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> Candidate:
        by_address = {c.address: c for c in candidates}
        hashes = [key[i : i + HASH_BYTES] for i in range(0, len(key) - HASH_BYTES + 1, HASH_BYTES)]
        owner = None
        for digest in reversed(hashes):
            address = self.index.get(digest)
            if address in by_address:
                owner = by_address[address]
                break
        least = min(candidates, key=lambda c: (c.in_flight, c.work, c.address))
        chosen, self.outcome = least, "miss"
        if owner is not None:
            total = sum(c.in_flight for c in candidates)
            bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
            if owner.in_flight + 1 <= bound or owner.in_flight - least.in_flight < self.min_gap:
                chosen, self.outcome = owner, "hit"
            else:
                self.outcome = "overloaded"
        self._record(hashes, chosen.address)
        return chosen

    def _record(self, hashes: list[bytes], address: str) -> None:
        index = self.index
        for digest in hashes:
            index[digest] = address
            index.move_to_end(digest)
        while len(index) > self.max_entries:
            index.popitem(last=False)
