"""What a Python model's worker process costs: the ``tiny`` Python model (``peers/tiny.py``) round
trip in a worker (Quiver's default), in the server's process (``--backend-config=python,
in-process=true``, the model's ``EXECUTE_ON_EVENT_LOOP`` fast path) and in Triton's Python backend
(its stub process; the real ``tritonserver`` of ``peers/triton.py``), all in one run.

Three measurements:

- **over the wire**: ``benchmarks/loadgen.py`` trials (HTTP with the binary extension, gRPC) at
  each concurrency, against each server started in turn; latency percentiles and throughput,
  the CPU per request of the server and of its model's process, and the time per request inside
  the server's inference core from each server's own statistics (``/v2/models/tiny/stats``:
  scheduler, hand-over and round trip to the model's process, without the HTTP or gRPC frontend,
  whose speed differs between the servers for reasons of its own);
- **placed alike**: HTTP binary at concurrency 1 and paced with Quiver's worker and Triton's stub
  each placed on the vCPUs the same way (``--placements``, ``--repeat`` rounds taken in turn): left
  to itself the scheduler puts a worker on its server's vCPU or on another one, run by run, and
  that choice moves the CPU a request costs more than either server's code does;
- **the hop alone**: the backend's ``run()`` called in this process for one request, in a
  worker vs in-process, without HTTP; what the process boundary adds (shared-memory write, two
  control messages, copy out).

``--baseline DIR`` adds Quiver's worker from another checkout's ``src`` folder (before a change)
to the wire trials and to every placed round, for before/after figures from the same run;
``--ungated`` adds Quiver's worker whose server spins for its answers whatever the machine's CPU
pressure (``answer-spin-pressure=100``; by default it spins only while tasks waited for a CPU
less than 10% of the last 10 seconds, which other jobs on a shared machine often exceed).

Run: ``python -m benchmarks.python_worker`` (``--help``); writes ``results/python_worker.md`` and
``.json`` (``--output-name``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from benchmarks import common, loadgen
from benchmarks.peers import WORK as PEERS_HOME
from benchmarks.peers import PeerError, tiny
from benchmarks.peers.quiver import QuiverServer
from quiver.ipc.inbox import cpu_pressure

RESULTS = Path(__file__).parent / "results"
IN_PROCESS = "--backend-config=python,in-process=true"
SPINNING = "quiver worker, spinning"
TRITON = "triton (python backend stub)"
BASELINE = "quiver worker, baseline"
UNGATED = "quiver worker, spin ungated"
#: The server's spin for a worker's answer whatever the machine's CPU pressure (``--ungated``).
UNGATED_FLAG = "--backend-config=python,answer-spin-pressure=100"
NO_ANSWER_SPIN = "quiver worker, no answer spin"
#: The server's event loop sleeps while its worker runs (``--no-answer-spin``).
NO_ANSWER_SPIN_FLAG = "--backend-config=python,answer-spin-microseconds=0"
PLACEMENTS = ("same", "split")


def log(message: str) -> None:
    print(f"[python_worker] {message}", file=sys.stderr, flush=True)


def _repository(folder: Path) -> Path:
    repository = folder / "repository"
    version = repository / tiny.MODEL / "1"
    version.mkdir(parents=True, exist_ok=True)
    (repository / tiny.MODEL / "config.pbtxt").write_text(tiny.EVENT_LOOP_PYTHON_CONFIG)
    (version / "model.py").write_text(tiny.PYTHON_MODEL)
    return repository


def _payload() -> loadgen.Payload:
    x = np.arange(16, dtype=np.float32).reshape(tiny.SHAPE) / 4 - 1
    return loadgen.Payload(tiny.MODEL, {tiny.INPUT: x}, expected={tiny.OUTPUT: x * 2})


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``, its ended threads included: its CPU-time
    clock where Linux offers it (nanoseconds), else psutil (clock ticks); 0 once it is gone."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        with contextlib.suppress(psutil.Error):
            return float(sum(psutil.Process(pid).cpu_times()[:2]))
    return 0.0


def _children_cpu(pid: int | None) -> float:
    """CPU seconds of ``pid``'s live child processes (the Python workers of a Quiver server)."""
    if pid is None:
        return 0.0
    total = 0.0
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            total += _cpu_seconds(child.pid)
    return total


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (the threads it starts later inherit it)."""
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task), cpus)


def _place(server_pid: int, placement: str, cpus: list[int]) -> None:
    """The server's threads on the first vCPU, its child processes (Quiver's workers, Triton's
    stubs) on the same one (``same``) or the second (``split``), this load generator on the
    second: the same placement for every server."""
    first, second = {cpus[0]}, {cpus[1]}
    _pin(server_pid, first)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(server_pid).children(recursive=True):
            _pin(child.pid, first if placement == "same" else second)
    _pin(os.getpid(), second)


#: The statistics extension's counters read around a trial: (section, field) of ``inference_stats``.
_STATS = (("success", "count"), ("success", "ns"), ("queue", "ns"), ("compute_input", "ns"),
          ("compute_infer", "ns"), ("compute_output", "ns"))


def _model_stats(http: str | None) -> dict[str, int]:
    """The tiny model's cumulative inference statistics (``GET /v2/models/tiny/stats``, the same
    extension on both servers); empty if they cannot be read."""
    if http is None:
        return {}
    try:
        with urllib.request.urlopen(f"http://{http}/v2/models/{tiny.MODEL}/stats", timeout=5) as response:
            body = json.loads(response.read())
        stats = body["model_stats"][0]["inference_stats"]
        return {f"{section}.{field}": int(stats[section][field]) for section, field in _STATS}
    except (OSError, ValueError, LookupError, TypeError):
        return {}


def _core_times(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Per request over a trial, from the statistics: the time inside the server's inference core
    (``success``: from the model's scheduler taking the request to its answer, the frontend
    excluded), its queue part, and its compute part (input + infer + output: for Triton's Python
    backend, from the requests saved to the stub's shared memory through the stub's answer read
    back; for Quiver's worker, from the inputs written to its pool through the answer read back,
    less a wait in the worker behind another request), in us."""
    if not before or not after:
        return {}
    count = after["success.count"] - before["success.count"]
    if count <= 0:
        return {}

    def per(*keys: str) -> float:
        return sum(after[k] - before[k] for k in keys) / count / 1000

    return {"core_us": per("success.ns"), "queue_us": per("queue.ns"),
            "compute_us": per("compute_input.ns", "compute_infer.ns", "compute_output.ns")}


