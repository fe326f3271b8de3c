"""Fuzzing every method of ``inference.GRPCInferenceService`` (and the health service) on a
real server: random bytes as the serialized request, messages with random field values,
hostile ModelInferRequests, and streams of them. No example may be answered INTERNAL or
UNKNOWN (or time out) unless ``support.fuzz`` lists it as deliberate (UNIMPLEMENTED for the
shared-memory RPCs, UNAVAILABLE for a model that is not loaded); the server must
stay up and keep answering the canary. Knobs: tests/support/fuzz.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import assume, example, given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from support.fuzz import (
    CATALOG,
    FULL_CATALOG,
    MODEL_NAMES,
    PROTECTED,
    TIMEOUT,
    Watch,
    build_repository,
    compare_outputs,
    fuzz,
    http_call,
    start_server,
)
from support.hostile import NAME_KINDS, SHAPE_KINDS, In, Req, example_request, served_version
from support.hostile_grpc import (
    METHODS,
    UNARY,
    call_stream,
    call_unary,
    defang_log_settings,
    encode_request,
    field_overrides,
    grpc_infer_requests,
    grpc_outputs,
    message_class,
    messages,
    protected,
)
from support.server import QuiverServer

#: RPCs that answer UNIMPLEMENTED by design (the README: shared memory).
UNIMPLEMENTED = {
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
}
LOG_DEFAULTS = {"log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0, "log_format": "default"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    root = tmp_path_factory.mktemp("fuzz_grpc")
    repo = build_repository(root / "models")
    running = start_server(repo, f"--model-cache-dir={root / 'cache'}")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def channel(server: QuiverServer) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)]
    with grpc.insecure_channel(server.grpc_url, options=options) as opened:
        yield opened


CANARY = pb.ModelInferRequest(model_name="simple")
for _name, _values in (("INPUT0", list(range(16))), ("INPUT1", [1] * 16)):
    CANARY.inputs.add(name=_name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend(_values)


@pytest.fixture(scope="module")
def watch(server: QuiverServer, channel: grpc.Channel) -> Iterator[Watch]:
    def canary() -> str | None:
        code, details, answer = call_unary(channel, "ModelInfer", CANARY.SerializeToString(), TIMEOUT)
        if code != "OK":
            return f"{code}: {details}"
        outputs = grpc_outputs(pb.ModelInferResponse.FromString(answer))
        got = {name: array.reshape(-1).tolist() for name, (_, array) in outputs.items()}
        if got.get("OUTPUT0") != list(range(1, 17)) or got.get("OUTPUT1") != list(range(-1, 15)):
            return f"wrong answer: {got}"
        return None

    watch = Watch(server, canary)
    yield watch
    watch.assert_clean()


def restore_logging(server: QuiverServer) -> None:
    """Back to the start's settings (log_file untouched: a server may refuse to change it)."""
    reply = http_call(server.port, "POST", "/v2/logging", json.dumps(LOG_DEFAULTS).encode())
    if reply.status != 200:  # a log_file left unusable by an example: back to standard error
        reply = http_call(server.port, "POST", "/v2/logging", json.dumps({**LOG_DEFAULTS, "log_file": ""}).encode())
    assert reply.status == 200, reply.body


def check_status(case: Any, method: str, code: str, details: str) -> None:
    if method in UNIMPLEMENTED and code == "UNIMPLEMENTED":
        return
    case.grpc(code, details)


def unsafe(method: str, payload: bytes) -> bool:
    """Whether bytes parse into a request that would touch the canary's model or open a log
    file (such examples are skipped: the fuzzer must not wreck its own witness)."""
    try:
        message = message_class(METHODS[method].input_type).FromString(payload)
    except Exception:
        return False
    if protected(method, message, PROTECTED):
        return True
    if method == "LogSettings":
        return defang_log_settings(pb.LogSettingsRequest.FromString(payload)).SerializeToString() != payload
    return False


# -- every method: random bytes, random messages ---------------------------------------------


