"""The same inference and error cases through every client: tritonclient.http (JSON and
binary), tritonclient.http.aio, tritonclient.grpc (raw, as it always sends), typed
``contents`` built with service_pb2 and the stub, and tritonclient.grpc.aio. Results must be
identical; errors must carry the status that ``quiver/frontends/status.py`` gives their code,
and, where the service raised them, the same message."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from build_repository import LABELS
from conftest import MAX_INPUT_SIZE
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from quiver.errors import ErrorCode
from quiver.frontends.status import grpc_status, http_status
from support.models import ONNX_TYPES
from support.server import QuiverServer

PROTOCOLS = ["http-json", "http-binary", "http-aio", "grpc-raw", "grpc-contents", "grpc-aio"]
DATATYPES = [*ONNX_TYPES, "BF16"]

#: Triton's InferTensorContents field per datatype (FP16 and BF16: raw only).
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def sample(datatype: str) -> np.ndarray:
    """Values that catch truncation, sign and byte-order mistakes."""
    if datatype == "BOOL":
        return np.array([True, False, True])
    if datatype == "BYTES":
        return np.array([b"hello", "ünïcode".encode(), b""], dtype=np.object_)
    if datatype == "BF16":
        return np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16)
    dtype = np.dtype(datatype.lower().replace("fp", "float"))
    if dtype.kind == "f":
        return np.array([1.5, -2.25, 65504.0 if datatype == "FP16" else 1e30], dtype=dtype)
    info = np.iinfo(dtype)
    return np.array([info.min, 1, info.max], dtype=dtype)


@dataclass
class Tensor:
    name: str
    datatype: str
    data: np.ndarray


@dataclass
class Result:
    outputs: dict[str, np.ndarray]
    model_version: str
    id: str


@dataclass
class Failure(Exception):
    protocol: str
    status: int | grpc.StatusCode
    message: str
    extra: dict[str, Any] = field(default_factory=dict)


def expected_status(protocol: str, code: ErrorCode) -> int | grpc.StatusCode:
    return http_status(code) if protocol.startswith("http") else grpc_status(code)


def _normalise(datatype: str, array: np.ndarray) -> np.ndarray:
    if datatype == "BYTES":
        return np.array(
            [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)], dtype=np.object_
        ).reshape(array.shape)
    if datatype == "BF16" and array.dtype != ml_dtypes.bfloat16:
        return array.view(ml_dtypes.bfloat16)
    return array


# -- the clients --------------------------------------------------------------------------


class Clients:
    """Every client, created once for the module; aio ones live on one event loop thread."""

    def __init__(self, server: QuiverServer) -> None:
        self.server = server
        self.http = httpclient.InferenceServerClient(server.url)
        self.grpc = grpcclient.InferenceServerClient(server.grpc_url)
        self.channel = grpc.insecure_channel(
            server.grpc_url, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.aio_http: aiohttpclient.InferenceServerClient = self.run(self._make_http())
        self.aio_grpc: aiogrpcclient.InferenceServerClient = self.run(self._make_grpc())

    async def _make_http(self) -> aiohttpclient.InferenceServerClient:
        return aiohttpclient.InferenceServerClient(self.server.url)

    async def _make_grpc(self) -> aiogrpcclient.InferenceServerClient:
        return aiogrpcclient.InferenceServerClient(self.server.grpc_url)

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self) -> None:
        self.run(self.aio_http.close())
        self.run(self.aio_grpc.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.http.close()
        self.grpc.close()
        self.channel.close()

    # -- one inference, any protocol -----------------------------------------------------

    def infer(
        self,
        protocol: str,
        model: str,
        tensors: list[Tensor],
        outputs: list[tuple[str, int]] | None = None,
        version: str = "",
        request_id: str = "",
    ) -> Result:
        if protocol == "grpc-contents":
            return self._infer_contents(model, tensors, outputs, version, request_id)
        module: Any = grpcclient if protocol.startswith("grpc") else httpclient
        binary = protocol != "http-json"
        inputs = []
        for tensor in tensors:
            inp = module.InferInput(tensor.name, list(tensor.data.shape), tensor.datatype)
            if module is httpclient:
                inp.set_data_from_numpy(tensor.data, binary_data=binary)
            else:
                inp.set_data_from_numpy(tensor.data)
            inputs.append(inp)
        requested = None
        if outputs is not None:
            if module is httpclient:
                requested = [module.InferRequestedOutput(n, binary_data=binary, class_count=k) for n, k in outputs]
            else:
                requested = [module.InferRequestedOutput(n, class_count=k) for n, k in outputs]
        kwargs = {"model_version": version, "outputs": requested, "request_id": request_id}
        try:
            if protocol == "http-aio":
                result = self.run(self.aio_http.infer(model, inputs, **kwargs))
            elif protocol == "grpc-aio":
                result = self.run(self.aio_grpc.infer(model, inputs, **kwargs))
            elif module is httpclient:
                result = self.http.infer(model, inputs, **kwargs)
            else:
                result = self.grpc.infer(model, inputs, **kwargs)
        except InferenceServerException as exc:
            raise _failure(protocol, exc) from None
        if module is httpclient:
            response = result.get_response()
            names = [(o["name"], o["datatype"]) for o in response["outputs"]]
            version_got, id_got = response["model_version"], response.get("id", "")
        else:
            response = result.get_response()
            names = [(o.name, o.datatype) for o in response.outputs]
            version_got, id_got = response.model_version, response.id
        return Result(
            {n: _normalise(dt, result.as_numpy(n)) for n, dt in names}, version_got, id_got
        )

    def _infer_contents(
        self,
        model: str,
        tensors: list[Tensor],
        outputs: list[tuple[str, int]] | None,
        version: str,
        request_id: str,
    ) -> Result:
        request = contents_request(model, tensors, version, request_id)
        for name, k in outputs or []:
            out = request.outputs.add(name=name)
            if k:
                out.parameters["classification"].int64_param = k
        try:
            response = self.stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as exc:
            raise Failure("grpc-contents", exc.code(), exc.details()) from None
        result = grpcclient.InferResult(response)
        return Result(
            {o.name: _normalise(o.datatype, result.as_numpy(o.name)) for o in response.outputs},
            response.model_version,
            response.id,
        )


def contents_request(model: str, tensors: list[Tensor], version: str = "", request_id: str = "") -> Any:
    """A ModelInferRequest with typed contents, built field by field with Triton's rules."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for tensor in tensors:
        entry = request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.data.shape))
        getattr(entry.contents, CONTENTS[tensor.datatype]).extend(tensor.data.reshape(-1).tolist())
    return request


