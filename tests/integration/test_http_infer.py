"""Inference over HTTP with the real tritonclient (sync and asyncio), every datatype, JSON and binary."""

from __future__ import annotations

import asyncio

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from build_repository import LABELS
from tritonclient.utils import InferenceServerException

from support.models import ONNX_TYPES
from support.server import QuiverServer

NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}


def sample(datatype: str) -> np.ndarray:
    """Values that catch truncation, sign and byte-order mistakes."""
    if datatype == "BOOL":
        return np.array([True, False, True])
    if datatype == "BYTES":
        return np.array([b"hello", "ünïcode".encode(), b""], dtype=np.object_)
    dtype = np.dtype(NUMPY[datatype])
    if dtype.kind == "f":
        return np.array([1.5, -2.25, 65504.0 if datatype == "FP16" else 1e30], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([info.min, 1, info.max], dtype=dtype)


@pytest.fixture(scope="module")
def client(server: QuiverServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata["name"] == "quiver"
    assert "binary_tensor_data" in metadata["extensions"]
    assert "classification" in metadata["extensions"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(ONNX_TYPES))
def test_every_datatype_round_trips(
    client: httpclient.InferenceServerClient, datatype: str, binary: bool
) -> None:
    data = sample(datatype)
    inp = httpclient.InferInput("INPUT0", list(data.shape), datatype)
    inp.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer(f"identity_{datatype.lower()}", [inp], outputs=[out])
    got = result.as_numpy("OUTPUT0")
    assert got is not None
    if datatype == "BYTES":
        # JSON carries strings: tritonclient hands them back as str, binary as bytes.
        expected = [v.decode() for v in data] if not binary else list(data)
        assert [v.decode() if isinstance(v, bytes) and not binary else v for v in got] == expected
    else:
        assert got.dtype == data.dtype
        np.testing.assert_array_equal(got, data)
    assert result.get_response()["model_name"] == f"identity_{datatype.lower()}"
    assert result.get_output("OUTPUT0")["datatype"] == datatype


def test_bf16_round_trips_over_binary(client: httpclient.InferenceServerClient) -> None:
    data = np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16)
    inp = httpclient.InferInput("INPUT0", [3], "BF16")
    inp.set_data_from_numpy(data, binary_data=True)
    result = client.infer("identity_bf16", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
    got = result.as_numpy("OUTPUT0")
    assert got is not None
    np.testing.assert_array_equal(got.view(ml_dtypes.bfloat16).astype(np.float32), data.astype(np.float32))


def simple_inputs(batch: int = 1, binary: bool = True) -> tuple[list[httpclient.InferInput], np.ndarray, np.ndarray]:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.full((batch, 16), 3, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [batch, 16], "INT32"), httpclient.InferInput("INPUT1", [batch, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a, b


def test_simple_model_batch_request_id_and_default_outputs(client: httpclient.InferenceServerClient) -> None:
    inputs, a, b = simple_inputs(batch=3)
    result = client.infer("simple", inputs, request_id="req-42")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "req-42"
    assert response["model_version"] == "1"


def test_only_requested_outputs_are_returned(client: httpclient.InferenceServerClient) -> None:
    inputs, a, b = simple_inputs(binary=False)
    result = client.infer("simple", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("simple")
    assert metadata["platform"] == "onnxruntime_onnx"
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert config["input"][1]["dims"] == [16]  # int64 as numbers, as Triton sends them
    assert config["input"][1]["data_type"] == "TYPE_INT32"


def test_classification_returns_top_k_with_labels(client: httpclient.InferenceServerClient) -> None:
    features = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    inp = httpclient.InferInput("INPUT", [2, 8], "FP32")
    inp.set_data_from_numpy(features)
    probabilities = client.infer("classifier", [inp]).as_numpy("OUTPUT")
    assert probabilities is not None
    result = client.infer("classifier", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT", class_count=3)])
    top = result.as_numpy("OUTPUT")
    assert top is not None and top.shape == (2, 3)
    for row in range(2):
        order = np.argsort(-probabilities[row])[:3]
        for rank, entry in enumerate(top[row]):
            value, index, label = entry.decode().split(":")
            assert int(index) == order[rank]
            assert label == LABELS[order[rank]]
            assert float(value) == pytest.approx(probabilities[row][order[rank]], abs=1e-6)


def test_version_policies(client: httpclient.InferenceServerClient) -> None:
    assert client.get_model_metadata("versioned")["versions"] == ["2", "3"]
    assert client.get_model_metadata("versioned_all")["versions"] == ["1", "2", "3"]
    assert client.get_model_metadata("versioned_specific")["versions"] == ["1", "3"]
    assert not client.is_model_ready("versioned", "1")
    assert client.is_model_ready("versioned", "2")
    data = np.zeros((1, 4), dtype=np.float32)
    for version, expected in (("", 3.0), ("2", 2.0), ("3", 3.0)):
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(data)
        result = client.infer("versioned", [inp], model_version=version)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data + expected)
        assert result.get_response()["model_version"] == (version or "3")
    with pytest.raises(InferenceServerException, match="version 1 is not served"):
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(data)
        client.infer("versioned", [inp], model_version="1")


def test_autocomplete_fills_config_from_onnx_model(client: httpclient.InferenceServerClient) -> None:
    config = client.get_model_config("autocomplete")
    assert config["max_batch_size"] == 4
    assert config["backend"] == "onnxruntime"
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["input"][0]["dims"] == [16]
    partial = client.get_model_config("partial")
    assert partial["max_batch_size"] == 2
    assert [o["name"] for o in partial["output"]] == ["OUTPUT0", "OUTPUT1"]
    inputs, a, b = simple_inputs(batch=2)
    np.testing.assert_array_equal(client.infer("autocomplete", inputs).as_numpy("OUTPUT0"), a + b)


def test_python_add_sub_example(client: httpclient.InferenceServerClient) -> None:
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    y = np.array([0.5, 0.5, 0.5, 0.5], dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(y)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + y)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x - y)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(client: httpclient.InferenceServerClient, algorithm: str) -> None:
    inputs, a, b = simple_inputs(batch=2)
    result = client.infer(
        "simple",
        inputs,
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_broken_model_is_unavailable_with_reason(client: httpclient.InferenceServerClient) -> None:
    assert not client.is_model_ready("broken")
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("broken", [inp])
    assert info.value.status() == "503"
    assert "weights file is corrupt" in info.value.message()


def test_asyncio_client_concurrent_requests(server: QuiverServer) -> None:
    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(server.url) as client:
            assert await client.is_server_ready()
            assert (await client.get_model_metadata("simple"))["name"] == "simple"

            async def one(i: int) -> None:
                a = np.full((1, 16), i, dtype=np.int32)
                inputs = [aiohttpclient.InferInput("INPUT0", [1, 16], "INT32"), aiohttpclient.InferInput("INPUT1", [1, 16], "INT32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(a, binary_data=False)
                result = await client.infer("simple", inputs, request_id=str(i))
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
                assert result.get_response()["id"] == str(i)

            await asyncio.gather(*(one(i) for i in range(32)))

    asyncio.run(main())


def test_python_bytes_model(client: httpclient.InferenceServerClient) -> None:
    text = np.array([["héllo", "world"]], dtype=np.object_)
    inp = httpclient.InferInput("TEXT", [1, 2], "BYTES")
    inp.set_data_from_numpy(text)
    result = client.infer("string_upper", [inp])
    assert result.as_numpy("UPPER").tolist() == [["HÉLLO".encode(), b"WORLD"]]


def test_model_whose_execute_raises_gets_a_500_naming_it(client: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("raises", [inp])
    assert info.value.status() == "500"
    assert "model 'raises'" in info.value.message() and "tokenizer exploded" in info.value.message()


def test_model_whose_session_fails_is_unavailable(client: httpclient.InferenceServerClient) -> None:
    assert not client.is_model_ready("corrupt_onnx")
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("corrupt_onnx")
    assert info.value.status() == "503"
    assert "onnxruntime could not load" in info.value.message()


def test_kind_gpu_falls_back_to_cpu_with_a_log_line(client: httpclient.InferenceServerClient, server: QuiverServer) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has a CUDA provider: KIND_GPU does not fall back here")
    inputs, a, b = simple_inputs()
    np.testing.assert_array_equal(client.infer("gpu_simple", inputs).as_numpy("OUTPUT0"), a + b)
    assert "KIND_GPU asked for, but onnxruntime has no CUDA execution provider" in server.log
