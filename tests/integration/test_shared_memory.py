"""System shared memory (Triton's shared-memory extension) with ``tritonclient.utils.shared_memory``:
regions registered, used for inputs and outputs, listed and unregistered over HTTP and gRPC
(sync and asyncio), with Triton's errors (qa/L0_shared_memory/shared_memory_test.py); CUDA
shared memory answered as a Triton without GPU support."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import threading
import uuid
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
import tritonclient.utils.shared_memory as shm
from build_repository import SIMPLE_CONFIG, simple_onnx
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from support.models import write_config, write_onnx, write_python
from support.server import QuiverServer

BYTES = 64  # 16 INT32
PROTOCOLS = ["http", "grpc"]

GATED_MODEL = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        folder = os.path.join(os.path.dirname(__file__), "..")
        with open(os.path.join(folder, "entered"), "w") as marker:
            marker.write("in execute")
        gate = os.path.join(folder, "gate")
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return responses
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shm") / "models"
    root.mkdir()
    write_onnx(root, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_config(
        root,
        "strings",
        """
        backend: "identity"
        max_batch_size: 0
        input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
        """,
    )
    write_python(
        root,
        "gated",
        GATED_MODEL,
        """
        backend: "python"
        max_batch_size: 0
        input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
        """,
    )
    return root


@pytest.fixture(scope="module", params=["one-process", "frontend-workers"])
def server(request: pytest.FixtureRequest, repo: Path) -> Iterator[QuiverServer]:
    """Served by the server process, then by frontend worker processes (registration relayed
    to the model side, which reads the regions)."""
    workers = ("--frontend-workers", "2") if request.param == "frontend-workers" else ()
    with QuiverServer(repo, args=("--allow-client-shm=true", *workers)) as running:
        yield running


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    root = tmp_path_factory.mktemp("shm_off") / "models"
    root.mkdir()
    write_onnx(root, "simple", simple_onnx(), SIMPLE_CONFIG)
    with QuiverServer(root) as running:  # --allow-client-shm defaults to false, as in Triton
        yield running


class Regions:
    """Shared-memory objects this test created (unique keys), destroyed at the end."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}
        self.prefix = f"quiver_test_{uuid.uuid4().hex[:12]}"

    def create(self, name: str, size: int = BYTES) -> tuple[str, Any]:
        key = f"/{self.prefix}_{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        self.handles[name] = handle
        return key, handle

    def destroy(self) -> None:
        for handle in self.handles.values():
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.destroy()


def _client(server: QuiverServer, protocol: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.url)
    return grpcclient.InferenceServerClient(server.grpc_url)


