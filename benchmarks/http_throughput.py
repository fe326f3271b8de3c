"""HTTP and gRPC throughput of Quiver on Triton's ``simple`` model, next to floors.

Run: ``.venv/bin/python -m benchmarks.http_throughput`` from the repository root (or ``make
bench``); ``--help`` for options.

What it measures, per trial (fixed duration after a warm-up):

* ``quiver``: ``quiver serve`` on a temporary repository holding only ``simple`` (INT32[16] x2 ->
  sum, difference; max_batch_size 8), driven over HTTP/1.1 keep-alive with one connection per
  concurrent worker, with JSON and with Triton's binary tensor extension; and over KServe v2
  gRPC (encoding ``grpc``: ``inference.GRPCInferenceService/ModelInfer`` with
  ``raw_input_contents``), one channel shared by the concurrent callers.
* ``floor: raw HTTP``: a minimal uvloop + httptools server (in this module, run as a subprocess
  with ``--serve-floor``) that answers the same requests with a fixed pre-encoded response. It is the
  cost of HTTP plus this client alone on this machine: no server can beat it here.
* ``floor: raw gRPC``: a minimal ``grpc.aio`` server on uvloop (``--serve-grpc-floor``) whose
  ``ModelInfer`` returns a fixed, pre-built ``ModelInferResponse``: the cost of python gRPC (and
  protobuf) plus this client alone.
* ``floor: onnxruntime``: ``InferenceSession.run`` on the same model and inputs, in-process, in a
  tight loop: the cost of the model itself.

The load generator is ``benchmarks/loadgen.py``, deliberately lean so that it leaves the cores to
the server: one process, one uvloop event loop, callback-driven ``asyncio.Protocol`` connections
that write pre-encoded request bytes and frame responses by their head. Every response's status is
checked (non-200 is an error); the first response of each connection and one in ``--check-every``
after it is decoded and compared with the right answer (a wrong answer is an error too).

Over gRPC it runs in the same process and loop: a ``grpc.aio`` stub on one channel, N caller
coroutines each awaiting ``ModelInfer`` with one pre-built ``ModelInferRequest`` in a loop. A call
that does not end with status OK counts as an error (in ``non_200``, which for gRPC means "status
not OK"); each caller's first response and one in ``--check-every`` is checked.

Both the client's CPU time (``time.process_time``) and the server process's (psutil, or
``/proc/PID/stat``) are measured over each trial's measured window, as a percentage of one core, so
the table shows where the cores went: on a 2-core machine the client and the server share them.

Results: a markdown table on stdout and in ``benchmarks/results/http_throughput.md``, the same as
JSON in ``benchmarks/results/http_throughput.json``, per-request latencies in
``benchmarks/results/raw/`` (gitignored), and with ``--plot`` a PNG (drawn by the throwaway
matplotlib venv, ``common.plot_in_venv``; ``--plot-from http_throughput.json`` draws it again).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from benchmarks import common, loadgen
from benchmarks.common import ROOT, command_line, run_async
from benchmarks.peers import Endpoints, Server
from benchmarks.peers.quiver import QuiverServer
from examples.build_repository import SIMPLE_CONFIG, simple_onnx

try:
    import psutil
except ImportError:  # pragma: no cover - optional
    psutil = None  # type: ignore[assignment]

MODEL = "simple"
INFER_PATH = f"/v2/models/{MODEL}/infer"
SHAPE = [1, 16]
INPUT0 = np.arange(16, dtype=np.int32).reshape(SHAPE)
INPUT1 = (np.arange(16, dtype=np.int32) * 3 - 7).reshape(SHAPE)
EXPECTED = {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}
PAYLOAD = loadgen.Payload(MODEL, {"INPUT0": INPUT0, "INPUT1": INPUT1}, expected=EXPECTED)
ENCODINGS = ("json", "binary", "grpc")
HTTP_ENCODINGS = ("json", "binary")
TARGETS = ("floor-ort", "floor-http", "floor-grpc", "quiver", "quiver-threaded")
TARGET_LABELS = {
    "floor-ort": "floor: onnxruntime in-process",
    "floor-http": "floor: raw HTTP (uvloop+httptools)",
    "floor-grpc": "floor: raw gRPC (grpc.aio on uvloop)",
    "quiver": "quiver",
    "quiver-threaded": "quiver, every call on the instance thread",
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- payloads ------------------------------------------------------------------------------


def canned_response(encoding: str) -> bytes:
    """What a Triton-like server answers, as a complete HTTP response (for the floor server)."""
    outputs = []
    raw = b""
    for name in ("OUTPUT0", "OUTPUT1"):
        arr = EXPECTED[name]
        entry: dict[str, Any] = {"name": name, "datatype": "INT32", "shape": SHAPE}
        if encoding == "json":
            entry["data"] = arr.ravel().tolist()
        else:
            entry["parameters"] = {"binary_data_size": arr.nbytes}
            raw += arr.astype("<i4").tobytes()
        outputs.append(entry)
    header = orjson.dumps({"model_name": MODEL, "model_version": "1", "outputs": outputs})
    body = header + raw
    lines = ["HTTP/1.1 200 OK", f"content-length: {len(body)}"]
    if encoding == "json":
        lines.append("content-type: application/json")
    else:
        lines.append("content-type: application/octet-stream")
        lines.append(f"inference-header-content-length: {len(header)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def grpc_canned_response() -> Any:
    """What Triton answers (every output raw), as a ``ModelInferResponse`` (for the floor server)."""
    from tritonclient.grpc import service_pb2 as pb

    response = pb.ModelInferResponse(model_name=MODEL, model_version="1")
    for name in ("OUTPUT0", "OUTPUT1"):
        response.outputs.add(name=name, datatype="INT32", shape=SHAPE)
        response.raw_output_contents.append(EXPECTED[name].astype("<i4").tobytes())
    return response


# -- the floor servers ---------------------------------------------------------------------


class _FloorProtocol(asyncio.Protocol):
    """Answers every infer request with a fixed response; health probes with 200."""

    def __init__(self, responses: dict[bool, bytes]) -> None:
        import httptools

        self.responses = responses
        self.parser = httptools.HttpRequestParser(self)
        self.error = httptools.HttpParserError
        self.url = b""
        self.binary = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except self.error:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.binary = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.binary = True

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.url == INFER_PATH.encode():
            self.transport.write(self.responses[self.binary])
        elif self.url.startswith(b"/v2/health/"):
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        else:
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")


async def _serve_floor(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    responses = {False: canned_response("json"), True: canned_response("binary")}
    server = await loop.create_server(lambda: _FloorProtocol(responses), host, port, backlog=1024)
    bound = server.sockets[0].getsockname()
    print(f"started HTTP service at {bound[0]}:{bound[1]}", file=sys.stderr, flush=True)  # as Quiver says it
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await server.wait_closed()


def run_floor_server(host: str, port: int) -> int:
    run_async(_serve_floor(host, port))
    return 0


async def _serve_grpc_floor(host: str, port: int) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    response = grpc_canned_response()

    class Floor(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
        async def ModelInfer(self, request: Any, context: Any) -> Any:
            return response

    loop = asyncio.get_running_loop()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"started GRPC service at {host}:{bound}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


def run_grpc_floor_server(host: str, port: int) -> int:
    run_async(_serve_grpc_floor(host, port))
    return 0


# -- results -------------------------------------------------------------------------------


@dataclass
class TrialResult(loadgen.TrialResult):
    """A row of the table: a load generator trial (or the onnxruntime floor) against ``target``."""

    target: str = ""


def run_ort_floor(model_path: Path, warmup: float, duration: float) -> TrialResult:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    feeds = {"INPUT0": INPUT0, "INPUT1": INPUT1}
    names = ["OUTPUT0", "OUTPUT1"]
    out0, out1 = session.run(names, feeds)
    if not (np.array_equal(out0, EXPECTED["OUTPUT0"]) and np.array_equal(out1, EXPECTED["OUTPUT1"])):
        raise SystemExit("onnxruntime floor: the model gives a wrong answer")
    run = session.run
    clock = time.perf_counter_ns
    deadline = clock() + int(warmup * 1e9)
    while clock() < deadline:
        run(names, feeds)
    lat: list[int] = []
    append = lat.append
    cpu0, t0 = time.process_time(), time.perf_counter()
    deadline = clock() + int(duration * 1e9)
    now = clock()
    while now < deadline:
        run(names, feeds)
        after = clock()
        append(after - now)
        now = after
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    del session
    arr = np.asarray(lat, dtype=np.int64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99]) / 1e6
    return TrialResult(
        target="floor-ort",
        encoding="-",
        concurrency=1,
        requests=len(arr),
        seconds=seconds,
        req_per_s=len(arr) / seconds,
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        client_cpu_s=cpu,
        client_cpu_pct=100 * cpu / seconds,
        latencies_ns=lat,
    )


# -- servers as subprocesses ---------------------------------------------------------------


def target_encodings(target: str, encodings: list[str]) -> list[str]:
    """The encodings (protocols) ``target`` serves, of those asked for."""
    if target == "floor-http":
        return [e for e in encodings if e in HTTP_ENCODINGS]
    if target == "floor-grpc":
        return [e for e in encodings if e == "grpc"]
    return list(encodings)


def target_server(target: str, repo: Path, log: Path, args: argparse.Namespace) -> Server:
    """The server ``target`` drives: a floor (this module with ``--serve-floor`` or
    ``--serve-grpc-floor``), or ``quiver serve`` (without inline execution for ``quiver-threaded``)."""
    listeners = ("GRPC",) if target == "floor-grpc" else ("HTTP",) if target == "floor-http" else ("HTTP", "GRPC", "Metrics")
    if target.startswith("floor"):
        flag = "--serve-grpc-floor" if target == "floor-grpc" else "--serve-floor"
        argv = [sys.executable, "-m", "benchmarks.http_throughput", flag, "0"]
        return Server(target, argv, log=log, listeners=listeners, cwd=ROOT, stop_timeout=30.0)
    flags = ["--inline-execution-threshold-us", "0"] if target == "quiver-threaded" else []
    return QuiverServer(repo, flags, log=log, listeners=listeners, executable=args.quiver, name=target, stop_timeout=30.0)


def drive(endpoints: Endpoints, target: str, args: argparse.Namespace, results: list[TrialResult]) -> None:
    encodings = target_encodings(target, args.encodings)
    for encoding in encodings:
        loadgen.sanity_check(*endpoints.address(encoding), encoding, PAYLOAD)
    for encoding in encodings:
        for concurrency in args.concurrency:
            log(f"{target} {encoding} c={concurrency}: {args.warmup:g} s warm-up + {args.duration:g} s ...")
            res = loadgen.run_trial(
                *endpoints.address(encoding),
                encoding,
                concurrency,
                args.warmup,
                args.duration,
                PAYLOAD,
                endpoints.pid,
                args.check_every,
                result=TrialResult(target=target),
            )
            results.append(res)
            log(f"  {summary(res)}")
            if res.first_error:
                log(f"  first error: {res.first_error}")


# -- reporting -----------------------------------------------------------------------------


def summary(r: TrialResult) -> str:
    server = "-" if r.server_cpu_pct is None else f"{r.server_cpu_pct:.0f}%"
    return (
        f"{r.req_per_s:,.0f} req/s, p50 {r.p50_ms or 0:.3f} ms, p99 {r.p99_ms or 0:.3f} ms, "
        f"errors {r.errors}, client CPU {r.client_cpu_pct:.0f}%, server CPU {server}"
    )


def markdown_table(results: list[TrialResult]) -> str:
    head = (
        "| target | encoding | concurrency | req/s | p50 ms | p90 ms | p99 ms | errors "
        "| client CPU % | server CPU % |"
    )
    rows = [head, "|" + "---|" * 3 + "---:|" * 7]
    for r in results:
        latency = " | ".join(common.dash(ms, ".3f") for ms in (r.p50_ms, r.p90_ms, r.p99_ms))
        rows.append(
            f"| {TARGET_LABELS[r.target]} | {r.encoding} | {r.concurrency} | {r.req_per_s:,.0f} | {latency} "
            f"| {r.errors} | {r.client_cpu_pct:.0f} | {common.dash(r.server_cpu_pct, '.0f')} |"
        )
    return "\n".join(rows)


def environment() -> dict[str, Any]:
    return {
        **common.environment(
            ("onnxruntime", "quiver", "uvloop", "httptools", "grpcio", "protobuf", "uvicorn")
        ),
        "cpu_time_source": "psutil" if psutil is not None else "/proc/PID/stat",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def markdown_report(env: dict[str, Any], cmd: str, args: argparse.Namespace, results: list[TrialResult], notes: list[str]) -> str:
    lines = [
        "# HTTP and gRPC throughput: Triton's `simple` model (INT32[16] x2 -> sum, difference)",
        "",
        f"- Command: `{cmd}`",
        f"- Date: {env['date']}",
        f"- Machine: {env['nproc']} cores, {env['cpu_model']} ({env['platform']});"
        f" load average at start {' / '.join(str(x) for x in env['load_average_at_start'])} (1/5/15 min:"
        " anything well above 0 means other processes shared the cores)",
        f"- Versions: Python {env['python']}, onnxruntime {env['onnxruntime']}, quiver {env['quiver']}"
        f" (uvicorn {env['uvicorn']}, uvloop {env['uvloop']}, httptools {env['httptools']},"
        f" grpcio {env['grpcio']}, protobuf {env['protobuf']})",
        f"- Trials: {args.warmup:g} s warm-up, then {args.duration:g} s measured, per row;"
        " one HTTP/1.1 keep-alive connection per concurrent request, one request at a time on each."
        " gRPC (encoding `grpc`): one `grpc.aio` channel (one HTTP/2 connection) in the same client"
        " process and loop, N caller coroutines each awaiting `ModelInfer` with a pre-built"
        " request (`raw_input_contents`); every call's status is checked, and a sample of answers.",
        "- CPU % is CPU time over the measured window as a percentage of one core"
        f" (this machine has {env['nproc']}, so {100 * (env['nproc'] or 1)}% is all of it); the client"
        " shares the cores with the server. The onnxruntime floor runs in the client process.",
        "- `floor: raw HTTP` answers with a fixed pre-encoded response (same body as Triton's), so it is"
        " the cost of HTTP plus this load generator alone; `floor: onnxruntime` is"
        " `InferenceSession.run` in a tight loop, the cost of the model alone. `floor: raw gRPC` is a"
        " `grpc.aio` server on uvloop whose `ModelInfer` returns a fixed `ModelInferResponse`: what"
        " python gRPC (with protobuf) costs on this machine before any server logic.",
        "- At concurrency 1 every request is a ping-pong between two processes, so the fast rows are"
        " sensitive to whether the scheduler keeps client and server on one core or wakes the other"
        " (a cross-core wake-up can cost tens of µs on a VM): the raw-HTTP floor's c=1 row can vary"
        " several-fold between runs; a p50 far below the p90 shows the mix. At higher concurrency"
        " the same placement luck decides whether client and floor server get a core each (their"
        " CPU % add up to ~200) or share one (~100), so the floor rows vary between runs too.",
        "- gRPC costs more than HTTP here before any server logic: `grpc.aio` runs the transport on"
        " gRPC core's own threads and hands every completion to the event loop through a poller"
        " thread and a socket pair, several thread wake-ups per call on each side (client and"
        " server), which is most of the raw-gRPC floor's CPU. The client's share is larger too, so"
        " the gRPC rows leave the server less of the two cores than the HTTP rows do.",
        "",
        markdown_table(results),
    ]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------


def _csv(kind: type, choices: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        if kind is int and any(x < 1 for x in items):
            raise argparse.ArgumentTypeError("concurrency must be >= 1")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(
            "HTTP and gRPC throughput of `quiver serve` on Triton's `simple` model (JSON and binary "
            "tensor encodings over HTTP, raw tensors over gRPC, several concurrency levels), next to "
            "floors: onnxruntime called in-process, and minimal uvloop+httptools and grpc.aio servers "
            "answering with a fixed response. "
            "Prints a markdown table; writes benchmarks/results/http_throughput.{json,md}."
        ),
    )
    parser.add_argument("--concurrency", type=_csv(int), default=[1, 8, 32], metavar="N,N,...", help="concurrency levels (default: 1,8,32)")
    parser.add_argument("--duration", type=float, default=5.0, metavar="SECONDS", help="measured seconds per trial (default: 5)")
    parser.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS", help="warm-up seconds before each trial (default: 1)")
    parser.add_argument(
        "--encodings",
        type=_csv(str, ENCODINGS),
        default=list(ENCODINGS),
        metavar="E,E,...",
        help="json, binary (HTTP) and/or grpc (KServe v2 gRPC, raw tensors) (default: json,binary,grpc)",
    )
    parser.add_argument("--targets", type=_csv(str, TARGETS), default=list(TARGETS), metavar="T,T,...", help=f"which of {', '.join(TARGETS)} to run (default: all)")
    parser.add_argument("--check-every", type=int, default=50, metavar="N", help="decode and check one response in N (and each connection's first) (default: 50)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results", metavar="DIR", help="where results go (default: benchmarks/results)")
    parser.add_argument("--no-raw", action="store_true", help="don't write per-request latencies to OUTPUT_DIR/raw/")
    parser.add_argument("--plot", action="store_true", help="also write OUTPUT_DIR/http_throughput.png (with the plotting venv)")
    parser.add_argument("--plot-from", type=Path, default=None, metavar="JSON",
                        help="only draw OUTPUT_DIR/http_throughput.png from an earlier http_throughput.json")
    parser.add_argument("--quiver", default=None, metavar="PATH", help="the quiver executable (default: the one next to this Python, else .venv/bin/quiver)")
    parser.add_argument("--serve-floor", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-grpc-floor", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_floor is not None:
        return run_floor_server("127.0.0.1", args.serve_floor)
    if args.serve_grpc_floor is not None:
        return run_grpc_floor_server("127.0.0.1", args.serve_grpc_floor)
    if args.plot_from is not None:
        return common.plot_from("http_throughput", args.plot_from, args.output_dir / "http_throughput.png")
    if args.duration <= 0 or args.warmup < 0 or args.check_every < 1:
        raise SystemExit("--duration must be > 0, --warmup >= 0, --check-every >= 1")
    env = environment()
    cmd = command_line()
    results: list[TrialResult] = []
    notes: list[str] = []
    exit_codes: dict[str, int | None] = {}
    status = 0
    log(f"{env['nproc']} cores ({env['cpu_model']}); {len(args.concurrency) * len(args.encodings)} trial(s) per Quiver target")

    with tempfile.TemporaryDirectory(prefix="quiver-bench-") as tmp:
        repo = Path(tmp) / "repository"
        import onnx

        model = simple_onnx()
        onnx.checker.check_model(model)
        model_path = common.test_support("models").write_onnx(repo, MODEL, model, SIMPLE_CONFIG) / "1" / "model.onnx"

        try:
            if "floor-ort" in args.targets:
                log(f"floor-ort: onnxruntime in-process, {args.warmup:g} s warm-up + {args.duration:g} s ...")
                res = run_ort_floor(model_path, args.warmup, args.duration)
                results.append(res)
                log(f"  {summary(res)}")

            for target in ("floor-http", "floor-grpc", "quiver", "quiver-threaded"):
                encodings = target_encodings(target, args.encodings)
                if target not in args.targets or not encodings:
                    continue
                server = target_server(target, repo, Path(tmp) / f"{target}.log", args)
                log(f"{target}: starting {shlex.join(server.argv)}")
                try:
                    endpoints = server.start()
                    ports = ", ".join(f"{p} {a}" for p, a in (("HTTP", endpoints.http), ("gRPC", endpoints.grpc)) if a)
                    log(f"{target}: ready at {ports}; pid {endpoints.pid}")
                    drive(endpoints, target, args, results)
                finally:
                    code = server.stop()
                    exit_codes[target] = code
                    if code != 0:
                        what = "had to be killed" if code is None else f"exited with {code}"
                        notes.append(f"{target} server {what} after SIGTERM (expected 0)")
                        log(f"{target}: server {what} after SIGTERM; log tail:\n{server.tail()}")
                        status = 1
                    else:
                        log(f"{target}: stopped with SIGTERM, exit code 0")
        except (RuntimeError, OSError) as exc:
            log(f"error: {exc}")
            notes.append(f"aborted: {exc}")
            status = 1

    if not results:
        return status or 1
    if any(r.errors for r in results):
        bad = [f"{r.target}/{r.encoding}/c{r.concurrency}: {r.errors} ({r.first_error})" for r in results if r.errors]
        notes.append("errors: " + "; ".join(bad))
        status = 1

    table = markdown_table(results)
    print(table)
    out: Path = args.output_dir
    payload = {
        "benchmark": "http_throughput",
        "command": cmd,
        "environment": env,
        "settings": {
            **common.trial_settings(args),
            "encodings": args.encodings,
            "check_every": args.check_every,
        },
        "server_exit_codes": exit_codes,
        "notes": notes,
        "results": [
            {"target": r.target, **r.to_dict(), "label": TARGET_LABELS[r.target]}
            for r in results
        ],
    }
    log(common.write_results(out, "http_throughput", markdown_report(env, cmd, args, results, notes), payload))
    if not args.no_raw:
        raw_dir = out / "raw"
        raw_dir.mkdir(exist_ok=True)
        raw_path = raw_dir / "http_throughput_latencies.npz"
        np.savez_compressed(
            raw_path,
            **{f"{r.target}__{r.encoding}__c{r.concurrency}": np.asarray(r.latencies_ns, dtype=np.int64) for r in results},
        )
        log(f"wrote per-request latencies (ns) to {raw_path}")
    if args.plot:
        log(f"plot: {common.plot_in_venv('http_throughput', out / 'http_throughput.json', out / 'http_throughput.png')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
