"""A generic KServe v2 load generator: HTTP/1.1 (JSON or Triton's binary tensor extension) and gRPC.

It is deliberately lean, so that it leaves the cores to the server under test: one process, one
event loop (uvloop when installed, through ``common.run_async``), requests encoded once before
the trial.

* HTTP (encodings ``json`` and ``binary``): one keep-alive connection per concurrent request,
  one request in flight on each; callback-driven ``asyncio.Protocol`` connections that write the
  pre-encoded request bytes and frame each response by its head: ``Content-Length``,
  ``Transfer-Encoding: chunked`` (MLServer/uvicorn may send either), or, without either, the end
  of the connection. Header names are matched case-insensitively; interim ``1xx`` responses are
  skipped; ``Connection: close`` (or an HTTP/1.0 answer without keep-alive) makes the client
  open a new connection for the next request (counted in ``reconnects``, not as an error).
* gRPC (encoding ``grpc``): a ``grpc.aio`` stub of ``tritonclient.grpc.service_pb2_grpc`` on
  one channel (one HTTP/2 connection), N caller coroutines each awaiting ``ModelInfer`` with a
  pre-built ``ModelInferRequest`` (inputs in ``raw_input_contents``).

What is sent is a :class:`Payload`: a model, its inputs as ``{name: numpy array}`` (the KServe
datatype follows the dtype; object, bytes and str arrays are BYTES) and how to check an answer
(expected outputs compared with a tolerance, and/or a callable). Every response's status is
checked (not 200 / not OK is an error); each connection's (or caller's) first answer, each
payload's first, and one in ``check_every`` after that are decoded and checked: a wrong answer is
an error too, in the warm-up as well.

A payload may instead be a request the server must refuse: ``status`` (HTTP) and
``grpc_status`` (gRPC) name the answer it must get, and ``body`` sends a raw (say malformed)
HTTP body instead of encoded inputs. An answer with exactly that status counts in ``rejected``,
not as an error; any other answer, a 200 included, is an error.

``rate`` paces a trial (at most that many requests per second in all, each connection or caller
waiting ``concurrency / rate`` seconds between its sends; the first sends staggered over that
period) instead of sending the next request as soon as an answer comes; ``request_timeout_s``
counts a request unanswered after that long as a timeout (an error; HTTP: its connection is
dropped and opened again; gRPC: the call's deadline).

Several payloads (say one per model) make a multi-model trial: each request takes the next index
of ``mix``, a pre-drawn sequence of payload indices (:func:`zipf_sequence` draws one from a Zipf
law), cycling when it runs out; without ``mix`` the payloads take turns. The result counts the
requests per model.

API::

    Payload(model, inputs, expected=None, check=None, rtol=0.0, atol=0.0, outputs=None, version="",
            body=None, status=200, grpc_status="OK")
    run_trial(host, port, encoding, concurrency, warmup_s, duration_s, payloads, server_pid=None,
              check_every=50, mix=None, progress=1.0, *, result=None, on_begin=None, on_end=None,
              drain_timeout_s=60.0, rate=None, request_timeout_s=None)
              -> TrialResult          (run_trial_async: the same, awaitable)
    sanity_check(host, port, encoding, payload, timeout=30.0) -> dict[str, np.ndarray]
    zipf_sequence(n_models, s, length, seed=0) -> list[int]

Self-test: ``.venv/bin/python -m benchmarks.loadgen --selftest`` from the repository root
(response framing, then a ``quiver serve`` of Triton's ``simple`` model in all three encodings,
and a Zipf mix over copies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import struct
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from benchmarks.common import cpu_seconds, run_async

ENCODINGS = ("json", "binary", "grpc")

_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
_BY_KIND = {(dt.kind, dt.itemsize): name for name, dt in _DTYPES.items()}
_CONTENTS = {  # typed gRPC contents, for servers that do not answer with raw_output_contents
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def datatype_of(array: np.ndarray[Any, Any]) -> str:
    """The KServe v2 datatype of ``array`` (object, bytes and str arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    try:
        return _BY_KIND[(array.dtype.kind, array.dtype.itemsize)]
    except KeyError:
        raise ValueError(f"no KServe v2 datatype for numpy dtype {array.dtype}") from None


def _as_bytes(item: Any) -> bytes:
    return item if isinstance(item, bytes) else str(item).encode()


def _to_raw(array: np.ndarray[Any, Any], datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in map(_as_bytes, array.ravel()))
    return np.ascontiguousarray(array, dtype=_DTYPES[datatype]).tobytes()


def _from_raw(raw: bytes, datatype: str, shape: list[int]) -> np.ndarray[Any, Any]:
    if datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            items.append(bytes(raw[offset + 4 : offset + 4 + length]))
            offset += 4 + length
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array.reshape(shape)
    if datatype == "BF16":  # decoded as float32
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=_DTYPES[datatype]).reshape(shape)


def _from_json(data: Any, datatype: str, shape: list[int]) -> np.ndarray[Any, Any]:
    if datatype == "BYTES":
        array = np.empty(int(np.prod(shape)), dtype=object)
        array[:] = [_as_bytes(x) for x in np.asarray(data, dtype=object).ravel()]
        return array.reshape(shape)
    return np.asarray(data, dtype=np.float32 if datatype == "BF16" else _DTYPES[datatype]).reshape(shape)


def decode_http_outputs(body: bytes, header_length: int | None) -> dict[str, np.ndarray[Any, Any]]:
    """The outputs of a v2 HTTP infer response: JSON, or a JSON header of ``header_length`` bytes
    followed by the binary outputs (Triton's binary tensor extension)."""
    header = orjson.loads(body[:header_length] if header_length is not None else body)
    offset = header_length or 0
    outputs = {}
    for out in header["outputs"]:
        shape = [int(d) for d in out["shape"]]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if header_length is None:
                raise ValueError(f"{out['name']} is binary but the response has no Inference-Header-Content-Length")
            outputs[out["name"]] = _from_raw(body[offset : offset + size], out["datatype"], shape)
            offset += size
        else:
            outputs[out["name"]] = _from_json(out["data"], out["datatype"], shape)
    return outputs


def decode_grpc_outputs(response: Any) -> dict[str, np.ndarray[Any, Any]]:
    """The outputs of a ``ModelInferResponse``, raw or typed contents."""
    raw = response.raw_output_contents
    outputs = {}
    for index, out in enumerate(response.outputs):
        shape = [int(d) for d in out.shape]
        if index < len(raw):
            outputs[out.name] = _from_raw(raw[index], out.datatype, shape)
        else:
            values = getattr(out.contents, _CONTENTS[out.datatype])
            outputs[out.name] = _from_json(list(values), out.datatype, shape)
    return outputs


