"""The response cache's key, its least-recently-used bound and its flags."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from quiver.metrics.statistics import ModelStatistics
from quiver.response_cache import CacheConfigError, ResponseCache, parse_cache_config, request_key
from quiver.types import DataType, InferenceRequest, InferenceResponse, RequestedOutput, Tensor


def _request(data: np.ndarray, *, name: str = "X", datatype: DataType = DataType.FP32, **params: object) -> InferenceRequest:
    return InferenceRequest("m", "", [Tensor(name, datatype, tuple(data.shape), data)], parameters=dict(params))


def test_key_is_the_request() -> None:
    data = np.arange(4, dtype=np.float32)
    key = request_key("m", "1", _request(data))
    assert key == request_key("m", "1", _request(data.copy(), priority=3, timeout=10, binary_data_output=True))
    assert key != request_key("m", "2", _request(data))
    assert key != request_key("n", "1", _request(data))
    assert key != request_key("m", "1", _request(data.reshape(2, 2)))
    assert key != request_key("m", "1", _request(data.view(np.int32), datatype=DataType.INT32))
    assert key != request_key("m", "1", _request(data, name="Y"))
    assert key != request_key("m", "1", _request(data, custom="a"))
    asked = _request(data)
    asked.outputs = [RequestedOutput("OUT")]
    assert key != request_key("m", "1", asked)
    # BYTES elements carry their lengths: ["ab", "c"] is not ["a", "bc"].
    first = np.array([b"ab", b"c"], dtype=object)
    second = np.array([b"a", b"bc"], dtype=object)
    assert request_key("m", "1", _request(first, datatype=DataType.BYTES)) != request_key(
        "m", "1", _request(second, datatype=DataType.BYTES)
    )
    two = InferenceRequest("m", "", [Tensor("A", DataType.FP32, (1,), data[:1]), Tensor("B", DataType.FP32, (1,), data[1:2])])
    assert request_key("m", "1", two) == request_key("m", "1", InferenceRequest("m", "", two.inputs[::-1]))


def _response(value: float) -> InferenceResponse:
    return InferenceResponse("m", "1", [Tensor("OUT", DataType.FP32, (4,), np.full(4, value, dtype=np.float32))])


def test_least_recently_used_out_first() -> None:
    cache = ResponseCache(size=2 * (256 + 64 + 16))
    for key in (b"a", b"b"):
        assert cache.insert(key, _response(1.0), "m")
    assert cache.insert(b"a", _response(1.0), "m") is None  # there already: no second entry
    assert len(cache) == 2
    assert cache.lookup(b"a") is not None  # a is now the most recently used
    cache.insert(b"c", _response(2.0), "m")
    assert cache.lookup(b"b") is None
    assert cache.lookup(b"a") is not None and cache.lookup(b"c") is not None
    assert cache.evictions == 1 and len(cache) == 2
    assert not ResponseCache(size=100).insert(b"x", _response(1.0), "m")  # larger than the cache


def test_cached_answers_cannot_be_changed_and_hits_are_counted() -> None:
    cache = ResponseCache(size=1 << 20)
    stats = ModelStatistics()
    runs = []

    async def run(request: InferenceRequest) -> InferenceResponse:
        runs.append(request)
        return _response(float(len(runs)))

    async def twice() -> list[InferenceResponse]:
        request = _request(np.zeros(4, dtype=np.float32))
        return [await cache.infer("m", "1", request, stats, 1, run) for _ in range(2)]

    first, second = asyncio.run(twice())
    assert len(runs) == 1
    np.testing.assert_array_equal(second.outputs[0].data, first.outputs[0].data)
    with pytest.raises(ValueError):
        second.outputs[0].data[0] = 5.0
    assert stats.cache_hit.count == 1 and stats.cache_miss.count == 1
    assert stats.success.count == 1  # the miss's success is the scheduler's to count
    assert stats.inference_count == 0


@pytest.mark.parametrize(
    ("values", "byte_size", "expected"),
    [([], None, 0), (["local,size=1024"], None, 1024), ([], "2048", 2048), (["local,size=0"], None, 0)],
)
def test_cache_flags(values: list[str], byte_size: str | None, expected: int) -> None:
    assert parse_cache_config(values, byte_size) == expected


@pytest.mark.parametrize(
    ("values", "byte_size", "message"),
    [
        (["local,size=1"], "1", "Incompatible flags --response-cache-byte-size and --cache-config"),
        (["local,size=1", "redis,host=h"], None, "multiple cache configurations"),
        (["size=1"], None, "No cache specified"),
        (["local,size"], None, "--cache-config option format is"),
        (["redis,host=h"], None, "cache 'redis' is not available"),
        (["local,bytes=1"], None, "unknown setting"),
        (["local,size=-1"], None, "must not be negative"),
    ],
)
def test_bad_cache_flags(values: list[str], byte_size: str | None, message: str) -> None:
    with pytest.raises(CacheConfigError, match=message):
        parse_cache_config(values, byte_size)
