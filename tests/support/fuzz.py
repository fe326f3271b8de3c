"""The fuzz suite's harness: bounded hypothesis settings, a raw HTTP client, the repository the
fuzzed servers serve, and :class:`Watch`, the checks every example ends with.

Every example asserts that the server answered (a client timeout, never a hang), that a
client's mistake is not a 5xx (HTTP) or INTERNAL/UNKNOWN (gRPC) unless the answer is on an
explicit list of deliberate ones, that the process is still alive, and that a request with a
known answer (the canary) is still answered correctly.

Knobs (environment, or ``--fuzz-examples`` / ``--fuzz-seed`` on the pytest command line):

- ``QUIVER_FUZZ_EXAMPLES=N``: examples per fuzz test (each test has a small default so the
  suite takes a minute or two);
- ``QUIVER_FUZZ_SEED=N``: another fixed seed; ``random`` for a fresh one each run (hypothesis
  prints a reproduction blob on failure). Unset: derandomized, the same examples every run;
- ``QUIVER_FUZZ_REPORT=FILE``: record every violation as a JSON line in FILE instead of
  failing at the first one (to survey a build; the test still fails at the end if any).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import struct
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from build_repository import (
    ADD_SUB_CONFIG,
    ADD_SUB_MODEL,
    CLASSIFIER_CONFIG,
    LABELS,
    SIMPLE_CONFIG,
    classifier_onnx,
    simple_onnx,
)
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed

from support.hostile import In, ModelSpec, Req, TensorSpec, numpy_dtype
from support.models import (
    add_constant_onnx,
    identity_onnx,
    make_model,
    write_config,
    write_identities,
    write_onnx,
    write_python,
)
from support.server import QuiverServer

EXAMPLES_ENV = "QUIVER_FUZZ_EXAMPLES"
SEED_ENV = "QUIVER_FUZZ_SEED"
REPORT_ENV = "QUIVER_FUZZ_REPORT"

#: Seconds a client waits for an answer: past it, the server hung.
TIMEOUT = 20.0

T = TypeVar("T", bound=Callable[..., Any])


def examples(default: int) -> int:
    override = os.environ.get(EXAMPLES_ENV, "").strip()
    return int(override) if override else default


def fuzz(default_examples: int) -> Callable[[T], T]:
    """Decorator (above ``@given``) for one fuzz test: ``default_examples`` examples (or
    ``QUIVER_FUZZ_EXAMPLES``), no deadline, no example database, derandomized unless
    ``QUIVER_FUZZ_SEED`` says otherwise, and a pytest timeout that grows with the count."""
    count = examples(default_examples)
    seed_text = os.environ.get(SEED_ENV, "").strip()
    config = settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=not seed_text,
        print_blob=bool(seed_text),
        suppress_health_check=list(HealthCheck),
    )

    def apply(test: T) -> T:
        wrapped = config(test)
        if seed_text and seed_text != "random":
            wrapped = hypothesis_seed(int(seed_text))(wrapped)
        marked: T = pytest.mark.timeout(max(120, int(count * 1.5)))(wrapped)
        return marked

    return apply


# -- a raw HTTP client -----------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def error(self) -> str:
        try:
            value = json.loads(self.body)
        except ValueError:
            return self.body[:300].decode("utf-8", "replace")
        if isinstance(value, dict) and isinstance(value.get("error"), str):
            return value["error"]
        return self.body[:300].decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def http_call(
    port: int,
    method: str,
    target: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    timeout: float = TIMEOUT,
) -> Reply:
    """One request on a fresh connection, headers exactly as given (no Host or
    Accept-Encoding added unless given; Content-Length from ``body`` unless given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        given = {k.lower() for k in (headers or {})}
        if "host" not in given:
            conn.putheader("Host", f"127.0.0.1:{port}")
        for key, value in (headers or {}).items():
            conn.putheader(key, value.encode("utf-8"))
        if body is not None and "content-length" not in given:
            conn.putheader("Content-Length", str(len(body)))
        try:
            conn.endheaders(body)
        except (BrokenPipeError, ConnectionResetError):
            # the server answered (a 405, a 413) and closed before reading the whole body:
            # its answer may still be there to read; if not, there is nothing to check
            try:
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                return Reply(0, {}, b"")
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        response = conn.getresponse()
        data = response.read()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, *, half_close: bool = True, timeout: float = TIMEOUT) -> bytes:
    """Send ``data`` as it is on a fresh connection, optionally close our side, and read
    until the server closes or goes quiet (``timeout``). Returns what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
            if not half_close and b"\r\n\r\n" in b"".join(chunks):
                break  # an answer came; the connection may stay open
        return b"".join(chunks)


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})")


def statuses_in(raw: bytes) -> list[int]:
    """Status codes of the responses in a raw exchange (pipelining may give several)."""
    return [int(m.group(1)) for m in _STATUS_LINE.finditer(raw)]


# -- what may be a 5xx -----------------------------------------------------------------------

#: Deliberate 5xx answers (status or gRPC code, and what the message must say), each the
#: README's documented meaning of that status; anything else 5xx is a failure.
DELIBERATE_HTTP = [
    # a model that is not loaded, failed to load, or is being unloaded: UNAVAILABLE
    (503, re.compile(r"is not ready|is unloading|failed to load|no model is loaded|still loading")),
    # an S3 store that cannot be reached (the SageMaker server's bogus endpoint): UNAVAILABLE
    (503, re.compile(r"^S3 |cannot fetch '.*' from s3://")),
    # a backend or location Quiver does not support: UNSUPPORTED
    # ... and Triton's refusal to move the trace file through the trace API: UNSUPPORTED
    (501, re.compile(r"backend '.*' is not supported|needs the Python package|only s3:// URLs|not supported"
                     r"|trace file location can not be updated")),
]
DELIBERATE_GRPC = [
    ("UNAVAILABLE", DELIBERATE_HTTP[0][1]),
    ("UNIMPLEMENTED", re.compile(r"Method not implemented|not implemented|not supported")),
    ("UNIMPLEMENTED", DELIBERATE_HTTP[2][1]),
]
FORBIDDEN_GRPC = {"INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS"}


def http_deliberate(status: int, message: str) -> bool:
    return any(status == code and pattern.search(message) for code, pattern in DELIBERATE_HTTP)


def grpc_deliberate(code: str, message: str) -> bool:
    return any(code == name and pattern.search(message) for name, pattern in DELIBERATE_GRPC)


# -- the checks of every example --------------------------------------------------------------


class Violation(AssertionError):
    pass


_KINDS: dict[str, type[Violation]] = {}
_EXCEPTION = re.compile(r"^((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt))\b", re.M)


def violation_kind(problems: list[str], log: str) -> type[Violation]:
    """A Violation subclass per kind of failure (what was wrong, and the last exception the
    server logged), so that hypothesis reports, and shrinks, each distinct failure."""
    first = re.sub(r"'[^']*'", "'...'", problems[0].split(":")[0])[:80]
    raised = _EXCEPTION.findall(log)
    key = f"{first} / {raised[-1] if raised else 'no traceback'}"
    kind = _KINDS.get(key)
    if kind is None:
        kind = _KINDS[key] = type(f"Violation[{key}]", (Violation,), {})
    return kind


@dataclass
class Case:
    """One example's request, as :meth:`Watch.case` opens it."""

    what: str
    request: str
    log_from: int
    problems: list[str] = field(default_factory=list)

    def fail(self, problem: str) -> None:
        self.problems.append(problem)

    def http(self, reply: Reply, *, expect: Callable[[Reply], str | None] | None = None) -> None:
        """A 5xx is a failure unless deliberate; ``expect`` may add its own complaint."""
        if reply.status >= 500 and not http_deliberate(reply.status, reply.error):
            self.fail(f"answered {reply.status}: {reply.error[:2000]}")
        if expect is not None:
            problem = expect(reply)
            if problem:
                self.fail(problem)

    def grpc(self, code: str, message: str) -> None:
        if code in FORBIDDEN_GRPC and not grpc_deliberate(code, message):
            self.fail(f"answered {code}: {message[:2000]}")
        elif code not in ("OK",) and code not in (
            "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED",
            "FAILED_PRECONDITION", "OUT_OF_RANGE", "CANCELLED", "PERMISSION_DENIED",
        ) and not grpc_deliberate(code, message):
            self.fail(f"answered {code} (not a client-error status): {message[:2000]}")