def _preview(array: np.ndarray[Any, Any], n: int = 8) -> str:
    flat = array.ravel()
    text = repr(flat[:n].tolist())
    return text[:-1] + ", ...]" if flat.size > n else text


def describe_outputs(outputs: Mapping[str, np.ndarray[Any, Any]]) -> str:
    return "; ".join(f"{name} {datatype_of(a)} {list(a.shape)} {_preview(a)}" for name, a in outputs.items()) or "no outputs"


def _compare(name: str, got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], rtol: float, atol: float) -> str | None:
    if datatype_of(got) != datatype_of(want):
        return f"{name}: datatype {datatype_of(got)}, expected {datatype_of(want)}"
    if got.shape != want.shape:
        return f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    if want.dtype.kind in "OSU":
        ok = [_as_bytes(x) for x in got.ravel()] == [_as_bytes(x) for x in want.ravel()]
    elif want.dtype.kind in "fc":
        ok = bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
    else:
        ok = bool(np.array_equal(got, want))
    if ok:
        return None
    detail = ""
    if want.dtype.kind in "iufc" and want.size:
        detail = f" (max difference {float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max()):.3g})"
    return f"{name}: wrong values {_preview(got)}, expected {_preview(want)}{detail}"


# -- what is sent ---------------------------------------------------------------------------


@dataclass
class Payload:
    """One inference request, and how to check its answer.

    ``expected``: outputs the answer must hold (same datatype and shape; values equal, or within
    ``rtol``/``atol`` for floats); ``check``: a callable given the decoded outputs, returning
    None or what is wrong. ``outputs``: the outputs to request; by default none are named (the
    server answers with all of them) except in the ``binary`` encoding, which names those of
    ``expected`` with ``binary_data`` (or, without ``expected``, sets ``binary_data_output``).

    A request the server must refuse: ``status`` is the HTTP status and ``grpc_status`` the gRPC
    status code name (``"NOT_FOUND"``) it must be answered with (200 and ``"OK"``: a normal
    request); ``body``, HTTP only, is sent as is (JSON content type) instead of the encoded
    inputs, e.g. malformed JSON.
    """

    model: str
    inputs: Mapping[str, Any]
    expected: Mapping[str, Any] | None = None
    check: Callable[[dict[str, np.ndarray[Any, Any]]], str | None] | None = None
    rtol: float = 0.0
    atol: float = 0.0
    outputs: Sequence[str] | None = None
    version: str = ""
    body: bytes | None = None
    status: int = 200
    grpc_status: str = "OK"

    def __post_init__(self) -> None:
        self.inputs = {name: np.asarray(a) for name, a in self.inputs.items()}
        if self.expected is not None:
            self.expected = {name: np.asarray(a) for name, a in self.expected.items()}

    @property
    def infer_path(self) -> str:
        version = f"/versions/{self.version}" if self.version else ""
        return f"/v2/models/{self.model}{version}/infer"

    def http_body(self, encoding: str) -> tuple[bytes, int | None]:
        """The request body, and for ``binary`` the length of its JSON header."""
        if self.body is not None:
            return self.body, None
        inputs = []
        raw = []
        for name, array in self.inputs.items():
            datatype = datatype_of(array)
            entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
            if encoding == "json":
                flat = array.ravel()
                if datatype == "BYTES":
                    entry["data"] = [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
                else:
                    entry["data"] = flat.tolist()
            elif encoding == "binary":
                data = _to_raw(array, datatype)
                entry["parameters"] = {"binary_data_size": len(data)}
                raw.append(data)
            else:
                raise ValueError(f"not an HTTP encoding: {encoding!r}")
            inputs.append(entry)
        body: dict[str, Any] = {"inputs": inputs}
        binary = encoding == "binary"
        names = list(self.outputs) if self.outputs is not None else (list(self.expected or ()) if binary else [])
        if names:
            body["outputs"] = [{"name": n, "parameters": {"binary_data": True}} if binary else {"name": n} for n in names]
        elif binary:
            body["parameters"] = {"binary_data_output": True}
        header = orjson.dumps(body)
        return (header + b"".join(raw), len(header)) if binary else (header, None)

    def http_headers(self, encoding: str) -> dict[str, str]:
        _, header_length = self.http_body(encoding)
        if header_length is None:
            return {"Content-Type": "application/json"}
        return {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_length)}

    def http_request(self, encoding: str, host: str, port: int) -> bytes:
        """The complete pre-encoded HTTP/1.1 request."""
        body, header_length = self.http_body(encoding)
        lines = [f"POST {self.infer_path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
        if header_length is None:
            lines.append("Content-Type: application/json")
        else:
            lines += ["Content-Type: application/octet-stream", f"Inference-Header-Content-Length: {header_length}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    def grpc_request(self) -> Any:
        """The ``ModelInferRequest``, every input in ``raw_input_contents``."""
        from tritonclient.grpc import service_pb2 as pb

        if self.body is not None:
            raise ValueError(f"payload for {self.model!r}: a raw body is for HTTP only")
        request = pb.ModelInferRequest(model_name=self.model, model_version=self.version)
        for name, array in self.inputs.items():
            datatype = datatype_of(array)
            request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
            request.raw_input_contents.append(_to_raw(array, datatype))
        for name in self.outputs or ():
            request.outputs.add(name=name)
        return request

    def verify(self, outputs: dict[str, np.ndarray[Any, Any]]) -> str | None:
        """None if ``outputs`` is a right answer, else what is wrong."""
        for name, want in (self.expected or {}).items():
            got = outputs.get(name)
            if got is None:
                return f"output {name} missing (got {sorted(outputs)})"
            problem = _compare(name, got, want, self.rtol, self.atol)
            if problem is not None:
                return problem
        if self.check is not None:
            try:
                return self.check(outputs)
            except Exception as exc:
                return f"check raised {type(exc).__name__}: {exc}"
        return None

    def verify_http(self, body: bytes, header_length: int | None) -> str | None:
        try:
            outputs = decode_http_outputs(body, header_length)
        except Exception as exc:
            return f"undecodable response ({type(exc).__name__}: {exc}): {body[:200]!r}"
        return self.verify(outputs)

    def verify_grpc(self, response: Any) -> str | None:
        try:
            outputs = decode_grpc_outputs(response)
        except Exception as exc:
            return f"undecodable response ({type(exc).__name__}: {exc}): {str(response)[:200]!r}"
        return self.verify(outputs)


def zipf_sequence(n_models: int, s: float, length: int, seed: int = 0) -> list[int]:
    """``length`` indices in ``range(n_models)`` drawn from a Zipf law, P(k) proportional to
    1 / (k + 1) ** s: index 0 the most popular; ``s`` 0 is uniform."""
    if n_models < 1 or length < 1:
        raise ValueError("n_models and length must be >= 1")
    weights = np.arange(1, n_models + 1, dtype=np.float64) ** -float(s)
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.choice(n_models, size=length, p=weights / weights.sum())]


# -- results --------------------------------------------------------------------------------


@dataclass
class TrialResult:
    """One trial. Counters and latencies cover the measured window (wrong answers: warm-up too).

    ``non_200``: responses not 200 (gRPC: calls not OK), or for a payload that must be refused,
    not the status it must get; ``rejected``: refusals with exactly that status (not errors);
    ``connection_errors``: requests lost with their connection, failed reconnections;
    ``timeouts``: requests unanswered after ``request_timeout_s``; ``errors`` is the sum of
    ``non_200``, ``wrong_answers``, ``connection_errors`` and ``timeouts``.
    ``reconnects``: connections opened again in the window (a server's ``Connection: close``).
    ``machine_busy_cores``: the whole machine's busy CPU over the window (``/proc/stat``), in
    cores: the server, this load generator and whatever else runs.
    ``to_dict()`` gives every field but the latencies (for JSON).
    """

    encoding: str = ""
    concurrency: int = 0
    requests: int = 0
    seconds: float = 0.0
    req_per_s: float = 0.0
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    errors: int = 0
    non_200: int = 0
    wrong_answers: int = 0
    connection_errors: int = 0
    timeouts: int = 0
    rejected: int = 0
    answers_checked: int = 0
    reconnects: int = 0
    client_cpu_s: float = 0.0
    server_cpu_s: float | None = None
    client_cpu_pct: float = 0.0
    server_cpu_pct: float | None = None
    machine_busy_cores: float | None = None
    first_error: str | None = None
    model_requests: dict[str, int] = field(default_factory=dict)
    model_errors: dict[str, int] = field(default_factory=dict)
    latencies_ns: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "latencies_ns"}
        return {k: dict(v) if isinstance(v, dict) else v for k, v in out.items()}