def _failure(protocol: str, exc: InferenceServerException) -> Failure:
    status = exc.status()
    if protocol.startswith("grpc"):
        name = str(status).removeprefix("StatusCode.")
        return Failure(protocol, getattr(grpc.StatusCode, name), exc.message())
    return Failure(protocol, int(status), exc.message())


@pytest.fixture(scope="module")
def clients(server: QuiverServer) -> Iterator[Clients]:
    made = Clients(server)
    yield made
    made.close()


def outcome(call: Callable[[], Result]) -> Result | Failure:
    try:
        return call()
    except Failure as failure:
        return failure


def simple_tensors(batch: int = 1, datatype: str = "INT32", width: int = 16) -> list[Tensor]:
    a = np.arange(width * batch, dtype=np.int32).reshape(batch, width)
    if datatype == "FP32":
        a = a.astype(np.float32)
    return [Tensor("INPUT0", datatype, a), Tensor("INPUT1", datatype, np.full_like(a, 3))]


# -- results ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("protocol", "datatype"),
    [
        (p, d)
        for d in DATATYPES
        for p in PROTOCOLS
        # tritonclient refuses BF16 in JSON; typed contents have no FP16/BF16 field.
        if not (p == "http-json" and d == "BF16")
        and not (p == "grpc-contents" and d in ("FP16", "BF16"))
    ],
)
def test_every_datatype_round_trips(clients: Clients, protocol: str, datatype: str) -> None:
    data = sample(datatype).reshape(3)
    result = clients.infer(
        protocol, f"identity_{datatype.lower()}", [Tensor("INPUT0", datatype, data)], request_id="rt"
    )
    got = result.outputs["OUTPUT0"]
    if datatype == "BYTES":
        assert list(got) == list(data)
    else:
        assert got.dtype == data.dtype, (got.dtype, data.dtype)
        np.testing.assert_array_equal(got, data)
    assert result.model_version == "1"
    assert result.id == "rt"


@pytest.fixture(scope="module")
def reference(clients: Clients) -> Callable[..., Result | Failure]:
    """The HTTP (binary) outcome of a case, which every other protocol must equal."""
    cache: dict[str, Result | Failure] = {}

    def get(key: str, call: Callable[[str], Result]) -> Result | Failure:
        if key not in cache:
            cache[key] = outcome(lambda: call("http-binary"))
        return cache[key]

    return get