def _short(value: Any, limit: int = 1500) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class Watch:
    """Wraps every example of a module's fuzz tests against one server.

    ``with watch.case("POST /v2/...", request_repr) as case: ... case.http(reply)``; on
    leaving, the server must be alive and (every ``canary_every`` cases) answer the canary;
    an exception from the client (a timeout, a reset connection) is a failure too.
    """

    def __init__(self, server: QuiverServer, canary: Callable[[], str | None], *, canary_every: int = 1) -> None:
        self.server = server
        self.canary = canary
        self.canary_every = canary_every
        self.cases = 0
        self.report = os.environ.get(REPORT_ENV, "").strip()
        self.violations = 0
        self.test = ""

    @contextlib.contextmanager
    def case(self, what: str, request: Any = "") -> Iterator[Case]:
        case = Case(what, _short(request), len(self.server.lines))
        try:
            yield case
        except TimeoutError as exc:
            case.fail(f"no answer within {TIMEOUT:g} s (a hang): {exc!r}")
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            case.fail(f"the connection failed: {exc!r}")
        self.cases += 1
        assert self.server.process is not None
        if self.server.process.poll() is not None:
            case.fail(f"the server died (exit code {self.server.process.returncode})")
        elif self.cases % self.canary_every == 0:
            problem = self.canary()
            if problem:
                case.fail(f"the canary request failed afterwards: {problem}")
        if case.problems:
            self._report(case)

    def _report(self, case: Case) -> None:
        time.sleep(0.05)  # the log line of a traceback may trail the answer
        log = "\n".join(self.server.lines[case.log_from :])
        message = (
            f"{case.what}: " + "; ".join(case.problems)
            + f"\nrequest: {case.request}\nserver log since the request:\n{textwrap.indent(log[-6000:], '  ')}"
        )
        if self.report:
            self.violations += 1
            entry = {
                "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                "what": case.what,
                "problems": case.problems,
                "request": case.request,
                "log": log[-6000:],
            }
            with open(self.report, "a", encoding="utf-8") as out:
                out.write(json.dumps(entry) + "\n")
            return
        raise violation_kind(case.problems, log)(message)

    def assert_clean(self) -> None:
        """In report mode, fail once at the end if anything was recorded."""
        if self.violations:
            raise Violation(f"{self.violations} violations recorded in {self.report}")