# -- the trial state both protocols share ----------------------------------------------------


class _Run:
    def __init__(
        self, payloads: list[Payload], mix: list[int], check_every: int, result: TrialResult,
        period_s: float = 0.0, timeout_s: float | None = None,
    ) -> None:
        self.payloads = payloads
        self.mix = mix
        self.mix_len = len(mix)
        self.pos = 0
        self.check_every = check_every
        self.result = result
        self.latencies = result.latencies_ns
        self.counts = [0] * len(payloads)
        self.errors_by = [0] * len(payloads)
        self.unchecked = set(range(len(payloads)))  # each payload's first answer is checked
        self.named = len({p.model for p in payloads}) > 1
        self.measuring = False
        self.stopping = False
        self.completed = 0  # every response, warm-up included: spreads the answer checks
        self.period_ns = int(period_s * 1e9)  # pacing: least time between one sender's sends
        self.timeout_s = timeout_s

    def next_index(self) -> int:
        pos = self.pos
        index = self.mix[pos]
        pos += 1
        self.pos = 0 if pos == self.mix_len else pos
        return index

    def first(self, index: int | None, message: str) -> None:
        res = self.result
        if res.first_error is None:
            res.first_error = f"{self.payloads[index].model}: {message}" if self.named and index is not None else message

    def answer(self, index: int, problem: str | None) -> None:
        self.unchecked.discard(index)
        if self.measuring:
            self.result.answers_checked += 1
        if problem is not None:  # a wrong answer in the warm-up matters too
            self.result.wrong_answers += 1
            self.errors_by[index] += 1
            self.first(index, problem if self.measuring else f"(warm-up) {problem}")

    async def window(
        self, warmup_s: float, duration_s: float, server_pid: int | None,
        on_begin: Callable[[], Any] | None, on_end: Callable[[], Any] | None,
    ) -> dict[str, float | None]:
        """Warm-up, then the measured window (marks: times and CPU), then stopping."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(warmup_s)
        if on_begin is not None:
            await loop.run_in_executor(None, on_begin)
        marks: dict[str, float | None] = {"server0": _server_cpu(server_pid), "busy0": machine_busy_seconds()}
        marks["cpu0"], marks["t0"] = time.process_time(), time.perf_counter()
        self.measuring = True
        await asyncio.sleep(duration_s)
        marks["t1"], marks["cpu1"] = time.perf_counter(), time.process_time()
        self.measuring = False
        self.stopping = True
        marks["server1"], marks["busy1"] = _server_cpu(server_pid), machine_busy_seconds()
        self.on_stopping()
        if on_end is not None:
            await loop.run_in_executor(None, on_end)
        return marks

    def on_stopping(self) -> None:
        pass


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has spent busy so far (``/proc/stat``: all but idle
    and iowait), whoever ran: the server, the load generator and anything else."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        return cpu_seconds(pid)
    except Exception:  # the server is gone: the trial's errors say why
        return None


class _Progress:
    """Every ``interval`` seconds, the running count on stderr (in place on a terminal)."""

    def __init__(self, run: _Run, label: str, interval: float) -> None:
        self.run, self.label, self.interval = run, label, interval
        self.tty = sys.stderr.isatty()
        self.loop = asyncio.get_running_loop()
        self.start = self.last_t = self.loop.time()
        self.last_n = 0
        self.handle = self.loop.call_later(interval, self.tick)

    def tick(self) -> None:
        run, res = self.run, self.run.result
        now, done = self.loop.time(), run.completed
        rate = (done - self.last_n) / max(now - self.last_t, 1e-9)
        self.last_t, self.last_n = now, done
        phase = "measuring" if run.measuring else "draining" if run.stopping else "warm-up"
        errors = res.non_200 + res.wrong_answers + res.connection_errors + res.timeouts
        line = f"[loadgen] {self.label}: {now - self.start:5.1f} s {phase}, {done:,} responses, {rate:,.0f}/s, errors {errors}"
        sys.stderr.write(f"\r{line:<100}" if self.tty else line + "\n")
        sys.stderr.flush()
        self.handle = self.loop.call_later(self.interval, self.tick)

    def stop(self, res: TrialResult) -> None:
        self.handle.cancel()
        line = (
            f"[loadgen] {self.label}: {res.requests:,} requests in {res.seconds:.1f} s, "
            f"{res.req_per_s:,.0f}/s, errors {res.errors}"
        )
        sys.stderr.write(f"\r{line:<100}\n" if self.tty else line + "\n")
        sys.stderr.flush()


# -- HTTP/1.1 -------------------------------------------------------------------------------

_HEAD, _LENGTH, _CHUNKED, _EOF = range(4)
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)")
_TE_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r\n]*chunked")
_CONN_CLOSE = re.compile(rb"\r\nconnection:[^\r\n]*close")
_CONN_KEEP_ALIVE = re.compile(rb"\r\nconnection:[^\r\n]*keep-alive")
_HEADER_LENGTH = re.compile(rb"\r\ninference-header-content-length:[ \t]*(\d+)")
_MAX_HEAD = 1 << 16


class _Conn(asyncio.Protocol):
    """One keep-alive connection with at most one request in flight."""

    __slots__ = (
        "body_start", "buf", "checked", "chunks", "close_after", "head", "index", "mode", "need", "pos",
        "run", "sent", "status", "t0", "transport",
    )

    def __init__(self, run: _HttpRun) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.mode = _HEAD
        self.need = 0  # _LENGTH: where the body ends in buf
        self.body_start = 0
        self.pos = 0  # _CHUNKED: where the next chunk-size line starts in buf
        self.chunks: list[bytes] = []
        self.status = 0
        self.head = b""  # lower-cased, from the status line to the last header
        self.close_after = False
        self.t0 = 0  # when the request in flight was sent; 0: none in flight
        self.sent = 0  # when the last request was sent (pacing)
        self.index = 0  # its payload
        self.checked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self) -> None:
        run = self.run
        index = self.index = run.next_index()
        self.t0 = self.sent = time.perf_counter_ns()
        self.transport.write(run.requests[index])  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.mode == _HEAD and not self._head():
            return
        mode = self.mode
        if mode == _LENGTH:
            if len(buf) < self.need:
                return
            if len(buf) > self.need:
                self.fail(f"more bytes than one response: {bytes(buf[:200])!r}")
                return
            body = bytes(buf[self.body_start : self.need])
        elif mode == _CHUNKED:
            body = self._chunked()
            if body is None:
                return
        else:  # the body ends with the connection
            return
        buf.clear()
        self.mode = _HEAD
        self.run.on_response(self, body)

    def _head(self) -> bool:
        """Parse the response head once it is all in; False while it is not (or is bad)."""
        buf = self.buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self.fail(f"no end of response head in {len(buf)} bytes: {bytes(buf[:200])!r}")
                return False
            head = bytes(buf[:end]).lower()
            try:
                if not head.startswith(b"http/"):
                    raise ValueError
                space = head.index(b" ")
                status = int(head[space + 1 : space + 4])
            except ValueError:
                self.fail(f"not an HTTP status line: {bytes(buf[:200])!r}")
                return False
            if 100 <= status < 200:  # interim response (100 Continue): the real one follows
                del buf[: end + 4]
                continue
            break
        self.status, self.head = status, head
        self.close_after = _CONN_CLOSE.search(head) is not None or (
            head.startswith(b"http/1.0") and _CONN_KEEP_ALIVE.search(head) is None
        )
        start = self.body_start = end + 4
        if _TE_CHUNKED.search(head) is not None:  # overrides any Content-Length
            self.mode, self.pos, self.chunks = _CHUNKED, start, []
            return True
        match = _CONTENT_LENGTH.search(head)
        if match is not None:
            self.mode, self.need = _LENGTH, start + int(match.group(1))
        elif status in (204, 304):
            self.mode, self.need = _LENGTH, start
        else:
            self.mode, self.close_after = _EOF, True
        return True

    def _chunked(self) -> bytes | None:
        """The body once the last chunk (and trailers) are in; None until then."""
        buf, pos = self.buf, self.pos
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0].strip(), 16)
            except ValueError:
                self.fail(f"bad chunk size line: {bytes(buf[pos : pos + 80])!r}")
                return None
            if size == 0:  # last chunk; then trailers, if any, and an empty line
                if len(buf) < eol + 4:
                    break
                if buf[eol + 2 : eol + 4] == b"\r\n":
                    end = eol + 4
                else:
                    trailers = buf.find(b"\r\n\r\n", eol)
                    if trailers < 0:
                        break
                    end = trailers + 4
                if end != len(buf):
                    self.fail(f"more bytes than one response: {bytes(buf[end : end + 200])!r}")
                    return None
                return b"".join(self.chunks)
            if len(buf) < eol + 4 + size:
                break
            if buf[eol + 2 + size : eol + 4 + size] != b"\r\n":
                self.fail("chunk not followed by CRLF")
                return None
            self.chunks.append(bytes(buf[eol + 2 : eol + 2 + size]))
            pos = eol + 4 + size
        self.pos = pos
        return None

    def fail(self, message: str) -> None:
        self.run.first(self.index, message)
        if self.transport is not None:
            self.transport.abort()  # connection_lost counts it and reconnects

    def connection_lost(self, exc: Exception | None) -> None:
        if self.mode == _EOF and self.t0:  # the body ended with the connection
            body = bytes(self.buf[self.body_start :])
            self.buf.clear()
            self.mode = _HEAD
            self.run.on_response(self, body)
        self.run.on_lost(self, exc)


class _HttpRun(_Run):
    def __init__(self, *args: Any, binary: bool, host: str, port: int) -> None:
        super().__init__(*args)
        self.binary = binary
        self.host, self.port = host, port
        self.requests: list[bytes] = []
        self.conns: list[_Conn] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_response(self, conn: _Conn, body: bytes) -> None:
        latency = time.perf_counter_ns() - conn.t0
        conn.t0 = 0
        index = conn.index
        want = self.payloads[index].status
        self.completed += 1
        if self.measuring:
            self.latencies.append(latency)
            self.counts[index] += 1
            if conn.status != want:
                self.result.non_200 += 1
                self.errors_by[index] += 1
                expected = f" (expected {want})" if want != 200 else ""
                self.first(index, f"HTTP {conn.status}{expected}: {body[:200]!r}")
            elif want != 200:
                self.result.rejected += 1
        if conn.status == 200 == want and (not conn.checked or index in self.unchecked or self.completed % self.check_every == 0):
            conn.checked = True
            header_length = None
            if self.binary:
                match = _HEADER_LENGTH.search(conn.head)
                header_length = int(match.group(1)) if match else None
            self.answer(index, self.payloads[index].verify_http(body, header_length))
        if self.stopping:
            self.on_stopping()
        elif conn.close_after:
            conn.transport.close()  # type: ignore[union-attr]  # on_lost opens the next one
        elif self.period_ns:
            wait = conn.sent + self.period_ns - time.perf_counter_ns()
            if wait > 0:
                asyncio.get_running_loop().call_later(wait / 1e9, self.paced_send, conn)
            else:
                conn.send()
        else:
            conn.send()

    def paced_send(self, conn: _Conn) -> None:
        """Send ``conn``'s next request when its pacing slot comes, if it is still wanted."""
        transport = conn.transport
        if not self.stopping and conn.t0 == 0 and conn in self.conns and transport is not None and not transport.is_closing():
            conn.send()

    def watch(self) -> None:
        """Every so often: drop the connection of each request unanswered after the timeout."""
        assert self.timeout_s is not None
        limit = int(self.timeout_s * 1e9)
        now = time.perf_counter_ns()
        for conn in list(self.conns):
            if conn.t0 and now - conn.t0 > limit:
                conn.t0 = 0  # not in flight any more: on_lost reconnects without counting it again
                if self.measuring:
                    self.result.timeouts += 1
                    self.errors_by[conn.index] += 1
                self.first(conn.index, f"no answer in {self.timeout_s:g} s")
                if conn.transport is not None:
                    conn.transport.abort()  # on_lost reconnects (or, when stopping, settles)

    def on_lost(self, conn: _Conn, exc: Exception | None) -> None:
        in_flight = conn.t0 != 0
        conn.t0 = 0
        if conn in self.conns:
            self.conns.remove(conn)
        if in_flight:
            if self.measuring:
                self.result.connection_errors += 1
                self.errors_by[conn.index] += 1
            self.first(conn.index, f"connection lost mid-request ({exc or 'closed by the server'})")
        if self.stopping:
            self.on_stopping()
            return
        task = asyncio.get_running_loop().create_task(self._reconnect(0.05 if in_flight else 0.0))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reconnect(self, delay: float) -> None:
        while not self.stopping:
            if delay:
                await asyncio.sleep(delay)
                if self.stopping:
                    return
            try:
                conn = await self.connect()
            except OSError as exc:
                if self.measuring:
                    self.result.connection_errors += 1
                self.first(None, f"cannot reconnect to {self.host}:{self.port}: {exc}")
                delay = min(max(2 * delay, 0.05), 1.0)
                continue
            if self.measuring:
                self.result.reconnects += 1
            if not self.stopping:
                conn.send()
            return

    async def connect(self) -> _Conn:
        _, conn = await asyncio.get_running_loop().create_connection(lambda: _Conn(self), self.host, self.port)
        self.conns.append(conn)
        return conn

    def on_stopping(self) -> None:
        if not self.idle.done() and all(c.t0 == 0 for c in self.conns):
            self.idle.set_result(None)


