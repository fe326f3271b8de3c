"""The gRPC frontend with the real tritonclient.grpc (sync and asyncio), the raw stub for
messages tritonclient never sends, the health service, flags and shutdown."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from support.models import write_onnx, write_python
from support.server import QuiverServer, run_quiver


@pytest.fixture(scope="module")
def client(server: QuiverServer) -> Any:
    made = grpcclient.InferenceServerClient(server.grpc_url)
    yield made
    made.close()


@pytest.fixture(scope="module")
def stub(server: QuiverServer) -> Any:
    channel = grpc.insecure_channel(server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata.name == "quiver"
    assert "classification" in metadata.extensions
    model = client.get_model_metadata("simple")
    assert model.platform == "onnxruntime_onnx"
    assert list(model.versions) == ["1"]
    assert (model.inputs[0].name, model.inputs[0].datatype, list(model.inputs[0].shape)) == ("INPUT0", "INT32", [-1, 16])
    as_json = client.get_model_metadata("simple", as_json=True)
    assert as_json["outputs"][1]["name"] == "OUTPUT1"
    assert list(client.get_model_metadata("versioned").versions) == ["2", "3"]


def test_model_config_is_the_real_proto(client: Any) -> None:
    response = client.get_model_config("simple")
    config = response.config
    assert isinstance(config, model_config_pb2.ModelConfig)
    assert config.name == "simple" and config.max_batch_size == 8
    assert config.input[1].data_type == model_config_pb2.TYPE_INT32
    assert list(config.input[1].dims) == [16]
    assert client.get_model_config("autocomplete", as_json=True)["config"]["max_batch_size"] == 4


def test_model_ready_answers_false_for_unknown_models(client: Any) -> None:
    """As Triton: ModelReady is ready=false (not an error) for what is not served."""
    assert client.is_model_ready("simple")
    assert client.is_model_ready("versioned", "2")
    assert not client.is_model_ready("versioned", "1")
    assert not client.is_model_ready("no_such_model")
    assert not client.is_model_ready("broken")


@pytest.mark.parametrize(
    ("call", "status", "message"),
    [
        (lambda c: c.get_model_metadata("no_such_model"), "StatusCode.NOT_FOUND", "unknown model: 'no_such_model'"),
        (lambda c: c.get_model_config("no_such_model"), "StatusCode.NOT_FOUND", "unknown model"),
        (lambda c: c.get_model_metadata("simple", "7"), "StatusCode.NOT_FOUND", "version 7 is not served"),
        (lambda c: c.get_model_config("broken"), "StatusCode.UNAVAILABLE", "weights file is corrupt"),
        (lambda c: c.get_model_metadata("simple", "latest"), "StatusCode.INVALID_ARGUMENT", "is not a number"),
    ],
)
def test_metadata_errors(client: Any, call: Any, status: str, message: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call(client)
    assert info.value.status() == status
    assert message in info.value.message()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compression_and_request_parameters(client: Any, algorithm: str) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer(
        "simple", inputs, compression_algorithm=algorithm, priority=1, timeout=1000, parameters={"custom": "x"}
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_response_carries_every_output_raw_in_order(stub: Any) -> None:
    request = service_pb2.ModelInferRequest(model_name="simple", id="raw-1")
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[2, 16])
        request.raw_input_contents.append(a.tobytes())
    request.outputs.add(name="OUTPUT1")
    request.outputs.add(name="OUTPUT0")
    response = stub.ModelInfer(request, timeout=30)
    assert (response.model_name, response.model_version, response.id) == ("simple", "1", "raw-1")
    assert [o.name for o in response.outputs] == ["OUTPUT1", "OUTPUT0"]
    assert all(not o.HasField("contents") for o in response.outputs)
    assert len(response.raw_output_contents) == 2
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.int32), np.zeros(32))
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[1], np.int32), (a * 2).reshape(-1))


def test_bytes_response_is_length_prefixed(stub: Any) -> None:
    request = service_pb2.ModelInferRequest(model_name="identity_bytes")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"ab", b""])
    response = stub.ModelInfer(request, timeout=30)
    assert response.raw_output_contents[0] == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 0)


def test_classification_through_uint64_parameter(stub: Any) -> None:
    request = service_pb2.ModelInferRequest(model_name="classifier")
    request.inputs.add(name="INPUT", datatype="FP32", shape=[1, 8]).contents.fp32_contents.extend(range(8))
    request.outputs.add(name="OUTPUT").parameters["classification"].uint64_param = 2
    response = stub.ModelInfer(request, timeout=30)
    assert response.outputs[0].datatype == "BYTES" and list(response.outputs[0].shape) == [1, 2]


def _request(model: str = "simple", **tensors: tuple[str, list[int]]) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, (datatype, shape) in tensors.items():
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    return request


def _bad_requests() -> list[tuple[str, Any, str]]:
    cases = []
    r = _request(INPUT0=("INT32", [1, 16]), INPUT1=("INT32", [1, 16]))
    r.raw_input_contents.append(bytes(64))
    cases.append(("one raw buffer for two inputs", r, "unable to find data for input tensor 'INPUT1' for model 'simple' in request."))
    r = _request(INPUT0=("INT32", [1, 16]), INPUT1=("INT32", [1, 16]))
    r.raw_input_contents.extend([bytes(64), bytes(64)])
    r.inputs[1].contents.int_contents.extend(range(16))
    cases.append(("raw and contents mixed", r, "contents field must not be specified when using raw_input_contents for 'INPUT1' for model 'simple'"))
    r = _request(INPUT0=("FP8", [1]))
    cases.append(("unknown datatype", r, "input 'INPUT0': unknown datatype 'FP8'"))
    r = _request("identity_fp16", INPUT0=("FP16", [2]))
    r.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    cases.append(("FP16 in contents", r, "input 'INPUT0': FP16 data can only be sent in raw_input_contents"))
    r = _request("identity_fp16", INPUT0=("FP16", [2]))
    cases.append(("FP16 with no data", r, "input 'INPUT0': FP16 data can only be sent in raw_input_contents"))
    r = _request(INPUT0=("INT32", [1, 16]), INPUT1=("INT32", [1, 16]))
    r.inputs[0].contents.int64_contents.extend(range(16))
    cases.append(("wrong contents field", r, "input 'INPUT0': INT32 data goes in contents.int_contents, got contents.int64_contents"))
    r = _request(INPUT0=("INT32", [1, 16]), INPUT1=("INT32", [1, 16]))
    r.inputs[0].contents.int_contents.extend(range(15))
    cases.append(("element count", r, "input 'INPUT0': shape [1, 16] needs 16 elements but contents.int_contents has 15"))
    r = _request("identity_int8", INPUT0=("INT8", [2]))
    r.inputs[0].contents.int_contents.extend([1, 300])
    cases.append(("INT8 out of range", r, "input 'INPUT0': a value is out of range for INT8"))
    r = _request("identity_uint16", INPUT0=("UINT16", [1]))
    r.inputs[0].contents.uint_contents.append(70000)
    cases.append(("UINT16 out of range", r, "out of range for UINT16"))
    r = _request(INPUT0=("INT32", [-1, 16]), INPUT1=("INT32", [1, 16]))
    cases.append(("negative dim", r, "input 'INPUT0': 'shape' must be a list of non-negative integers"))
    r = _request("identity_bytes", INPUT0=("BYTES", [1]))
    r.raw_input_contents.append(struct.pack("<I", 100) + b"short")
    cases.append(("BYTES length that lies", r, "input 'INPUT0': BYTES element 0 claims 100 bytes"))
    r = _request("identity_bytes", INPUT0=("BYTES", [1 << 40]))
    r.raw_input_contents.append(b"")
    cases.append(("BYTES shape far past the data", r, "needs at least"))
    r = _request("identity_fp32", INPUT0=("FP32", [2]))
    r.raw_input_contents.append(bytes(12))
    cases.append(("raw size", r, "input 'INPUT0': shape [2] of FP32 needs 8 bytes but its raw_input_contents has 12"))
    r = _request("identity_fp32", INPUT0=("FP32", [2]))
    r.inputs[0].parameters["shared_memory_region"].string_param = "region0"
    cases.append((
        "shared memory",
        r,
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter "
        "for tensor 'INPUT0'",
    ))
    huge = 1 << 62
    r = _request("identity_int32", INPUT0=("INT32", [0, huge]))
    r.raw_input_contents.append(b"")
    cases.append(("zero and huge dims, raw", r, f"input 'INPUT0': shape [0, {huge}] is too large"))
    r = _request("identity_int32", INPUT0=("INT32", [huge, 0]))
    cases.append(("huge and zero dims, contents", r, f"input 'INPUT0': shape [{huge}, 0] is too large"))
    r = _request("identity_bytes", INPUT0=("BYTES", [0, huge]))
    r.raw_input_contents.append(b"")
    cases.append(("BYTES zero and huge dims", r, "is too large"))
    r = _request("identity_int32", INPUT0=("INT32", [huge, huge]))
    r.inputs[0].contents.int_contents.append(1)
    cases.append(("dims past int64 together", r, "its dimensions multiply to more than 9223372036854775807 bytes"))
    r = _request("identity_int32", INPUT0=("INT32", [1] * 65))
    r.raw_input_contents.append(bytes(4))
    cases.append(("rank 65", r, "input 'INPUT0': 'shape' has 65 dimensions, more than the 64 allowed"))
    r = _request("identity_int32", INPUT0=("INT32", [0] * 100_000))
    cases.append(("rank 100000", r, "'shape' has 100000 dimensions"))
    r = _request("identity_bytes", INPUT0=("BYTES", [3]))
    r.inputs[0].contents.bytes_contents.extend([b"a", b"b"])
    cases.append(("BYTES contents count", r, "input 'INPUT0': shape [3] needs 3 elements but contents.bytes_contents has 2"))
    return cases


@pytest.mark.parametrize(("request_message", "message"), [c[1:] for c in _bad_requests()], ids=[c[0] for c in _bad_requests()])
def test_malformed_requests_are_invalid_argument(stub: Any, client: Any, request_message: Any, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request_message, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert client.is_server_ready()
    _simple_answers(client)


def _simple_answers(client: Any) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a * 2)


def test_a_message_that_is_not_a_request_is_invalid_argument(server: QuiverServer, client: Any) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
        for garbage in (b"\xff\xff\xff", b"\x0a\x80\x80\x80\x80\x10"):
            with pytest.raises(grpc.RpcError) as info:
                infer(garbage, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed ModelInferRequest message" in info.value.details()
    _simple_answers(client)


def test_limits_in_a_stream_fail_that_request_only(server: QuiverServer) -> None:
    bad = _request("identity_int32", INPUT0=("INT32", [0, 1 << 62]))
    good = _request("identity_int32", INPUT0=("INT32", [2]))
    good.inputs[0].contents.int_contents.extend([7, 8])
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter([good, bad, good]), timeout=30))
    assert answers[0].error_message == "" and answers[2].error_message == ""
    assert "is too large" in answers[1].error_message
    for answer in (answers[0], answers[2]):
        np.testing.assert_array_equal(np.frombuffer(answer.infer_response.raw_output_contents[0], np.int32), [7, 8])


def test_typed_contents_for_narrow_types_and_empty_tensors(stub: Any) -> None:
    request = _request("identity_int8", INPUT0=("INT8", [3]))
    request.inputs[0].contents.int_contents.extend([-128, 0, 127])
    response = stub.ModelInfer(request, timeout=30)
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.int8), [-128, 0, 127])
    request = _request("identity_fp32", INPUT0=("FP32", [0]))
    response = stub.ModelInfer(request, timeout=30)
    assert list(response.outputs[0].shape) == [0] and response.raw_output_contents[0] == b""


def test_long_stream_answers_in_order(server: QuiverServer) -> None:
    count = 200

    async def requests() -> Any:
        for i in range(count):
            a = np.full((1, 16), i, dtype=np.int32)
            inputs = [aiogrpcclient.InferInput("INPUT0", [1, 16], "INT32"), aiogrpcclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(a)
            model = "simple" if i % 7 else "no_such_model"
            yield {"model_name": model, "inputs": inputs, "request_id": str(i)}

    async def main() -> None:
        async with aiogrpcclient.InferenceServerClient(server.grpc_url) as client:
            index = 0
            async for result, error in client.stream_infer(requests()):
                if index % 7:
                    assert error is None, error
                    assert result.get_response().id == str(index)
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * index))
                else:
                    assert error is not None and "unknown model" in error.message()
                    assert result is None
                index += 1
            assert index == count

    asyncio.run(main())


def test_aio_client_concurrent_requests(server: QuiverServer) -> None:
    async def main() -> None:
        async with aiogrpcclient.InferenceServerClient(server.grpc_url) as client:
            assert await client.is_server_ready()

            async def one(i: int) -> None:
                a = np.full((1, 16), i, dtype=np.int32)
                inputs = [aiogrpcclient.InferInput("INPUT0", [1, 16], "INT32"), aiogrpcclient.InferInput("INPUT1", [1, 16], "INT32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(a)
                result = await client.infer("simple", inputs, request_id=str(i))
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
                assert result.get_response().id == str(i)

            await asyncio.gather(*(one(i) for i in range(32)))

    asyncio.run(main())


def test_health_service(server: QuiverServer) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="nothing.Here"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


# -- flags and lifecycle (servers of their own) ---------------------------------------------

SLOW_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)])
            for r in requests
        ]
"""