def _trial(
    name: str, endpoints: Any, encoding: str, concurrency: int, rate: float | None, args: argparse.Namespace,
    **extra: Any,
) -> dict[str, Any]:
    """One loadgen trial, with the CPU per request of the server's process and of its workers,
    and the time per request inside the server's inference core (its statistics)."""
    marks: dict[str, float] = {}
    stats: dict[str, dict[str, int]] = {}

    def mark(when: str) -> None:
        # the workers' CPU read nearest the window's edge (the server's own is read there too);
        # the statistics request then lies outside the window at its end, inside at its start
        if when == "end":
            marks[when] = _children_cpu(endpoints.pid)
            stats[when] = _model_stats(endpoints.http)
        else:
            stats[when] = _model_stats(endpoints.http)
            marks[when] = _children_cpu(endpoints.pid)

    result = loadgen.run_trial(
        *endpoints.address(encoding), encoding, concurrency, args.warmup, args.duration, _payload(),
        server_pid=endpoints.pid, progress=None, rate=rate,
        on_begin=lambda: mark("begin"), on_end=lambda: mark("end"),
    )
    row = {"server": name, **result.to_dict(), "rate": rate, **extra}
    row.update(_core_times(stats.get("begin", {}), stats.get("end", {})))
    # CPU per request over the measured window: the server's process, its workers
    if result.requests and result.server_cpu_s is not None:
        children = max(0.0, marks.get("end", 0.0) - marks.get("begin", 0.0))
        row["server_cpu_us"] = (result.server_cpu_s - children) / result.requests * 1e6
        row["worker_cpu_us"] = children / result.requests * 1e6
    paced = f" at {rate:g}/s" if rate else ""
    where = f" [{extra['placement']}]" if extra.get("placement") else ""
    log(f"{name}{where} {encoding} c={concurrency}{paced}: {result.req_per_s:.0f} req/s, p50 {result.p50_ms:.3f} ms, "
        f"CPU/request server {row.get('server_cpu_us', 0):.0f} us + workers {row.get('worker_cpu_us', 0):.0f} us, "
        f"errors {result.errors}")
    return row


