"""The exact finiteness scan (rollwire.common.finite, issue 36) against np.isfinite, over every
special bit pattern: all 65,536 patterns of the 16-bit formats, and for F32/F64 every NaN
payload hypothesis draws, +-inf, the largest finite values, subnormals and -0, alone and
hidden among finite values. BF16's reference is np.isfinite of the same bits widened to F32
(a BF16 value is the top half of an F32)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.common.finite import FLOAT_DTYPES, all_finite
from rollwire.common.safetensors_header import StreamingFinite, TensorEntry, nonfinite_tensor

BITS = {"BF16": 16, "F16": 16, "F32": 32, "F64": 64}
UNSIGNED = {16: np.uint16, 32: np.uint32, 64: np.uint64}


def reference(patterns: np.ndarray, dtype: str) -> np.ndarray:
    """np.isfinite of each bit pattern read as `dtype`, elementwise (the independent computation)."""
    if dtype == "BF16":
        return np.isfinite((patterns.astype(np.uint32) << 16).view(np.float32))
    return np.isfinite(patterns.view({"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]))


def raw(patterns: np.ndarray) -> bytes:
    return patterns.astype(patterns.dtype.newbyteorder("<")).tobytes()


assert sys.byteorder == "little"  # the views below are the little-endian bytes safetensors holds


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_every_16_bit_pattern_alone_and_beside_finite_values(dtype):
    patterns = np.arange(1 << 16, dtype=np.uint16)
    finite = reference(patterns, dtype)
    assert (~finite).sum() == (2 * (1 << 7) if dtype == "BF16" else 2 * (1 << 10))  # every NaN payload, +-inf
    one = np.float32(1.0).view(np.uint32) >> 16 if dtype == "BF16" else np.float16(1.0).view(np.uint16)
    ones = np.full(1000, one, dtype=np.uint16)
    alone = memoryview(patterns.tobytes())
    for p in range(1 << 16):
        ones[437] = p  # a single value among many finite ones
        got = (all_finite(alone[2 * p : 2 * p + 2], dtype), all_finite(ones.data.cast("B"), dtype))
        assert got == (finite[p], finite[p]), hex(p)


def special_patterns(bits: int) -> st.SearchStrategy[int]:
    """Bit patterns with an all-ones exponent (NaNs of every payload, +-inf), their finite
    neighbours (largest finite), subnormals, +-0 and arbitrary ones, of either sign."""
    exp_bits = {16: 5, 32: 8, 64: 11}[bits]
    mant = bits - 1 - exp_bits
    sign = st.sampled_from([0, 1 << (bits - 1)])
    all_ones = ((1 << exp_bits) - 1) << mant
    nan_or_inf = st.integers(0, (1 << mant) - 1).map(lambda m: all_ones | m)
    largest = st.integers(0, (1 << mant) - 1).map(lambda m: (all_ones - (1 << mant)) | m)
    subnormal = st.integers(0, (1 << mant) - 1)
    anything = st.integers(0, (1 << (bits - 1)) - 1)
    body = st.one_of(nan_or_inf, largest, subnormal, st.just(0), anything)
    return st.tuples(sign, body).map(lambda t: t[0] | t[1])


@pytest.mark.parametrize("dtype", ["F32", "F64", "F16", "BF16"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_arrays_of_special_patterns_agree_with_isfinite(dtype, data):
    bits = BITS[dtype]
    values = data.draw(st.lists(special_patterns(bits), max_size=64))
    patterns = np.array(values, dtype=UNSIGNED[bits])
    assert all_finite(raw(patterns), dtype) == bool(reference(patterns, dtype).all())


@pytest.mark.parametrize("dtype", sorted(FLOAT_DTYPES))
def test_views_and_empty_data(dtype):
    width = BITS[dtype] // 8
    inf = np.array([np.inf], dtype=np.float32 if dtype in ("F32", "BF16") else np.float64)
    ok = np.zeros(3, dtype=UNSIGNED[BITS[dtype]]).tobytes()
    assert all_finite(b"", dtype) and all_finite(memoryview(ok)[width:], dtype)
    if dtype == "F64":
        assert not all_finite(memoryview(ok + inf.tobytes())[width:], dtype)


def test_a_tensor_split_across_pieces_at_odd_offsets_is_scanned_whole():
    """StreamingFinite completes a value split between pieces: one -inf F32 straddling every cut."""
    body = np.ones(1000, dtype="<f4")
    body[500] = -np.inf
    data = body.tobytes()
    entries = {"t": TensorEntry("F32", (1000,), 0, len(data))}
    assert nonfinite_tensor(data, entries, 0) == "t"
    for cut in (1, 2, 3, 2001, 2002, 2003):
        scan = StreamingFinite(entries, 0)
        assert scan.feed(memoryview(data)[:cut]) is None
        assert scan.feed(memoryview(data)[cut:]) == "t", cut
    body[500] = 0.0
    scan = StreamingFinite(entries, 0)
    assert scan.feed(body.tobytes()[:2001]) is None and scan.feed(body.tobytes()[2001:]) is None