async def _http_trial(run: _HttpRun, encoding: str, concurrency: int, window: Any, drain_timeout_s: float) -> dict[str, float | None]:
    run.requests = [p.http_request(encoding, run.host, run.port) for p in run.payloads]
    await asyncio.gather(*(run.connect() for _ in range(concurrency)))
    loop = asyncio.get_running_loop()
    for k, conn in enumerate(list(run.conns)):
        if run.period_ns and k:  # paced: the first sends spread over one period
            loop.call_later(k * run.period_ns / concurrency / 1e9, run.paced_send, conn)
        else:
            conn.send()
    watchdog = None
    if run.timeout_s is not None:
        async def watch() -> None:
            while True:
                await asyncio.sleep(min(1.0, run.timeout_s / 4))  # type: ignore[operator]
                run.watch()
        watchdog = loop.create_task(watch())
    marks: dict[str, float | None] = await window
    try:
        await asyncio.wait_for(asyncio.shield(run.idle), timeout=drain_timeout_s)
    except TimeoutError:
        run.first(None, f"requests still in flight {drain_timeout_s:g} s after the trial")
        run.result.connection_errors += sum(1 for c in run.conns if c.t0)
    if watchdog is not None:
        watchdog.cancel()
    for task in list(run.tasks):
        task.cancel()
    for conn in list(run.conns):
        if conn.transport is not None:
            conn.transport.close()
    await asyncio.sleep(0)
    return marks


