"""Quiver next to real Triton and real MLServer: same machine, same model, same load, one run.

Run: ``.venv/bin/python -m benchmarks.compare`` from the repository root (or ``make
bench-compare``); ``--help`` for options; ``--quick`` for a smoke run (1 s trials, small side
workloads).

Workload ``tiny`` (every server): model ``tiny``, INPUT0 FP32 [1, 16] -> OUTPUT0 = INPUT0 * 2,
served by ``quiver serve`` as a Triton Python model (the same ``model.py`` Triton runs) and as an
ONNX model, by Triton 2.51 (``tritonserver`` from PyPI's nvidia-pytriton, Python backend) and by
MLServer 1.7.1 (default ``parallel_workers`` and ``parallel_workers: 0``); each peer in a virtual
environment of its own under ``benchmarks/.work`` (``benchmarks/peers/``). For each peer: start,
one checked request per encoding, then ``benchmarks/loadgen.py`` trials for every encoding x
concurrency, then Triton's own ``perf_analyzer`` (``benchmarks/perf_analyzer.py``) over HTTP and
gRPC at the same concurrencies, stop. Next to them, the in-process floors: ``x * 2`` in numpy
and the ONNX model's ``InferenceSession.run``, in a loop.

Ratios per (encoding, concurrency): Quiver's req/s over Triton's and over MLServer's (both
variants), Quiver's p99 over Triton's; the issue's targets judged cell by cell (MET / MISSED):
"Tiny model, HTTP binary and gRPC, concurrency 1, 8 and 32: requests/s at least equal to Triton's
and at least 3x MLServer's; p99 no worse than Triton's." The verdicts compare like with like:
Quiver's Python model against Triton's Python model; the ONNX model is shown as extra.

Workloads ``resnet``, ``text`` and ``multi-model`` (Quiver only: Triton's pip build has only the
Python backend, MLServer has no ensembles or Triton repositories): ``benchmarks.batching``,
``benchmarks.pipelines`` and ``benchmarks.multi_model`` run as subprocesses with modest
settings, their results written to ``OUTPUT_DIR/compare-workloads/`` and folded into the report.

Writes ``OUTPUT_DIR/compare.json`` (everything), ``compare.md`` (tables, ratios, verdicts) and
``compare.png`` (drawn by a throwaway venv with matplotlib, ``benchmarks/.work/plotvenv``).
Ctrl-C or SIGTERM stops every server it started and exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common, compare_workers
from benchmarks.common import ROOT
from benchmarks.plots import ENCODING_LABEL

RESULTS = ROOT / "benchmarks" / "results"
SUBDIR = "compare-workloads"

WORKLOADS = ("tiny", "resnet", "text", "multi-model", compare_workers.WORKLOAD)
QUIVER, QUIVER_ONNX, TRITON, MLSERVER, MLSERVER0 = "quiver-python", "quiver-onnx", "triton", "mlserver", "mlserver-workers0"
PEERS = (QUIVER, QUIVER_ONNX, *compare_workers.PEERS, TRITON, MLSERVER, MLSERVER0)
ENCODINGS = ("json", "binary", "grpc")

TARGET = (
    "Tiny model, HTTP binary and gRPC, concurrency 1, 8 and 32: requests/s at least equal to "
    "Triton's and at least 3x MLServer's; p99 no worse than Triton's."
)
TARGET_ENCODINGS = ("binary", "grpc")
TARGET_CONCURRENCY = (1, 8, 32)
RESNET_TARGET_PCT = 90.0


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- stopping on Ctrl-C / SIGTERM -----------------------------------------------------------

_scripts: set[subprocess.Popen[bytes]] = set()  # the side workloads' scripts (own sessions)
_server_groups: set[int] = set()  # peers' servers (session leaders) not yet stopped cleanly
_signal_received = 0


def _on_signal(signum: int, frame: Any) -> None:
    global _signal_received
    if _signal_received:  # already stopping
        return
    _signal_received = signum
    raise KeyboardInterrupt


def _stop_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGINT a script's process group (the script stops the servers it started and removes its
    temporary folders as on Ctrl-C), then SIGKILL what is left: the group, and the script's
    servers, which run in sessions of their own."""
    _scripts.discard(proc)
    servers = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for server in servers:
        with contextlib.suppress(Exception):
            server.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _descendants(pid: int) -> list[Any]:
    """The live descendants of ``pid`` (psutil processes)."""
    import psutil

    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def _cleanup() -> None:
    for proc in list(_scripts):
        _stop_group(proc)
    if "benchmarks.peers" in sys.modules:
        sys.modules["benchmarks.peers"].kill_all()
    # A stop interrupted half way (after SIGTERM, before SIGKILL) leaves its server out of
    # kill_all's list: finish it by process group (the unreaped leader keeps the id taken).
    for pgid in list(_server_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        _server_groups.discard(pgid)


# -- helpers --------------------------------------------------------------------------------


def _csv(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [part.strip() for part in text.split(",") if part.strip()]
        wrong = [item for item in items if item not in choices]
        if wrong or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(choices)}")
        return items

    return parse


def _ints(text: str) -> list[int]:
    try:
        items = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        items = []
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8,32")
    return items


def _num(value: float | None, digits: int = 0) -> str:
    return common.dash(value, f",.{digits}f")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _alive(pid: int) -> bool:
    try:
        import psutil

        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except ImportError:  # pragma: no cover - psutil is a Quiver dependency
        return Path(f"/proc/{pid}").exists()
    except Exception:
        return False


def _get_json(url: str, timeout: float = 10.0) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


# -- workload tiny ----------------------------------------------------------------------------


def _make_peer(key: str, workers: int) -> Any:
    if key in (QUIVER, QUIVER_ONNX, *compare_workers.PEERS):
        from benchmarks.peers.quiver import QuiverPeer

        backend = "python" if key in (QUIVER, compare_workers.QUIVER_WORKERS) else "onnx"
        return QuiverPeer(backend, frontend_workers=workers if key in compare_workers.PEERS else 0)
    if key == TRITON:
        from benchmarks.peers.triton import TritonPeer

        return TritonPeer()
    from benchmarks.peers.mlserver import MLServerPeer

    return MLServerPeer(parallel_workers=0 if key == MLSERVER0 else None)


def _packages(key: str) -> str:
    """What the peer was installed from, for the report."""
    if key in (QUIVER, QUIVER_ONNX, *compare_workers.PEERS):
        return f"quiver {common.version('quiver')} (the project venv, .venv)"
    if key == TRITON:
        from benchmarks.peers import triton

        return f"{triton.PYTRITON} (its bundled tritonserver, Python backend only)"
    from benchmarks.peers import mlserver

    return " ".join(mlserver.PACKAGES)


def _floors(seconds: float) -> dict[str, Any]:
    """The tiny model with no server: numpy ``x * 2`` and onnxruntime's ``run``, in a loop."""
    import numpy as np
    import onnxruntime as ort

    from benchmarks.peers import tiny

    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(tiny.SHAPE)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(tiny.onnx_model(), sess_options=options, providers=["CPUExecutionProvider"])
    (y,) = session.run([tiny.OUTPUT], {tiny.INPUT: x})
    assert np.array_equal(y, x * 2), y

    def loop(call: Callable[[], Any]) -> dict[str, float]:
        call()
        calls, start = 0, time.perf_counter()
        deadline = start + seconds
        while True:
            for _ in range(100):
                call()
            calls += 100
            now = time.perf_counter()
            if now >= deadline:
                break
        elapsed = now - start
        return {"calls": calls, "seconds": elapsed, "calls_per_s": calls / elapsed,
                "us_per_call": 1e6 * elapsed / calls}

    feed, names = {tiny.INPUT: x}, [tiny.OUTPUT]
    return {
        "numpy x * 2": loop(lambda: x * 2),
        "onnxruntime InferenceSession.run": loop(lambda: session.run(names, feed)),
    }


def _perf_analyzer_setup(enabled: bool) -> dict[str, Any]:
    if not enabled:
        return {"status": "off (--no-perf-analyzer)"}
    from benchmarks import perf_analyzer

    log("perf_analyzer: setting up (benchmarks/.work/perf_analyzer) ...")
    try:
        install = perf_analyzer.setup()
    except perf_analyzer.PerfAnalyzerError as exc:
        log(f"perf_analyzer: setup failed: {exc}")
        return {"status": "setup failed", "error": str(exc)}
    return {"status": "ok", "versions": install.versions}


def _run_peer(key: str, args: argparse.Namespace, payload: Any, pa: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import loadgen
    from benchmarks.peers import PeerError

    peer = _make_peer(key, args.frontend_workers)
    rec: dict[str, Any] = {
        "key": key, "name": peer.name, "status": "ok", "error": None, "packages": None,
        "server": None, "setup_s": None, "start_s": None, "load_avg_end": None, "sanity": {}, "notes": [],
        "trials": [], "perf_analyzer": [],
    }
    log(f"[{peer.name}] setup ...")
    began = time.monotonic()
    try:
        peer.setup()
        rec["packages"] = _packages(key)
    except PeerError as exc:
        rec.update(status="setup failed", error=str(exc))
        log(f"[{peer.name}] setup failed: {exc}")
        return rec
    except Exception as exc:  # anything else a broken install throws
        rec.update(status="setup failed", error=f"{type(exc).__name__}: {exc}")
        log(f"[{peer.name}] setup failed: {rec['error']}")
        return rec
    rec["setup_s"] = round(time.monotonic() - began, 1)
    log(f"[{peer.name}] starting ...")
    began = time.monotonic()
    try:
        endpoints = peer.start("tiny")
    except PeerError as exc:
        rec.update(status="start failed", error=str(exc))
        log(f"[{peer.name}] start failed: {exc}")
        peer.stop()
        return rec
    except Exception as exc:
        rec.update(status="start failed", error=f"{type(exc).__name__}: {exc}")
        log(f"[{peer.name}] start failed: {rec['error']}")
        peer.stop()
        return rec
    rec["start_s"] = round(time.monotonic() - began, 1)
    _server_groups.add(endpoints.pid)
    try:
        with contextlib.suppress(Exception):
            meta = _get_json(f"http://{endpoints.http}/v2")
            rec["server"] = {"name": meta.get("name"), "version": meta.get("version")}
        log(f"[{peer.name}] ready in {rec['start_s']} s: http {endpoints.http}, grpc {endpoints.grpc}, "
            f"pid {endpoints.pid}, server {rec['server']}")

        usable: list[str] = []
        for encoding in args.encodings:
            if encoding == "grpc" and endpoints.grpc is None:
                rec["sanity"][encoding] = "n/a (no gRPC endpoint)"
                continue
            try:
                loadgen.sanity_check(*endpoints.address(encoding), encoding, payload)
            except RuntimeError as exc:
                if encoding == "binary" and key in (MLSERVER, MLSERVER0):
                    rec["sanity"][encoding] = "n/a (not supported)"
                    rec["notes"].append(f"binary tensor extension not supported; a binary request got: {exc}")
                    log(f"[{peer.name}] binary: n/a (not supported)")
                else:
                    rec["sanity"][encoding] = f"error: {exc}"
                    log(f"[{peer.name}] {encoding}: sanity check failed: {exc}")
                continue
            rec["sanity"][encoding] = "ok"
            usable.append(encoding)

        for encoding in usable:
            for concurrency in args.concurrency:
                if not _alive(endpoints.pid):
                    rec["status"] = "died"
                    rec["error"] = "the server exited during the trials"
                    break
                result = loadgen.run_trial(
                    *endpoints.address(encoding), encoding, concurrency, args.warmup, args.duration, payload,
                    server_pid=endpoints.pid, progress=max(1.0, args.duration / 2),
                )
                trial = result.to_dict()
                rec["trials"].append(trial)
                if result.errors:
                    log(f"[{peer.name}] {encoding} c={concurrency}: {result.errors} errors, first: {result.first_error}")

        if pa["status"] == "ok" and _alive(endpoints.pid):
            rec["perf_analyzer"] = _perf_analyzer_rows(key, peer.name, endpoints, args)
    finally:
        log(f"[{peer.name}] stopping")
        peer.stop()
        _server_groups.discard(endpoints.pid)
        rec["load_avg_end"] = round(os.getloadavg()[0], 2)
    return rec


def _perf_analyzer_rows(key: str, name: str, endpoints: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import perf_analyzer

    rows: list[dict[str, Any]] = []
    measurement_ms = max(500, round(args.duration * 1000 / 3))
    for protocol in ("http", "grpc"):
        url = endpoints.http if protocol == "http" else endpoints.grpc
        if url is None:
            continue
        extra: list[str] = []
        tensors = "binary tensors" if protocol == "http" else "raw tensors"
        if protocol == "http" and key in (MLSERVER, MLSERVER0):  # no binary tensor extension
            extra = ["--input-tensor-format", "json", "--output-tensor-format", "json"]
            tensors = "JSON tensors"
        unsupported = None  # perf_analyzer needs Triton's model configuration extension
        for concurrency in args.concurrency:
            row: dict[str, Any] = {"protocol": protocol, "tensors": tensors, "concurrency": concurrency}
            if unsupported is not None:
                row["error"] = unsupported
                rows.append(row)
                continue
            log(f"[{name}] perf_analyzer {protocol} ({tensors}) c={concurrency} ...")
            try:
                row.update(perf_analyzer.run(
                    url=url, protocol=protocol, model="tiny", concurrency=concurrency,
                    measurement_ms=measurement_ms, extra_args=extra,
                ))
                log(f"[{name}] perf_analyzer {protocol} c={concurrency}: {row['req_per_s']:,.0f} req/s, "
                    f"p99 {row['p99_ms']:.3f} ms")
            except perf_analyzer.PerfAnalyzerError as exc:
                row["error"] = str(exc)
                log(f"[{name}] perf_analyzer {protocol} c={concurrency}: {exc}")
                if "failed to get model config" in str(exc):
                    unsupported = "n/a: the server has no model configuration endpoint, which perf_analyzer needs"
            rows.append(row)
    return rows


def run_tiny(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from benchmarks import loadgen
    from benchmarks.peers import tiny

    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(tiny.SHAPE)
    payload = loadgen.Payload(tiny.MODEL, {tiny.INPUT: x}, expected={tiny.OUTPUT: x * 2})
    log("tiny: in-process floors (numpy, onnxruntime) ...")
    floors = _floors(max(1.0, args.duration))
    for label, floor in floors.items():
        log(f"  floor {label}: {floor['calls_per_s']:,.0f} calls/s ({floor['us_per_call']:.2f} us/call)")
    pa = _perf_analyzer_setup(args.perf_analyzer)
    peers = [_run_peer(key, args, payload, pa) for key in args.peers]
    out: dict[str, Any] = {"floors": floors, "perf_analyzer": pa, "peers": peers}
    out["ratios"] = _ratios(peers, args)
    out["perf_analyzer_ratios"] = _pa_ratios(peers, args)
    out["verdicts"], out["verdict_summary"] = _verdicts(peers, args)
    out["workers_verdicts"] = compare_workers.verdicts(
        lambda key, e, c: _trial(peers, key, e, c), QUIVER, QUIVER_ONNX, TRITON,
    )
    return out


# -- ratios and verdicts --------------------------------------------------------------------


def _trial(peers: list[dict[str, Any]], key: str, encoding: str, concurrency: int) -> dict[str, Any] | None:
    for rec in peers:
        if rec["key"] == key:
            for trial in rec["trials"]:
                if trial["encoding"] == encoding and trial["concurrency"] == concurrency:
                    return dict(trial)
    return None


def _peer(peers: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    return next((rec for rec in peers if rec["key"] == key), None)


def _mlserver_basis(peers: list[dict[str, Any]], key: str, encoding: str, concurrency: int) -> tuple[dict[str, Any] | None, str]:
    """MLServer's trial for this cell; for binary (which it lacks) its JSON trial, said so."""
    trial = _trial(peers, key, encoding, concurrency)
    if trial is None and encoding == "binary":
        rec = _peer(peers, key)
        if rec is not None and rec["sanity"].get("binary") == "n/a (not supported)":
            return _trial(peers, key, "json", concurrency), "json"
    return trial, encoding


def _rps(trial: dict[str, Any] | None) -> float | None:
    return None if trial is None else float(trial["req_per_s"])


def _p99(trial: dict[str, Any] | None) -> float | None:
    return None if trial is None or trial["p99_ms"] is None else float(trial["p99_ms"])


Measure = dict[str, Any] | None  # a trial, or a perf_analyzer row, or nothing


def _versus(row: dict[str, Any], of: Callable[[str], Measure], triton: Measure, ml: Measure, ml0: Measure) -> dict[str, Any]:
    """``row`` with both Quiver variants' req/s over Triton's and both MLServers', and their p99
    over Triton's; ``of(key)``: a Quiver variant's measure."""
    for key, tag in ((QUIVER, "quiver_python"), (QUIVER_ONNX, "quiver_onnx")):
        quiver = of(key)
        row[f"{tag}_vs_triton"] = _div(_rps(quiver), _rps(triton))
        row[f"{tag}_vs_mlserver"] = _div(_rps(quiver), _rps(ml))
        row[f"{tag}_vs_mlserver_workers0"] = _div(_rps(quiver), _rps(ml0))
        row[f"{tag}_p99_vs_triton"] = _div(_p99(quiver), _p99(triton))
    return row


def _ratios(peers: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for encoding in args.encodings:
        for concurrency in args.concurrency:
            ml, ml_basis = _mlserver_basis(peers, MLSERVER, encoding, concurrency)
            ml0, ml0_basis = _mlserver_basis(peers, MLSERVER0, encoding, concurrency)
            row: dict[str, Any] = {"encoding": encoding, "concurrency": concurrency,
                                   "mlserver_basis": ml_basis, "mlserver_workers0_basis": ml0_basis}
            rows.append(_versus(row, lambda key, e=encoding, c=concurrency: _trial(peers, key, e, c),
                                _trial(peers, TRITON, encoding, concurrency), ml, ml0))
    return rows


def _pa_ratios(peers: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    def row_of(key: str, protocol: str, concurrency: int) -> Measure:
        rec = _peer(peers, key)
        for row in rec["perf_analyzer"] if rec else []:
            if row["protocol"] == protocol and row["concurrency"] == concurrency and "error" not in row:
                return dict(row)
        return None

    rows = []
    for protocol in ("http", "grpc"):
        for concurrency in args.concurrency:
            row: dict[str, Any] = {"protocol": protocol, "concurrency": concurrency}
            rows.append(_versus(row, lambda key, p=protocol, c=concurrency: row_of(key, p, c),
                                row_of(TRITON, protocol, concurrency), row_of(MLSERVER, protocol, concurrency),
                                row_of(MLSERVER0, protocol, concurrency)))
    return rows


def _why_missing(peers: list[dict[str, Any]], key: str) -> str:
    rec = _peer(peers, key)
    if rec is None:
        return f"{key} not run"
    if rec["status"] != "ok":
        return f"{rec['name']}: {rec['status']}"
    return f"{rec['name']}: no trial"


def _verdicts(peers: list[dict[str, Any]], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Each target cell: MET / MISSED / not measured, for each of the issue's four comparisons."""
    checks = ("req/s >= Triton", "req/s >= 3x MLServer", "req/s >= 3x MLServer (parallel_workers 0)", "p99 <= Triton")
    cells = []
    for encoding in TARGET_ENCODINGS:
        for concurrency in TARGET_CONCURRENCY:
            quiver = _trial(peers, QUIVER, encoding, concurrency)
            triton = _trial(peers, TRITON, encoding, concurrency)
            ml, ml_basis = _mlserver_basis(peers, MLSERVER, encoding, concurrency)
            ml0, ml0_basis = _mlserver_basis(peers, MLSERVER0, encoding, concurrency)
            cell: dict[str, Any] = {
                "encoding": encoding, "concurrency": concurrency,
                "quiver_req_per_s": _rps(quiver), "triton_req_per_s": _rps(triton),
                "mlserver_req_per_s": _rps(ml), "mlserver_basis": ml_basis,
                "mlserver_workers0_req_per_s": _rps(ml0), "mlserver_workers0_basis": ml0_basis,
                "quiver_p99_ms": _p99(quiver), "triton_p99_ms": _p99(triton), "checks": {},
            }

            def judge(ours: float | None, theirs: float | None, factor: float, higher: bool,
                      other: str, ours_trial: dict[str, Any] | None = quiver,
                      their_trial: dict[str, Any] | None = None) -> dict[str, Any]:
                if ours_trial is None:
                    return {"verdict": "NOT MEASURED", "why": _why_missing(peers, QUIVER)}
                if theirs is None or ours is None:
                    return {"verdict": "NOT MEASURED", "why": _why_missing(peers, other)}
                if their_trial is not None and their_trial.get("errors"):
                    # A peer answering errors fast would flatter its rate and tail.
                    return {"verdict": "NOT MEASURED", "why": f"{other} had {their_trial['errors']} errors"}
                ratio = ours / theirs
                met = ours >= factor * theirs if higher else ours <= theirs
                verdict: dict[str, Any] = {"verdict": "MET" if met else "MISSED", "ratio": ratio}
                if ours_trial["errors"]:
                    verdict.update(verdict="MISSED", why=f"Quiver had {ours_trial['errors']} errors")
                return verdict

            cell["checks"][checks[0]] = judge(_rps(quiver), _rps(triton), 1.0, True, TRITON, their_trial=triton)
            cell["checks"][checks[1]] = judge(_rps(quiver), _rps(ml), 3.0, True, MLSERVER, their_trial=ml)
            cell["checks"][checks[2]] = judge(_rps(quiver), _rps(ml0), 3.0, True, MLSERVER0, their_trial=ml0)
            cell["checks"][checks[3]] = judge(_p99(quiver), _p99(triton), 1.0, False, TRITON, their_trial=triton)
            if encoding != ml_basis or encoding != ml0_basis:
                cell["note"] = "MLServer has no binary tensor extension: judged against its HTTP JSON number"
            cells.append(cell)
    summary = []
    for check in checks:
        verdicts = [(c, c["checks"][check]["verdict"]) for c in cells]
        met = [c for c, v in verdicts if v == "MET"]
        missed = [f"{ENCODING_LABEL[c['encoding']]} c={c['concurrency']}" for c, v in verdicts if v == "MISSED"]
        unmeasured = sum(1 for _, v in verdicts if v == "NOT MEASURED")
        text = f"{check}: MET in {len(met)} of {len(cells)} cells"
        if missed:
            text += f"; MISSED in {', '.join(missed)}"
        if unmeasured:
            text += f"; {unmeasured} not measured"
        summary.append(text)
    return cells, summary


# -- the Quiver-only workloads (existing scripts as subprocesses) ---------------------------


def _script_argv(workload: str, args: argparse.Namespace, out: Path) -> tuple[str, list[str], str]:
    """(the benchmark's module, its arguments, the JSON it writes) with modest settings (smaller
    with --quick)."""
    d, w = args.duration, args.warmup
    if workload == "resnet":
        batches = "1,8,16" if args.quick else "1,2,4,8,12,16,24,32"
        return "benchmarks.batching", [
            "--concurrency", "16", "--variants", "none,0",
            "--duration", f"{max(2.0, 2 * d):g}", "--warmup", f"{max(2.0, 4 * w):g}",
            "--ceiling-batches", batches, "--ceiling-seconds", "1" if args.quick else "2",
            "--output-dir", str(out),
        ], "batching.json"
    if workload == "text":
        return "benchmarks.pipelines", [
            "--pipelines", "text_pipeline",
            "--text-concurrency", ",".join(map(str, args.concurrency)),
            "--floor-batch", "8,32",
            "--duration", f"{max(2.0, d):g}", "--warmup", f"{max(1.0, 2 * w):g}",
            "--output-dir", str(out),
        ], "pipelines.json"
    if workload == compare_workers.WORKLOAD:
        return compare_workers.script_argv(args.frontend_workers, d, w, args.quick, out)
    models, resident, requests = (60, 10, 200) if args.quick else (300, 30, 1500)
    return "benchmarks.multi_model", [
        "--models", str(models), "--resident", str(resident), "--requests", str(requests),
        "--output-dir", str(out),
    ], "multi_model.json"


def run_script_workload(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    out = args.output_dir / SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    module, script_args, json_name = _script_argv(workload, args, out)
    result_path = out / json_name
    result_path.unlink(missing_ok=True)  # never fold in a stale result
    log_path = out / f"{module.rpartition('.')[2]}.log"
    argv = [sys.executable, "-m", module, *script_args]
    rec: dict[str, Any] = {"module": module, "argv": script_args, "log": str(log_path),
                           "json": str(result_path), "status": "ok", "error": None}
    log(f"{workload}: {' '.join(['python', '-m', module, *script_args])}")
    began = time.monotonic()
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        _scripts.add(proc)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                sys.stderr.write(f"  [{workload}] {line.decode(errors='replace')}")
            code = proc.wait()
        finally:
            _stop_group(proc)  # the server it started, if anything is left
    rec["exit_code"] = code
    rec["elapsed_s"] = round(time.monotonic() - began, 1)
    if code != 0:
        rec.update(status="failed", error=f"exit code {code}; see {log_path}")
    try:
        rec["data"] = json.loads(result_path.read_text())
    except (OSError, ValueError) as exc:
        rec.update(status="failed", error=(rec["error"] or "") + f" (no result: {exc})")
        return rec
    try:
        rec["summary"] = SUMMARIES[workload](rec["data"])
    except (LookupError, TypeError, ValueError, ZeroDivisionError) as exc:
        rec.update(status="failed", error=f"cannot read {result_path.name}: {type(exc).__name__}: {exc}")
    if workload == "multi-model":  # the per-request arrays stay in multi_model.json
        rec["data"].pop("per_request", None)
    return rec


def _summary_resnet(data: dict[str, Any]) -> dict[str, Any]:
    ceiling = data["ceiling"]["best_images_per_s"]
    at16 = [r for r in data["results"] if r["concurrency"] == 16]
    batched = [r for r in at16 if r["variant"] != "no dynamic batching"]
    plain = [r for r in at16 if r["variant"] == "no dynamic batching"]
    best = max(batched, key=lambda r: r["req_per_s"], default=None)
    summary: dict[str, Any] = {
        "ceiling_images_per_s": ceiling, "ceiling_batch": data["ceiling"]["best_batch_size"],
        "target_pct": RESNET_TARGET_PCT,
        "rows": [{"variant": r["variant"], "req_per_s": r["req_per_s"], "pct_of_ceiling": 100 * r["req_per_s"] / ceiling,
                  "mean_batch": r.get("mean_batch"), "p99_ms": r["p99_ms"], "errors": r["errors"]} for r in at16],
    }
    if plain:
        summary["no_batching_pct"] = 100 * plain[0]["req_per_s"] / ceiling
    if best is not None:
        pct = 100 * best["req_per_s"] / ceiling
        summary.update(best_variant=best["variant"], batching_pct=pct,
                       verdict="MET" if pct >= RESNET_TARGET_PCT and not best["errors"] else "MISSED")
    return summary


def _summary_text(data: dict[str, Any]) -> dict[str, Any]:
    rows = [r for r in data["rows"] if r["pipeline"] == "text_pipeline"]
    floors = {r["target"]: r for r in rows if r["target"].startswith("floor")}
    floor1 = next((r for t, r in floors.items() if t.endswith("batch 1")), None)
    floor_big = next((r for t, r in floors.items() if not t.endswith("batch 1")), None)
    servers = [r for r in rows if not r["target"].startswith("floor")]
    best = max(servers, key=lambda r: r["req_per_s"], default=None)
    return {
        "floor_batch1_req_per_s": floor1 and floor1["req_per_s"],
        "floor_batched": floor_big and {"target": floor_big["target"], "req_per_s": floor_big["req_per_s"]},
        "rows": [{"concurrency": r["concurrency"], "req_per_s": r["req_per_s"], "p99_ms": r["p99_ms"],
                  "errors": r["errors"], "mean_batch": r["mean_batch"],
                  "vs_floor_batch1": _div(r["req_per_s"], floor1 and floor1["req_per_s"]),
                  "vs_floor_batched": _div(r["req_per_s"], floor_big and floor_big["req_per_s"])} for r in servers],
        "best_concurrency": best and best["concurrency"],
        "best_vs_floor_batch1": best and _div(best["req_per_s"], floor1 and floor1["req_per_s"]),
        "best_vs_floor_batched": best and _div(best["req_per_s"], floor_big and floor_big["req_per_s"]),
    }


def _summary_multi(data: dict[str, Any]) -> dict[str, Any]:
    keys = ("models", "resident", "requests", "zipf", "distinct_models_requested", "most_models_loaded_at_once",
            "server_hit_rate", "lru_simulated_hit_rate", "belady_hit_rate", "loads", "evictions",
            "requests_per_second", "hit_ms", "miss_ms", "cold_floor_ms", "server_exit_code")
    summary = {k: data.get(k) for k in keys}
    summary["vs_lru"] = _div(data["server_hit_rate"], data["lru_simulated_hit_rate"])
    summary["vs_belady"] = _div(data["server_hit_rate"], data["belady_hit_rate"])
    return summary


SUMMARIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "resnet": _summary_resnet, "text": _summary_text, "multi-model": _summary_multi,
    compare_workers.WORKLOAD: compare_workers.summary,
}


# -- the report -----------------------------------------------------------------------------


_table = common.markdown_table


def _cell(check: dict[str, Any]) -> str:
    if check["verdict"] == "NOT MEASURED":
        return f"not measured ({check['why']})"
    text = f"**{check['verdict']}** ({_ratio(check['ratio'])})"
    if check.get("why"):
        text += f", {check['why']}"
    return text


def markdown(report: dict[str, Any]) -> str:
    env, settings = report["environment"], report["settings"]
    lines = [
        "# Quiver next to Triton and MLServer: one run, same machine, same model, same load",
        "",
        f"- Date: {env['date']}",
        f"- Machine: {env['nproc']} cores, {env['cpu_model']} ({env['platform']}), no GPU; "
        f"load average at start {report['load_avg_start']}",
        f"- Command: `{report['command']}`",
        f"- Run time: {report['elapsed_s'] / 60:.1f} min",
        "- Versions: " + "; ".join(f"{k}: {v}" for k, v in report["versions"].items()),
        f"- Trials: {settings['warmup_s']:g} s warm-up then {settings['duration_s']:g} s measured per "
        f"(peer, encoding, concurrency), with `benchmarks/loadgen.py` (one process, one uvloop loop; HTTP: one "
        "keep-alive connection per concurrent request; gRPC: one channel, N callers); every status "
        "checked and one answer in 50 compared with INPUT0 * 2. CPU % is of one core (the whole machine is "
        f"{env['nproc'] * 100}%); client and server share the cores, so every number here is a "
        "client+server-on-one-box number.",
        "",
    ]
    tiny = report["workloads"].get("tiny")
    if tiny is not None:
        lines += _markdown_tiny(tiny, settings)
    titles = {"resnet": "ResNet-50 dynamic batching", "text": "Text pipeline (tokenizer -> MiniLM -> pooling)",
              "multi-model": "Multi-model (Zipf over many models, memory for a few)",
              compare_workers.WORKLOAD: "Frontend workers: scaling and CPU per request (tiny model)"}
    if any(key in report["workloads"] for key in titles):
        lines += [
            "## Quiver-only workloads", "",
            "Quiver alone, against in-process floors and simulations rather than other servers: Triton's pip "
            "build (nvidia-pytriton's tritonserver) has only the Python backend (no ONNX Runtime or PyTorch "
            "backend, so no ResNet-50 or MiniLM as Triton would serve them), and MLServer serves neither "
            "Triton repositories, ensembles nor on-demand model loading under a memory budget. Each runs "
            "the existing script as a subprocess with modest settings; its own report is in "
            f"`{SUBDIR}/`.", "",
        ]
    for key, title in titles.items():
        rec = report["workloads"].get(key)
        if rec is not None:
            lines += _markdown_script(key, title, rec)
    return "\n".join(lines) + "\n"


def _markdown_tiny(tiny: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    peers = tiny["peers"]
    lines = [
        "## Tiny model (INPUT0 FP32 [1, 16] -> INPUT0 * 2)",
        "",
        "Every peer serves the same function: Quiver and Triton the same `config.pbtxt` and `model.py` "
        "(Triton Python backend API), Quiver also an ONNX graph (one `Mul`), MLServer a custom `MLModel` "
        "runtime with its NumPy codec. Verdicts compare Quiver's Python model with Triton's Python model "
        "(same model kind); the ONNX rows are extra information. The verdicts use the loadgen numbers; "
        "perf_analyzer's, further down, are a second opinion from an independent client. "
        "`MLServer pw0`: MLServer with `parallel_workers: 0` (inference in the main process); plain "
        "`MLServer` is its default (one worker process).",
        "",
        f"### The issue's targets: {TARGET}",
        "",
    ]
    rows = []
    for cell in tiny["verdicts"]:
        checks = cell["checks"]
        basis = " (its JSON number)" if cell["mlserver_basis"] != cell["encoding"] else ""
        basis0 = " (its JSON number)" if cell["mlserver_workers0_basis"] != cell["encoding"] else ""
        rows.append([
            ENCODING_LABEL[cell["encoding"]], str(cell["concurrency"]),
            _num(cell["quiver_req_per_s"]), _num(cell["triton_req_per_s"]),
            _num(cell["mlserver_req_per_s"]) + basis, _num(cell["mlserver_workers0_req_per_s"]) + basis0,
            _num(cell["quiver_p99_ms"], 3), _num(cell["triton_p99_ms"], 3),
            *(_cell(check) for check in checks.values()),
        ])
    lines += _table(
        ["encoding", "c", "Quiver req/s", "Triton req/s", "MLServer req/s", "MLServer pw0 req/s",
         "Quiver p99 ms", "Triton p99 ms", *next(iter(tiny["verdicts"]), {"checks": {}})["checks"].keys()],
        rows, "lr" + "r" * 6 + "l" * 4,
    )
    lines += ["", *(f"- {line}" for line in tiny["verdict_summary"])]
    if any(c.get("note") for c in tiny["verdicts"]):
        lines.append("- MLServer has no binary tensor extension (HTTP binary is n/a for it): in the HTTP binary "
                     "rows Quiver's binary number is compared with MLServer's HTTP JSON number.")
    if tiny.get("workers_verdicts"):
        lines += ["", *compare_workers.markdown(tiny["workers_verdicts"], settings.get("frontend_workers", 2))]
    lines += [
        "",
        "### Ratios (loadgen)",
        "",
        "Quiver's req/s divided by each peer's at the same encoding and concurrency (above 1: Quiver "
        "serves more), and Quiver's p99 divided by Triton's (below 1: Quiver's tail is shorter). "
        "`*`: MLServer's HTTP JSON number (it has no binary).",
        "",
    ]
    rows = []
    for r in tiny["ratios"]:
        star = "*" if r["mlserver_basis"] != r["encoding"] else ""
        star0 = "*" if r["mlserver_workers0_basis"] != r["encoding"] else ""
        rows.append([
            ENCODING_LABEL[r["encoding"]], str(r["concurrency"]),
            _ratio(r["quiver_python_vs_triton"]), _ratio(r["quiver_python_vs_mlserver"]) + star,
            _ratio(r["quiver_python_vs_mlserver_workers0"]) + star0, _ratio(r["quiver_python_p99_vs_triton"]),
            _ratio(r["quiver_onnx_vs_triton"]), _ratio(r["quiver_onnx_vs_mlserver"]) + star,
            _ratio(r["quiver_onnx_vs_mlserver_workers0"]) + star0, _ratio(r["quiver_onnx_p99_vs_triton"]),
        ])
    lines += _table(
        ["encoding", "c", "Quiver (python) / Triton", "/ MLServer", "/ MLServer pw0", "p99 / Triton's",
         "Quiver (onnx) / Triton", "/ MLServer", "/ MLServer pw0", "p99 / Triton's"],
        rows, "lr" + "r" * 8,
    )
    lines += ["", "### Absolute numbers (loadgen)", ""]
    rows = []
    for rec in peers:
        if rec["status"] not in ("ok", "died"):
            rows.append([rec["name"], f"{rec['status']}: {rec['error']}", *["-"] * 9])
            continue
        for encoding in settings["encodings"]:
            sanity = rec["sanity"].get(encoding, "-")
            if sanity != "ok":
                rows.append([rec["name"], ENCODING_LABEL[encoding], sanity, *["-"] * 8])
                continue
            for t in rec["trials"]:
                if t["encoding"] != encoding:
                    continue
                rows.append([
                    rec["name"], ENCODING_LABEL[encoding], str(t["concurrency"]), _num(t["req_per_s"]),
                    _num(t["p50_ms"], 3), _num(t["p90_ms"], 3), _num(t["p99_ms"], 3), str(t["errors"]),
                    _num(t["client_cpu_pct"]), _num(t["server_cpu_pct"]),
                    (t["first_error"] or "")[:120],
                ])
    lines += _table(["peer", "encoding", "c", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors",
                     "client CPU %", "server CPU %", "first error"], rows, "ll" + "r" * 8 + "l")
    floors = tiny["floors"]
    lines += ["", "In-process floors (no server, no network; the cost of the model alone): " + "; ".join(
        f"{label}: {f['calls_per_s']:,.0f} calls/s ({f['us_per_call']:.2f} us per call)" for label, f in floors.items()
    ) + "."]

    pa = tiny["perf_analyzer"]
    lines += ["", "### perf_analyzer (Triton's own client, a second opinion)", ""]
    if pa["status"] != "ok":
        lines.append(f"perf_analyzer: {pa['status']}" + (f": {pa['error']}" if pa.get("error") else ""))
    else:
        lines.append(
            "perf_analyzer 2.60.0 from PyPI through a private Debian 13 loader (`benchmarks/perf_analyzer.py`); "
            "HTTP with binary tensors (its default; JSON tensors for MLServer), gRPC with raw tensors; "
            f"measurement windows of {max(500, round(settings['duration_s'] * 1000 / 3))} ms until three agree "
            "within 50% (at most 6). Client CPU % is perf_analyzer's CPU time over its wall time."
        )
        lines.append("")
        rows = []
        for rec in peers:
            for r in rec["perf_analyzer"]:
                label = f"{r['protocol'].upper()} ({r['tensors']})"
                if "error" in r:
                    error = r["error"] if r["error"].startswith("n/a") else f"error: {r['error'][:160]}"
                    rows.append([rec["name"], label, str(r["concurrency"]), error, *["-"] * 4])
                    continue
                cpu = 100 * r["client_cpu_s"] / r["wall_s"] if r.get("wall_s") else None
                rows.append([rec["name"], label, str(r["concurrency"]), _num(r["req_per_s"]), _num(r["p50_ms"], 3),
                             _num(r["p90_ms"], 3), _num(r["p99_ms"], 3), _num(cpu)])
        lines += _table(["peer", "protocol", "c", "req/s", "p50 ms", "p90 ms", "p99 ms", "client CPU %"], rows,
                        "llr" + "r" * 5)
        lines += ["", "Ratios by perf_analyzer's numbers:", ""]
        rows = [[r["protocol"].upper(), str(r["concurrency"]), _ratio(r["quiver_python_vs_triton"]),
                 _ratio(r["quiver_python_vs_mlserver"]), _ratio(r["quiver_python_vs_mlserver_workers0"]),
                 _ratio(r["quiver_python_p99_vs_triton"]), _ratio(r["quiver_onnx_vs_triton"]),
                 _ratio(r["quiver_onnx_p99_vs_triton"])] for r in tiny["perf_analyzer_ratios"]]
        lines += _table(["protocol", "c", "Quiver (python) / Triton", "/ MLServer", "/ MLServer pw0",
                         "p99 / Triton's", "Quiver (onnx) / Triton", "p99 / Triton's"], rows, "lr" + "r" * 6)

    lines += ["", "### Peers", ""]
    rows = []
    for rec in peers:
        server = rec["server"] or {}
        version = f"{server.get('name', '')} {server.get('version', '')}".strip() or "-"
        notes = "; ".join(rec["notes"])[:300]
        rows.append([rec["name"], rec["status"] if rec["status"] == "ok" else f"**{rec['status']}**: {rec['error']}",
                     version, rec["packages"] or "-", _num(rec["setup_s"], 1), _num(rec["start_s"], 1),
                     _num(rec["load_avg_end"], 1), notes])
    lines += _table(["peer", "status", "server (GET /v2)", "installed from", "setup s", "start s",
                     "load avg after", "notes"], rows, "llllrrrl")
    lines += ["", "`load avg after`: the machine's 1-minute load average when the peer's last trial ended; "
              "the peers run one after another, so work from other processes in between shows here."]
    return [*lines, ""]


def _markdown_script(key: str, title: str, rec: dict[str, Any]) -> list[str]:
    lines = [f"### {title}", "",
             f"`python -m {rec['module']} {' '.join(rec['argv'])}` ({rec.get('elapsed_s', '-')} s; "
             f"full output in `{Path(rec['json']).parent.name}/{Path(rec['json']).name}`).", ""]
    if rec["status"] != "ok":
        lines += [f"**{rec['status']}**: {rec['error']}", ""]
    summary = rec.get("summary")
    if summary is None:
        return lines
    if key == "resnet":
        rows = [[r["variant"], _num(r["req_per_s"], 1), f"{r['pct_of_ceiling']:.0f}%", _num(r["mean_batch"], 1),
                 _num(r["p99_ms"]), str(r["errors"])] for r in summary["rows"]]
        lines += [f"In-process ceiling: {summary['ceiling_images_per_s']:.1f} images/s (onnxruntime, best batch size "
                  f"{summary['ceiling_batch']}). Quiver over HTTP (binary tensors), concurrency 16:", ""]
        lines += _table(["server", "req/s", "% of ceiling", "mean batch", "p99 ms", "errors"], rows, "lrrrrr")
        if "batching_pct" in summary:
            lines += ["", f"- Target: dynamic batching at c=16 >= {RESNET_TARGET_PCT:.0f}% of the best in-process "
                      f"throughput: **{summary['verdict']}** ({summary['batching_pct']:.0f}%, {summary['best_variant']}; "
                      f"without dynamic batching {summary.get('no_batching_pct', 0):.0f}%)."]
    elif key == "text":
        rows = [[str(r["concurrency"]), _num(r["req_per_s"], 1), _num(r["p99_ms"], 1), _num(r["mean_batch"], 1),
                 str(r["errors"]), _ratio(r["vs_floor_batch1"]), _ratio(r["vs_floor_batched"])] for r in summary["rows"]]
        batched = summary["floor_batched"] or {}
        lines += [f"In-process floor (the same steps called in-process, no server): batch 1 "
                  f"{_num(summary['floor_batch1_req_per_s'], 1)} req/s, batch "
                  f"{batched.get('target', '?').rsplit(' ', 1)[-1]} {_num(batched.get('req_per_s'), 1)} req/s "
                  "(what perfect batching could reach). Quiver over HTTP (binary tensors):", ""]
        lines += _table(["c", "req/s", "p99 ms", "MiniLM mean batch", "errors", "/ floor batch 1", "/ floor batched"],
                        rows, "rrrrrrr")
        lines += ["", f"- Best: c={summary['best_concurrency']}, {_ratio(summary['best_vs_floor_batch1'])} the "
                  f"in-process batch-1 floor, {_ratio(summary['best_vs_floor_batched'])} the batched floor."]
    elif key == compare_workers.WORKLOAD:
        lines += compare_workers.markdown_script(summary)
    else:
        s = summary
        rows = [
            ["hit rate, Quiver (on_demand, default eviction policy)", f"{s['server_hit_rate']:.3f}"],
            ["hit rate, LRU simulated on the same trace", f"{s['lru_simulated_hit_rate']:.3f}"],
            ["hit rate, offline optimum (Belady MIN)", f"{s['belady_hit_rate']:.3f}"],
            ["Quiver / LRU simulated", _ratio(s["vs_lru"])],
            ["Quiver / Belady", _ratio(s["vs_belady"])],
            ["hit / miss latency p50 ms", f"{s['hit_ms']['p50']:.2f} / {s['miss_ms']['p50']:.2f}"],
            ["loads / evictions", f"{s['loads']} / {int(s['evictions'])}"],
        ]
        lines += [f"Zipf({s['zipf']}) over {s['models']} models, memory for {s['resident']} "
                  f"(at most {s['most_models_loaded_at_once']} loaded at once), {s['requests']} requests one at a time:", ""]
        lines += _table(["measure", "value"], rows, "lr")
    return [*lines, ""]


# -- main -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(
            "Quiver side by side with real Triton and real MLServer on this machine: same model, same load "
            "generator, one run; reports ratios and the issue's targets as MET / MISSED. Writes "
            "OUTPUT_DIR/compare.{json,md,png}."
        ),
    )
    parser.add_argument("--workloads", type=_csv(WORKLOADS), default=list(WORKLOADS), metavar="W,W",
                        help=f"of {','.join(WORKLOADS)} (default: all)")
    parser.add_argument("--peers", type=_csv(PEERS), default=list(PEERS), metavar="P,P",
                        help=f"servers for the tiny workload, of {','.join(PEERS)} (default: all)")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8, 32], metavar="N,N", help="default: 1,8,32")
    parser.add_argument("--encodings", type=_csv(ENCODINGS), default=list(ENCODINGS), metavar="E,E",
                        help="json and binary (HTTP), grpc (default: all)")
    parser.add_argument("--frontend-workers", type=int, default=compare_workers.default_workers(), metavar="N",
                        help="--frontend-workers of the quiver-*-workers peers; the frontend-workers workload runs "
                             "0, 2 .. N+2 (default: the cores this process may use, at least 2)")
    parser.add_argument("--duration", type=float, default=5.0, metavar="S", help="measured seconds per trial (default: 5)")
    parser.add_argument("--warmup", type=float, default=1.0, metavar="S", help="warm-up seconds per trial (default: 1)")
    parser.add_argument("--perf-analyzer", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure every peer with Triton's perf_analyzer (default: on)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS, metavar="DIR",
                        help="where compare.{json,md,png} go; the side workloads' own results go to "
                             f"DIR/{SUBDIR}/ (default: benchmarks/results)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 s trials after 0.5 s of warm-up (overrides --duration and --warmup), "
                             "small side workloads")
    parser.add_argument("--plot-from", type=Path, default=None, metavar="JSON",
                        help="only draw JSON's plot (a PNG beside it) from an earlier compare.json, with the "
                             "plotting venv")
    return parser


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    args.output_dir = args.output_dir.resolve()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "compare",
        "command": common.command_line(),
        "environment": common.environment(("quiver", "onnxruntime", "onnx", "numpy", "tritonclient", "grpcio", "uvloop")),
        "load_avg_start": " / ".join(f"{v:.2f}" for v in os.getloadavg()),
        "settings": {
            "workloads": args.workloads, "peers": args.peers, "concurrency": args.concurrency,
            "encodings": args.encodings, "duration_s": args.duration, "warmup_s": args.warmup,
            "perf_analyzer": args.perf_analyzer, "quick": args.quick, "frontend_workers": args.frontend_workers,
        },
        "target": TARGET,
        "workloads": {},
    }
    log(f"workloads {','.join(args.workloads)}; peers {','.join(args.peers)}; encodings "
        f"{','.join(args.encodings)}; concurrency {','.join(map(str, args.concurrency))}; "
        f"{args.warmup:g} s + {args.duration:g} s per trial")
    if "tiny" in args.workloads:
        report["workloads"]["tiny"] = run_tiny(args)
    for workload in ("resnet", "text", "multi-model", compare_workers.WORKLOAD):
        if workload in args.workloads:
            report["workloads"][workload] = run_script_workload(workload, args)
    report["versions"] = _versions(report)
    report["elapsed_s"] = round(time.monotonic() - started, 1)

    json_path = args.output_dir / "compare.json"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path = args.output_dir / "compare.md"
    md_path.write_text(markdown(report))
    log(f"wrote {md_path} and {json_path}")
    if report["workloads"].get("tiny"):
        log(f"plot: {common.plot_in_venv('compare', json_path, json_path.with_suffix('.png'))}")
    tiny = report["workloads"].get("tiny")
    if tiny:
        for line in tiny["verdict_summary"]:
            log(f"target: {line}")
    failed = [rec["name"] for rec in (tiny or {}).get("peers", []) if rec["status"] != "ok"]
    failed += [k for k, v in report["workloads"].items() if k != "tiny" and v["status"] != "ok"]
    if failed:
        log(f"not everything ran: {', '.join(failed)} (see the report)")
    log(f"done in {report['elapsed_s'] / 60:.1f} min")
    return 0


def _versions(report: dict[str, Any]) -> dict[str, str]:
    env = report["environment"]
    versions = {"Python": env["python"], "quiver": env["quiver"], "onnxruntime": env["onnxruntime"]}
    tiny = report["workloads"].get("tiny")
    if tiny:
        for rec in tiny["peers"]:
            label = {TRITON: "triton", MLSERVER: "mlserver", MLSERVER0: "mlserver"}.get(rec["key"])
            if label is None or (label in versions and rec["status"] != "ok"):
                continue
            server = rec.get("server") or {}
            served = f"{server.get('name', '?')} {server.get('version', '?')}" if server else rec["status"]
            versions[label] = f"{served} ({(rec['packages'] or rec['error']).split(' (')[0]})"
        pa = tiny["perf_analyzer"]
        versions["perf_analyzer"] = (pa.get("versions") or {}).get("perf-analyzer", pa["status"])
    return versions


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_from is not None:
        return common.plot_from("compare", args.plot_from, args.plot_from.with_suffix(".png"))
    if args.quick:
        args.duration, args.warmup = 1.0, 0.5
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        return run(args)
    except KeyboardInterrupt:
        signum = _signal_received or signal.SIGINT
        log(f"interrupted ({signal.Signals(signum).name}): stopping every server")
        return 128 + signum
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second interrupt in the middle of cleaning up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _cleanup()


if __name__ == "__main__":
    sys.exit(main())
