"""`payload_digests`: the same two digests as hashlib's sha256 and blake3's, on either side of the
size where the two run on two threads, for every buffer type a pusher hands it."""

from __future__ import annotations

import hashlib
import os

import pytest
from blake3 import blake3

from rollwire.common.digest import PARALLEL_BYTES, payload_digests


@pytest.mark.parametrize("size", [1, 4095, PARALLEL_BYTES - 1, PARALLEL_BYTES, PARALLEL_BYTES + 12_345])
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_the_digests_are_sha256_and_blake3_of_the_bytes(size: int, kind: type) -> None:
    data = os.urandom(size)
    assert payload_digests(kind(data)) == (hashlib.sha256(data).hexdigest(), blake3(data).hexdigest())


def test_a_payload_that_is_not_a_buffer_is_refused_on_the_callers_thread() -> None:
    with pytest.raises(TypeError):
        payload_digests("text" * PARALLEL_BYTES)  # pyright: ignore[reportArgumentType]