def _module(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


@pytest.fixture(autouse=True)
def _clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts and ends with no region registered on the shared server."""
    yield
    if "server" in request.fixturenames:
        running: QuiverServer = request.getfixturevalue("server")
        httpclient.InferenceServerClient(running.url).unregister_system_shared_memory()


def _status_names(client: Any, protocol: str) -> set[str]:
    status = client.get_system_shared_memory_status()
    if protocol == "http":
        return {region["name"] for region in status}
    return set(status.regions)


def _register_simple(client: Any, regions: Regions, offset: int = 0) -> dict[str, Any]:
    handles = {}
    for name in ("input0", "input1", "output0", "output1"):
        key, handle = regions.create(name, BYTES + offset)
        client.register_system_shared_memory(name, key, BYTES, offset=offset)
        handles[name] = handle
    shm.set_shared_memory_region(handles["input0"], [np.arange(16, dtype=np.int32)], offset=offset)
    shm.set_shared_memory_region(handles["input1"], [np.ones(16, dtype=np.int32)], offset=offset)
    return handles


def _simple_request(module: Any, offset: int = 0) -> tuple[list[Any], list[Any]]:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input0", BYTES, offset=offset)
    inputs[1].set_shared_memory("input1", BYTES, offset=offset)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output0", BYTES, offset=offset)
    outputs[1].set_shared_memory("output1", BYTES, offset=offset)
    return inputs, outputs


def _check_outputs(handles: dict[str, Any], result: Any, offset: int = 0) -> None:
    sum_ = shm.get_contents_as_numpy(handles["output0"], np.int32, [1, 16], offset=offset)
    diff = shm.get_contents_as_numpy(handles["output1"], np.int32, [1, 16], offset=offset)
    np.testing.assert_array_equal(sum_[0], np.arange(16) + 1)
    np.testing.assert_array_equal(diff[0], np.arange(16) - 1)
    # the response names the outputs but carries no data for them
    output = result.get_output("OUTPUT0")
    if isinstance(output, dict):  # HTTP: name, datatype and shape only
        assert output == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]}
    else:  # gRPC: the output's raw contents are empty
        assert output.name == "OUTPUT0" and list(output.shape) == [1, 16]
        assert result.get_response().raw_output_contents[0] == b""


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_round_trip_with_outputs_written_to_regions(server: QuiverServer, regions: Regions, protocol: str) -> None:
    client = _client(server, protocol)
    handles = _register_simple(client, regions)
    assert _status_names(client, protocol) == {"input0", "input1", "output0", "output1"}
    inputs, outputs = _simple_request(_module(protocol))
    result = client.infer("simple", inputs, outputs=outputs)
    _check_outputs(handles, result)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_round_trip_at_an_offset(server: QuiverServer, regions: Regions, protocol: str) -> None:
    client = _client(server, protocol)
    handles = _register_simple(client, regions, offset=32)
    inputs, outputs = _simple_request(_module(protocol))  # offsets are within the region
    result = client.infer("simple", inputs, outputs=outputs)
    _check_outputs(handles, result, offset=32)
    status = client.get_system_shared_memory_status("input0")
    entry = status[0] if protocol == "http" else status.regions["input0"]
    if protocol == "http":
        assert entry["offset"] == 32 and entry["byte_size"] == BYTES
        assert entry["key"] == f"/{regions.prefix}_input0"
    else:
        assert entry.offset == 32 and entry.byte_size == BYTES


def test_asyncio_clients_round_trip(server: QuiverServer, regions: Regions) -> None:
    async def run(protocol: str) -> None:
        if protocol == "http":
            client: Any = httpaio.InferenceServerClient(server.url)
            module: Any = httpclient
        else:
            client = grpcaio.InferenceServerClient(server.grpc_url)
            module = grpcclient
        try:
            handles = {}
            for name in ("input0", "input1", "output0", "output1"):
                key, handle = regions.create(f"{protocol}_{name}")
                await client.register_system_shared_memory(name, key, BYTES)
                handles[name] = handle
            shm.set_shared_memory_region(handles["input0"], [np.arange(16, dtype=np.int32)])
            shm.set_shared_memory_region(handles["input1"], [np.ones(16, dtype=np.int32)])
            inputs, outputs = _simple_request(module)
            result = await client.infer("simple", inputs, outputs=outputs)
            _check_outputs(handles, result)
            await client.unregister_system_shared_memory()
            status = await client.get_system_shared_memory_status()
            assert len(status if protocol == "http" else status.regions) == 0
        finally:
            await client.close()

    asyncio.run(run("http"))
    asyncio.run(run("grpc"))


def test_grpc_stream_requests_use_regions(server: QuiverServer, regions: Regions) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    handles = _register_simple(client, regions)
    answers: list[Any] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        answers.append(error or result)
        if len(answers) == 3:
            done.set()

    client.start_stream(callback=callback)
    try:
        for _ in range(3):
            inputs, outputs = _simple_request(grpcclient)
            client.async_stream_infer("simple", inputs, outputs=outputs)
        assert done.wait(60)
    finally:
        client.stop_stream()
    for answer in answers:
        assert not isinstance(answer, InferenceServerException), answer
        _check_outputs(handles, answer)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shared_memory_inputs_mix_with_sent_inputs_and_outputs(
    server: QuiverServer, regions: Regions, protocol: str
) -> None:
    client = _client(server, protocol)
    module = _module(protocol)
    key, handle = regions.create("input0")
    client.register_system_shared_memory("input0", key, BYTES)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    out_key, out_handle = regions.create("output1")
    client.register_system_shared_memory("output1", out_key, BYTES)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input0", BYTES)
    inputs[1].set_data_from_numpy(np.full((1, 16), 5, dtype=np.int32))
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[1].set_shared_memory("output1", BYTES)
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0")[0], np.arange(16) + 5)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(out_handle, np.int32, [16]), np.arange(16) - 5
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bytes_tensors_through_regions(server: QuiverServer, regions: Regions, protocol: str) -> None:
    client = _client(server, protocol)
    module = _module(protocol)
    data = np.array([b"alpha", b"", b"gamma delta"], dtype=object)
    serialized = serialize_byte_tensor(data)
    size = serialized_byte_size(serialized)
    key, handle = regions.create("strings_in", size)
    out_key, out_handle = regions.create("strings_out", size)
    client.register_system_shared_memory("strings_in", key, size)
    client.register_system_shared_memory("strings_out", out_key, size)
    shm.set_shared_memory_region(handle, [serialized])
    inputs = [module.InferInput("INPUT0", [3], "BYTES")]
    inputs[0].set_shared_memory("strings_in", size)
    outputs = [module.InferRequestedOutput("OUTPUT0")]
    outputs[0].set_shared_memory("strings_out", size)
    client.infer("strings", inputs, outputs=outputs)
    got = shm.get_contents_as_numpy(out_handle, np.object_, [3])
    assert list(got) == list(data)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_register_errors(server: QuiverServer, regions: Regions, protocol: str) -> None:
    client = _client(server, protocol)
    key, _ = regions.create("dummy")
    client.register_system_shared_memory("dummy", key, BYTES)
    with pytest.raises(InferenceServerException, match="shared memory region 'dummy' already in manager"):
        client.register_system_shared_memory("dummy", key, BYTES)
    for offset, size in ((0, BYTES + 1), (1, BYTES), (BYTES, 1), (BYTES + 1, 0)):
        with pytest.raises(
            InferenceServerException, match="failed to register shared memory region 'other': invalid args"
        ):
            client.register_system_shared_memory("other", key, size, offset=offset)
    with pytest.raises(InferenceServerException, match="Unable to open shared memory region: '/quiver_no_such"):
        client.register_system_shared_memory("other", "/quiver_no_such_key", 8)
    for bad in ("/", "///", "/a/../b"):
        with pytest.raises(InferenceServerException, match="invalid shm key"):
            client.register_system_shared_memory("other", bad, 8)
    reserved = "/triton_python_backend_shm_region_x"
    with pytest.raises(
        InferenceServerException,
        match="cannot register shared memory region 'other' with key '/triton_python_backend_shm_region_x' "
        "as the key contains the reserved prefix 'triton_python_backend_shm_region_'",
    ):
        client.register_system_shared_memory("other", reserved, 8)
    assert _status_names(client, protocol) == {"dummy"}
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'nope'"):
        client.get_system_shared_memory_status("nope")


def test_register_does_not_follow_links(server: QuiverServer, regions: Regions, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    link = Path("/dev/shm") / f"{regions.prefix}_link"
    link.symlink_to(secret)
    try:
        with pytest.raises(InferenceServerException, match="Unable to open shared memory region"):
            httpclient.InferenceServerClient(server.url).register_system_shared_memory(
                "link", f"/{link.name}", 8
            )
    finally:
        link.unlink()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_inference_errors(server: QuiverServer, regions: Regions, protocol: str) -> None:
    client = _client(server, protocol)
    module = _module(protocol)
    handles = _register_simple(client, regions)
    # a region larger than the input: the byte sizes must match
    big_key, _ = regions.create("big", 128)
    client.register_system_shared_memory("big", big_key, 128)
    inputs, outputs = _simple_request(module)
    inputs[1].set_shared_memory("big", 128)
    with pytest.raises(
        InferenceServerException,
        match=re.escape("input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 128"),
    ):
        client.infer("simple", inputs, outputs=outputs)
    # an output region too small for the result
    inputs, outputs = _simple_request(module)
    outputs[0].set_shared_memory("output0", 32)
    with pytest.raises(
        InferenceServerException,
        match=r"shared memory size specified with the request for output 'OUTPUT0' \(32 bytes\) "
        "should be at least 64 bytes to hold the results",
    ):
        client.infer("simple", inputs, outputs=outputs)
    # past the region's end
    inputs, outputs = _simple_request(module)
    inputs[0].set_shared_memory("input0", BYTES, offset=8)
    with pytest.raises(
        InferenceServerException, match="Invalid offset \\+ byte size for shared memory region: 'input0'"
    ):
        client.infer("simple", inputs, outputs=outputs)
    inputs, outputs = _simple_request(module)
    inputs[0].set_shared_memory("input0", 0, offset=BYTES)
    with pytest.raises(InferenceServerException, match="Invalid offset for shared memory region: 'input0'"):
        client.infer("simple", inputs, outputs=outputs)
    # unregistered, then used
    client.unregister_system_shared_memory("input0")
    assert _status_names(client, protocol) == {"input1", "output0", "output1", "big"}
    inputs, outputs = _simple_request(module)
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'input0'"):
        client.infer("simple", inputs, outputs=outputs)
    # the server goes on serving
    key, _ = regions.create("again")
    client.register_system_shared_memory("input0", key, BYTES)
    shm.set_shared_memory_region(regions.handles["again"], [np.arange(16, dtype=np.int32)])
    inputs, outputs = _simple_request(module)
    _check_outputs(handles, client.infer("simple", inputs, outputs=outputs))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_region_shrunk_after_registering_is_refused(server: QuiverServer, regions: Regions, protocol: str) -> None:
    client = _client(server, protocol)
    module = _module(protocol)
    handles = _register_simple(client, regions)
    os.truncate(f"/dev/shm/{regions.prefix}_input0", 8)  # a hostile client's ftruncate
    inputs, outputs = _simple_request(module)
    with pytest.raises(InferenceServerException, match="shared memory region 'input0' is no longer its registered size"):
        client.infer("simple", inputs, outputs=outputs)
    assert client.is_server_live()
    os.truncate(f"/dev/shm/{regions.prefix}_input0", BYTES)  # put back: usable again
    shm.set_shared_memory_region(handles["input0"], [np.arange(16, dtype=np.int32)])
    _check_outputs(handles, client.infer("simple", *_simple_request(module)[:1], outputs=_simple_request(module)[1]))


def test_http_classification_or_binary_with_a_region_is_refused(server: QuiverServer) -> None:
    body = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
        ],
        "outputs": [
            {"name": "OUTPUT0", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 64, "classification": 2}}
        ],
    }
    url = f"{server.http}/v2/models/simple/infer"
    response = requests.post(url, json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == "Output can't set both 'shared_memory_region' and 'classification'"
    body["outputs"][0]["parameters"] = {"shared_memory_region": "r", "shared_memory_byte_size": 64, "binary_data": True}
    response = requests.post(url, json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == "Output can't set both 'shared_memory_region' and 'binary_data'"
    body["outputs"] = []
    body["inputs"][0]["parameters"] = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
    response = requests.post(url, json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "Input must set only one of the following fields: 'data', 'binary_data_size' in "
        "'parameters', 'shared_memory_region' in 'parameters'. But set 'data' 'shared_memory_region'"
    )
    body["inputs"][0]["parameters"] = {"shared_memory_region": "r"}
    del body["inputs"][0]["data"]
    response = requests.post(url, json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == (
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter "
        "for tensor 'INPUT0'"
    )


def test_plain_http_register_status_unregister(server: QuiverServer, regions: Regions) -> None:
    key, _ = regions.create("plain")
    base = f"{server.http}/v2/systemsharedmemory"
    response = requests.post(f"{base}/region/plain/register", json={"key": key, "offset": 0, "byte_size": 16}, timeout=30)
    assert response.status_code == 200, response.text
    assert requests.get(f"{base}/status", timeout=30).json() == [
        {"name": "plain", "key": key, "offset": 0, "byte_size": 16}
    ]
    assert requests.get(f"{base}/region/plain/status", timeout=30).json()[0]["name"] == "plain"
    response = requests.post(f"{base}/region/plain/register", json={"offset": 0, "byte_size": 16}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == "Shared memory register request has no 'key' field"
    response = requests.post(f"{base}/region/x/register", json={"key": key}, timeout=30)
    assert response.json()["error"] == "Shared memory register request has no 'byte_size' field"
    response = requests.post(f"{base}/register", json={"key": key, "byte_size": 16}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"] == "'region name' is necessary to register system shared memory region"
    assert requests.get(f"{base}/region/plain/register", timeout=30).status_code == 405
    assert requests.post(f"{base}/unregister", timeout=30).status_code == 200
    assert requests.get(f"{base}/status", timeout=30).json() == []
    metadata = requests.get(f"{server.http}/v2", timeout=30).json()
    assert {"system_shared_memory", "cuda_shared_memory"} <= set(metadata["extensions"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_region_unregistered_while_in_use_goes_when_the_request_is_done(
    server: QuiverServer, repo: Path, regions: Regions, protocol: str
) -> None:
    gate, entered = repo / "gated" / "gate", repo / "gated" / "entered"
    gate.unlink(missing_ok=True)
    entered.unlink(missing_ok=True)
    client = _client(server, protocol)
    module = _module(protocol)
    key, handle = regions.create("gated_in")
    out_key, out_handle = regions.create("gated_out")
    client.register_system_shared_memory("gated_in", key, BYTES)
    client.register_system_shared_memory("gated_out", out_key, BYTES)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    inputs = [module.InferInput("INPUT0", [16], "INT32")]
    inputs[0].set_shared_memory("gated_in", BYTES)
    outputs = [module.InferRequestedOutput("OUTPUT0")]
    outputs[0].set_shared_memory("gated_out", BYTES)
    done: list[Any] = []
    worker = threading.Thread(
        target=lambda: done.append(_client(server, protocol).infer("gated", inputs, outputs=outputs))
    )
    worker.start()
    try:
        for _ in range(3000):  # until the request is in the model (the gate holds it there)
            if entered.exists():
                break
            threading.Event().wait(0.02)
        assert entered.exists(), "the request never reached the model"
        httpclient.InferenceServerClient(server.url).unregister_system_shared_memory()
        # still listed while the request uses them
        assert _status_names(client, protocol) == {"gated_in", "gated_out"}
    finally:
        gate.write_text("open")
        worker.join(60)
    assert done, "the request did not finish"
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [16]), np.arange(16))
    assert _status_names(client, protocol) == set()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cuda_shared_memory_as_a_triton_without_gpus(server: QuiverServer, protocol: str) -> None:
    client = _client(server, protocol)
    status = client.get_cuda_shared_memory_status()
    assert len(status if protocol == "http" else status.regions) == 0
    handle = base64.b64encode(bytes(64)) if protocol == "http" else bytes(64)
    with pytest.raises(
        InferenceServerException,
        match="failed to register CUDA shared memory region: 'gpu0', GPUs not supported",
    ):
        client.register_cuda_shared_memory("gpu0", handle, 0, 64)
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("gpu0")
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'gpu0'"):
        client.get_cuda_shared_memory_status("gpu0")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_client_shared_memory_is_off_by_default(
    locked_server: QuiverServer, regions: Regions, protocol: str
) -> None:
    client = _client(locked_server, protocol)
    key, _ = regions.create("dummy", 8)
    assert _status_names(client, protocol) == set()
    for call in (
        lambda: client.register_system_shared_memory("dummy", key, 8),
        lambda: client.unregister_system_shared_memory("dummy"),
        lambda: client.unregister_system_shared_memory(),
    ):
        with pytest.raises(InferenceServerException, match="Client shared memory is disabled") as caught:
            call()
        assert "'--allow-client-shm=true'" in str(caught.value)
    assert _status_names(client, protocol) == set()
    # inference without shared memory is unaffected
    inputs = [_module(protocol).InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    assert client.infer("simple", inputs).as_numpy("OUTPUT0")[0, 0] == 2
