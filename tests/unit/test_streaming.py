"""Response streams and the generate extension's JSON mapping, as pure logic."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as pb

from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError, UnsupportedError
from quiver.frontends.restrictions import http_group
from quiver.protocol.generate import decode_generate, encode_generate
from quiver.streaming import Cancellation, ResponseStream, StreamClosed, StreamResponse
from quiver.types import DataType, InferenceResponse, Tensor


def _response(value: int) -> InferenceResponse:
    return InferenceResponse("m", "1", [Tensor("OUT", DataType.INT32, (1,), np.array([value], np.int32))])


def test_a_stream_keeps_the_order_of_sends_from_threads_and_ends_at_the_final_flag() -> None:
    async def run() -> list[int]:
        stream = ResponseStream()

        def send() -> None:
            for i in range(200):
                stream.put(StreamResponse(response=_response(i)))
            stream.put(StreamResponse(final=True))
            with pytest.raises(StreamClosed):
                stream.put(StreamResponse(response=_response(200)))

        thread = threading.Thread(target=send)
        thread.start()
        seen = []
        async for item in stream.responses():
            if item.response is not None:
                seen.append(int(item.response.outputs[0].data[0]))
        thread.join()
        assert stream.closed and stream.sent == 200
        return seen

    assert asyncio.run(run()) == list(range(200))


def test_finish_closes_once_and_cancellation_calls_back_once() -> None:
    async def run() -> None:
        stream = ResponseStream()
        assert stream.finish() is True
        assert stream.finish() is False
        calls: list[int] = []
        cancellation = Cancellation()
        cancellation.add_callback(lambda: calls.append(1))
        cancellation.cancel()
        cancellation.cancel()
        cancellation.add_callback(lambda: calls.append(2))  # already cancelled: at once
        assert cancellation.cancelled and calls == [1, 2]

    asyncio.run(run())


def test_a_cancelled_stream_drops_responses_but_keeps_the_final() -> None:
    async def run() -> list[StreamResponse]:
        stream = ResponseStream()
        stream.put(StreamResponse(response=_response(0)))
        stream.cancellation.cancel()
        stream.put(StreamResponse(response=_response(1)))  # the client left: not queued
        stream.put(StreamResponse(final=True))
        return [item async for item in stream.responses()]

    items = asyncio.run(run())
    assert [i.response is not None for i in items] == [True, False] and items[-1].final


def _config() -> ModelConfig:
    proto = pb.ModelConfig(name="llm", backend="python", max_batch_size=0)
    proto.input.add(name="PROMPT", data_type=pb.TYPE_STRING, dims=[1, 1])
    proto.input.add(name="IDS", data_type=pb.TYPE_INT32, dims=[2, -1], optional=True)
    proto.input.add(name="FLAG", data_type=pb.TYPE_BOOL, dims=[1], optional=True)
    proto.output.add(name="TEXT", data_type=pb.TYPE_STRING, dims=[-1])
    return ModelConfig.from_proto(proto)


def test_generate_shapes_inputs_and_keeps_the_rest_as_parameters() -> None:
    body = b'{"PROMPT": "hi", "IDS": [1, 2, 3, 4, 5, 6], "temperature": 0.5, "n": 2, "id": "7",' \
        b' "parameters": {"FLAG": true, "stop": "x"}}'
    request = decode_generate(body, _config(), "llm", "", 1 << 20)
    tensors = {t.name: t for t in request.inputs}
    assert tensors["PROMPT"].shape == (1, 1) and tensors["PROMPT"].data.tolist() == [[b"hi"]]
    assert tensors["IDS"].shape == (2, 3) and tensors["IDS"].data.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert tensors["FLAG"].shape == (1,) and tensors["FLAG"].data.tolist() == [True]
    assert request.parameters == {"temperature": 0.5, "n": 2, "id": "7", "stop": "x"}
    assert request.id == "7"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"PROMPT": "a", "IDS": [1, 2, 3]}', "The schema can not convert input 'IDS' to tensor with proper shape"),
        (b'{"PROMPT": "a", "PROMPT": "b"}', "input 'PROMPT' already exists in request"),
        (b'{"PROMPT": "a", "IDS": [1, "2"]}', "attempt to access JSON non-signed-integer as signed-integer"),
        (b'{"PROMPT": "a", "FLAG": 1}', "attempt to access JSON non-boolean as boolean"),
        (b'{"PROMPT": "a", "x": null}', "parameter 'x' has invalid type"),
        (b'{"PROMPT": "a", "parameters": [1]}', "Expected JSON object for keyword: 'parameters'"),
    ],
)
def test_generate_refuses_with_tritons_words(body: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_generate(body, _config(), "llm", "", 1 << 20)


def test_generate_refuses_inputs_past_the_size_limit() -> None:
    with pytest.raises(InvalidArgumentError, match="exceeds the maximum allowed input size of 16"):
        decode_generate(b'{"PROMPT": "a long prompt"}', _config(), "llm", "", 16)


def test_generate_answers_one_element_as_a_value_and_more_as_an_array() -> None:
    response = InferenceResponse(
        "llm", "1",
        [
            Tensor("TEXT", DataType.BYTES, (1,), np.array([b"done"], dtype=np.object_)),
            Tensor("IDS", DataType.INT32, (2, 2), np.arange(4, dtype=np.int32).reshape(2, 2)),
            Tensor("EMPTY", DataType.FP32, (0,), np.zeros(0, np.float32)),
        ],
        id="",
        parameters={"tokens": 4},
    )
    assert encode_generate(response) == {
        "EMPTY": [], "IDS": [0, 1, 2, 3], "TEXT": "done", "model_name": "llm", "model_version": "1", "tokens": 4,
    }
    response.parameters = {"raw": b"\x00"}
    with pytest.raises(UnsupportedError, match="TRITONSERVER_PARAMETER_BYTES"):
        encode_generate(response)


@pytest.mark.parametrize(
    "path", ["/v2/models/m/generate", "/v2/models/m/generate_stream", "/v2/models/m/versions/2/generate_stream"]
)
def test_generate_routes_are_in_the_inference_group(path: str) -> None:
    assert http_group("POST", path) == "inference"  # --http-restricted-api inference:... covers them
