"""A tensor's elements read from raw bytes, whichever way the bytes arrived.

The binary tensor extension over HTTP (``binary_data_size``) and gRPC's
``raw_input_contents`` both carry an input as its elements' bytes in row-major order (BYTES
elements each behind a 4-byte little-endian length). Both decode them here, with the same
checks: the size must be exactly what the shape and datatype need, and BF16 needs
``ml_dtypes`` on the server.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quiver.errors import InvalidArgumentError
from quiver.protocol.bytes_codec import deserialize_bytes
from quiver.types import HAVE_BF16, DataType


def array_from_raw(
    buffer: bytes | memoryview,
    datatype: DataType,
    shape: tuple[int, ...],
    count: int,
    name: str,
    size_source: str,
) -> np.ndarray[Any, Any]:
    """Input ``name``'s array, ``count`` elements of ``shape`` decoded from ``buffer``.

    ``size_source`` names where the size came from in the error for a wrong size
    ("binary_data_size is", "its raw_input_contents has").
    """
    expected = count * datatype.itemsize
    if not expected and datatype is DataType.BYTES:  # (itemsize 0 first: reading DataType.X costs)
        return deserialize_bytes(buffer, count, name).reshape(shape)
    if len(buffer) != expected:
        raise InvalidArgumentError(
            f"input '{name}': shape {list(shape)} of {datatype.value} needs {expected} bytes "
            f"but {size_source} {len(buffer)}"
        )
    if not HAVE_BF16 and datatype is DataType.BF16:
        raise InvalidArgumentError(f"input '{name}': BF16 needs the ml_dtypes package on the server")
    return np.frombuffer(buffer, dtype=datatype.numpy_dtype).reshape(shape)
