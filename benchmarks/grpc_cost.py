"""Where a gRPC request's server CPU goes: Quiver over ``grpc.aio`` next to two floors.

Run: ``.venv/bin/python -m benchmarks.grpc_cost`` from the repository root; ``--help`` for
options.

``benchmarks/loadgen.py`` drives ``ModelInfer`` (the ``tiny`` model's request, FP32 [1, 16], one
``grpc.aio`` channel, N callers) against each target in turn, and the server's CPU time over
the measured window is split by thread, per answered request:

* ``event loop``: the server's main thread. Quiver serves every gRPC call on it (``grpc.aio``'s
  Cython machinery, three asyncio tasks per call, Quiver's decode, the service, the model's
  Python glue, the encode), so 1e6 / its microseconds per request is the one-process ceiling;
* ``event_engine``: gRPC core's I/O threads (HTTP/2 framing, the socket reads and writes);
* ``other threads``: the rest of the process; for ``grpc.aio`` that is mostly its poller thread,
  which takes every completion off gRPC core's queue and wakes the event loop through a
  socket pair (one write per completion, about four completions per unary call);
* ``children``: the Python model's own process.

The targets (``--targets``):

* ``floor-grpcio``: a ``grpc.aio`` server on uvloop whose generic handler answers every
  ``ModelInfer`` with the same pre-serialized ``ModelInferResponse`` (bytes in, bytes out, as
  Quiver's handler is registered): what ``grpc.aio`` costs before any server code;
* ``floor-h2``: the same answer from a bare HTTP/2 responder on uvloop (this module with
  ``--serve-floor h2``): it parses the client's frames and answers each call's last DATA frame
  with HEADERS, DATA and trailers in one write, acknowledging SETTINGS and PINGs and returning
  the connection's receive window. It decodes no headers and keeps no per-stream flow
  control, so it is a lower bound for gRPC served by Python on the event loop without
  ``grpcio``'s server, not a server;
* ``floor-h2lib``: the same answer from a server on uvloop whose HTTP/2 is the ``h2``
  package's connection (python-hyper's state machine: every header block decoded and
  validated, both flow-control windows and each stream's state kept), one write per batch of
  events: what a correct HTTP/2 layer from a well-kept library costs per call before any gRPC;
* ``floor-quiver``: the same answer from Quiver's own gRPC server (``quiver.frontends.grpc_server``,
  what ``quiver serve`` runs by default): HTTP/2 and gRPC as a server must do them (headers
  decoded, flow control, a task per call, a context for the handler) around a handler that
  returns the canned bytes;
* ``quiver-onnx`` and ``quiver-python``: ``quiver serve`` (one process) with ``tiny`` as ONNX
  and as Triton's Python model unchanged; ``grpcio-quiver-onnx`` and ``grpcio-quiver-python``:
  the same with ``--grpc-server grpcio`` (``grpc.aio``'s server, as before Quiver had its own);
* ``h2-quiver-onnx`` and ``h2-quiver-python``: the same models behind ``floor-h2`` instead of
  ``grpc.aio``: the server assembled as ``quiver serve`` does (``runner.assemble``, the models
  loaded) and each call's message handed to Quiver's own ``ModelInfer`` handler
  (``InferenceServicer.model_infer_bytes``: parse, decode, the service, the model, encode), its
  answer sent as ``floor-h2`` sends the canned one. What Quiver's request path costs without
  ``grpc.aio``'s server around it (still without header decoding, which a client's repeated
  headers would let a real server cache).

Targets alternate round by round (``--repeat``); each cell is the median of its rounds.
Results: a markdown table on stdout and in ``benchmarks/results/grpc_cost.md``, the same as
JSON in ``grpc_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks import common, loadgen
from benchmarks.common import ROOT
from benchmarks.peers import Server
from benchmarks.peers.quiver import QuiverServer
from benchmarks.request_cpu import PAYLOAD, write_repository

TARGETS = (
    "floor-grpcio", "floor-h2", "floor-h2lib", "floor-quiver", "quiver-onnx", "quiver-python", "grpcio-quiver-onnx",
    "grpcio-quiver-python", "h2-quiver-onnx", "h2-quiver-python",
)
DEFAULT_TARGETS = ("floor-grpcio", "floor-h2", "floor-quiver", "quiver-onnx", "quiver-python", "grpcio-quiver-onnx", "grpcio-quiver-python")
ROLES = ("event loop", "event_engine", "other threads", "children")
_TICK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[grpc_cost {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def canned_answer() -> bytes:
    """Quiver's answer to the payload, serialized (what both floors send)."""
    from tritonclient.grpc import service_pb2 as pb

    (name, array), = PAYLOAD.expected.items()  # type: ignore[union-attr]
    message = pb.ModelInferResponse(model_name=PAYLOAD.model, model_version="1")
    message.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
    message.raw_output_contents.append(array.tobytes())
    answer: bytes = message.SerializeToString()
    return answer


