"""Reading a safetensors header without torch: tensor names, dtypes and shapes.

The generator checks a pushed adapter against the base model before loading any of it,
and the CLI reads a PEFT folder, neither of which should need torch to do so.
"""

from __future__ import annotations

import json
import struct

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 * 1024 * 1024


class HeaderError(ValueError):
    """The bytes are not a well-formed safetensors file."""


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


def read_header(data: bytes, body_length: int | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Map tensor name -> (dtype, shape); raises HeaderError with a readable reason.

    `data` is the whole file, or only its header when `body_length` gives the body size.
    """
    if len(data) < 8:
        raise HeaderError(f"payload is {len(data)} bytes; a safetensors file starts with an 8-byte header length")
    (length,) = struct.unpack("<Q", data[:8])
    if length > _MAX_HEADER or 8 + length > len(data):
        raise HeaderError(f"header length {length} does not fit in a payload of {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HeaderError(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a JSON object")
    body = len(data) - 8 - length if body_length is None else body_length
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"tensor {name!r} has a malformed header entry") from None
        count = 1
        for dim in shape:
            count *= dim
        if dtype not in _DTYPE_BYTES or end - start != count * _DTYPE_BYTES[dtype] or not 0 <= start <= end <= body:
            raise HeaderError(f"tensor {name!r} has offsets or dtype that do not match its shape {list(shape)}")
        tensors[name] = (dtype, shape)
    return tensors
