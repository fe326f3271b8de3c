"""Fuzzing every KServe v2 HTTP route of a real server: random bytes, random JSON, hostile
inference bodies, paths, headers and connections. Every example must be answered without a
5xx (but the deliberate ones of ``support.fuzz``), the server must stay up, and the canary
(``simple`` with a known answer) must still be answered right. See tests/support/fuzz.py
for the knobs (QUIVER_FUZZ_EXAMPLES, QUIVER_FUZZ_SEED, QUIVER_FUZZ_REPORT)."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from support.fuzz import (
    FULL_CATALOG,
    MODEL_NAMES,
    PROTECTED,
    TIMEOUT,
    Reply,
    Watch,
    build_repository,
    compare_outputs,
    fuzz,
    http_call,
    http_canary,
    http_outputs,
    raw_exchange,
    start_server,
    statuses_in,
)
from support.hostile import (
    NAME_KINDS,
    NESTING_KINDS,
    SHAPE_KINDS,
    HttpBody,
    In,
    Out,
    Raw,
    dumps,
    example_request,
    http_bodies,
    http_encode,
    json_values,
    nested,
    parameter_values,
    path_segments,
    served_version,
    versions,
)
from support.server import QuiverServer

#: (method, path template) of every v2 route; {m} a model, {v} a version.
ROUTES = [
    ("GET", "/v2/health/live"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2"),
    ("GET", "/v2/models/{m}"),
    ("GET", "/v2/models/{m}/versions/{v}"),
    ("GET", "/v2/models/{m}/ready"),
    ("GET", "/v2/models/{m}/versions/{v}/ready"),
    ("GET", "/v2/models/{m}/config"),
    ("GET", "/v2/models/{m}/versions/{v}/config"),
    ("GET", "/v2/models/stats"),
    ("GET", "/v2/models/{m}/stats"),
    ("GET", "/v2/models/{m}/versions/{v}/stats"),
    ("POST", "/v2/models/{m}/infer"),
    ("POST", "/v2/models/{m}/versions/{v}/infer"),
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/{m}/load"),
    ("POST", "/v2/repository/models/{m}/unload"),
    ("GET", "/v2/logging"),
    ("POST", "/v2/logging"),
    ("GET", "/v2/trace/setting"),
    ("POST", "/v2/trace/setting"),
    ("GET", "/v2/models/{m}/trace/setting"),
    ("POST", "/v2/models/{m}/trace/setting"),
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "FOO"]
CONTENT_TYPES = [
    "application/json", "application/octet-stream", "text/plain", "", "application/json; charset=utf-16",
    "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "application/vnd.sagemaker-triton.binary+json;json-header-size=5",
]
#: The logging settings the server starts with; restored after every logging example so the
#: server keeps logging to its standard error, where the watch reads tracebacks.
LOG_DEFAULTS = {
    "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0, "log_format": "default",
}
#: ``log_file`` values the fuzzer may send: none of them creates a file anywhere. (Any other
#: string would make the server open that file; refusing that is the logging fix's job.)
SAFE_LOG_FILES = ["", "\x00", "a\x00b", "/nonexistent-quiver-fuzz/dir/x.log", "/proc/self/nonexistent/x", "/", "/dev/null/x"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    root = tmp_path_factory.mktemp("fuzz_http")
    repo = build_repository(root / "models")
    running = start_server(repo, f"--model-cache-dir={root / 'cache'}")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def watch(server: QuiverServer) -> Iterator[Watch]:
    watch = Watch(server, http_canary(server.port))
    yield watch
    watch.assert_clean()


def route_path(template: str, model: str, version: str) -> str:
    return template.replace("{m}", model).replace("{v}", version)


def defang(body: Any) -> Any:
    """A logging body that cannot make the server open a file (see SAFE_LOG_FILES)."""
    if isinstance(body, dict) and "log_file" in body:
        value = body["log_file"]
        if isinstance(value, str | Raw) and value not in SAFE_LOG_FILES:
            body = dict(body, log_file="")
    return body


def restore_logging(server: QuiverServer) -> None:
    """Back to the start's settings (log_file untouched: a server may refuse to change it)."""
    reply = http_call(server.port, "POST", "/v2/logging", json.dumps(LOG_DEFAULTS).encode())
    if reply.status != 200:  # a log_file left unusable by an example: back to standard error
        reply = http_call(server.port, "POST", "/v2/logging", json.dumps({**LOG_DEFAULTS, "log_file": ""}).encode())
    assert reply.status == 200, reply.body