# -- the floors ------------------------------------------------------------------------------


async def _serve_grpcio(host: str, answer: bytes) -> tuple[int, Any]:
    import grpc

    async def model_infer(data: bytes, context: Any) -> bytes:
        return answer

    handler = grpc.unary_unary_rpc_method_handler(model_infer)

    class Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
        def service(self, details: Any) -> Any:
            return handler if details.method == "/inference.GRPCInferenceService/ModelInfer" else None

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((Handler(),))
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return port, server.stop


_FRAME = struct.Struct(">BBL")  # after the 3-byte length: type, flags, stream id
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + _FRAME.pack(kind, flags, stream) + payload


class _H2Floor(asyncio.Protocol):
    """HTTP/2 frames in, every call answered with ``answer`` (see the module's docstring)."""

    #: HPACK: ":status: 200" (static index 8); "content-type: application/grpc" and
    #: "grpc-status: 0" as literals without indexing.
    HEADERS = b"\x88\x0f\x10\x10application/grpc"
    TRAILERS = b"\x00\x0bgrpc-status\x010"

    def __init__(self, answer: bytes | Callable[[bytes], Awaitable[bytes]]) -> None:
        #: the canned answer, or the handler whose answer to each call's message is sent
        self.answer = answer
        self.bodies: dict[int, bytes] = {}
        self.buffer = b""
        self.preface = False
        self.received = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        # SETTINGS (none), and a large connection receive window.
        transport.write(_frame(4, 0, 0, b"") + _frame(8, 0, 0, (1 << 30).to_bytes(4, "big")))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        at, end, out = 0, len(buffer), []
        if not self.preface:
            if end < len(_PREFACE):
                self.buffer = buffer
                return
            at, self.preface = len(_PREFACE), True
        while end - at >= 9:
            length = int.from_bytes(buffer[at : at + 3], "big")
            if end - at - 9 < length:
                break
            kind, flags, stream = _FRAME.unpack_from(buffer, at + 3)
            payload = buffer[at + 9 : at + 9 + length]
            at += 9 + length
            if kind == 0:  # DATA: the call's message; answered at END_STREAM
                self.received += length
                stream &= 0x7FFFFFFF
                if isinstance(self.answer, bytes):
                    if flags & 1:
                        out.append(self.reply(stream, self.answer))
                    continue
                body = self.bodies.pop(stream, b"") + payload
                if flags & 1:
                    asyncio.get_running_loop().create_task(self.call(stream, self.answer, body[5:]))
                else:
                    self.bodies[stream] = body
            elif kind in (4, 6) and not flags & 1:  # SETTINGS, PING: acknowledged
                out.append(_frame(kind, 1, 0, payload if kind == 6 else b""))
        self.buffer = buffer[at:]
        if self.received > 1 << 20:
            out.append(_frame(8, 0, 0, self.received.to_bytes(4, "big")))
            self.received = 0
        if out:
            self.transport.write(b"".join(out))

    def reply(self, stream: int, answer: bytes) -> bytes:
        message = b"\x00" + len(answer).to_bytes(4, "big") + answer
        return _frame(1, 4, stream, self.HEADERS) + _frame(0, 0, stream, message) + _frame(1, 5, stream, self.TRAILERS)

    async def call(self, stream: int, handler: Callable[[bytes], Awaitable[bytes]], data: bytes) -> None:
        self.transport.write(self.reply(stream, await handler(data)))


class _H2LibFloor(asyncio.Protocol):
    """``floor-h2lib``: the canned answer from a server whose HTTP/2 is the ``h2`` package's
    connection state machine (headers decoded and validated, both flow-control windows kept,
    each stream's state tracked), one write per batch of events."""

    def __init__(self, answer: bytes) -> None:
        import h2.config
        import h2.connection

        self.message = b"\x00" + len(answer).to_bytes(4, "big") + answer
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(1 << 30)
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        import h2.events

        conn = self.conn
        for event in conn.receive_data(data):
            kind = type(event)
            if kind is h2.events.DataReceived:
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if event.stream_ended is not None:
                    self.reply(event.stream_id)
            elif kind is h2.events.StreamEnded:
                pass
        out = conn.data_to_send()
        if out:
            self.transport.write(out)

    def reply(self, stream: int) -> None:
        conn = self.conn
        conn.send_headers(stream, ((b":status", b"200"), (b"content-type", b"application/grpc")))
        conn.send_data(stream, self.message)
        conn.send_headers(stream, ((b"grpc-status", b"0"),), end_stream=True)


