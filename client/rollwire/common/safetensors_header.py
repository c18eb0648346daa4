"""Reading a safetensors header without torch: tensor names, dtypes, shapes; finiteness.

The generator and the proxy check a pushed adapter against the base model before loading
any of it, and the CLI reads a PEFT folder, none of which should need torch to do so.

Cost is linear in the input and bounded: the header length is capped before parsing, deep
JSON nesting and huge integers fail fast (Python's recursion and int-digit limits), the
tensor count and the number of dimensions are capped, and every dimension is below 2**40,
so no product of a shape is more than a small integer. `nonfinite_tensor` scans values in
blocks with `rollwire.common.finite` (two integer reductions, without the GIL).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from itertools import pairwise

from rollwire.common.finite import FLOAT_DTYPES, all_finite

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 * 1024 * 1024
MAX_DIM = 1 << 40
"""Every dimension of a tensor is below this."""
MAX_DIMS = 8
"""Default bound on the number of dimensions of a tensor in a file (pushed adapters: 2)."""
_BLOCK = 1 << 20  # finiteness scan block, a multiple of every element size


class HeaderError(ValueError):
    """The bytes are not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: data offsets are relative to the body's start."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_file_header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The header of a safetensors file on disk, reading only the header bytes."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > _MAX_HEADER:
            raise HeaderError(f"{path}: header length {length} is implausible")
        head = fh.read(length)
        fh.seek(0, 2)
        body = fh.tell() - 8 - length
    return read_header(struct.pack("<Q", length) + head, body_length=body)


def read_header(data: bytes, body_length: int | None = None, **limits) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Map tensor name -> (dtype, shape); raises HeaderError with a readable reason.

    `data` is the whole file, or only its header when `body_length` gives the body size.
    `limits` are those of `read_entries`.
    """
    return {name: (e.dtype, e.shape) for name, e in read_entries(data, body_length, **limits).items()}


def header_length(data: bytes | bytearray) -> int:
    """The declared header length (the first 8 bytes, little-endian)."""
    if len(data) < 8:
        raise HeaderError(f"payload is {len(data)} bytes; a safetensors file starts with an 8-byte header length")
    return struct.unpack("<Q", data[:8])[0]


def read_entries(
    data: bytes,
    body_length: int | None = None,
    *,
    max_header: int = _MAX_HEADER,
    max_tensors: int | None = None,
    max_dims: int = MAX_DIMS,
) -> dict[str, TensorEntry]:
    """Map tensor name -> TensorEntry, checking the header's structure with bounded cost."""
    length = header_length(data)
    if length > max_header:
        raise HeaderError(f"header of {length} bytes exceeds the limit of {max_header} bytes")
    if 8 + length > len(data):
        raise HeaderError(f"header length {length} does not fit in a payload of {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON errors, over-long ints
        raise HeaderError(f"header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    count = len(header) - ("__metadata__" in header)
    if max_tensors is not None and count > max_tensors:
        raise HeaderError(f"header lists {count} tensors; at most {max_tensors} are expected")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError("header __metadata__ is not an object of strings")
    body = len(data) - 8 - length if body_length is None else body_length
    tensors: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _entry(name, entry, body, max_dims)
    return tensors


def _entry(name: str, entry, body: int, max_dims: int) -> TensorEntry:
    shown = name[:120]
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {shown!r} has a malformed header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise HeaderError(f"tensor {shown!r} has an unknown dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or len(shape) > max_dims:
        raise HeaderError(
            f"tensor {shown!r} has a malformed shape (a list of at most {max_dims} dimensions is expected)"
        )
    if not all(type(d) is int and 0 <= d < MAX_DIM for d in shape):
        raise HeaderError(f"tensor {shown!r} has a dimension that is not an integer in [0, 2**40)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise HeaderError(f"tensor {shown!r} has malformed data_offsets")
    start, end = offsets
    count = 1
    for dim in shape:  # at most max_dims factors below 2**40: a small integer
        count *= dim
    if end - start != count * _DTYPE_BYTES[dtype] or not 0 <= start <= end <= body:
        raise HeaderError(f"tensor {shown!r} has offsets or dtype that do not match its shape {shape}")
    return TensorEntry(dtype, tuple(shape), start, end)


# -- finiteness: rollwire.common.finite decides it per block, exactly, at memory speed --------


def nonfinite_tensor(data, entries: dict[str, TensorEntry], body_offset: int) -> str | None:
    """The name of the first float tensor holding a NaN or an infinity, else None.

    `data` holds the file; tensor data starts at `body_offset`. Linear, in blocks of views
    (nothing copied), each decided by `finite.all_finite`.
    """
    view = memoryview(data).cast("B")
    for name, e in entries.items():
        if e.dtype not in FLOAT_DTYPES:
            continue
        for pos in range(body_offset + e.start, body_offset + e.end, _BLOCK):
            if not all_finite(view[pos : min(pos + _BLOCK, body_offset + e.end)], e.dtype):
                return name
    return None


class StreamingFinite:
    """`nonfinite_tensor` over a file that arrives in pieces: `feed` them in order (header
    included); `bad` names the first float tensor seen to hold a NaN or an infinity.

    Each piece is scanned once, as it arrives, in whole elements: a value split between two
    pieces is completed with the next piece's first bytes. Overlapping tensors (not valid
    safetensors, but not refused by `read_entries`) cannot be scanned in one pass: then
    `needs_full_scan` is set and the caller runs `nonfinite_tensor` on the whole file."""

    def __init__(self, entries: dict[str, TensorEntry], body_offset: int) -> None:
        regions = sorted(
            (body_offset + e.start, body_offset + e.end, name, e.dtype)
            for name, e in entries.items()
            if e.dtype in FLOAT_DTYPES
        )
        self.needs_full_scan = any(a[1] > b[0] for a, b in pairwise(regions))
        self.regions = [] if self.needs_full_scan else regions
        self.pos = 0  # offset in the file of the next byte fed
        self.index = 0  # first region not scanned to its end
        self.carry = b""  # the start of a value split by the end of the last piece
        self.bad: str | None = None

    def feed(self, piece: bytes | memoryview) -> str | None:
        view = memoryview(piece)
        start, end = self.pos, self.pos + len(view)
        self.pos = end
        while self.bad is None and self.index < len(self.regions):
            first, last, name, dtype = self.regions[self.index]
            if first >= end:
                break
            low, high = max(first, start), min(last, end)
            if low < high and not self._scan(view[low - start : high - start], dtype):
                self.bad = name
            if last > end:
                break
            self.index += 1
        return self.bad

    def _scan(self, data: memoryview, dtype: str) -> bool:
        size = _DTYPE_BYTES[dtype]
        if self.carry:
            value = self.carry + bytes(data[: size - len(self.carry)])
            data = data[size - len(self.carry) :]
            if len(value) < size:  # the piece ended inside this value
                self.carry = value
                return True
            self.carry = b""
            if not all_finite(value, dtype):
                return False
        whole = len(data) - len(data) % size
        for pos in range(0, whole, _BLOCK):
            if not all_finite(data[pos : min(pos + _BLOCK, whole)], dtype):
                return False
        self.carry = bytes(data[whole:])
        return True