SLOW_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def test_help_lists_the_grpc_flags() -> None:
    serve = run_quiver("serve", "--help")
    for flag in ("--grpc-max-message-size", "--allow-grpc", "--allow-http"):
        assert flag in serve.stdout, flag


def test_allow_http_and_allow_grpc(tmp_path: Path) -> None:
    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    with QuiverServer(tmp_path, args=("--allow-http=false",)) as server:
        assert "started HTTP service" not in server.log
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            assert client.is_server_ready() and client.is_model_ready("simple")
    with QuiverServer(tmp_path, args=("--allow-grpc", "false")) as server:
        assert "started GRPC service" not in server.log
        assert httpclient.InferenceServerClient(server.url).is_server_ready()


def test_grpc_port_in_use_fails_start_up(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_quiver(
            "serve", "--model-repository", str(tmp_path), "--http-port", "0", "--grpc-port", str(port)
        )
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr


def test_sigterm_finishes_in_flight_rpcs_and_health_goes_not_serving(tmp_path: Path) -> None:
    write_python(tmp_path, "slow", SLOW_MODEL, SLOW_CONFIG)
    server = QuiverServer(tmp_path).start()
    statuses: list[int] = []
    results: dict[str, Any] = {}
    channel = grpc.insecure_channel(server.grpc_url)
    watching = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

    def watch() -> None:
        try:
            for reply in watching:
                statuses.append(reply.status)
        except grpc.RpcError:
            pass  # the server went away

    def infer() -> None:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            inp = grpcclient.InferInput("INPUT0", [2], "FP32")
            inp.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
            try:
                results["out"] = client.infer("slow", [inp]).as_numpy("OUTPUT0")
            except InferenceServerException as exc:
                results["error"] = exc

    watcher = threading.Thread(target=watch)
    watcher.start()
    worker = threading.Thread(target=infer)
    worker.start()
    time.sleep(0.4)  # the request is in the model
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    worker.join(30)
    assert server.wait(30) == 0, server.log
    watching.cancel()
    watcher.join(10)
    channel.close()
    assert "error" not in results, results
    np.testing.assert_array_equal(results["out"], [2.0, 4.0])
    assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