async def _quiver_handler(backend: str) -> Callable[[bytes], Awaitable[bytes]]:
    """Quiver's ModelInfer handler over ``tiny`` as ``backend``, assembled as ``quiver serve``
    assembles it."""
    from quiver import settings as server_settings
    from quiver.cli import build_parser
    from quiver.frontends.grpc import InferenceServicer
    from quiver.heap import freeze_heap
    from quiver.runner import assemble, load_models

    repository = write_repository(Path(tempfile.mkdtemp(prefix="grpc_cost-h2-")), backend)
    args = build_parser().parse_args(["serve", "--model-repository", str(repository), "--allow-metrics", "false"])
    settings = server_settings.from_args(args, os.environ)
    parts = assemble(settings)
    await load_models(parts, settings)
    parts.service.ready = True
    freeze_heap("started")  # as the runner does once serving
    servicer = InferenceServicer(parts.service)

    async def handle(data: bytes) -> bytes:
        answer: bytes = await servicer.model_infer_bytes(data, None)
        return answer

    return handle


async def _serve_h2(host: str, answer: bytes | Callable[[bytes], Awaitable[bytes]]) -> tuple[int, Any]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _H2Floor(answer), host, 0, backlog=1024)

    async def stop() -> None:
        server.close()

    return int(server.sockets[0].getsockname()[1]), stop


async def _serve_floor(kind: str, host: str) -> None:
    loop = asyncio.get_running_loop()
    if kind == "grpcio":
        port, stop = await _serve_grpcio(host, canned_answer())
    elif kind == "h2":
        port, stop = await _serve_h2(host, canned_answer())
    elif kind == "quiver":
        from quiver.frontends.grpc_plumbing import raw_method
        from quiver.frontends.grpc_server import GrpcServer

        answer = canned_answer()

        async def model_infer(data: bytes, context: Any) -> bytes:
            return answer

        method = raw_method("ModelInfer", model_infer)
        server = GrpcServer({method.name: method}, max_receive_message_size=1 << 26, max_send_message_size=1 << 26)
        port = await server.start(host, 0)

        async def stop() -> None:
            await server.close()
    elif kind == "h2lib":
        answer = canned_answer()
        server = await loop.create_server(lambda: _H2LibFloor(answer), host, 0, backlog=1024)
        port = int(server.sockets[0].getsockname()[1])

        async def stop() -> None:
            server.close()
    else:  # h2-quiver-BACKEND
        port, stop = await _serve_h2(host, await _quiver_handler(kind.removeprefix("h2-quiver-")))
    print(f"started GRPC service at {host}:{port}", file=sys.stderr, flush=True)  # as Quiver says it
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await stop(0) if kind == "grpcio" else await stop()