def assert_same(got: Result | Failure, want: Result | Failure) -> None:
    assert isinstance(got, Result) and isinstance(want, Result), (got, want)
    assert got.outputs.keys() == want.outputs.keys()
    for name in want.outputs:
        np.testing.assert_array_equal(got.outputs[name], want.outputs[name])
    assert (got.model_version, got.id) == (want.model_version, want.id)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_batch_requested_outputs_and_ids_match(clients: Clients, reference: Any, protocol: str) -> None:
    def call(p: str) -> Result:
        return clients.infer(p, "simple", simple_tensors(batch=3), outputs=[("OUTPUT1", 0)], request_id="r-1")

    result = call(protocol)
    assert list(result.outputs) == ["OUTPUT1"]
    np.testing.assert_array_equal(result.outputs["OUTPUT1"], np.arange(48, dtype=np.int32).reshape(3, 16) - 3)
    assert_same(result, reference("simple", call))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_classification_matches(clients: Clients, reference: Any, protocol: str) -> None:
    features = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)

    def call(p: str) -> Result:
        return clients.infer(p, "classifier", [Tensor("INPUT", "FP32", features)], outputs=[("OUTPUT", 3)])

    result = call(protocol)
    top = result.outputs["OUTPUT"]
    assert top.shape == (2, 3)
    _value, index, label = top[0][0].decode().split(":")
    assert label == LABELS[int(index)]
    assert_same(result, reference("classifier", call))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_versions_match(clients: Clients, reference: Any, protocol: str) -> None:
    data = np.zeros((1, 4), dtype=np.float32)
    for version, added in (("", 3.0), ("2", 2.0), ("3", 3.0)):

        def call(p: str, version: str = version) -> Result:
            return clients.infer(p, "versioned", [Tensor("INPUT0", "FP32", data)], version=version)

        result = call(protocol)
        np.testing.assert_array_equal(result.outputs["OUTPUT0"], data + added)
        assert result.model_version == (version or "3")
        assert_same(result, reference(f"versioned-{version}", call))


# -- errors -------------------------------------------------------------------------------