# -- gRPC -----------------------------------------------------------------------------------


async def _grpc_trial(run: _Run, host: str, port: int, concurrency: int, window: Any, drain_timeout_s: float) -> dict[str, float | None]:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    requests = [p.grpc_request() for p in run.payloads]
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    latencies, counts, errors_by, unchecked = run.latencies, run.counts, run.errors_by, run.unchecked
    payloads, result, check_every = run.payloads, run.result, run.check_every
    clock = time.perf_counter_ns
    rpc_error = grpc.aio.AioRpcError

    async with grpc.aio.insecure_channel(f"{host}:{port}", options=options) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer

        period_ns, timeout_s = run.period_ns, run.timeout_s

        async def caller(start_ns: int) -> None:
            checked = False
            t0 = clock() - period_ns + start_ns  # paced: the first call after start_ns
            while not run.stopping:
                if period_ns:
                    wait = t0 + period_ns - clock()
                    if wait > 0:
                        await asyncio.sleep(wait / 1e9)
                        if run.stopping:
                            break
                index = run.next_index()
                want = payloads[index].grpc_status
                t0 = clock()
                try:
                    response = await infer(requests[index], timeout=timeout_s)
                except rpc_error as exc:
                    latency = clock() - t0
                    run.completed += 1
                    code = exc.code().name
                    if run.measuring:
                        latencies.append(latency)
                        counts[index] += 1
                        if code == want:
                            result.rejected += 1
                        else:
                            if code == "DEADLINE_EXCEEDED" and timeout_s is not None:
                                result.timeouts += 1
                            else:
                                result.non_200 += 1
                            errors_by[index] += 1
                            expected = f" (expected {want})" if want != "OK" else ""
                            run.first(index, f"gRPC {code}{expected}: {exc.details()}")
                    if code != want and not period_ns:
                        await asyncio.sleep(0.01)
                    continue
                latency = clock() - t0
                run.completed += 1
                if run.measuring:
                    latencies.append(latency)
                    counts[index] += 1
                    if want != "OK":
                        result.non_200 += 1
                        errors_by[index] += 1
                        run.first(index, f"gRPC OK (expected {want})")
                if want == "OK" and (not checked or index in unchecked or run.completed % check_every == 0):
                    checked = True
                    run.answer(index, payloads[index].verify_grpc(response))

        loop = asyncio.get_running_loop()
        callers = [loop.create_task(caller(k * period_ns // concurrency)) for k in range(concurrency)]
        marks: dict[str, float | None] = await window
        _, late = await asyncio.wait(callers, timeout=drain_timeout_s)
        if late:
            run.first(None, f"requests still in flight {drain_timeout_s:g} s after the trial")
            result.connection_errors += len(late)
            for task in late:
                task.cancel()
        for task in callers:
            if task.done() and not task.cancelled() and task.exception() is not None:
                result.connection_errors += 1
                run.first(None, f"caller failed: {task.exception()!r}")
    return marks


# -- trials ---------------------------------------------------------------------------------


async def run_trial_async(
    host: str,
    port: int,
    encoding: str,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    payloads: Payload | Sequence[Payload],
    server_pid: int | None = None,
    check_every: int = 50,
    mix: Sequence[int] | None = None,
    progress: float | None = 1.0,
    *,
    result: TrialResult | None = None,
    on_begin: Callable[[], Any] | None = None,
    on_end: Callable[[], Any] | None = None,
    drain_timeout_s: float = 60.0,
    rate: float | None = None,
    request_timeout_s: float | None = None,
) -> TrialResult:
    """Drive ``host:port`` (the HTTP port, or the gRPC port for ``grpc``) with ``concurrency``
    requests in flight: ``warmup_s`` seconds, then ``duration_s`` measured.

    ``encoding``: ``json``, ``binary`` (Triton's binary tensor extension, outputs asked for as
    binary) or ``grpc``. ``payloads``: one, or several taken in the order of ``mix`` (payload
    indices, cycled) or in turn. ``server_pid``: the server whose CPU (with its children) is
    measured over the window. ``check_every``: decode and check one answer in N. ``progress``:
    seconds between progress lines on stderr, or None for none. ``result``: an instance (of a
    subclass, say) to fill in. ``on_begin``/``on_end``: blocking callables run (in a thread)
    just before the measured window opens and just after it closes, e.g. to read server
    statistics. ``drain_timeout_s``: how long requests in flight at the end may take.
    ``rate``: at most that many requests per second in all (paced; default: as fast as answers
    come). ``request_timeout_s``: a request unanswered after that long counts as a timeout.
    """
    payloads = [payloads] if isinstance(payloads, Payload) else list(payloads)
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r}: choose from {', '.join(ENCODINGS)}")
    if not payloads or concurrency < 1 or check_every < 1 or duration_s <= 0 or warmup_s < 0:
        raise ValueError("need payloads, concurrency >= 1, check_every >= 1, duration_s > 0, warmup_s >= 0")
    if (rate is not None and rate <= 0) or (request_timeout_s is not None and request_timeout_s <= 0):
        raise ValueError("rate and request_timeout_s must be > 0 when given")
    order = list(range(len(payloads))) if mix is None else [int(i) for i in mix]
    if not order or min(order) < 0 or max(order) >= len(payloads):
        raise ValueError(f"mix must be a non-empty sequence of indices into the {len(payloads)} payload(s)")
    result = result if result is not None else TrialResult()
    result.encoding, result.concurrency = encoding, concurrency
    models = {p.model for p in payloads}
    label = f"{payloads[0].model if len(models) == 1 else f'{len(models)} models'} {encoding} c={concurrency}"

    period_s = concurrency / rate if rate else 0.0
    run: _Run
    if encoding == "grpc":
        run = _Run(payloads, order, check_every, result, period_s, request_timeout_s)
    else:
        run = _HttpRun(
            payloads, order, check_every, result, period_s, request_timeout_s,
            binary=encoding == "binary", host=host, port=port,
        )
    ticker = _Progress(run, label, progress) if progress else None
    window = run.window(warmup_s, duration_s, server_pid, on_begin, on_end)
    try:
        if isinstance(run, _HttpRun):
            marks = await _http_trial(run, encoding, concurrency, window, drain_timeout_s)
        else:
            marks = await _grpc_trial(run, host, port, concurrency, window, drain_timeout_s)
    finally:
        window.close()  # if it never ran (no connection)
        if ticker is not None:
            ticker.handle.cancel()
    _finish(run, marks)
    if ticker is not None:
        ticker.stop(result)
    return result


def run_trial(*args: Any, **kwargs: Any) -> TrialResult:
    """:func:`run_trial_async` (same arguments) on an event loop of its own: uvloop when it is
    installed (``common.run_async``)."""
    return run_async(run_trial_async(*args, **kwargs))  # type: ignore[no-any-return]


def _finish(run: _Run, marks: dict[str, float | None]) -> None:
    res = run.result
    seconds = float(marks["t1"]) - float(marks["t0"])  # type: ignore[arg-type]
    lat = np.asarray(res.latencies_ns, dtype=np.int64)
    res.requests = len(lat)
    res.seconds = seconds
    res.req_per_s = len(lat) / seconds
    if len(lat):
        p50, p90, p99 = np.percentile(lat, [50, 90, 99]) / 1e6
        res.p50_ms, res.p90_ms, res.p99_ms = float(p50), float(p90), float(p99)
    res.errors = res.non_200 + res.wrong_answers + res.connection_errors + res.timeouts
    res.client_cpu_s = float(marks["cpu1"]) - float(marks["cpu0"])  # type: ignore[arg-type]
    res.client_cpu_pct = 100 * res.client_cpu_s / seconds
    server0, server1 = marks["server0"], marks["server1"]
    if server0 is not None and server1 is not None:
        res.server_cpu_s = server1 - server0
        res.server_cpu_pct = 100 * res.server_cpu_s / seconds
    busy0, busy1 = marks.get("busy0"), marks.get("busy1")
    if busy0 is not None and busy1 is not None:
        res.machine_busy_cores = (busy1 - busy0) / seconds
    res.model_requests, res.model_errors = {}, {}
    for payload, count, errors in zip(run.payloads, run.counts, run.errors_by, strict=True):
        res.model_requests[payload.model] = res.model_requests.get(payload.model, 0) + count
        if errors:
            res.model_errors[payload.model] = res.model_errors.get(payload.model, 0) + errors


# -- one request, checked in full -----------------------------------------------------------


def sanity_check(host: str, port: int, encoding: str, payload: Payload, timeout: float = 30.0) -> dict[str, np.ndarray[Any, Any]]:
    """Send ``payload`` once (urllib, or a blocking gRPC channel) and check the answer in full.

    Returns the decoded outputs; raises RuntimeError saying what came back when the request
    fails or the answer is wrong.
    """
    what = f"{encoding} request to model {payload.model!r} at {host}:{port}"
    if encoding == "grpc":
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        with grpc.insecure_channel(f"{host}:{port}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"{what}: no gRPC server answered in {timeout:g} s") from None
            try:
                response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(payload.grpc_request(), timeout=timeout)
            except grpc.RpcError as exc:
                raise RuntimeError(f"{what}: gRPC status {exc.code().name}: {exc.details()}") from None
        try:
            outputs = decode_grpc_outputs(response)
        except Exception as exc:
            raise RuntimeError(f"{what}: undecodable response ({type(exc).__name__}: {exc}): {str(response)[:300]!r}") from None
    elif encoding in ("json", "binary"):
        body, _ = payload.http_body(encoding)
        request = urllib.request.Request(
            f"http://{host}:{port}{payload.infer_path}", data=body, headers=payload.http_headers(encoding), method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                data = resp.read()
                header = resp.headers.get("Inference-Header-Content-Length")
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{what}: HTTP {exc.code} {exc.reason}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"{what}: no answer: {exc}") from None
        try:
            outputs = decode_http_outputs(data, int(header) if header is not None else None)
        except Exception as exc:
            raise RuntimeError(f"{what}: undecodable response ({type(exc).__name__}: {exc}): {data[:300]!r}") from None
    else:
        raise ValueError(f"encoding {encoding!r}: choose from {', '.join(ENCODINGS)}")
    problem = payload.verify(outputs)
    if problem is not None:
        raise RuntimeError(f"{what}: wrong answer: {problem}. The response: {describe_outputs(outputs)}")
    return outputs


# -- self-test ------------------------------------------------------------------------------


def _simple_payload(model: str = "simple") -> Payload:
    """Triton's ``simple`` model: INT32 [1, 16] x2 -> their sum and difference."""
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = (np.arange(16, dtype=np.int32) * 3 - 7).reshape(1, 16)
    return Payload(model, {"INPUT0": in0, "INPUT1": in1}, expected={"OUTPUT0": in0 + in1, "OUTPUT1": in0 - in1})


def _simple_answer_json() -> bytes:
    payload = _simple_payload()
    outputs = [
        {"name": name, "datatype": "INT32", "shape": list(a.shape), "data": a.ravel().tolist()}
        for name, a in (payload.expected or {}).items()
    ]
    return orjson.dumps({"model_name": "simple", "model_version": "1", "outputs": outputs})


def _framings(body: bytes) -> dict[str, bytes]:
    """The same answer framed the ways HTTP/1.1 servers may frame it."""
    chunks = b"".join(b"%x;ext=1\r\n" % len(body[k : k + 37]) + body[k : k + 37] + b"\r\n" for k in range(0, len(body), 37))
    return {
        "content-length": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body,
        "upper-case": b"HTTP/1.1 200 OK\r\nCONTENT-LENGTH: %d\r\nCONTENT-TYPE: application/json\r\n\r\n" % len(body) + body,
        "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n" + chunks + b"0\r\n\r\n",
        "chunked+trailer": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\nX-Trailer: 1\r\n\r\n",
        "100-continue": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        "close": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body,
        "eof": b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body,
    }


class _FakeServer(asyncio.Protocol):
    """Answers each request with one fixed framing of the ``simple`` answer, in small pieces."""

    def __init__(self, response: bytes, close: bool) -> None:
        self.response, self.close = response, close
        self.buf = bytearray()
        self.tasks: set[asyncio.Task[None]] = set()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", bytes(self.buf[: end + 2])) if end >= 0 else None
        if match is None or len(self.buf) < end + 4 + int(match.group(1)):
            return
        del self.buf[: end + 4 + int(match.group(1))]
        task = asyncio.get_running_loop().create_task(self.answer())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def answer(self) -> None:
        assert self.transport is not None
        for k in range(0, len(self.response), 100):
            self.transport.write(self.response[k : k + 100])
            await asyncio.sleep(0)
        if self.close:
            self.transport.close()


def _fake_server(response: bytes, close: bool) -> tuple[int, Callable[[], None]]:
    """A _FakeServer on a loop of its own in a thread: its port, and how to stop it."""
    import threading

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, int] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(loop.create_server(lambda: _FakeServer(response, close), "127.0.0.1", 0))
        box["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the fake server did not start")

    def stop() -> None:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return box["port"], stop


class _Sink:
    """Stands in for a trial: keeps what a connection delivers."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def first(self, index: int | None, message: str) -> None:
        self.got.append(b"FAIL " + message.encode())

    def on_response(self, conn: _Conn, body: bytes) -> None:
        self.got.append(body)

    def on_lost(self, conn: _Conn, exc: Exception | None) -> None:
        pass


def _selftest_framing(duration: float) -> None:
    payload = _simple_payload()
    for name, response in _framings(_simple_answer_json()).items():
        close = name in ("close", "eof")
        # 1. byte by byte into one connection
        sink = _Sink()
        got = sink.got
        conn = _Conn(sink)  # type: ignore[arg-type]
        for _ in range(1 if close else 2):
            conn.t0 = 1
            for i in range(len(response)):
                conn.data_received(response[i : i + 1])
        if close:
            conn.connection_lost(None)
        assert len(got) == (1 if close else 2) and all(payload.verify_http(b, None) is None for b in got), (name, got[:1])
        assert conn.status == 200 and conn.close_after == close, (name, conn.status, conn.close_after)
        # 2. a live server framing its answers that way, driven for a while
        port, stop = _fake_server(response, close)
        try:
            res = run_trial("127.0.0.1", port, "binary", 4, 0.2, duration, payload, check_every=1, progress=None)
        finally:
            stop()
        print(
            f"  framing {name:15s}: {res.req_per_s:8,.0f} req/s, {res.answers_checked} answers checked, "
            f"errors {res.errors}, reconnects {res.reconnects}",
            file=sys.stderr,
        )
        assert res.errors == 0 and res.requests > 0 and res.answers_checked == res.requests, (name, res)
        assert (res.reconnects > 0) == close, (name, res.reconnects)
    # 3. a server that never answers: every request times out, and its connection is replaced
    port, stop = _fake_server(b"", False)
    try:
        res = run_trial("127.0.0.1", port, "json", 2, 0.0, max(duration, 1.0), payload, progress=None, request_timeout_s=0.25)
    finally:
        stop()
    print(f"  silent server: {res.timeouts} timeouts, errors {res.errors}", file=sys.stderr)
    assert res.timeouts >= 4 and res.errors == res.timeouts and res.requests == 0, res


def _selftest(args: argparse.Namespace) -> int:
    import shlex
    import tempfile

    from benchmarks.common import test_support
    from benchmarks.peers.quiver import QuiverServer
    from examples.build_repository import SIMPLE_CONFIG, simple_onnx

    print("loadgen self-test: response framings (byte by byte, then live)", file=sys.stderr)
    _selftest_framing(args.duration / 2)

    names = ["simple", *(f"simple_{k}" for k in range(1, args.models))]
    with tempfile.TemporaryDirectory(prefix="loadgen-selftest-") as tmp:
        repo = Path(tmp) / "repository"
        model, models = simple_onnx(), test_support("models")
        for name in names:
            models.write_onnx(repo, name, model, SIMPLE_CONFIG.replace('name: "simple"', f'name: "{name}"'))
        server = QuiverServer(repo, log=Path(tmp) / "server.log", executable=args.quiver, stop_timeout=30.0)
        print(f"loadgen self-test: {shlex.join(server.argv)}", file=sys.stderr)
        with server:
            endpoints, pid = server.endpoints, server.pid
            payloads = [_simple_payload(name) for name in names]
            wrong = _simple_payload()
            wrong.expected = {"OUTPUT0": np.zeros((1, 16), np.int32)}
            for encoding in ENCODINGS:
                sanity_check(*endpoints.address(encoding), encoding, payloads[0])
                try:
                    sanity_check(*endpoints.address(encoding), encoding, wrong)
                except RuntimeError as exc:
                    print(f"  sanity check of a wrong expectation raised, as it should: {exc}", file=sys.stderr)
                else:
                    raise AssertionError("sanity_check accepted a wrong answer")
            rows: list[tuple[str, TrialResult]] = []
            for encoding in ENCODINGS:
                res = run_trial(*endpoints.address(encoding), encoding, args.concurrency, args.warmup, args.duration, payloads[0], pid)
                rows.append((encoding, res))
            mix = zipf_sequence(len(payloads), args.zipf, 10_000, seed=1)
            for encoding in ("binary", "grpc"):
                res = run_trial(*endpoints.address(encoding), encoding, args.concurrency, args.warmup, args.duration, payloads, pid, mix=mix)
                rows.append((f"{encoding}, zipf {args.zipf:g} over {len(payloads)}", res))
            # paced trials, and requests the server must refuse (an unknown model: 404 / NOT_FOUND)
            unknown = _simple_payload("no_such_model")
            unknown.status, unknown.grpc_status = 404, "NOT_FOUND"
            malformed = Payload("simple", {}, body=b'{"inputs": [', status=400)
            for encoding in ENCODINGS:
                bad = [unknown] if encoding == "grpc" else [unknown, malformed]
                rate = 100.0
                res = run_trial(*endpoints.address(encoding), encoding, 2, 0.2, args.duration, [payloads[0], *bad],
                                progress=None, rate=rate, request_timeout_s=10)
                print(f"  {encoding}, paced at {rate:g}/s with refusals: {res.req_per_s:.1f} req/s, "
                      f"{res.rejected} rejected, errors {res.errors}", file=sys.stderr)
                assert res.errors == 0 and res.rejected > 0, (encoding, res.first_error)
                assert abs(res.req_per_s - rate) < 0.15 * rate, (encoding, res.req_per_s)
                # a good request marked as one to refuse: every answer is then an error
                wrong_ok = _simple_payload()
                wrong_ok.status, wrong_ok.grpc_status = 404, "NOT_FOUND"
                res = run_trial(*endpoints.address(encoding), encoding, 1, 0.0, 0.3, wrong_ok, progress=None)
                assert res.errors == res.requests > 0 and res.rejected == 0, (encoding, res)
    print("| trial | req/s | p50 ms | p99 ms | errors | client CPU % | server CPU % | requests per model |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for label, r in rows:
        print(
            f"| {label} | {r.req_per_s:,.0f} | {r.p50_ms or 0:.3f} | {r.p99_ms or 0:.3f} | {r.errors} "
            f"| {r.client_cpu_pct:.0f} | {r.server_cpu_pct or 0:.0f} | {r.model_requests} |"
        )
    failed = [label for label, r in rows if r.errors or not r.requests]
    for label, r in rows:
        assert sum(r.model_requests.values()) == r.requests, (label, r.model_requests, r.requests)
    zipf_rows = [r for label, r in rows if "zipf" in label]
    for r in zipf_rows:
        counts = [r.model_requests.get(n, 0) for n in names]
        if len(names) > 1 and args.zipf > 0 and not counts[0] > counts[-1]:
            failed.append(f"zipf counts not skewed: {counts}")
    if failed:
        print(f"loadgen self-test FAILED: {failed}", file=sys.stderr)
        return 1
    print("loadgen self-test passed", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The benchmarks' KServe v2 load generator; --selftest checks it.")
    parser.add_argument("--selftest", action="store_true", help="check the response framings, then drive a `quiver serve` of Triton's simple model")
    parser.add_argument("--duration", type=float, default=1.0, metavar="S", help="measured seconds per trial (default: 1)")
    parser.add_argument("--warmup", type=float, default=0.5, metavar="S", help="warm-up seconds per trial (default: 0.5)")
    parser.add_argument("--concurrency", type=int, default=4, metavar="N", help="default: 4")
    parser.add_argument("--models", type=int, default=4, metavar="N", help="copies of simple in the Zipf trial (default: 4)")
    parser.add_argument("--zipf", type=float, default=1.2, metavar="S", help="Zipf exponent of the multi-model trial (default: 1.2)")
    parser.add_argument("--quiver", default=None, metavar="PATH", help="the quiver executable (default: the one next to this Python, else .venv/bin/quiver)")
    args = parser.parse_args(argv)
    if not args.selftest:
        parser.print_help()
        return 2
    return _selftest(args)


if __name__ == "__main__":
    sys.exit(main())