def _trials(name: str, endpoints: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    payload = _payload()
    rows = []
    for encoding in args.encodings:
        loadgen.sanity_check(*endpoints.address(encoding), encoding, payload)
        # each concurrency as fast as the server answers; then, with --rate, one connection
        # paced at the same rate for every server (the same gaps between requests: how long a
        # process sleeps between two requests changes what waking it costs)
        plan: list[tuple[int, float | None]] = [(c, None) for c in args.concurrency]
        plan += [(1, float(args.rate))] if args.rate else []
        for concurrency, rate in plan:
            rows.append(_trial(name, endpoints, encoding, concurrency, rate, args))
    return rows


def _placed(name: str, endpoints: Any, args: argparse.Namespace, cpus: list[int], round_: int) -> list[dict[str, Any]]:
    """HTTP binary at concurrency 1 and paced, the server placed as each of ``--placements`` says."""
    loadgen.sanity_check(*endpoints.address("binary"), "binary", _payload())
    rows = []
    for placement in args.placements:
        _place(endpoints.pid, placement, cpus)
        for rate in [None] + ([float(args.rate)] if args.rate else []):
            rows.append(_trial(name, endpoints, "binary", 1, rate, args, placement=placement, round=round_))
    return rows


def _placements(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """``--repeat`` rounds, each Quiver's worker then Triton's stub, at each placement."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return [], "needs two CPUs"
    rows: list[dict[str, Any]] = []
    error = ""
    try:
        for round_ in range(args.repeat):
            run = partial(_placed, args=args, cpus=cpus, round_=round_)
            rows += _quiver("quiver worker", (), args, run)
            if args.baseline:
                rows += _quiver(BASELINE, (), args, run, src=args.baseline)
            if args.ungated:
                rows += _quiver(UNGATED, (UNGATED_FLAG,), args, run)
            if not args.no_triton:
                placed, error = _triton(args, run)
                rows += placed
    finally:
        _pin(os.getpid(), set(cpus))
    return rows, error


Run = Callable[[str, Any], list[dict[str, Any]]]


def _quiver(
    name: str, flags: tuple[str, ...], args: argparse.Namespace, run: Run | None = None, src: Path | None = None
) -> list[dict[str, Any]]:
    """Quiver's trials (``src``: the ``src`` folder of the checkout to run, first on its path)."""
    folder = PEERS_HOME / "python_worker" / name.replace(" ", "_").replace(",", "")
    folder.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"} if src else None
    server = QuiverServer(_repository(folder), flags, log=folder / "server.log", cwd=folder,
                          ready_path=f"/v2/models/{tiny.MODEL}/ready", name=name, env=env)
    with server:
        return run(name, server.endpoints) if run else _trials(name, server.endpoints, args)


def _triton(args: argparse.Namespace, run: Run | None = None) -> tuple[list[dict[str, Any]], str]:
    from benchmarks.peers.triton import TritonPeer

    peer = TritonPeer()
    try:
        peer.setup()
        endpoints = peer.start(tiny.MODEL)
    except PeerError as exc:
        peer.stop()
        return [], str(exc)
    try:
        return (run(TRITON, endpoints) if run else _trials(TRITON, endpoints, args)), ""
    finally:
        peer.stop()


def _hop(calls: int) -> dict[str, Any]:
    """``run()`` of one request in a worker vs in-process, in this process, no HTTP."""
    from quiver.backends.base import SERVER, InstanceSpec, ModelFiles
    from quiver.backends.python import BACKEND
    from quiver.config import ModelConfig, parse_model_config
    from quiver.types import DataType, InferenceRequest, Tensor

    folder = Path(tempfile.mkdtemp(prefix="quiver-hop-"))
    repository = _repository(folder)
    path = repository / tiny.MODEL / "config.pbtxt"
    proto = parse_model_config(path.read_text(), path, tiny.MODEL)
    config = ModelConfig.from_proto(proto, str(path))
    files = ModelFiles(repository=repository, model_dir=repository / tiny.MODEL, version=1)
    spec = InstanceSpec(group=config.instance_groups[0], index=0)
    data = np.ones(tiny.SHAPE, dtype=np.float32)
    request = InferenceRequest(tiny.MODEL, "", [Tensor(tiny.INPUT, DataType.FP32, tiny.SHAPE, data)])
    out: dict[str, Any] = {}
    for mode, in_process in (("worker", "false"), ("in-process", "true")):
        SERVER.backend_config = {"python": {"in-process": in_process}}
        instance = BACKEND.create_instance(config, files, spec)

        async def measure(instance: Any = instance) -> tuple[list[float], float, float]:
            for _ in range(200):
                await instance.run([request])
            samples = []
            cpu, workers = time.process_time(), _children_cpu(os.getpid())
            for _ in range(calls):
                began = time.perf_counter_ns()
                await instance.run([request])
                samples.append((time.perf_counter_ns() - began) / 1000)
            return samples, time.process_time() - cpu, _children_cpu(os.getpid()) - workers

        samples, cpu, workers = common.run_async(measure())
        instance.unload()
        samples.sort()
        out[mode] = {
            "calls": calls,
            "p50_us": round(statistics.median(samples), 1),
            "p99_us": round(samples[int(len(samples) * 0.99) - 1], 1),
            "mean_us": round(statistics.fmean(samples), 1),
            "server_cpu_us": round(cpu / calls * 1e6, 1),
            "worker_cpu_us": round(workers / calls * 1e6, 1),
        }
        log(f"hop {mode}: p50 {out[mode]['p50_us']} us, CPU per call {out[mode]['server_cpu_us']} us "
            f"+ worker {out[mode]['worker_cpu_us']} us")
    return out


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# Python model round trip: worker process vs in-process vs Triton's stub",
        "",
        f"`{report['command']}`, {env['date']}, {env['nproc']} cores ({env['cpu_model']}), "
        f"Python {env.get('python', '')}. The `tiny` model (`OUTPUT0 = INPUT0 * 2`, FP32 [1, 16]); "
        f"each trial {report['settings']['warmup']} s warm-up then {report['settings']['duration']} s "
        "measured, `benchmarks/loadgen.py` (binary = HTTP with the binary tensor extension).",
        "",
        "CPU per request: the server's process and its child processes (Quiver's Python workers, "
        "Triton's stubs), user + system, over the measured window. A concurrency `1 at N/s` is "
        "one connection paced at at most N requests per second, the same for every server (about "
        "a millisecond between an answer and the next request): what a process costs per request "
        "depends on how long it sleeps between two (waking a sleeping process is most of a tiny "
        "model's cost), so that row compares the servers at equal gaps.",
        "",
        "In the server's core: the mean time per request from the model's scheduler taking it to its "
        "answer (the statistics extension's `success`, read before and after the window on each server: "
        "the frontend, HTTP or gRPC, is outside it), and its queue and compute parts. Compute is the round "
        "trip to the model's process: Triton's from the requests saved to the stub's shared memory through "
        "the stub's answer read back (the hand-over to its backend thread is queue time), Quiver's from the "
        "inputs written to the worker's pool through its answer read back (a request that waited in the "
        "worker behind another counts that wait as queue time). One difference favours Quiver by a few "
        "microseconds: Triton's frontend encodes the answer on the backend's thread before the request's "
        "statistics end, so Triton's time in the core holds that encoding; Quiver's does not.",
        "",
        "| server | encoding | concurrency | req/s | p50 ms | p99 ms | server CPU us/req | worker CPU us/req "
        "| in the core us/req (queue / compute) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["trials"]:
        paced = f" at {row['rate']:g}/s" if row.get("rate") else ""
        core = (f"{row['core_us']:.0f} ({row['queue_us']:.0f} / {row['compute_us']:.0f})"
                if row.get("core_us") is not None else "-")
        lines.append(
            f"| {row['server']} | {row['encoding']} | {row['concurrency']}{paced} | {row['req_per_s']:.0f} | "
            f"{common.dash(row['p50_ms'], '.3f')} | {common.dash(row['p99_ms'], '.3f')} | "
            f"{common.dash(row.get('server_cpu_us'), '.0f')} | {common.dash(row.get('worker_cpu_us'), '.0f')} | "
            f"{core} | {row['errors']} |"
        )
    if report.get("triton_error"):
        lines += ["", f"Triton did not run: {report['triton_error']}"]
    load = report.get("load_average")
    if load:
        lines += ["", f"Load average (1, 5, 15 min) before the run: {load['before']}, after: {load['after']}."]
    pressure = report["settings"].get("cpu_pressure")
    if pressure:
        lines += ["", f"CPU pressure (some avg10, % of the last 10 s with a task waiting for a CPU) before the run: "
                      f"{pressure['before']}, after: {pressure['after']}."]
    ratios = report.get("ratios") or []
    if ratios:
        lines += ["", "Quiver's worker over Triton's stub, same run (below 1: Quiver's is lower): p50 latency, "
                      "time in the core, worker (stub) CPU per request; and p50 over Quiver in-process:", ""]
        lines += ["| worker | encoding | concurrency | p50 / triton | in the core / triton | worker CPU / stub CPU "
                  "| p50 / quiver in-process |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in ratios:
            paced = f" at {r['rate']:g}/s" if r.get("rate") else ""
            lines.append(f"| {r.get('server', 'quiver worker')} | {r['encoding']} | {r['concurrency']}{paced} | "
                         f"{common.dash(r['vs_triton'], '.2f')} | {common.dash(r.get('core_vs_triton'), '.2f')} | "
                         f"{common.dash(r.get('worker_cpu_vs_triton'), '.2f')} | "
                         f"{common.dash(r['vs_in_process'], '.2f')} |")
    summary = report.get("placed_summary") or []
    if summary:
        rounds = report["settings"].get("repeat")
        lines += [
            "", f"Worker CPU per request with the servers placed alike (HTTP binary, one connection; "
            f"median of {rounds} rounds taken in turn, range in brackets; req/s the median): `same`: the "
            "server's threads and its workers (Triton: its stub) on one vCPU, the load generator on the "
            "other; `split`: the workers on the load generator's vCPU. Left to itself the scheduler "
            "picks either, run by run, and a process woken on another vCPU than the one that woke it "
            "costs both more (the rows above mix them):", "",
            "| placement | concurrency | quiver worker us/req | req/s | baseline us/req | req/s | spin ungated us/req | req/s "
            "| triton stub us/req | req/s | quiver / triton |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rate = report["settings"].get("rate")
        for cell in summary:
            parts = []
            for key in ("quiver", "baseline", "ungated", "triton"):
                got = cell.get(key)
                parts += ([f"{got['worker_cpu_us']:.0f} [{got['min']:.0f}-{got['max']:.0f}]", f"{got['req_per_s']:.0f}"]
                          if got else ["-", "-"])
            paced = f"1 at {rate:g}/s" if cell["paced"] else "1"
            lines.append(f"| {cell['placement']} | {paced} | {' | '.join(parts)} | {common.dash(cell.get('ratio'), '.2f')} |")
    if report.get("placed_error"):
        lines += ["", f"Placed trials: {report['placed_error']}"]
    hop = report.get("hop")
    if hop:
        lines += [
            "", "The process boundary alone (`run()` of one request in this process on uvloop, as the "
            "server runs it, no HTTP; CPU per call of this process and of the worker):", "",
            "| mode | p50 us | p99 us | mean us | CPU us/call | worker CPU us/call |", "|---|---:|---:|---:|---:|---:|",
        ]
        for mode, row in hop.items():
            lines.append(f"| {mode} | {row['p50_us']} | {row['p99_us']} | {row['mean_us']} | "
                         f"{common.dash(row.get('server_cpu_us'))} | {common.dash(row.get('worker_cpu_us'))} |")
    return "\n".join(lines)


def _placed_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker CPU per request at each placement and pacing: each server's median over the
    rounds (and its range), and Quiver's over Triton's."""
    out = []
    for placement in PLACEMENTS:
        for paced in (False, True):
            cell: dict[str, Any] = {"placement": placement, "paced": paced}
            for key, server in (("quiver", "quiver worker"), ("baseline", BASELINE), ("ungated", UNGATED), ("triton", TRITON)):
                mine = [r for r in rows if r["server"] == server and r.get("placement") == placement
                        and bool(r.get("rate")) == paced and r.get("worker_cpu_us") is not None]
                if mine:
                    cpu = [r["worker_cpu_us"] for r in mine]
                    cell[key] = {
                        "worker_cpu_us": statistics.median(cpu), "min": min(cpu), "max": max(cpu),
                        "req_per_s": statistics.median(r["req_per_s"] for r in mine), "rounds": len(mine),
                    }
            if any(key in cell for key in ("quiver", "baseline", "ungated", "triton")):
                if "quiver" in cell and "triton" in cell:
                    cell["ratio"] = cell["quiver"]["worker_cpu_us"] / cell["triton"]["worker_cpu_us"]
                out.append(cell)
    return out


def _ratios(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each Quiver worker row against Triton's and the in-process row of the same encoding,
    concurrency and pacing: p50, time in the core, and worker (stub) CPU per request."""
    def peer(server: str, like: dict[str, Any]) -> dict[str, Any] | None:
        for row in trials:
            if (row["server"].startswith(server) and row["encoding"] == like["encoding"]
                    and row["concurrency"] == like["concurrency"] and row.get("rate") == like.get("rate")):
                return row
        return None

    def ratio(mine: dict[str, Any], other: dict[str, Any] | None, key: str) -> float | None:
        if other is None or not mine.get(key) or not other.get(key):
            return None
        return float(mine[key]) / float(other[key])

    out = []
    for row in trials:
        if row["server"] not in ("quiver worker", BASELINE, UNGATED, SPINNING, NO_ANSWER_SPIN):
            continue
        triton, inproc = peer("triton", row), peer("quiver in-process", row)
        out.append({
            "server": row["server"], "encoding": row["encoding"], "concurrency": row["concurrency"],
            "rate": row.get("rate"),
            "vs_triton": ratio(row, triton, "p50_ms"),
            "vs_in_process": ratio(row, inproc, "p50_ms"),
            "core_vs_triton": ratio(row, triton, "core_us"),
            "worker_cpu_vs_triton": ratio(row, triton, "worker_cpu_us"),
        })
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.python_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per trial (default 10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per trial (default 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="default: 1 8")
    parser.add_argument("--encodings", nargs="+", default=["binary", "grpc"], choices=loadgen.ENCODINGS)
    parser.add_argument("--rate", type=float, default=1000.0,
                        help="also one connection paced at at most this many requests per second for every "
                             "server (0: not run; default 1000; loadgen's pacing timer has millisecond "
                             "resolution on uvloop, so above about 1000/s it stops pacing)")
    parser.add_argument("--hop-calls", type=int, default=3000, help="calls of the hop measurement (default 3000)")
    parser.add_argument("--spin-us", type=int, default=200,
                        help="also a worker with --backend-config=python,spin-microseconds=N (0: not run; default 200)")
    parser.add_argument("--placements", nargs="*", default=list(PLACEMENTS), choices=PLACEMENTS,
                        help="also HTTP binary at concurrency 1 and paced with Quiver's worker and Triton's stub "
                             "placed alike: the server's threads on one vCPU, its workers (stubs) on the same one "
                             "(same) or the other (split), the load generator on the other (default: same split; "
                             "none: not run)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds of the placed trials, the servers taken in turn (default 3)")
    parser.add_argument("--no-triton", action="store_true", help="skip Triton (no download)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="also Quiver's worker from this checkout's src folder (before a change), in the wire "
                             "trials and every placed round")
    parser.add_argument("--ungated", action="store_true",
                        help="also Quiver's worker with the server's answer spin whatever the CPU pressure "
                             "(answer-spin-pressure=100), in the wire trials and every placed round")
    parser.add_argument("--no-answer-spin", action="store_true",
                        help="also Quiver's worker with the server's answer spin off (answer-spin-microseconds=0), "
                             "in the wire trials: what the spin costs the server and buys the latency")
    parser.add_argument("--no-in-process", action="store_true", help="skip the in-process server")
    parser.add_argument("--no-hop", action="store_true", help="skip the hop measurement")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--output-name", default="python_worker", help="results file name (default: python_worker)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load_before = os.getloadavg()
    pressure_before = cpu_pressure()
    if args.baseline is not None and not (args.baseline / "quiver").is_dir():
        raise SystemExit(f"--baseline {args.baseline}: not a src folder holding the quiver package")
    trials = _quiver("quiver worker", (), args)
    if args.baseline:
        trials += _quiver(BASELINE, (), args, src=args.baseline)
    if args.ungated:
        trials += _quiver(UNGATED, (UNGATED_FLAG,), args)
    if args.no_answer_spin:
        trials += _quiver(NO_ANSWER_SPIN, (NO_ANSWER_SPIN_FLAG,), args)
    if args.spin_us:
        trials += _quiver(SPINNING, (f"--backend-config=python,spin-microseconds={args.spin_us}",), args)
    if not args.no_in_process:
        trials += _quiver("quiver in-process", (IN_PROCESS,), args)
    triton_error = "skipped (--no-triton)"
    if not args.no_triton:
        rows, triton_error = _triton(args)
        trials += rows
    placed, placed_error = _placements(args) if args.placements and args.repeat > 0 else ([], "")
    report = {
        "command": common.command_line(),
        "environment": common.environment(["numpy", "tritonclient"]),
        "settings": {"duration": args.duration, "warmup": args.warmup, "concurrency": args.concurrency,
                     "encodings": args.encodings, "spin_us": args.spin_us, "rate": args.rate,
                     "placements": args.placements, "repeat": args.repeat,
                     "baseline": str(args.baseline) if args.baseline else None, "ungated": args.ungated,
                     "no_answer_spin": args.no_answer_spin,
                     "cpu_pressure": {"before": pressure_before, "after": cpu_pressure()}},
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "trials": trials,
        "triton_error": triton_error,
        "ratios": _ratios(trials),
        "placed": placed,
        "placed_error": placed_error,
        "placed_summary": _placed_summary(placed),
        "hop": None if args.no_hop else _hop(args.hop_calls),
    }
    text = markdown(report)
    print(text)
    log(common.write_results(args.output_dir, args.output_name, text, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
