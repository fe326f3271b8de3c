"""Triton's rules where Quiver used to differ: ensembles over batching and non-batching models,
classification labels from every label-file form, the repository index listing every model,
duplicate output names, JSON nesting and chunk limits, and Triton's error texts; with
tritonclient (HTTP and gRPC, sync and asyncio) and plain HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from build_repository import CLASSIFIER_CONFIG, classifier_onnx
from tritonclient.utils import InferenceServerException

from support.models import write_config, write_onnx
from support.server import QuiverServer

LABELS = [f"class {i}" for i in range(10)]

#: label file name -> its bytes (each form Triton's readers meet), and the labels expected
LABEL_FILES: dict[str, tuple[bytes, list[str]]] = {
    "lf": ("\n".join(LABELS).encode() + b"\n", LABELS),
    "crlf": ("\r\n".join(LABELS).encode() + b"\r\n", LABELS),
    "cr": ("\r".join(LABELS).encode(), LABELS),
    "bom": (b"\xef\xbb\xbf" + "\n".join(LABELS).encode(), LABELS),
    "utf16": ("\n".join(LABELS).encode("utf-16"), LABELS),
    "latin1": ("\n".join([*LABELS[:9], "caf\xe9"]).encode("latin-1"), [*LABELS[:9], "caf\xe9"]),
    "form_feed": ("\n".join([*LABELS[:9], "a\x0cb"]).encode(), [*LABELS[:9], "a\x0cb"]),
}

BATCHING_IDENTITY = """
name: "{name}"
backend: "identity"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""

#: Triton serves this: a non-batching ensemble ([16]) over composing models that batch ([-1]).
FLAT_ENSEMBLE = """
name: "flat"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "batcher_a" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "flat_identity" model_version: -1 input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "mid2" } },
  { model_name: "batcher_b" model_version: -1 input_map { key: "INPUT0" value: "mid2" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""

FLAT_IDENTITY = """
name: "flat_identity"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""

