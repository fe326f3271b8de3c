"""Names and paths from clients that the filesystem would refuse (a NUL byte, a component
longer than NAME_MAX, ``..``, a path too long) over HTTP, gRPC and the SageMaker routes:
model names, TargetModel values, archive keys, ``file:`` parameters of the repository API,
SageMaker ``url``\\ s. Each is a 400 / INVALID_ARGUMENT naming it, never a 500, and the next
correct request is answered correctly."""

from __future__ import annotations

import base64
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.archives import ADD, onnx_bytes, single_archive
from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer

TARGET = "X-Amzn-SageMaker-Target-Model"
LONG = "n" * 300
#: Names that reach the filesystem when a model is looked up, and what the error says.
BAD_NAMES = [
    (LONG, "300 bytes, more than the 255"),
    (LONG + ".tar.gz", "307 bytes, more than the 255"),
    ("a\x00b", "NUL or control character"),
    ("a\x00b.tar.gz", "NUL or control character"),
    ("x.tar.gz::" + LONG, "its component"),
    ("é" * 128 + ".tgz", "260 bytes"),
]


def x(value: float = 0.0) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def gx(value: float = 0.0) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def request(base: str, method: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    finally:
        conn.close()


INFER = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}
CONFIG = json.dumps(
    {
        "backend": "onnxruntime",
        "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    }
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("names_repo")
    write_onnx(repo, "plain", add_constant_onnx(7.0), ADD.format(name="plain"))
    (repo / "arch.tar.gz").write_bytes(single_archive(3.0))
    cache = tmp_path_factory.mktemp("names_cache")
    args = ("--model-control-mode=on_demand", "--model-cache-dir", str(cache))
    with QuiverServer(repo, args=args, env={"SAGEMAKER_MULTI_MODEL": "true"}) as server:
        yield server


def still_serving(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    assert client.infer("plain", x(1.0)).as_numpy("OUTPUT0").tolist() == [[8.0] * 4]
    assert client.infer("arch.tar.gz", x(1.0)).as_numpy("OUTPUT0").tolist() == [[4.0] * 4]


def shown(name: str) -> str:
    """How the error message shows the start of ``name`` (control characters escaped)."""
    return name.encode("unicode_escape").decode("ascii")[:40]


@pytest.mark.parametrize(("name", "why"), BAD_NAMES)
def test_bad_model_names_over_http_and_grpc(server: QuiverServer, name: str, why: str) -> None:
    http = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        http.infer(name, x())
    assert info.value.status() == "400", info.value.message()
    assert "is not a valid model name" in info.value.message() and why in info.value.message()
    assert shown(name) in info.value.message()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        grpc.infer(name, gx())
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value.message()
    assert why in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        grpc.load_model(name)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value.message()
    status, body = request(server.http, "POST", f"/v2/repository/models/{quote(name)}/load", {})
    assert status == 400 and why in body["error"], body
    status, body = request(server.http, "POST", f"/v2/repository/models/{quote(name)}/unload", {})
    assert status == 400 and why in body["error"], body
    still_serving(server)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("1/" + LONG, "its component"),
        ("1/a\x00b", "NUL or control character"),
        ("1/../../../etc/passwd", "'..'"),
        ("/1/model.onnx", "relative path"),
        ("model.onnx", "not inside a version folder"),
        ("1/" + "/".join(["d" * 200] * 6), "more than 1024"),
    ],
)
def test_bad_file_parameters_over_http_and_grpc(server: QuiverServer, path: str, why: str) -> None:
    model = onnx_bytes(add_constant_onnx(1.0))
    status, body = request(
        server.http,
        "POST",
        "/v2/repository/models/uploaded/load",
        {"parameters": {"config": CONFIG, f"file:{path}": base64.b64encode(model).decode()}},
    )
    assert status == 400, body
    assert "file parameter 'file:" in body["error"] and why in body["error"], body
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as info:
        grpc.load_model("uploaded", config=CONFIG, files={f"file:{path}": model})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and why in info.value.message()
    # The same load with a good path works.
    grpc.load_model("uploaded", config=CONFIG, files={"file:1/model.onnx": model})
    assert grpc.infer("uploaded", gx(1.0)).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]
    still_serving(server)


def test_file_parameters_that_clash(server: QuiverServer) -> None:
    http = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        http.load_model("clash", config=CONFIG, files={"file:1/model.onnx": b"a", "file:1/model.onnx/x": b"b"})
    assert info.value.status() == "400"
    assert "'file:1/model.onnx' is a file too" in info.value.message()
    still_serving(server)


@pytest.mark.parametrize(
    ("target", "why"),
    [
        (LONG, "300 bytes, more than the 255"),
        (LONG + ".tar.gz", "307 bytes"),
        ("a/../b.tar.gz", "must be a folder name"),
        ("bad name.tar.gz", "letters, digits"),
    ],
)
def test_bad_target_models_over_sagemaker(server: QuiverServer, target: str, why: str) -> None:
    status, body = request(server.sagemaker_url, "POST", "/invocations", INFER, {TARGET: target})
    assert status == 400, body
    assert "is not a valid model name" in body["error"] and why in body["error"], body
    status, body = request(server.sagemaker_url, "POST", "/invocations", INFER, {TARGET: "arch.tar.gz"})
    assert status == 200 and body["outputs"][0]["data"] == [4.0] * 4, body


def test_bad_urls_and_names_in_sagemaker_loads(server: QuiverServer, tmp_path: Path) -> None:
    (tmp_path / "sm.tar.gz").write_bytes(single_archive(9.0))
    for body, why in [
        ({"model_name": "m1", "url": str(tmp_path / LONG)}, "its component"),
        ({"model_name": "m1", "url": str(tmp_path / LONG) + ".tar.gz"}, "its component"),
        ({"model_name": "m1", "url": f"{tmp_path}/a\x00b.tar.gz"}, "NUL or control character"),
        ({"model_name": "m1", "url": "/" + "/".join(["d" * 200] * 21)}, "more than 4096"),
        ({"model_name": "m1", "url": f"s3://bucket/{LONG}.tar.gz"}, "307 bytes, more than the 255"),
        ({"model_name": LONG, "url": str(tmp_path / "sm.tar.gz")}, "300 bytes"),
    ]:
        status, reply = request(server.sagemaker_url, "POST", "/models", body)
        assert status == 400, (body, reply)
        assert why in reply["error"], reply
    status, reply = request(server.sagemaker_url, "POST", "/models", {"model_name": "m1", "url": str(tmp_path / "sm.tar.gz")})
    assert status == 200, reply
    status, reply = request(server.sagemaker_url, "POST", "/invocations", INFER, {TARGET: "m1"})
    assert status == 200 and reply["outputs"][0]["data"] == [10.0] * 4, reply
