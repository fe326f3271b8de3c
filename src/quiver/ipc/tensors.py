"""Tensors into a shared-memory pool and back out as numpy views.

A tensor crosses as a descriptor ``[name, datatype, shape, segment, offset, nbytes]`` (Triton
datatype names, ``"FP32"``); the bytes are in the pool. Fixed-size datatypes are read back as a
numpy array over the shared memory itself (no copy); BYTES tensors are written in Triton's
length-prefixed encoding and decoded into an object array of ``bytes`` (a copy, as every BYTES
path in Quiver makes). An empty tensor has no block (segment ``""``).
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from quiver.ipc.shm import Arena, Mapper
from quiver.protocol.bytes_codec import deserialize_bytes, serialize_bytes
from quiver.types import DataType

Descriptor = list[Any]


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    return DataType[datatype].numpy_dtype


#: The numpy dtype of each fixed-size datatype (looked up once).
_DTYPES: dict[str, np.dtype[Any]] = {t.value: t.numpy_dtype for t in DataType if t is not DataType.BYTES}


def write(arena: Arena, name: str, datatype: str, array: np.ndarray[Any, Any], blocks: list[tuple[str, int]]) -> Descriptor:
    """Copy ``array`` into ``arena``; its ``(segment, offset)`` is appended to ``blocks``
    (give them back with :meth:`Arena.free_many` when the reader is done). Raises
    PoolFullError when it does not fit."""
    if datatype != "BYTES":
        nbytes = array.nbytes
        if nbytes == 0:
            return [name, datatype, list(array.shape), "", 0, 0]
        try:
            block = arena.put(array, nbytes)  # one copy, C-contiguous
        except (TypeError, ValueError, BufferError):  # strided, or no buffer
            block = arena.put(np.ascontiguousarray(array).reshape(-1).view(np.uint8), nbytes)
    else:
        encoded = serialize_bytes(array)
        nbytes = len(encoded)
        if not nbytes:
            return [name, datatype, list(array.shape), "", 0, 0]
        block = arena.put(encoded, nbytes)
    blocks.append(block)
    return [name, datatype, list(array.shape), block[0], block[1], nbytes]


def read(mapper: Mapper, descriptor: Descriptor, *, copy: bool = False) -> tuple[str, str, tuple[int, ...], np.ndarray[Any, Any]]:
    """``(name, datatype, shape, array)``: a view of the shared memory (``copy`` for an array
    of its own). ValueError for a descriptor that does not add up."""
    name, datatype, shape, segment, offset, nbytes = descriptor
    dims = tuple(map(int, shape))
    if dims and min(dims) < 0:
        raise ValueError(f"tensor '{name}' has a negative dimension in shape {list(dims)}")
    count = prod(dims)
    if datatype == "BYTES":
        data = bytes(mapper.view(segment, offset, nbytes)) if nbytes else b""
        array = deserialize_bytes(data, count, name).reshape(dims)
        return name, datatype, dims, array
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        dtype = numpy_dtype(datatype)
    if count * dtype.itemsize != nbytes:
        raise ValueError(
            f"tensor '{name}': {nbytes} bytes do not hold shape {list(dims)} of {datatype}"
        )
    if nbytes == 0:
        return name, datatype, dims, np.empty(dims, dtype=dtype)
    if copy:  # over a bytearray of its own: one copy, one array
        return name, datatype, dims, np.ndarray(dims, dtype, bytearray(mapper.view(segment, offset, nbytes)))
    return name, datatype, dims, np.ndarray(dims, dtype, mapper.view(segment, offset, nbytes))


def blocks_of(descriptors: list[Descriptor]) -> list[list[Any]]:
    """The ``[segment, offset]`` pairs to release once ``descriptors`` are read."""
    return [[d[3], d[4]] for d in descriptors if d[3]]
