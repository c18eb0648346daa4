"""The kept-token encoding (rollwire.common.kept): exact round trips, compact, and strict on
malformed input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollwire.common import kept


@given(st.sets(st.integers(0, 300_000), max_size=300))
def test_round_trip_is_exact(ids):
    assert kept.decode(kept.encode(ids)) == sorted(ids)


def test_empty_means_the_whole_vocabulary_and_top_k_is_compact():
    assert kept.encode([]) == b"" and kept.decode(b"") == []
    import random

    rng = random.Random(0)
    sizes = [len(kept.encode(rng.sample(range(151_936), 20))) for _ in range(200)]
    assert max(sizes) <= 60  # about 2 bytes per kept id over a Qwen-sized vocabulary


@pytest.mark.parametrize("data", [b"\x80", b"\xff" * 10 + b"\x01", b"\x05\x00"])
def test_malformed_sets_are_refused(data):
    with pytest.raises(ValueError):
        kept.decode(data)


def test_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError):
        kept.decode(kept.encode([3, 99]), vocab_size=50)
