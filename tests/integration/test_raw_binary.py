"""Raw binary requests (``Inference-Header-Content-Length: 0``): the whole body is the one
input, its shape deduced from the model configuration, with Triton's rules and messages
(qa/L0_http/http_test.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests

from support.models import write_config
from support.server import QuiverServer

RAW = {"Inference-Header-Content-Length": "0"}


def _identity(name: str, datatype: str, dims: str, max_batch: int = 0, inputs: int = 1) -> str:
    ins = ", ".join(
        f'{{ name: "INPUT{i}" data_type: {datatype} dims: {dims} }}' for i in range(inputs)
    )
    outs = ", ".join(
        f'{{ name: "OUTPUT{i}" data_type: {datatype} dims: {dims} }}' for i in range(inputs)
    )
    return (
        f'name: "{name}"\nbackend: "identity"\nmax_batch_size: {max_batch}\n'
        f"input [ {ins} ]\noutput [ {outs} ]\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo: Path = tmp_path_factory.mktemp("raw") / "models"
    repo.mkdir()
    write_config(repo, "zero_1_float32", _identity("zero_1_float32", "TYPE_FP32", "[ -1 ]"))
    write_config(repo, "batched_4", _identity("batched_4", "TYPE_FP32", "[ 4 ]", max_batch=8))
    write_config(repo, "batched_var", _identity("batched_var", "TYPE_INT32", "[ 2, -1 ]", max_batch=8))
    write_config(repo, "zero_1_object_1_element", _identity("zero_1_object_1_element", "TYPE_STRING", "[ 1 ]"))
    write_config(repo, "zero_1_object", _identity("zero_1_object", "TYPE_STRING", "[ -1 ]"))
    write_config(repo, "zero_1_float16", _identity("zero_1_float16", "TYPE_FP16", "[ -1, -1 ]"))
    write_config(repo, "zero_3_float32", _identity("zero_3_float32", "TYPE_FP32", "[ -1 ]", inputs=3))
    with QuiverServer(repo) as running:
        yield running


def _post(server: QuiverServer, model: str, body: bytes) -> requests.Response:
    return requests.post(f"{server.http}/v2/models/{model}/infer", data=body, headers=RAW, timeout=30)


def _output(response: requests.Response) -> tuple[dict[str, object], bytes]:
    size = int(response.headers["Inference-Header-Content-Length"])
    import json

    return json.loads(response.content[:size]), response.content[size:]


@pytest.mark.parametrize("count", [8, 32])
def test_raw_body_is_the_input_and_the_output_comes_back_binary(server: QuiverServer, count: int) -> None:
    data = np.arange(count, dtype=np.float32).tobytes()
    response = _post(server, "zero_1_float32", data)
    assert response.status_code == 200, response.text
    header, binary = _output(response)
    assert binary == data
    (output,) = header["outputs"]  # type: ignore[misc]
    assert output == {
        "name": "OUTPUT0",
        "datatype": "FP32",
        "shape": [count],
        "parameters": {"binary_data_size": len(data)},
    }


def test_a_batching_model_gets_a_batch_of_one(server: QuiverServer) -> None:
    data = np.arange(4, dtype=np.float32).tobytes()
    response = _post(server, "batched_4", data)
    assert response.status_code == 200, response.text
    header, binary = _output(response)
    assert header["outputs"][0]["shape"] == [1, 4]  # type: ignore[index]
    assert binary == data


def test_the_variable_dim_is_deduced_from_the_size(server: QuiverServer) -> None:
    data = np.arange(10, dtype=np.int32).tobytes()
    response = _post(server, "batched_var", data)
    assert response.status_code == 200, response.text
    header, binary = _output(response)
    assert header["outputs"][0]["shape"] == [1, 2, 5]  # type: ignore[index]
    assert binary == data


def test_a_size_that_does_not_fit_is_a_byte_size_mismatch(server: QuiverServer) -> None:
    response = _post(server, "batched_4", np.arange(5, dtype=np.float32).tobytes())
    assert response.status_code == 400
    assert response.json()["error"] == (
        "input byte size mismatch for input 'INPUT0' for model 'batched_4'. Expected 16, got 20"
    )
    response = _post(server, "batched_var", b"\x00" * 12)  # 3 int32 for dims [2, -1]
    assert response.status_code == 400
    assert "input byte size mismatch for input 'INPUT0' for model 'batched_var'" in response.json()["error"]


def test_bytes_input_of_one_element(server: QuiverServer) -> None:
    response = _post(server, "zero_1_object_1_element", b"427")
    assert response.status_code == 200, response.text
    header, binary = _output(response)
    assert header["outputs"][0]["shape"] == [1]  # type: ignore[index]
    assert binary[4:].decode() == "427"  # BYTES with the 4-byte length first
    assert int.from_bytes(binary[:4], "little") == 3


def test_bytes_input_needs_shape_one(server: QuiverServer) -> None:
    response = _post(server, "zero_1_object", b"427")
    assert response.status_code == 400
    assert "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]" in response.text


def test_more_than_one_variable_dim(server: QuiverServer) -> None:
    response = _post(server, "zero_1_float16", np.ones([2, 2], dtype=np.float16).tobytes())
    assert response.status_code == 400
    assert (
        "The shape of the raw input 'INPUT0' can not be deduced because there are more than one "
        "variable-sized dimension" in response.text
    )


def test_more_than_one_input(server: QuiverServer) -> None:
    response = _post(server, "zero_3_float32", np.arange(24, dtype=np.float32).tobytes())
    assert response.status_code == 400
    assert (
        "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in "
        "'zero_3_float32' model configuration" in response.text
    )


def test_an_empty_body_is_a_zero_size_tensor(server: QuiverServer) -> None:
    response = _post(server, "zero_1_float32", b"")
    assert response.status_code == 200, response.text
    header, binary = _output(response)
    assert header["outputs"][0]["shape"] == [0]  # type: ignore[index]
    assert binary == b""


def test_the_server_keeps_serving_json_requests(server: QuiverServer) -> None:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}
    response = requests.post(f"{server.http}/v2/models/zero_1_float32/infer", json=body, timeout=30)
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [1.0, 2.0]


def test_a_raw_body_over_the_input_size_limit(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    write_config(repo, "zero_1_float32", _identity("zero_1_float32", "TYPE_FP32", "[ -1 ]"))
    with QuiverServer(repo, args=("--http-max-input-size=1024",)) as running:
        response = _post(running, "zero_1_float32", bytes(2048))
        assert response.status_code == 413  # Triton: 400 (see the README's table)
        assert response.json()["error"] == (
            "Raw input has a byte_size (2048 bytes) that exceeds the maximum allowed value of 1024 "
            "bytes. Use --http-max-input-size to increase the limit."
        )