# -- measuring ---------------------------------------------------------------------------------


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid`` so far by thread role (see the module's docstring)."""
    import psutil

    seconds = dict.fromkeys(ROLES, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue  # the thread has ended
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        role = "event loop" if tid == str(pid) else "event_engine" if name.startswith("event_engine") else "other threads"
        seconds[role] += (int(fields[11]) + int(fields[12])) / _TICK
    try:
        for child in psutil.Process(pid).children(recursive=True):
            with_time = child.cpu_times()
            seconds["children"] += with_time.user + with_time.system
    except psutil.Error:
        pass
    return seconds


def start_target(target: str, folder: Path) -> Server:
    log_path = folder / f"{target}.log"
    if target.startswith(("floor-", "h2-")):
        argv = [sys.executable, "-m", "benchmarks.grpc_cost", "--serve-floor", target.removeprefix("floor-")]
        server: Server = Server(target, argv, log=log_path, listeners=("GRPC",), cwd=ROOT, stop_timeout=30.0)
    else:
        backend = target.removeprefix("grpcio-").removeprefix("quiver-")
        repository = folder / f"repository-{backend}"
        if not repository.exists():
            repository = write_repository(folder, backend)
        extra = ["--grpc-server", "grpcio"] if target.startswith("grpcio-") else []
        server = QuiverServer(repository, ["--frontend-workers", "0", *extra], log=log_path, cwd=folder, name=target,
                              ready_path=f"/v2/models/{PAYLOAD.model}/ready", stop_timeout=30.0)
    server.start()
    return server


def trial(server: Server, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    endpoints = server.endpoints
    marks: list[dict[str, float]] = []
    result = loadgen.run_trial(
        *endpoints.address("grpc"), "grpc", concurrency, args.warmup, args.duration, PAYLOAD, endpoints.pid,
        args.check_every, progress=None,
        on_begin=lambda: marks.append(cpu_by_role(endpoints.pid)),
        on_end=lambda: marks.append(cpu_by_role(endpoints.pid)),
    )
    answered = max(1, result.requests)
    per_request = {role: 1e6 * (marks[1][role] - marks[0][role]) / answered for role in ROLES}
    return {
        "req_per_s": result.req_per_s,
        "p99_ms": result.p99_ms,
        "errors": result.errors,
        "server_us": sum(per_request.values()),
        **{f"{role}_us": value for role, value in per_request.items()},
        "event_loop_busy_pct": 100.0 * (marks[1]["event loop"] - marks[0]["event loop"]) / max(result.seconds, 1e-9),
        "client_us": 1e6 * result.client_cpu_s / answered,
    }


COLUMNS = [
    ("req/s", "req_per_s", ",.0f"), ("p99 ms", "p99_ms", ".2f"), ("server CPU us/req", "server_us", ".0f"),
    ("event loop us", "event loop_us", ".0f"), ("event_engine us", "event_engine_us", ".0f"),
    ("other threads us", "other threads_us", ".0f"), ("children us", "children_us", ".0f"),
    ("event loop busy %", "event_loop_busy_pct", ".0f"), ("client us/req", "client_us", ".0f"),
]


def median_cell(samples: list[dict[str, Any]]) -> dict[str, Any]:
    cell: dict[str, Any] = {"rounds": len(samples), "errors": sum(s["errors"] for s in samples)}
    for _, key, _ in COLUMNS:
        values = [s[key] for s in samples if s[key] is not None]
        cell[key] = statistics.median(values) if values else None
    return cell


def markdown(cells: dict[tuple[str, int], dict[str, Any]], args: argparse.Namespace) -> str:
    header = ["target", "c", *(name for name, _, _ in COLUMNS), "errors"]
    rows = [
        [target, str(c), *(common.dash(cell[key], spec) for _, key, spec in COLUMNS), str(cell["errors"])]
        for (target, c), cell in cells.items()
    ]
    lines = [
        "# gRPC: where a request's server CPU goes",
        "",
        f"`{common.command_line()}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{args.duration:g} s per trial after {args.warmup:g} s of warm-up, the median of {args.repeat} "
        "rounds (targets alternating). Server CPU per answered request, split by thread (see "
        "`benchmarks/grpc_cost.py`); client: the load generator's own CPU per request.",
        "",
        *common.markdown_table(header, rows, "ll" + "r" * (len(header) - 2)),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help=f"of: {','.join(TARGETS)} (default: {','.join(DEFAULT_TARGETS)})")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="grpc_cost")
    parser.add_argument("--serve-floor", choices=("grpcio", "h2", "h2lib", "quiver", "h2-quiver-onnx", "h2-quiver-python"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_floor is None:
        args.targets = [t for t in args.targets.split(",") if t]
        unknown = set(args.targets) - set(TARGETS)
        if unknown:
            parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_floor is not None:
        common.run_async(_serve_floor(args.serve_floor, "127.0.0.1"))
        return 0
    folder = Path(tempfile.mkdtemp(prefix="grpc_cost-"))
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {(t, c): [] for t in args.targets for c in args.concurrency}
    try:
        for round_index in range(args.repeat):
            for target in args.targets:
                server = start_target(target, folder)
                try:
                    loadgen.sanity_check(*server.endpoints.address("grpc"), "grpc", PAYLOAD)
                    for concurrency in args.concurrency:
                        sample = trial(server, concurrency, args)
                        samples[(target, concurrency)].append(sample)
                        log(f"round {round_index + 1}/{args.repeat} {target} c={concurrency}: "
                            f"{sample['req_per_s']:,.0f} req/s, server {sample['server_us']:.0f} us/request "
                            f"(event loop {sample['event loop_us']:.0f}), client {sample['client_us']:.0f}")
                finally:
                    server.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    cells = {key: median_cell(value) for key, value in samples.items()}
    text = markdown(cells, args)
    print(text)
    report = {
        "environment": common.environment(["grpcio", "uvloop", "protobuf"]),
        "settings": {"duration": args.duration, "warmup": args.warmup, "repeat": args.repeat},
        "cells": [{"target": t, "concurrency": c, **cell, "samples": samples[(t, c)]} for (t, c), cell in cells.items()],
    }
    print(common.write_results(args.output_dir, args.stem, text, report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
