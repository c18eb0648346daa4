"""Whether little-endian IEEE floats are all finite, at memory speed: the one place for the idea.

An IEEE binary float is NaN or an infinity exactly when its exponent bits are all ones,
whatever its sign and mantissa. Read as an integer of its width, a positive such value is at
least its format's +inf (sign bit clear, exponent all ones: BF16 0x7F80, F16 0x7C00, F32
0x7F800000, F64 0x7FF0000000000000), and nothing finite and positive is that large; read as
an unsigned integer, a negative one is at least -inf's pattern (0xFF80, 0xFC00, ...), and
nothing finite is. So two integer `max` reductions over a view of the bytes decide it:
exact for every bit pattern (every NaN payload, +-inf, subnormals, -0), with no per-element
temporary (np.isfinite builds a boolean array; BF16 has no numpy float type at all), and
numpy runs each reduction without the GIL.

Invariant: `all_finite(data, dtype)` == every value of `data` read as `dtype` is finite;
`data` holds whole elements (a multiple of the element's size) of a dtype in `FLOAT_DTYPES`.
"""

from __future__ import annotations

import numpy as np

_LIMITS: dict[str, tuple[np.dtype, int, np.dtype, int]] = {
    # dtype: (signed view, +inf pattern, unsigned view, -inf pattern)
    "BF16": (np.dtype("<i2"), 0x7F80, np.dtype("<u2"), 0xFF80),
    "F16": (np.dtype("<i2"), 0x7C00, np.dtype("<u2"), 0xFC00),
    "F32": (np.dtype("<i4"), 0x7F800000, np.dtype("<u4"), 0xFF800000),
    "F64": (np.dtype("<i8"), 0x7FF0000000000000, np.dtype("<u8"), 0xFFF0000000000000),
}
FLOAT_DTYPES = frozenset(_LIMITS)
"""The safetensors dtypes whose values are checked (those with a NaN and infinities)."""


def all_finite(data: bytes | bytearray | memoryview, dtype: str) -> bool:
    """True when every value of `data` (little-endian `dtype` elements, whole ones) is finite."""
    signed, pos_inf, unsigned, neg_inf = _LIMITS[dtype]
    values = np.frombuffer(data, dtype=signed)
    if not values.size:
        return True
    return int(values.max()) < pos_inf and int(values.view(unsigned).max()) < neg_inf