@fuzz(200)
# a message that does not parse is the client's mistake: INVALID_ARGUMENT, not UNKNOWN
@example(method="ServerLive", payload=b"\x05")
@example(method="ModelInfer", payload=b"\xff")
@given(method=st.sampled_from(UNARY), payload=st.one_of(st.binary(max_size=300), st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 10, b"\x12\x00" * 100, b"\x0a\x05simple"])))
def test_random_bytes_on_every_method(server: QuiverServer, watch: Watch, channel: grpc.Channel, method: str, payload: bytes) -> None:
    assume(not unsafe(method, payload))
    with watch.case(f"{method} (raw bytes)", payload) as case:
        code, details, _ = call_unary(channel, method, payload, TIMEOUT)
        check_status(case, method, code, details)
    if method == "LogSettings":
        restore_logging(server)


def method_messages() -> st.SearchStrategy[tuple[str, Any]]:
    def build(method: str) -> st.SearchStrategy[tuple[str, Any]]:
        exclude = PROTECTED if method.startswith("RepositoryModel") else ()
        descriptor = METHODS[method].input_type
        return messages(descriptor, field_overrides(MODEL_NAMES, exclude=exclude)).map(lambda m: (method, m))

    return st.sampled_from(UNARY).flatmap(build)


#: Request metadata: odd keys and values, gRPC's own headers, binary ("-bin") values.
METADATA = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["x-a", "authorization", "grpc-accept-encoding", "triton-grpc-protocol", "user-agent", "te"]),
                  st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30)),
        st.tuples(st.sampled_from(["x-b-bin", "grpc-trace-bin"]), st.binary(max_size=30)),
    ),
    max_size=3,
)


@fuzz(300)
@given(call=method_messages(), metadata=METADATA)
# a log file name open() refuses (NUL)
@example(call=("LogSettings", pb.LogSettingsRequest(settings={"log_file": pb.LogSettingsRequest.SettingValue(string_param="\x00")})), metadata=[])
def test_random_messages_on_every_method(
    server: QuiverServer, watch: Watch, channel: grpc.Channel, call: tuple[str, Any], metadata: list[tuple[str, Any]]
) -> None:
    method, message = call
    if method == "LogSettings":
        defang_log_settings(message)
    assume(not protected(method, message, PROTECTED))
    with watch.case(f"{method} {metadata}", message) as case:
        try:
            code, details, _ = call_unary(channel, method, message.SerializeToString(), TIMEOUT, metadata=metadata)
        except ValueError:  # metadata the client library refuses to send
            return
        check_status(case, method, code, details)
    if method == "LogSettings":
        restore_logging(server)


# -- ModelInfer: valid requests and hostile mutations of them ---------------------------------


def infer_case(watch: Watch, channel: grpc.Channel, req: Req, message: Any) -> None:
    spec = next((m for m in FULL_CATALOG if m.name == req.model), None)
    with watch.case(f"ModelInfer {req.model} {req.mutations}", message) as case:
        code, details, answer = call_unary(channel, "ModelInfer", message.SerializeToString(), TIMEOUT)
        check_status(case, "ModelInfer", code, details)
        if req.mutations == ["version"] and not served_version(req.version) and code == "OK":
            case.fail(f"version {req.version!r} (not a served version, or not a positive integer) was answered OK")
        if not req.mutations and spec is not None and spec.always_ok:
            if code != "OK":
                case.fail(f"a valid request was answered {code}: {details}")
            else:
                problem = compare_outputs(req, grpc_outputs(pb.ModelInferResponse.FromString(answer)))
                if problem:
                    case.fail(problem)


@fuzz(300)
@given(request=grpc_infer_requests(FULL_CATALOG))
def test_model_infer_requests(watch: Watch, channel: grpc.Channel, request: tuple[Req, Any]) -> None:
    infer_case(watch, channel, *request)


def example_infer(model: str, inputs: list[In], **options: Any) -> tuple[Req, Any]:
    req = example_request(model, inputs, **options)
    return req, encode_request(req)