def hostile_paths() -> st.SearchStrategy[tuple[str, str]]:
    """(method, path): a route with hostile model and version segments; load and unload never
    name the canary's model."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[str, str]:
        method, template = draw(st.sampled_from(ROUTES))
        protect = PROTECTED if "/repository/" in template else ()
        model = draw(path_segments(MODEL_NAMES, exclude=protect))
        version = draw(st.one_of(path_segments(["1", "2"]), versions().map(lambda v: quote(v, safe=""))))
        return method, route_path(template, model, version)

    return build()


def bodies() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=512),
        json_values().map(lambda v: dumps(defang(v))),
        st.dictionaries(st.sampled_from(["inputs", "outputs", "parameters", "id", "ready", "log_info"]), json_values(6)).map(lambda v: dumps(defang(v))),
    )


# -- every route, random bodies -------------------------------------------------------------


@fuzz(150)
@given(route=st.sampled_from(ROUTES), method=st.one_of(st.none(), st.sampled_from(METHODS)), body=bodies(),
       content_type=st.sampled_from(CONTENT_TYPES), model=st.sampled_from(MODEL_NAMES))
def test_random_bodies_on_every_route(
    server: QuiverServer, watch: Watch, route: tuple[str, str], method: str | None, body: bytes, content_type: str, model: str
) -> None:
    verb = method or route[0]
    if "/repository/" in route[1] and model in PROTECTED:
        model = "victim"
    path = route_path(route[1], model, "1")
    headers = {"Content-Type": content_type} if content_type else {}
    with watch.case(f"{verb} {path}", body) as case:
        reply = http_call(server.port, verb, path, body, headers)
        if verb == "HEAD" and reply.status >= 500:  # no body: the GET twin says why
            reply = http_call(server.port, "GET", path, body, headers)
        case.http(reply)
    if path == "/v2/logging":
        restore_logging(server)


@fuzz(100)
@given(path=hostile_paths(), body=st.one_of(st.none(), st.just(b"{}"), bodies()))
def test_hostile_paths(server: QuiverServer, watch: Watch, path: tuple[str, str], body: bytes | None) -> None:
    method, target = path
    with watch.case(f"{method} {target}", body) as case:
        case.http(http_call(server.port, method, target, body))


# -- inference bodies: valid ones and hostile mutations of them ---------------------------------


def check_answer(encoded: HttpBody) -> Any:
    req = encoded.req
    spec = next((m for m in FULL_CATALOG if m.name == req.model), None)

    def expect(reply: Reply) -> str | None:
        if set(req.mutations) == {"version"} and not served_version(req.version) and not 400 <= reply.status < 500:
            return f"version {req.version!r} (not a served version, or not a positive integer) was answered {reply.status}, not 4xx"
        if req.mutations or spec is None or not spec.always_ok:
            return None
        if reply.status != 200:
            return f"a valid request was answered {reply.status}: {reply.error}"
        try:
            return compare_outputs(req, http_outputs(reply))
        except (ValueError, KeyError, TypeError) as exc:
            return f"the answer does not parse: {exc!r}: {reply.body[:300]!r}"

    return expect


def post_inference(server: QuiverServer, watch: Watch, encoded: HttpBody) -> None:
    req = encoded.req
    path = f"/v2/models/{quote(req.model, safe='')}"
    if req.version:
        path += f"/versions/{quote(req.version, safe='')}"
    path += "/infer"
    body = encoded.body()
    with watch.case(f"POST {path} {req.mutations}", {"headers": encoded.headers, "body": body}) as case:
        case.http(http_call(server.port, "POST", path, body, encoded.headers), expect=check_answer(encoded))


@fuzz(300)
@given(encoded=http_bodies(FULL_CATALOG))
def test_inference_bodies(server: QuiverServer, watch: Watch, encoded: HttpBody) -> None:
    """Valid requests (which must be answered right) and up to three mutations of any kind."""
    post_inference(server, watch, encoded)


def fp32(shape: list[int], flat: list[float], form: str = "json") -> In:
    return In("INPUT0", "FP32", shape, flat, form)


@fuzz(250)
@given(encoded=http_bodies(FULL_CATALOG, mutations=(1, 2), only=SHAPE_KINDS))
# the issue's: a zero beside a huge dimension, a rank over 64 (numpy's limit), past int64
@example(encoded=http_encode(example_request("identity_2d_fp32", [fp32([0, 2**62], [])], mutations=["shape"])))
@example(encoded=http_encode(example_request("identity_fp32", [fp32([1] * 65, [1.0])], mutations=["shape"])))
@example(encoded=http_encode(example_request("identity_fp32", [fp32([0, 2**63], [])], mutations=["shape"])))
@example(encoded=http_encode(example_request("identity_fp32", [fp32([2**63 - 1, 0], [], "binary")], mutations=["shape"])))
def test_inference_shapes_and_sizes(server: QuiverServer, watch: Watch, encoded: HttpBody) -> None:
    """Shapes (rank 0..100, zero beside huge dimensions), datatypes, binary sizes that lie."""
    post_inference(server, watch, encoded)


@fuzz(150)
@given(encoded=http_bodies(FULL_CATALOG, mutations=(1, 2), only=NESTING_KINDS))
# BYTES data nested 1,000 deep; top-k of an empty output
@example(encoded=http_encode(example_request(
    "identity_bytes", [In("INPUT0", "BYTES", [1], ["x"], data=nested(1000, "list"))], mutations=["deep"])))
@example(encoded=http_encode(example_request(
    "identity_fp32", [fp32([0], [])], outputs=[Out("OUTPUT0", {"classification": 2})], mutations=["classify"])))
# parameters nested 1,000 deep, which a Python model gets as JSON
@example(encoded=http_encode(example_request(
    "add_sub", [In("INPUT0", "FP32", [4], [1.0] * 4), In("INPUT1", "FP32", [4], [1.0] * 4)],
    parameters={"x": nested(1000, "list", b"1")}, mutations=["deep"])))
def test_inference_nesting_and_parameters(server: QuiverServer, watch: Watch, encoded: HttpBody) -> None:
    """Nesting past every limit in data and parameters; parameters of every type."""
    post_inference(server, watch, encoded)


@fuzz(150)
@given(encoded=http_bodies(FULL_CATALOG, mutations=(1, 1), only=NAME_KINDS))
# a name longer than a file name may be (an on-demand lookup); a negative version
@example(encoded=http_encode(example_request("a" * 256, [fp32([1], [1.0])], mutations=["model"])))
@example(encoded=http_encode(example_request("identity_fp32", [fp32([1], [1.0])], version="-1", mutations=["version"])))
def test_inference_names_and_versions(server: QuiverServer, watch: Watch, encoded: HttpBody) -> None:
    """Hostile model names (which an on-demand server looks up on disk) and versions."""
    post_inference(server, watch, encoded)


# -- headers: encodings, lengths, types --------------------------------------------------------

GARBAGE = b"\x1f\x8b\x08\x00garbage that is not gzip"


def encodings() -> st.SearchStrategy[tuple[str, Any]]:
    """(Content-Encoding value, how to encode the body)."""
    return st.one_of(
        st.sampled_from(["gzip", "deflate", "GZIP", " gzip ", "identity"]).map(lambda e: (e, "right")),
        st.sampled_from(["gzip", "deflate"]).map(lambda e: (e, "garbage")),
        st.sampled_from(["gzip", "deflate"]).map(lambda e: (e, "truncated")),
        st.sampled_from(["gzip", "deflate"]).map(lambda e: (e, "bomb")),
        st.sampled_from(["gzip", "deflate"]).map(lambda e: (e, "trailing")),
        st.sampled_from(["br", "zstd", "compress", "x-gzip", "gzip, gzip", "gzip, identity", "", "*", "gzip;q=1", "\u00e9"]).map(lambda e: (e, "right")),
    )


def encode_body(body: bytes, encoding: str, how: str) -> bytes:
    name = encoding.strip().lower()
    compress = (lambda b: gzip.compress(b)) if "gzip" in name else (lambda b: zlib.compress(b))
    if how == "right":
        return compress(body) if name in ("gzip", "deflate") else body
    if how == "garbage":
        return GARBAGE
    if how == "truncated":
        return compress(body)[:-5]
    if how == "trailing":
        return compress(body) + b"more"
    return compress(b"[" + b"0," * (2 << 20) + b"0]")  # inflates past the 1 MiB limit


HEADER_LENGTHS = ["-1", "0", "", "abc", "1e3", "+5", "0x10", "99999999999999999999", "\u0661\u0662", "\u00b2", "-0", "5 5", " 7", "7 "]


@fuzz(120)
@given(
    route=st.sampled_from(["/v2/models/simple/infer", "/v2/models/identity_fp32/infer", "/v2/repository/index", "/v2/logging", "/v2/repository/models/victim/unload"]),
    encoding=st.one_of(st.none(), encodings()),
    accept=st.one_of(st.none(), st.sampled_from(["gzip", "deflate", "br", "gzip;q=0", "*", "gzip, deflate;q=0.5", ";;;", "q=", "\u00e9", "gzip;q=abc"])),
    header_length=st.one_of(st.none(), st.sampled_from(HEADER_LENGTHS)),
    content_type=st.sampled_from(CONTENT_TYPES),
    extra=st.dictionaries(st.sampled_from(["Expect", "Transfer-Encoding", "Connection", "Content-Length", "X-Amzn-SageMaker-Target-Model", "Inference-Header-Content-Length"]),
                          st.sampled_from(["100-continue", "chunked", "close", "keep-alive", "0", "-1", "abc", "99999999", "simple", ""]), max_size=2),
)
def test_hostile_headers(
    server: QuiverServer, watch: Watch, route: str, encoding: tuple[str, str] | None, accept: str | None,
    header_length: str | None, content_type: str, extra: dict[str, str],
) -> None:
    from support.fuzz import CANARY_BODY

    body = b"{}"
    if route == "/v2/models/simple/infer":
        body = CANARY_BODY
    elif route.endswith("/infer"):  # an answer past 1 KiB: compressed if the client accepts
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2000], "data": [0.5] * 2000}]}).encode()
    headers: dict[str, str] = {"Content-Type": content_type} if content_type else {}
    if encoding is not None:
        headers["Content-Encoding"] = encoding[0]
        body = encode_body(body, *encoding)
    if accept is not None:
        headers["Accept-Encoding"] = accept
    if header_length is not None:
        headers["Inference-Header-Content-Length"] = header_length
    if "Content-Length" in extra or extra.get("Transfer-Encoding") == "chunked" or extra.get("Expect"):
        # a lie about the body's length: the raw-connection test's job (http.client would wait)
        extra = {k: v for k, v in extra.items() if k not in ("Content-Length", "Transfer-Encoding", "Expect")}
    headers.update(extra)
    with watch.case(f"POST {route} {headers}", body[:200]) as case:
        case.http(http_call(server.port, "POST", route, body, headers))


# -- the repository and logging extensions, field by field ------------------------------------


#: ``file:`` keys: inside a version folder, leaving it, or names the filesystem refuses.
FILE_KEYS = [
    "file:1/model.onnx", "file:1/model.py", "file:../x", "file:/etc/x", "file:1/../../x", "file:", "file:1",
    "file:1/", "file:a/model.onnx", "file:1/\x00", "file:1/a\x00b", "file:1/" + "a" * 300, "file:1/" + "a/" * 2100 + "x",
    "file:\u0661/model.onnx", "file:1\\..\\x", "file:1/.", "file:1/..", "file:01/model.onnx", "file:-1/m",
    "file:1//x", "file:1/./x", "file:99999999999999999999/x", "file:1/x/../../..", "file:1/" + "\u00e9" * 200,
]
#: Configs that parse: the files of the request are then written and the load tried.
CONFIGS = [
    '{"backend": "onnxruntime"}', '{"backend": "python"}', '{"backend": "identity"}', '{}', '{"backend": "tensorflow"}',
    '{"platform": "ensemble"}', '{"backend": "onnxruntime", "max_batch_size": -1}',
    '{"backend": "onnxruntime", "input": [{"name": "x", "data_type": "TYPE_FP8", "dims": [-5]}]}',
    '{"backend": "onnxruntime", "version_policy": {"specific": {"versions": [-1, 0, 99999999999]}}}',
    '{"name": "../x", "backend": "onnxruntime"}', '{"backend": "onnxruntime", "instance_group": [{"count": -1}]}',
    '{"backend": "onnxruntime", "dynamic_batching": {"max_queue_delay_microseconds": -1}}',
    '{"backend": "python", "parameters": {"x": {"string_value": 5}}}',
]


def load_bodies() -> st.SearchStrategy[Any]:
    file_value = st.one_of(
        st.sampled_from(["", "AAAA", "QUJD", "bm90IGFuIG9ubng="]),
        st.sampled_from(["not base64!", "QUJD=", "=" * 8, "\x00"]),
        parameter_values(),
    )
    config = st.one_of(
        st.sampled_from(CONFIGS),
        st.just(None),
        json_values(8).map(lambda v: dumps(v).decode("utf-8", "replace")),
        st.sampled_from(["[]", "null", "{" * 200 + "}" * 200, "{" * 2000 + "}" * 2000, '{"max_batch_size": 1e99}']),
        parameter_values(),
    )
    files = st.dictionaries(st.one_of(st.sampled_from(FILE_KEYS), st.text(max_size=12).map(lambda t: "file:" + t)), file_value, max_size=2)
    params = st.builds(lambda c, f: ({"config": c} if c is not None else {}) | f, config, files)
    return st.one_of(
        st.builds(lambda p: {"parameters": p}, params),
        st.builds(lambda p: {"parameters": p}, params),
        json_values(8),
        st.builds(lambda p: {"parameters": p}, json_values(6)),
    )


@fuzz(120)
@given(
    action=st.sampled_from(["index", "load", "unload"]),
    model=path_segments(MODEL_NAMES, exclude=PROTECTED),
    index_body=st.one_of(st.builds(lambda r: {"ready": r}, json_values(4)), json_values(6)),
    load_body=load_bodies(),
    unload_body=st.one_of(st.builds(lambda d: {"parameters": {"unload_dependents": d}}, json_values(4)), json_values(6)),
)
# file: names the filesystem refuses (NUL, too long); a model name too long to look up
@example(action="load", model="victim", index_body={}, unload_body={},
         load_body={"parameters": {"config": '{"backend": "onnxruntime"}', "file:1/\x00": "AAAA"}})
@example(action="load", model="victim", index_body={}, unload_body={},
         load_body={"parameters": {"config": '{"backend": "onnxruntime"}', "file:1/" + "a" * 300: "AAAA"}})
@example(action="load", model="a" * 300, index_body={}, load_body={}, unload_body={})
# base64 that is not even ASCII
@example(action="load", model="victim", index_body={}, unload_body={}, load_body={"parameters": {"file:1/model.onnx": "\u00e9"}})
def test_repository_bodies(
    server: QuiverServer, watch: Watch, action: str, model: str, index_body: Any, load_body: Any, unload_body: Any
) -> None:
    if action == "index":
        path, body = "/v2/repository/index", index_body
    elif action == "load":
        path, body = f"/v2/repository/models/{model}/load", load_body
    else:
        path, body = f"/v2/repository/models/{model}/unload", unload_body
    data = dumps(body)
    with watch.case(f"POST {path}", data) as case:
        case.http(http_call(server.port, "POST", path, data, {"Content-Type": "application/json"}))


LOG_KEYS = ["log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format"]


@fuzz(60)
@given(
    body=st.one_of(
        # one setting at a time: its value alone decides the answer
        st.dictionaries(st.sampled_from(LOG_KEYS), st.one_of(json_values(4), st.sampled_from(SAFE_LOG_FILES), st.sampled_from(["ISO8601", "default", "iso8601", ""])), min_size=1, max_size=1),
        st.dictionaries(st.sampled_from(LOG_KEYS), st.one_of(json_values(4), st.sampled_from(SAFE_LOG_FILES), st.sampled_from(["ISO8601", "default", "iso8601", ""])), max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(LOG_KEYS), st.text(max_size=8)), json_values(4), max_size=3),
    ),
    grpc_read=st.booleans(),
)
# a log file name open() refuses (NUL); a verbose level gRPC's uint32 cannot carry
@example(body={"log_file": "\x00"}, grpc_read=False)
@example(body={"log_verbose_level": 2**40}, grpc_read=True)
def test_logging_bodies(server: QuiverServer, watch: Watch, body: dict[str, Any], grpc_read: bool) -> None:
    data = dumps(defang(body))
    with watch.case("POST /v2/logging", data) as case:
        case.http(http_call(server.port, "POST", "/v2/logging", data, {"Content-Type": "application/json"}))
        # What was set must read back through both transports.
        case.http(http_call(server.port, "GET", "/v2/logging"))
        if grpc_read:
            import grpc
            from tritonclient.grpc import service_pb2 as pb
            from tritonclient.grpc import service_pb2_grpc

            with grpc.insecure_channel(server.grpc_url) as channel:
                try:
                    service_pb2_grpc.GRPCInferenceServiceStub(channel).LogSettings(pb.LogSettingsRequest(), timeout=TIMEOUT)
                except grpc.RpcError as exc:
                    case.grpc(exc.code().name, exc.details() or "")
    restore_logging(server)


# -- the connection itself: lengths that lie, chunks that lie, garbage ---------------------------


def raw_requests() -> st.SearchStrategy[tuple[bytes, bool]]:
    """(bytes on the wire, whether to close our side after sending)."""
    from support.fuzz import CANARY_BODY

    target = st.sampled_from(["/v2/models/simple/infer", "/v2/repository/index", "/v2/logging", "/v2/health/live"])
    length = st.one_of(
        st.integers(-3, 3).map(lambda d: ("delta", d)),
        st.sampled_from(["-1", "abc", "99999999999999999999", "1e3", "", "0x10", " 5", "5, 5"]).map(lambda v: ("value", v)),
    )

    def content_length(args: tuple[str, tuple[str, Any], bytes, bool, bool]) -> tuple[bytes, bool]:
        path, (how, value), body, twice, close = args
        declared = str(len(body) + value) if how == "delta" else value
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n"
        if twice:
            head += "Content-Length: 1\r\n"
        return head.encode("latin-1") + b"\r\n" + body, close or (how == "delta" and value > 0)

    def chunked(args: tuple[str, list[tuple[str, bytes]]]) -> tuple[bytes, bool]:
        path, chunks = args
        data = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        for size, payload in chunks:
            data += size.encode() + b"\r\n" + payload + b"\r\n"
        return data, True

    return st.one_of(
        st.tuples(target, length, st.sampled_from([CANARY_BODY, b"{}", b""]), st.booleans(), st.booleans()).map(content_length),
        st.tuples(
            target,
            st.lists(st.tuples(st.sampled_from(["5", "0", "-1", "ffffffffffffffff", "zz", "2;ext=1", ""]), st.binary(max_size=8)), max_size=3),
        ).map(chunked),
        st.tuples(st.binary(max_size=200), st.booleans()),
        st.sampled_from([
            b"GET /v2/health/live HTTP/1.1\r\n\r\n",
            b"GET /v2/health/live HTTP/9.9\r\nHost: x\r\n\r\n",
            b"GET " + b"/v2/models/" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n",
            b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n",
            b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01garbage",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello's start
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ]).map(lambda d: (d, True)),
    )


@fuzz(80)
@given(request=raw_requests())
def test_raw_connections(server: QuiverServer, watch: Watch, request: tuple[bytes, bool]) -> None:
    data, close = request
    with watch.case("raw connection", data[:300]) as case:
        # a connection left open with a request the server waits to complete gets no answer:
        # 2 s is enough to tell an answer came
        answer = raw_exchange(server.port, data, half_close=close, timeout=2.0 if not close else TIMEOUT)
        for status in statuses_in(answer):
            if status >= 500:
                case.fail(f"answered {status}: {answer[:1000]!r}")


@fuzz(60)
@given(method=st.sampled_from(METHODS), path=st.one_of(st.sampled_from(["/metrics", "/metrics/", "/", "/metrics?x=1", "/v2/health/live"]), path_segments(["metrics"]).map(lambda s: "/" + s)),
       body=st.one_of(st.none(), st.binary(max_size=200)), accept=st.one_of(st.none(), st.sampled_from(["gzip", "application/openmetrics-text", "*/*;q=x", "text/plain; version=0.0.4"])))
def test_metrics_listener(server: QuiverServer, watch: Watch, method: str, path: str, body: bytes | None, accept: str | None) -> None:
    headers = {"Accept": accept, "Accept-Encoding": accept} if accept else {}
    with watch.case(f"{method} metrics {path}", body) as case:
        case.http(http_call(server.metrics_port, method, path, body, headers))


def test_server_exits_cleanly_after_fuzzing(server: QuiverServer, tmp_path: Path) -> None:
    """Last in the module: the fuzzed server still stops on SIGTERM with exit code 0."""
    assert server.process is not None and server.process.poll() is None
    assert server.stop() == 0, "\n".join(server.lines[-50:])
