"""What one request may hold, checked before anything is allocated or walked recursively.

Shapes: at most :data:`MAX_RANK` dimensions, every one a non-negative int64, and dimensions
that fit an array: numpy refuses a shape whose non-zero dimensions multiply past 2**63-1
bytes even when another dimension is 0 (``[0, 2**62]``), so that is a client's mistake too.
The counts the shape gives are then held against the data by the decoders (binary sizes,
``data`` lengths, ``contents`` lengths) before they allocate.

JSON: no field nested :data:`MAX_JSON_DEPTH` levels or more, Triton's
``HTTP_MAX_JSON_NESTING_DEPTH`` (``data`` may hold at most 99 nested arrays there too).
orjson itself parses up to 1024 levels; past 100 nothing in Quiver or in a model should have
to walk it. :func:`may_nest_too_deep` is the cheap test of the raw bytes that lets normal
bodies skip the walk: a body with fewer than 100 ``[``/``{`` bytes cannot nest 100 deep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from quiver.errors import InvalidArgumentError
from quiver.types import DataType


def _numpy_max_rank() -> int:
    try:
        np.empty((1,) * 64)
    except ValueError:  # numpy 1.x: 32
        return 32
    return 64


#: Most dimensions a tensor may have: numpy's own limit (64 since numpy 2; Triton has no
#: smaller one, and a backend that gets numpy arrays cannot take more).
MAX_RANK = min(64, _numpy_max_rank())
#: Triton's HTTP_MAX_JSON_NESTING_DEPTH: a field nested this deep is refused.
MAX_JSON_DEPTH = 100
INT64_MAX = (1 << 63) - 1
#: Bytes per element of an array of each datatype (BYTES: one object pointer).
_ARRAY_ITEMSIZE = {dt: dt.itemsize or np.dtype(object).itemsize for dt in DataType}


def shape_text(dims: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def element_count(dims: Sequence[int], name: str, datatype: DataType) -> int:
    """The element count of input ``name``'s shape, or InvalidArgumentError naming the input.

    ``dims`` are integers (the JSON decoder checks the types first). The rank is checked
    before anything walks the dimensions, so a shape of a million dimensions costs nothing.
    """
    rank = len(dims)
    if rank > MAX_RANK:
        raise InvalidArgumentError(
            f"input '{name}': 'shape' has {rank} dimensions, more than the {MAX_RANK} allowed"
        )
    for dim in dims:
        if dim < 0 or dim > INT64_MAX:
            raise InvalidArgumentError(
                f"input '{name}': 'shape' must be a list of non-negative integers (int64), got "
                f"{shape_text(dims)}"
            )
    count = math.prod(dims)
    extent = count or math.prod(d for d in dims if d)
    if extent * _ARRAY_ITEMSIZE[datatype] > INT64_MAX:
        raise InvalidArgumentError(
            f"input '{name}': shape {shape_text(dims)} is too large: its "
            + ("dimensions" if count else "non-zero dimensions")
            + f" multiply to more than {INT64_MAX} bytes of {datatype.value}"
        )
    return count


# -- JSON nesting ------------------------------------------------------------------------


def may_nest_too_deep(raw: bytes, end: int | None = None) -> bool:
    """Whether ``raw[:end]`` has enough ``[`` and ``{`` bytes to nest MAX_JSON_DEPTH deep
    (brackets inside strings count too: this is a bound, :func:`nesting_depth` decides)."""
    if end is None:
        end = len(raw)
    if end < 2 * MAX_JSON_DEPTH:  # every bracket opened is closed: 200 bytes at least
        return False
    return raw.count(b"[", 0, end) + raw.count(b"{", 0, end) >= MAX_JSON_DEPTH


def nesting_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Lists and dicts on the deepest path through a parsed JSON ``value`` (0 for a scalar),
    counted up to ``limit``. Iterative, level by level; a container whose items are all
    scalars costs one C-level pass over them."""
    level = [value] if type(value) is list or type(value) is dict else []
    depth = 0
    while level and depth < limit:
        depth += 1
        below: list[Any] = []
        for container in level:
            items = container.values() if type(container) is dict else container
            kinds = set(map(type, items))
            if list in kinds or dict in kinds:
                below.extend([v for v in items if type(v) is list or type(v) is dict])
        level = below
    return depth


def too_deep(where: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{where}: JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"
    )


def check_depth(value: Any, where: str) -> None:
    """InvalidArgumentError naming ``where`` if ``value`` nests MAX_JSON_DEPTH deep."""
    if nesting_depth(value) >= MAX_JSON_DEPTH:
        raise too_deep(where)


def check_body_depth(value: Any, raw: bytes, what: str) -> None:
    """For a parsed JSON body: each top-level field of an object (else the whole body) is
    held to MAX_JSON_DEPTH, skipped when ``raw`` cannot nest that deep."""
    if not may_nest_too_deep(raw):
        return
    if type(value) is dict:
        for key, field in value.items():
            check_depth(field, f"{what}: '{key}'")
    else:
        check_depth(value, what)


__all__ = [
    "INT64_MAX",
    "MAX_JSON_DEPTH",
    "MAX_RANK",
    "check_body_depth",
    "check_depth",
    "element_count",
    "may_nest_too_deep",
    "nesting_depth",
    "shape_text",
    "too_deep",
]