# -- the fuzzed repository ------------------------------------------------------------------

STRING_CONFIG = """
name: "string_upper"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

#: Upper-cases each element; bytes that are not UTF-8 are the client's mistake (INVALID_ARG),
#: not an exception: a model that raises is a 500 by design, which would hide server bugs.
STRING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            try:
                upper = [s.decode("utf-8").upper().encode("utf-8") for s in text.reshape(-1)]
            except UnicodeDecodeError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"TEXT is not UTF-8: {exc}", pb_utils.TritonError.INVALID_ARG)))
                continue
            out = np.empty(len(upper), dtype=object)
            out[:] = upper
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", out.reshape(text.shape))]))
        return responses
"""

DOUBLE_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

DOUBLE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return out
"""

BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights file is corrupt")

    def execute(self, requests):
        return []
"""

ADD = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}
"""

#: IN -> add_one -> double -> DOUBLED, and IN -> add_ten -> PLUS_TEN.
PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "DOUBLED" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "PLUS_TEN" data_type: TYPE_FP32 dims: [ 4 ] }
]
ensemble_scheduling { step [
  { model_name: "add_one" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "plus_one" } },
  { model_name: "double" model_version: -1 input_map { key: "X" value: "plus_one" } output_map { key: "Y" value: "DOUBLED" } },
  { model_name: "add_ten" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "PLUS_TEN" } }
] }
"""

ACC_CONFIG = """
name: "acc"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  direct { }
  max_sequence_idle_microseconds: 5000000
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zero" } } ]
}
"""

#: ONNX identity models (dims [-1], no batching) for these datatypes, plus identity_bf16.
IDENTITY_TYPES = ["BOOL", "INT8", "UINT16", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES"]


def accumulator_onnx() -> Any:
    """OUTPUT = INPUT + STATE_IN, STATE_OUT = OUTPUT, FP32[batch, 1]."""
    from onnx import TensorProto, helper

    shape: list[int | str] = ["batch", 1]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT", "STATE_IN"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        ],
        "accumulator",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, shape),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, shape),
        ],
    )
    return make_model(graph)