#: A batching ensemble over a non-batching model whose dims include the batch ([-1, 4]).
BATCHED_OVER_FLAT = """
name: "batched_over_flat"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "flat_rows" input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""

FLAT_ROWS = """
name: "flat_rows"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
"""

#: The classifier's output, through an ensemble whose output has no label file of its own.
LABELLED_ENSEMBLE = """
name: "labelled_ensemble"
platform: "ensemble"
max_batch_size: 16
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling { step [
  { model_name: "classifier_crlf" input_map { key: "INPUT" value: "IN" } output_map { key: "OUTPUT" value: "SCORES" } }
] }
"""


def _build(root: Path) -> Path:
    repo = root / "models"
    repo.mkdir()
    for name in ("batcher_a", "batcher_b"):
        write_config(repo, name, BATCHING_IDENTITY.format(name=name))
    write_config(repo, "flat_identity", FLAT_IDENTITY)
    write_config(repo, "flat", FLAT_ENSEMBLE)
    write_config(repo, "flat_rows", FLAT_ROWS)
    write_config(repo, "batched_over_flat", BATCHED_OVER_FLAT)
    for form, (raw, _) in LABEL_FILES.items():
        name = f"classifier_{form}"
        folder = write_onnx(repo, name, classifier_onnx(), CLASSIFIER_CONFIG.replace('"classifier"', f'"{name}"'))
        (folder / "labels.txt").write_bytes(raw)
    write_config(repo, "labelled_ensemble", LABELLED_ENSEMBLE)
    # models that fail to load: the index lists them with the reason
    write_config(repo, "bad_config", 'backend: "identity"\nthis is not a config\n')
    corrupt = repo / "corrupt_onnx" / "1"
    corrupt.mkdir(parents=True)
    (corrupt / "model.onnx").write_bytes(b"not a model")
    (repo / "corrupt_onnx" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [1] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]\n'
    )
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = _build(tmp_path_factory.mktemp("parity"))
    with QuiverServer(repo, args=("--exit-on-error=false", "--strict-readiness=false")) as running:
        yield running


def _client(server: QuiverServer, protocol: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url)
    return grpcclient.InferenceServerClient(server.grpc_url)


def _module(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_non_batching_ensemble_over_batching_models(server: QuiverServer, protocol: str) -> None:
    module = _module(protocol)
    tensor = module.InferInput("IN", [16], "FP32")
    data = np.arange(16, dtype=np.float32)
    tensor.set_data_from_numpy(data)
    result = _client(server, protocol).infer("flat", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUT"), data)  # [16] back, not [1, 16]


def test_a_batching_ensemble_over_a_non_batching_model(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    tensor = httpclient.InferInput("IN", [3, 4], "FP32")
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("batched_over_flat", [tensor]).as_numpy("OUT"), data)


def test_ensembles_with_asyncio_clients(server: QuiverServer) -> None:
    async def run() -> None:
        data = np.arange(16, dtype=np.float32)
        async with httpaio.InferenceServerClient(server.url) as client:
            tensor = httpclient.InferInput("IN", [16], "FP32")
            tensor.set_data_from_numpy(data)
            np.testing.assert_array_equal((await client.infer("flat", [tensor])).as_numpy("OUT"), data)
        grpc = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            tensor = grpcclient.InferInput("IN", [16], "FP32")
            tensor.set_data_from_numpy(data)
            np.testing.assert_array_equal((await grpc.infer("flat", [tensor])).as_numpy("OUT"), data)
        finally:
            await grpc.close()

    asyncio.run(run())


def _top(client: Any, module: Any, model: str, k: int = 10) -> list[str]:
    tensor = module.InferInput("IN" if model == "labelled_ensemble" else "INPUT", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 8), dtype=np.float32))
    output = module.InferRequestedOutput("SCORES" if model == "labelled_ensemble" else "OUTPUT", class_count=k)
    result = client.infer(model, [tensor], outputs=[output])
    name = "SCORES" if model == "labelled_ensemble" else "OUTPUT"
    return [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy(name)[0]]


@pytest.mark.parametrize("form", sorted(LABEL_FILES))
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classification_labels_from_every_label_file_form(server: QuiverServer, protocol: str, form: str) -> None:
    labels = LABEL_FILES[form][1]
    entries = _top(_client(server, protocol), _module(protocol), f"classifier_{form}")
    assert len(entries) == 10
    for entry in entries:
        score, index, label = entry.split(":", 2)
        float(score)
        assert label == labels[int(index)], (form, entry)


def test_an_ensemble_output_has_the_labels_of_the_output_that_produces_it(server: QuiverServer) -> None:
    entries = _top(httpclient.InferenceServerClient(server.url), httpclient, "labelled_ensemble", k=3)
    for entry in entries:
        _, index, label = entry.split(":", 2)
        assert label == LABELS[int(index)]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_repository_index_lists_every_model_with_state_and_reason(server: QuiverServer, protocol: str) -> None:
    client = _client(server, protocol)
    if protocol == "http":
        entries = {e["name"]: e for e in client.get_model_repository_index()}
    else:
        entries = {
            m.name: {"name": m.name, "state": m.state, "reason": m.reason, "version": m.version}
            for m in client.get_model_repository_index().models
        }
    assert entries["flat"]["state"] == "READY"
    for failed in ("bad_config", "corrupt_onnx"):
        assert entries[failed]["state"] == "UNAVAILABLE", entries[failed]
        assert entries[failed]["reason"], entries[failed]
    # ready=true lists only the READY ones
    body = requests.post(f"{server.http}/v2/repository/index", json={"ready": True}, timeout=30).json()
    assert "bad_config" not in {e["name"] for e in body} and "flat" in {e["name"] for e in body}


def test_duplicate_output_names_are_a_400(server: QuiverServer) -> None:
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 8], "data": [[1.0] * 8]}],
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}],
    }
    response = requests.post(f"{server.http}/v2/models/batcher_a/infer", json=body, timeout=30)
    assert response.status_code == 400
    assert "output 'OUTPUT0' already exists in request" in response.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 8), dtype=np.float32))
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT0")]
    with pytest.raises(InferenceServerException, match="output 'OUTPUT0' already exists in request") as caught:
        client.infer("batcher_a", [tensor], outputs=outputs)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert requests.get(f"{server.http}/v2/health/live", timeout=30).status_code == 200


def test_json_nesting_depth(server: QuiverServer) -> None:
    def nested(depth: int) -> Any:
        value: Any = 1.0
        for _ in range(depth):
            value = [value]
        return value

    url = f"{server.http}/v2/models/flat_identity/infer"
    deep = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16], "data": nested(120)}]}
    response = requests.post(url, json=deep, timeout=30)
    assert response.status_code == 400
    assert "JSON nesting depth exceeds maximum allowed limit (100)" in response.json()["error"]
    index = requests.post(
        f"{server.http}/v2/repository/index", data='{"ready":' + "[" * 300 + "true" + "]" * 300 + "}", timeout=30
    )
    assert index.status_code == 400
    assert "JSON nesting depth exceeds maximum allowed limit (100)" in index.json()["error"]


def _chunked(server: QuiverServer, chunks: int) -> bytes:
    """A raw request whose body comes in ``chunks`` chunks of one byte (qa/L0_http's test)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v2/models/flat_identity/infer HTTP/1.1\r\nHost: x\r\n"
            b"Inference-Header-Content-Length: 0\r\nContent-Type: application/octet-stream\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        # the server may answer and close before it read everything
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"1\r\nA\r\n" * chunks + b"0\r\n\r\n")
        response = b""
        while True:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            response += part
    return response


def test_chunked_bodies_of_too_many_chunks_are_refused(server: QuiverServer) -> None:
    at_limit = _chunked(server, 65536)
    assert at_limit.startswith(b"HTTP/1.1 400 "), at_limit[:200]
    assert b"input byte size mismatch for input 'INPUT0' for model 'flat_identity'" in at_limit
    over = _chunked(server, 65537)
    assert over.startswith(b"HTTP/1.1 400 "), over[:200]
    assert (
        b"Chunked request body exceeds maximum of 65536 non-empty chunks. Send fewer or larger HTTP chunks."
        in over
    )
    assert requests.get(f"{server.http}/v2/health/live", timeout=30).status_code == 200


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritons_texts_for_common_mistakes(server: QuiverServer, protocol: str) -> None:
    client = _client(server, protocol)
    module = _module(protocol)
    tensor = module.InferInput("INPUT0", [9, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((9, 16), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="inference request batch-size must be <= 8 for 'batcher_a'"):
        client.infer("batcher_a", [tensor])
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
        client.infer("nope", [tensor])
    wrong = module.InferInput("INPUT0", [16], "INT32")
    wrong.set_data_from_numpy(np.ones(16, dtype=np.int32))
    with pytest.raises(
        InferenceServerException,
        match="inference input 'INPUT0' data-type is 'INT32', but model 'flat_identity' expects 'FP32'",
    ):
        client.infer("flat_identity", [wrong])
    short = module.InferInput("INPUT0", [15], "FP32")
    short.set_data_from_numpy(np.ones(15, dtype=np.float32))
    with pytest.raises(
        InferenceServerException,
        match=r"unexpected shape for input 'INPUT0' for model 'flat_identity'. Expected \[16\], got \[15\]",
    ):
        client.infer("flat_identity", [short])