@fuzz(200)
@given(request=grpc_infer_requests(FULL_CATALOG, mutations=(1, 2), only=SHAPE_KINDS + NAME_KINDS))
# the issue's: a rank over 64, a zero beside a huge dimension; a name too long for a file
@example(request=example_infer("identity_fp32", [In("INPUT0", "FP32", [1] * 65, [1.0], "contents")], mutations=["shape"]))
@example(request=example_infer("identity_fp32", [In("INPUT0", "FP32", [0, 2**62], [], "contents")], mutations=["shape"]))
@example(request=example_infer("identity_fp32", [In("INPUT0", "FP32", [2**62, 0], [], "binary")], mutations=["shape"]))
@example(request=example_infer("a" * 256, [In("INPUT0", "FP32", [1], [1.0], "contents")], mutations=["model"]))
@example(request=example_infer("identity_fp32", [In("INPUT0", "FP32", [1], [1.0], "contents")], version="-1", mutations=["version"]))
def test_model_infer_shapes_names_versions(watch: Watch, channel: grpc.Channel, request: tuple[Req, Any]) -> None:
    infer_case(watch, channel, *request)


@fuzz(60)
@given(size=st.sampled_from([(1 << 20) - 100, (1 << 20) + 1, 3 << 20]))
def test_model_infer_past_the_message_limit(watch: Watch, channel: grpc.Channel, size: int) -> None:
    """--grpc-max-message-size is 1 MiB here: past it is RESOURCE_EXHAUSTED, never a crash."""
    message = pb.ModelInferRequest(model_name="identity_uint16")
    message.inputs.add(name="INPUT0", datatype="UINT16", shape=[size // 2])
    message.raw_input_contents.append(b"\x01" * (size // 2 * 2))
    with watch.case(f"ModelInfer of {size} bytes", f"{size} bytes") as case:
        code, details, _ = call_unary(channel, "ModelInfer", message.SerializeToString(), TIMEOUT)
        check_status(case, "ModelInfer", code, details)


# -- ModelStreamInfer --------------------------------------------------------------------------


@fuzz(120)
@given(
    items=st.lists(
        st.one_of(
            grpc_infer_requests(CATALOG).map(lambda r: r[1].SerializeToString()),
            st.binary(max_size=100),
        ),
        min_size=0,
        max_size=5,
    )
)
@example(items=[b"4"])
def test_stream_infer(watch: Watch, channel: grpc.Channel, items: list[bytes]) -> None:
    """Each request of a stream is answered (a response or its error_message), in order; a
    bad one never ends the stream with INTERNAL, and no error_message is an internal error."""
    with watch.case("ModelStreamInfer", items) as case:
        code, details, answers = call_stream(channel, items, TIMEOUT)
        case.grpc(code, details)
        for raw in answers:
            answer = pb.ModelStreamInferResponse.FromString(raw)
            if answer.error_message.startswith("internal error"):
                case.fail(f"a stream request was answered: {answer.error_message}")
        if code == "OK" and len(answers) != len(items):
            case.fail(f"{len(items)} requests on the stream, {len(answers)} answers")


# -- the health service ------------------------------------------------------------------------


@fuzz(60)
@given(
    payload=st.one_of(
        st.binary(max_size=64),
        st.one_of(st.text(max_size=20), st.sampled_from(["", "inference.GRPCInferenceService", "\x00", "a" * 5000])).map(
            lambda service: health_pb2.HealthCheckRequest(service=service).SerializeToString()
        ),
    )
)
@example(payload=b"\x13")
def test_health_check(watch: Watch, channel: grpc.Channel, payload: bytes) -> None:
    stub = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
    with watch.case("Health/Check", payload) as case:
        try:
            stub(payload, timeout=TIMEOUT)
        except grpc.RpcError as exc:
            case.grpc(exc.code().name, exc.details() or "")


@fuzz(40)
@given(method=st.one_of(st.text(max_size=20), st.sampled_from(["", "/", "ModelInfer/", "../ModelInfer", "modelinfer", "\x00"])))
def test_unknown_methods(watch: Watch, channel: grpc.Channel, method: str) -> None:
    with watch.case(f"unknown method {method!r}", method) as case:
        code, details, _ = call_unary(channel, method, b"", TIMEOUT)
        if code != "UNIMPLEMENTED":
            case.grpc(code, details)


def test_server_exits_cleanly_after_fuzzing(server: QuiverServer) -> None:
    """Last in the module: the fuzzed server still stops on SIGTERM with exit code 0."""
    assert server.process is not None and server.process.poll() is None
    assert server.stop() == 0, "\n".join(server.lines[-50:])