def build_repository(repo: Path, *, full: bool = True) -> Path:
    """The models the fuzz servers serve: ONNX (``simple``, the canary; ``classifier`` with
    labels; identities of many datatypes; a sequence model), Python (``add_sub``,
    ``string_upper``), an identity-backend BF16 model, an ensemble (``pipeline``), a model
    that fails to load (``broken``) and one the repository API may load and unload freely
    (``victim``). ``full=False`` leaves out the identities and the sequence model."""
    repo.mkdir(parents=True, exist_ok=True)
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_python(repo, "add_sub", ADD_SUB_MODEL, ADD_SUB_CONFIG)
    write_python(repo, "string_upper", STRING_MODEL, STRING_CONFIG)
    write_onnx(repo, "add_one", add_constant_onnx(1.0), ADD.format(name="add_one", extra="dynamic_batching { max_queue_delay_microseconds: 2000 }"))
    write_onnx(repo, "add_ten", add_constant_onnx(10.0), ADD.format(name="add_ten", extra=""))
    write_python(repo, "double", DOUBLE_MODEL, DOUBLE_CONFIG)
    write_config(repo, "pipeline", PIPELINE)
    write_onnx(repo, "victim", add_constant_onnx(3.0), ADD.format(name="victim", extra=""))
    write_python(
        repo,
        "broken",
        BROKEN_MODEL,
        """
        backend: "python"
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """,
    )
    if full:
        folder = write_onnx(repo, "classifier", classifier_onnx(), CLASSIFIER_CONFIG)
        (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
        write_identities(repo, IDENTITY_TYPES)
        write_onnx(
            repo,
            "identity_2d_fp32",
            identity_onnx("FP32", [-1, -1]),
            """
            name: "identity_2d_fp32"
            platform: "onnxruntime_onnx"
            input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
            output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
            """,
        )
        write_onnx(repo, "acc", accumulator_onnx(), ACC_CONFIG)
    return repo


def _fp32(dims: tuple[int, ...]) -> TensorSpec:
    return TensorSpec("FP32", dims)


#: What the fuzzer knows of the models of :func:`build_repository`.
CATALOG = [
    ModelSpec("simple", 8, {"INPUT0": TensorSpec("INT32", (16,)), "INPUT1": TensorSpec("INT32", (16,))},
              {"OUTPUT0": TensorSpec("INT32", (16,)), "OUTPUT1": TensorSpec("INT32", (16,))}),
    ModelSpec("add_sub", 0, {"INPUT0": _fp32((4,)), "INPUT1": _fp32((4,))}, {"OUTPUT0": _fp32((4,)), "OUTPUT1": _fp32((4,))}),
    ModelSpec("string_upper", 8, {"TEXT": TensorSpec("BYTES", (-1,))}, {"UPPER": TensorSpec("BYTES", (-1,))}),
    ModelSpec("pipeline", 8, {"IN": _fp32((4,))}, {"DOUBLED": _fp32((4,)), "PLUS_TEN": _fp32((4,))}),
    ModelSpec("add_one", 8, {"INPUT0": _fp32((4,))}, {"OUTPUT0": _fp32((4,))}),
    ModelSpec("double", 8, {"X": _fp32((4,))}, {"Y": _fp32((4,))}),
    ModelSpec("victim", 8, {"INPUT0": _fp32((4,))}, {"OUTPUT0": _fp32((4,))}, always_ok=False),
]
FULL_CATALOG = [
    *CATALOG,
    ModelSpec("classifier", 16, {"INPUT": _fp32((8,))}, {"OUTPUT": _fp32((10,))}),
    *[
        ModelSpec(f"identity_{dt.lower()}", 0, {"INPUT0": TensorSpec(dt, (-1,))}, {"OUTPUT0": TensorSpec(dt, (-1,))})
        for dt in [*IDENTITY_TYPES, "BF16"]
    ],
    ModelSpec("identity_2d_fp32", 0, {"INPUT0": _fp32((-1, -1))}, {"OUTPUT0": _fp32((-1, -1))}),
    ModelSpec("acc", 4, {"INPUT": _fp32((1,))}, {"OUTPUT": _fp32((1,))}, always_ok=False),
]
#: Models the fuzzer must never unload or reload: the canary's.
PROTECTED = ("simple",)
MODEL_NAMES = sorted({m.name for m in FULL_CATALOG} | {"broken"})

#: The canary: ``simple`` on [0..15] and ones gives [1..16] and [-1..14].
CANARY_BODY = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
        ]
    }
).encode()


def check_canary_reply(reply: Reply) -> str | None:
    if reply.status != 200:
        return f"{reply.status}: {reply.error}"
    outputs = {o["name"]: o["data"] for o in reply.json()["outputs"]}
    if outputs.get("OUTPUT0") != list(range(1, 17)) or outputs.get("OUTPUT1") != list(range(-1, 15)):
        return f"wrong answer: {outputs}"
    return None


def http_canary(port: int, path: str = "/v2/models/simple/infer", headers: dict[str, str] | None = None) -> Callable[[], str | None]:
    def canary() -> str | None:
        try:
            reply = http_call(port, "POST", path, CANARY_BODY, {"Content-Type": "application/json", **(headers or {})})
        except OSError as exc:
            return f"no answer: {exc!r}"
        return check_canary_reply(reply)

    return canary


