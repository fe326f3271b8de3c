"""Triton's BYTES tensor encoding: each element a 4-byte little-endian length, then its bytes."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from quiver.errors import InvalidArgumentError

_LEN = struct.Struct("<I")


def serialize_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """Encode an object array of bytes (or str) in row-major order."""
    parts: list[bytes] = []
    pack = _LEN.pack
    for item in array.reshape(-1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray)):
            item = str(item).encode("utf-8")
        parts.append(pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int, name: str) -> np.ndarray[Any, Any]:
    """Decode ``count`` elements; the buffer must hold exactly that many, no more, no less."""
    view = memoryview(buffer)
    size = len(view)
    if count * 4 > size:  # each element needs at least its 4-byte length: check before allocating
        raise InvalidArgumentError(
            f"input '{name}': {count} BYTES elements need at least {count * 4} bytes, the data "
            f"has {size}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    unpack = _LEN.unpack_from
    for index in range(count):
        if offset + 4 > size:
            raise InvalidArgumentError(
                f"input '{name}': BYTES data ends after {index} of {count} elements"
            )
        (length,) = unpack(view, offset)
        offset += 4
        end = offset + length
        if end > size:
            raise InvalidArgumentError(
                f"input '{name}': BYTES element {index} claims {length} bytes but only "
                f"{size - offset} remain"
            )
        out[index] = bytes(view[offset:end])
        offset = end
    if offset != size:
        raise InvalidArgumentError(
            f"input '{name}': BYTES data has {size - offset} bytes left over after {count} elements"
        )
    return out
