"""Triton's BYTES tensor encoding: each element a 4-byte little-endian length, then its bytes.

Many elements of one length (all empty, or fixed-size ids) are decoded and encoded with
numpy, a strided view over the length prefixes: 15 million empty elements take a fraction of
a second instead of many. Other tensors take a plain loop over the elements.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from quiver.errors import InvalidArgumentError

_LEN = struct.Struct("<I")
#: From this many elements on, try the numpy path for elements of one length.
VECTOR_MIN = 256
#: Elements encoded per join by the loop.
_CHUNK = 1 << 16
#: Elements per numpy call: each call holds the GIL, so a codec thread lets the event loop
#: in between (1M elements: about 10 ms).
_BLOCK = 1 << 20


def serialize_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """Encode an object array of bytes (or str) in row-major order."""
    flat = array.reshape(-1)
    size = flat.size
    if size >= VECTOR_MIN and flat.dtype == object:
        encoded = _serialize_uniform(flat)
        if encoded is not None:
            return encoded
    if size <= _CHUNK:
        return _serialize_loop(flat)
    # A chunk at a time: one join of millions of parts would hold the GIL (and so the event
    # loop, when this runs on a codec thread) for most of a second.
    return b"".join([_serialize_loop(flat[i : i + _CHUNK]) for i in range(0, size, _CHUNK)])


def _serialize_loop(flat: np.ndarray[Any, Any]) -> bytes:
    parts: list[bytes] = []
    pack = _LEN.pack
    for item in flat:
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif isinstance(item, memoryview):
            item = item.tobytes()
        elif not isinstance(item, (bytes, bytearray)):
            item = str(item).encode("utf-8")
        parts.append(pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def _serialize_uniform(flat: np.ndarray[Any, Any]) -> bytes | None:
    """``flat`` as one (count, 4 + length) array, if its elements are bytes of one length
    (or str: encoded first), else None."""
    first = flat[0]
    kind = type(first)
    if kind is not bytes and kind is not str:
        return None
    count = flat.size
    if not len(first):
        # every element empty (what equals b"" or "" is what the loop encodes as empty too)
        for start in range(0, count, _BLOCK):
            if not bool((flat[start : start + _BLOCK] == first).all()):
                return None
        return bytes(4 * count)
    items = flat.tolist()
    if set(map(type, items)) != {kind}:
        return None
    if kind is str:
        items = [item.encode("utf-8") for item in items]
    length = len(items[0])
    if length >= 1 << 32 or set(map(len, items)) != {length}:
        return None
    out = np.empty((count, 4 + length), dtype=np.uint8)
    out[:, :4] = np.frombuffer(_LEN.pack(length), dtype=np.uint8)
    out[:, 4:] = np.frombuffer(b"".join(items), dtype=np.uint8).reshape(count, length)
    return out.tobytes()


def deserialize_bytes(buffer: bytes | memoryview, count: int, name: str) -> np.ndarray[Any, Any]:
    """Decode ``count`` elements; the buffer must hold exactly that many, no more, no less."""
    view = memoryview(buffer)
    size = len(view)
    if count * 4 > size:  # each element needs at least its 4-byte length: check before allocating
        raise InvalidArgumentError(
            f"input '{name}': {count} BYTES elements need at least {count * 4} bytes, the data "
            f"has {size}"
        )
    if count >= VECTOR_MIN and size % count == 0:
        uniform = _deserialize_uniform(view, count, size // count)
        if uniform is not None:
            return uniform
    data = view.obj if isinstance(view.obj, bytes) and len(view.obj) == size else bytes(view)
    items: list[Any] = [b""] * count
    unpack = _LEN.unpack_from
    offset = 0
    try:
        for index in range(count):
            (length,) = unpack(data, offset)
            start = offset + 4
            offset = start + length
            items[index] = data[start:offset]
    except struct.error:  # a length ran past the end: the careful walk says where
        offset = size + 1
    if offset != size:
        _explain(view, count, name)
    out = np.empty(count, dtype=object)
    out[:] = items
    return out


def _deserialize_uniform(view: memoryview, count: int, stride: int) -> np.ndarray[Any, Any] | None:
    """Elements that all have length ``stride - 4``, else None (read in place)."""
    length = stride - 4
    prefixes = np.ndarray((count,), dtype="<u4", buffer=view, strides=(stride,))
    for start in range(0, count, _BLOCK):
        if (prefixes[start : start + _BLOCK] != length).any():
            return None
    out = np.empty(count, dtype=object)
    if not length:
        for start in range(0, count, _BLOCK):
            out[start : start + _BLOCK] = b""
        return out
    elements = np.ndarray((count,), dtype=f"V{length}", buffer=view, offset=4, strides=(stride,))
    for start in range(0, count, _BLOCK):
        out[start : start + _BLOCK] = elements[start : start + _BLOCK]  # void -> bytes
    return out


def element_count(buffer: bytes | memoryview) -> int:
    """How many elements ``buffer`` holds, all of it (``triton_python_backend_utils``'
    ``deserialize_bytes_tensor`` has no count); InvalidArgumentError where it does not end
    on an element."""
    view = memoryview(buffer)
    index, offset, claimed = _walk(view, None)
    if claimed == -1:
        raise InvalidArgumentError(f"incomplete length field after {index} BYTES elements")
    if claimed is not None:
        raise InvalidArgumentError(
            f"BYTES element {index} of {claimed} bytes extends beyond buffer "
            f"({len(view) - offset + claimed} bytes remain)"
        )
    return index


def _walk(view: memoryview, count: int | None) -> tuple[int, int, int | None]:
    """Walk the length prefixes of ``count`` elements (None: until the data ends):
    ``(index, offset, claimed)``. ``claimed`` is None when they all fit (``offset`` is then
    where they end), -1 when element ``index``'s length field is cut off, else the length it
    claims, which runs to ``offset``, past the end."""
    size = len(view)
    offset = index = 0
    unpack = _LEN.unpack_from
    while offset < size if count is None else index < count:
        if offset + 4 > size:
            return index, offset, -1
        (length,) = unpack(view, offset)
        offset += 4 + length
        if offset > size:
            return index, offset, length
        index += 1
    return index, offset, None


def _explain(view: memoryview, count: int, name: str) -> None:
    """Raise the InvalidArgumentError that says where ``view`` fails to hold ``count`` elements."""
    size = len(view)
    index, offset, claimed = _walk(view, count)
    if claimed == -1:
        raise InvalidArgumentError(f"input '{name}': BYTES data ends after {index} of {count} elements")
    if claimed is not None:
        raise InvalidArgumentError(
            f"input '{name}': BYTES element {index} claims {claimed} bytes but only "
            f"{size - offset + claimed} remain"
        )
    raise InvalidArgumentError(
        f"input '{name}': BYTES data has {size - offset} bytes left over after {count} elements"
    )
