"""Shape limits and JSON nesting depth (quiver.protocol.limits), without a server."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quiver.errors import InvalidArgumentError
from quiver.protocol.limits import (
    INT64_MAX,
    MAX_JSON_DEPTH,
    MAX_RANK,
    check_body_depth,
    check_depth,
    element_count,
    may_nest_too_deep,
    nesting_depth,
)
from quiver.types import DataType

HUGE = 1 << 62


@pytest.mark.parametrize(
    ("shape", "count"),
    [((), 1), ((0,), 0), ((3, 4), 12), ((1,) * MAX_RANK, 1), ((0, 1 << 40), 0), ((INT64_MAX // 4,), INT64_MAX // 4)],
)
def test_shapes_that_fit(shape: tuple[int, ...], count: int) -> None:
    assert element_count(shape, "X", DataType.INT32) == count
    if count == 0:
        np.empty(shape, dtype=np.int32)  # numpy agrees such a shape is an array


@pytest.mark.parametrize(
    ("shape", "datatype", "message"),
    [
        ((1,) * (MAX_RANK + 1), DataType.INT32, f"input 'X': 'shape' has {MAX_RANK + 1} dimensions, more than the {MAX_RANK} allowed"),
        ((0,) * 1_000_000, DataType.INT32, "has 1000000 dimensions"),
        ((2, -1), DataType.FP32, "input 'X': 'shape' must be a list of non-negative integers (int64), got [2, -1]"),
        ((-1, -1), DataType.FP32, "must be a list of non-negative integers"),
        ((1 << 63,), DataType.UINT8, "must be a list of non-negative integers"),
        ((0, HUGE), DataType.INT32, f"input 'X': shape [0, {HUGE}] is too large: its non-zero dimensions multiply to more than {INT64_MAX} bytes of INT32"),
        ((HUGE, 0), DataType.BYTES, "non-zero dimensions multiply to more than"),
        ((HUGE, HUGE), DataType.BOOL, "is too large: its dimensions multiply to more than"),
        ((INT64_MAX // 4 + 1,), DataType.INT32, "too large"),
    ],
)
def test_shapes_refused_before_anything_is_allocated(shape: tuple[int, ...], datatype: DataType, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        element_count(shape, "X", datatype)
    assert message in info.value.message


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 4), st.integers(0, INT64_MAX), st.integers(-3, -1)), max_size=MAX_RANK + 2),
    st.sampled_from(list(DataType)),
)
def test_element_count_agrees_with_numpy(dims: list[int], datatype: DataType) -> None:
    """A shape element_count accepts is one numpy can make an array of (0 elements at most
    here: the count is held against the data later); one it refuses is a 4xx."""
    shape = tuple(dims)
    try:
        count = element_count(shape, "X", datatype)
    except InvalidArgumentError:
        return
    assert count == math.prod(shape)
    if count == 0:
        dtype = object if datatype is DataType.BYTES else datatype.numpy_dtype
        assert np.empty(shape, dtype=dtype).size == 0


def nested(depth: int, leaf: Any = 1, kind: str = "list") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


def reference_depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.text(alphabet="[]{}\"\\ab", max_size=4),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_nesting_depth_is_the_depth(value: Any) -> None:
    assert nesting_depth(value) == reference_depth(value)


@settings(max_examples=100, deadline=None)
@given(st.integers(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 3), st.sampled_from(["list", "dict"]), json_values)
def test_the_raw_bound_never_misses_a_deep_body(depth: int, kind: str, leaf: Any) -> None:
    value = nested(depth, leaf, kind)
    raw = orjson.dumps({"field": value})
    if nesting_depth(value) >= MAX_JSON_DEPTH:
        assert may_nest_too_deep(raw)
        with pytest.raises(InvalidArgumentError, match="'field': JSON nesting depth exceeds maximum allowed limit"):
            check_body_depth(orjson.loads(raw), raw, "request body")
    else:
        check_body_depth(orjson.loads(raw), raw, "request body")


def test_depth_limit_is_tritons() -> None:
    check_depth(nested(MAX_JSON_DEPTH - 1), "data")  # 99 nested arrays: Triton takes them too
    with pytest.raises(InvalidArgumentError, match=r"^input 'X': 'data': JSON nesting depth exceeds maximum allowed limit \(100\)$"):
        check_depth(nested(MAX_JSON_DEPTH), "input 'X': 'data'")
    assert nesting_depth(nested(1000)) == MAX_JSON_DEPTH  # counted up to the limit, no further


def test_cheap_bound_for_normal_bodies() -> None:
    flat = orjson.dumps({"inputs": [{"name": "X", "data": list(range(10_000))}]})
    assert not may_nest_too_deep(flat)
    rows = orjson.dumps({"data": [[1, 2]] * 200})
    assert may_nest_too_deep(rows)  # then nesting_depth decides
    check_body_depth(orjson.loads(rows), rows, "body")
    strings = orjson.dumps({"s": "[" * 500})
    assert may_nest_too_deep(strings)
    check_body_depth(orjson.loads(strings), strings, "body")  # brackets in strings are not depth
    assert not may_nest_too_deep(b"[" * 150, 150)


def test_wide_and_deep_values_are_walked_without_recursion() -> None:
    wide = [[i, [i]] for i in range(100_000)]
    assert nesting_depth(wide) == 3
    assert nesting_depth({"a": nested(5000, kind="dict")}) == MAX_JSON_DEPTH