ERRORS: dict[str, tuple[Callable[[Clients, str], Result], ErrorCode, str]] = {
    "wrong datatype": (
        lambda c, p: c.infer(p, "simple", simple_tensors(datatype="FP32")),
        ErrorCode.INVALID_ARG,
        "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'",
    ),
    "wrong shape": (
        lambda c, p: c.infer(p, "simple", simple_tensors(width=8)),
        ErrorCode.INVALID_ARG,
        "unexpected shape for input 'INPUT0' for model 'simple'",
    ),
    "batch too large": (
        lambda c, p: c.infer(p, "simple", simple_tensors(batch=9)),
        ErrorCode.INVALID_ARG,
        "batch-size must be <= 8",
    ),
    "missing input": (
        lambda c, p: c.infer(p, "simple", simple_tensors()[:1]),
        ErrorCode.INVALID_ARG,
        "but missing required input(s) ['INPUT1']",
    ),
    "unknown output": (
        lambda c, p: c.infer(p, "simple", simple_tensors(), outputs=[("OUTPUT7", 0)]),
        ErrorCode.INVALID_ARG,
        "unexpected inference output 'OUTPUT7'",
    ),
    "unknown model": (
        lambda c, p: c.infer(p, "no_such_model", simple_tensors()),
        ErrorCode.NOT_FOUND,
        "unknown model: 'no_such_model'",
    ),
    "version not served": (
        lambda c, p: c.infer(p, "simple", simple_tensors(), version="7"),
        ErrorCode.NOT_FOUND,
        "version 7 is not served",
    ),
    "broken model": (
        lambda c, p: c.infer(p, "broken", [Tensor("INPUT0", "FP32", np.zeros(1, np.float32))]),
        ErrorCode.UNAVAILABLE,
        "weights file is corrupt",
    ),
    "raising model": (
        lambda c, p: c.infer(p, "raises", [Tensor("INPUT0", "FP32", np.zeros(1, np.float32))]),
        ErrorCode.INTERNAL,
        "tokenizer exploded",
    ),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_have_matching_status_and_message(
    clients: Clients, reference: Any, case: str, protocol: str
) -> None:
    call, code, message = ERRORS[case]
    got = outcome(lambda: call(clients, protocol))
    assert isinstance(got, Failure), got
    assert got.status == expected_status(protocol, code), (got.status, got.message)
    assert message in got.message
    want = reference(case, lambda p: call(clients, p))
    assert isinstance(want, Failure)
    assert got.message == want.message  # the service said it, once, for every transport


@pytest.mark.filterwarnings("ignore:Sending a large body:ResourceWarning")  # aiohttp, > 1 MiB
def test_oversize_message(clients: Clients) -> None:
    """Over the limit (1 MiB here): HTTP 413, gRPC RESOURCE_EXHAUSTED; both keep serving."""
    data = np.zeros(MAX_INPUT_SIZE // 4 + 1024, dtype=np.float32)
    for protocol, status in (
        ("http-binary", 413),
        ("http-aio", 413),
        ("grpc-raw", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("grpc-aio", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ):
        got = outcome(lambda p=protocol: clients.infer(p, "identity_fp32", [Tensor("INPUT0", "FP32", data)]))
        assert isinstance(got, Failure) and got.status == status, (protocol, got)
        small = clients.infer(protocol, "identity_fp32", [Tensor("INPUT0", "FP32", data[:4])])
        np.testing.assert_array_equal(small.outputs["OUTPUT0"], data[:4])


def test_malformed_raw_contents(clients: Clients, server: QuiverServer) -> None:
    """A raw buffer whose size does not match the shape: 400 / INVALID_ARGUMENT naming it."""
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 60}},
                {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}},
            ]
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST",
        "/v2/models/simple/infer",
        body=header + bytes(124),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    response = conn.getresponse()
    http_error = json.loads(response.read())["error"]
    conn.close()
    assert response.status == http_status(ErrorCode.INVALID_ARG)

    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
    request.raw_input_contents.extend([bytes(60), bytes(64)])
    with pytest.raises(grpc.RpcError) as info:
        clients.stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc_status(ErrorCode.INVALID_ARG)

    async def aio() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                await stub.ModelInfer(request, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
        raise AssertionError("accepted")

    code, details = asyncio.run(aio())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    for message in (http_error, info.value.details(), details):
        assert "input 'INPUT0'" in message and "needs 64 bytes" in message


# -- streaming ----------------------------------------------------------------------------

STREAM_CASES = [
    ("simple", simple_tensors(batch=2), None),
    ("no_such_model", simple_tensors(), ErrorCode.NOT_FOUND),
    ("simple", simple_tensors(width=8), ErrorCode.INVALID_ARG),
    ("classifier", [Tensor("INPUT", "FP32", np.linspace(0, 1, 8, dtype=np.float32).reshape(1, 8))], None),
    ("raises", [Tensor("INPUT0", "FP32", np.zeros(1, np.float32))], ErrorCode.INTERNAL),
    ("identity_bytes", [Tensor("INPUT0", "BYTES", sample("BYTES"))], None),
]


def _stream_inputs(tensors: list[Tensor]) -> list[Any]:
    inputs = []
    for tensor in tensors:
        inp = grpcclient.InferInput(tensor.name, list(tensor.data.shape), tensor.datatype)
        inp.set_data_from_numpy(tensor.data)
        inputs.append(inp)
    return inputs


def _check_stream(clients: Clients, answers: list[tuple[Any, Any]]) -> None:
    assert len(answers) == len(STREAM_CASES)
    for index, ((model, tensors, code), (result, error)) in enumerate(zip(STREAM_CASES, answers, strict=True)):
        want = outcome(lambda model=model, tensors=tensors: clients.infer("http-binary", model, tensors))
        if code is None:
            assert error is None, error
            assert result.get_response().id == str(index)  # in request order
            assert isinstance(want, Result)
            for name, array in want.outputs.items():
                datatype = result.get_output(name).datatype
                np.testing.assert_array_equal(_normalise(datatype, result.as_numpy(name)), array)
        else:
            assert result is None or result.get_response().id == str(index)
            assert isinstance(want, Failure) and want.status == http_status(code)
            assert error.message() == want.message


def test_stream_mixes_good_and_bad_requests(clients: Clients) -> None:
    answers: list[tuple[Any, Any]] = []
    done = threading.Event()

    def callback(result: Any, error: Any) -> None:
        answers.append((result, error))
        if len(answers) == len(STREAM_CASES):
            done.set()

    client = grpcclient.InferenceServerClient(clients.server.grpc_url)
    client.start_stream(callback)
    try:
        for index, (model, tensors, _) in enumerate(STREAM_CASES):
            client.async_stream_infer(model, _stream_inputs(tensors), request_id=str(index))
        assert done.wait(30)
    finally:
        client.stop_stream()
        client.close()
    _check_stream(clients, answers)


def test_aio_stream_mixes_good_and_bad_requests(clients: Clients) -> None:
    async def requests() -> Any:
        for index, (model, tensors, _) in enumerate(STREAM_CASES):
            yield {"model_name": model, "inputs": _stream_inputs(tensors), "request_id": str(index)}

    async def main() -> list[tuple[Any, Any]]:
        async with aiogrpcclient.InferenceServerClient(clients.server.grpc_url) as client:
            got = []
            async for result, error in client.stream_infer(requests()):
                got.append((result, error))
            return got

    _check_stream(clients, asyncio.run(main()))