def start_server(repo: Path, *args: str, sagemaker: bool = False, env: dict[str, str] | None = None) -> QuiverServer:
    """A server on ``repo`` in on-demand mode, every model loaded at start, small limits
    (1 MiB bodies and messages) so oversized examples are cheap."""
    return QuiverServer(
        repo,
        args=(
            "--model-control-mode=on_demand",
            "--load-model=*",
            "--exit-on-error=false",
            "--http-max-input-size=1048576",
            "--grpc-max-message-size=1048576",
            "--model-load-wait-timeout=10",
            *args,
        ),
        sagemaker=sagemaker,
        env=env,
        timeout=120,
    ).start()


# -- the right answer to a valid request ----------------------------------------------------


def _array(tensor: In) -> np.ndarray[Any, Any]:
    if tensor.datatype == "BYTES":
        out = np.empty(len(tensor.flat), dtype=object)
        out[:] = [v.encode("utf-8") for v in tensor.flat]
        return out.reshape(tensor.shape)
    return np.asarray(tensor.flat, dtype=numpy_dtype(tensor.datatype)).reshape(tensor.shape)


def expected_outputs(req: Req) -> dict[str, np.ndarray[Any, Any]] | None:
    """What the model must answer to a valid request, for the models whose answer is easy
    to compute here (None for the others: only the status is checked)."""
    inputs = {t.name: _array(t) for t in req.inputs}
    with np.errstate(over="ignore"):
        if req.model == "simple":
            a, b = inputs["INPUT0"], inputs["INPUT1"]
            return {"OUTPUT0": a + b, "OUTPUT1": a - b}
        if req.model == "add_sub":
            a, b = inputs["INPUT0"], inputs["INPUT1"]
            return {"OUTPUT0": a + b, "OUTPUT1": a - b}
    if req.model.startswith("identity_"):
        return {"OUTPUT0": inputs["INPUT0"]}
    if req.model == "string_upper":
        text = inputs["TEXT"]
        upper = np.empty(text.size, dtype=object)
        upper[:] = [s.decode("utf-8").upper().encode("utf-8") for s in text.reshape(-1)]
        return {"UPPER": upper.reshape(text.shape)}
    return None


def decode_binary(datatype: str, raw: bytes, shape: list[int]) -> np.ndarray[Any, Any]:
    if datatype == "BYTES":
        items = []
        offset = 0
        while offset < len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            items.append(raw[offset + 4 : offset + 4 + length])
            offset += 4 + length
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    return np.frombuffer(raw, dtype=numpy_dtype(datatype)).reshape(shape)


def http_outputs(reply: Reply) -> dict[str, tuple[str, np.ndarray[Any, Any]]]:
    """name -> (datatype, array) of a 200 inference answer (JSON or JSON plus binary)."""
    length = reply.headers.get("inference-header-content-length")
    header_bytes = reply.body[: int(length)] if length is not None else reply.body
    header = json.loads(header_bytes)
    offset = len(header_bytes)
    out = {}
    for entry in header["outputs"]:
        datatype, shape = entry["datatype"], entry["shape"]
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            array = decode_binary(datatype, reply.body[offset : offset + size], shape)
            offset += size
        elif datatype == "BYTES":
            array = np.empty(len(entry["data"]), dtype=object)
            array[:] = [s.encode("utf-8") for s in entry["data"]]
            array = array.reshape(shape)
        else:
            array = np.asarray(entry["data"], dtype=numpy_dtype(datatype)).reshape(shape)
        out[entry["name"]] = (datatype, array)
    return out


def compare_outputs(req: Req, got: dict[str, tuple[str, np.ndarray[Any, Any]]]) -> str | None:
    """A complaint if ``got`` is not the right answer to the valid request ``req``."""
    wanted = None if req.outputs is None or not req.outputs else {o.name for o in req.outputs}
    expected = expected_outputs(req)
    if expected is None:
        return None
    names = set(expected) if wanted is None else wanted & set(expected)
    if set(got) != names:
        return f"answered outputs {sorted(got)}, expected {sorted(names)}"
    for name in names:
        _, array = got[name]
        want = expected[name]
        if array.shape != want.shape:
            return f"output {name} has shape {list(array.shape)}, expected {list(want.shape)}"
        if want.dtype == object:
            same = list(array.reshape(-1)) == list(want.reshape(-1))
        else:
            same = np.array_equal(array.astype(want.dtype), want)
        if not same:
            return f"output {name} is {array.reshape(-1)[:8]!r}..., expected {want.reshape(-1)[:8]!r}..."
    return None
