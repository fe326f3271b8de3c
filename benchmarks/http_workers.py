"""Frontend workers (``quiver serve --frontend-workers N``, HTTP and gRPC): requests/s, p99 and
server CPU per request for N = 0 (everything in the one server process) and N workers over the
one model side.

Run: ``.venv/bin/python -m benchmarks.http_workers`` from the repository root; ``--help``.

The ``tiny`` workload (``benchmarks/peers/tiny.py``: FP32 [1, 16] -> x * 2, no batching) as
Triton's Python model unchanged and as ONNX, over HTTP with binary tensors or gRPC (``--encodings``),
at ``--concurrency`` levels; the configurations alternate round by round (``--repeat``), so a
busy moment on a shared machine hits all of them. Server CPU is the server process with its
children (the workers, and Python model processes where there are any) over the measured
window, per answered request, and split by process: the model side (the server process
itself), the frontend workers, and the Python model's own processes. The model side is the
one part that does not grow with the workers, so the rate a machine with more cores could
reach is about 1e6 / (the model side's microseconds per request): the table's "model-side
ceiling". ``--triton`` adds Triton's Python model (``benchmarks.peers.triton``: the same
``model.py`` and config) to every round, for ratios taken in the same run; its rows count the
``tritonserver`` process as the model side and its Python stubs as the model's processes.
Every row also has the machine's busy cores over the window (everything that ran: the server,
the load generator, anything else).

``--src NAME=DIR`` (repeatable) compares checkouts in the same rounds: each variant's server
runs with the ``src`` folder DIR first on its ``PYTHONPATH`` (``--variant-flags NAME=FLAGS``
adds ``quiver serve`` flags to one variant; ``--flags`` to all). The table then has a
``quiver`` column naming the variant.

Writes ``benchmarks/results/http_workers.md`` and ``.json`` (``--output-name``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import common, loadgen
from benchmarks.common import ROOT
from benchmarks.peers import Endpoints, tiny
from benchmarks.peers.quiver import QuiverServer
from benchmarks.request_cpu import PAYLOAD, write_repository

#: How a child of the server is told apart: a frontend worker runs this module.
FRONTEND_MODULE = "quiver.frontends.frontend_worker"
PARTS = ("model_side_us", "frontend_us", "model_processes_us")


def cpu_by_part(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server process itself, its frontend workers, and its other
    children (Python model processes); a child that is gone by now is left out."""
    import psutil

    def seconds(process: psutil.Process) -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    server = psutil.Process(pid)
    parts = dict.fromkeys(PARTS, 0.0)
    parts["model_side_us"] = seconds(server)
    for child in server.children(recursive=True):
        try:
            part = "frontend_us" if FRONTEND_MODULE in child.cmdline() else "model_processes_us"
            parts[part] += seconds(child)
        except psutil.Error:
            continue
    return parts


def log(message: str) -> None:
    print(f"[http_workers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _mark(marks: list[dict[str, float]], pid: int) -> None:
    marks.append(cpu_by_part(pid))


TRITON = "triton"


@contextlib.contextmanager
def _server(
    backend: str, count: int | str, repository: Path, folder: Path, src: str | None = None, flags: list[str] | None = None
) -> Iterator[Endpoints]:
    """The endpoints of Quiver with ``count`` frontend workers serving ``repository`` (from the
    checkout's ``src`` folder ``src``, with ``flags``), or of Triton (``count == "triton"``)
    serving the same tiny Python model."""
    if count == TRITON:
        from benchmarks.peers.triton import TritonPeer

        peer = TritonPeer()
        peer.setup()
        try:
            yield peer.start("tiny")
        finally:
            peer.stop()
        return
    env = {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")} if src else None
    with QuiverServer(repository, ["--frontend-workers", str(count), *(flags or [])], log=folder / "server.log",
                      cwd=folder, env=env, ready_path=f"/v2/models/{tiny.MODEL}/ready",
                      name=f"workers={count}") as server:
        yield server.endpoints


def _order(key: tuple[str, str, str, int | str, int], variants: list[str]) -> tuple[str, str, int, int, int, int]:
    """Rows by model, encoding, concurrency, then Quiver's worker counts and variants (in the
    order given), Triton last."""
    backend, encoding, variant, count, c = key
    rank = variants.index(variant) if variant in variants else 0
    return backend, encoding, c, 1 if count == TRITON else 0, count if isinstance(count, int) else 0, rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="0,2", help="worker counts to compare (default: 0,2)")
    parser.add_argument("--backends", default="onnx,python")
    parser.add_argument("--encodings", default="binary")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--output-name", default="http_workers", help="results file name (default: http_workers)")
    parser.add_argument("--triton", action="store_true",
                        help="also run Triton's Python model (benchmarks.peers.triton) in every round")
    parser.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                        help="a Quiver variant: NAME=the src folder of a checkout (repeatable; default: "
                        "this checkout, as the server's environment finds it)")
    parser.add_argument("--flags", default="", help="extra `quiver serve` flags for every Quiver server (one string)")
    parser.add_argument("--variant-flags", action="append", default=[], metavar="NAME=FLAGS",
                        help="extra `quiver serve` flags for one --src variant (repeatable)")
    args = parser.parse_args(argv)
    variants: dict[str, str | None] = dict(common.source_variants(parser, args.src, ROOT / "src")) if args.src else {"": None}
    variant_flags = {name: args.flags.split() for name in variants}
    for spec in args.variant_flags:
        name, _, flags = spec.partition("=")
        if name not in variants:
            parser.error(f"--variant-flags {spec!r}: no --src variant named {name!r}")
        variant_flags[name] += flags.split()
    counts: list[int | str] = [int(n) for n in args.workers.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    backends = args.backends.split(",")
    encodings = args.encodings.split(",")
    work = Path(tempfile.mkdtemp(prefix="http_workers-"))
    repositories = {b: write_repository(work, b) for b in backends}
    samples: dict[tuple[str, str, str, int | str, int], list[dict[str, float]]] = {}
    configurations: list[tuple[str, str, int | str]] = [(b, v, n) for b in backends for n in counts for v in variants]
    if args.triton:
        configurations.append(("python", "", TRITON))
    for round_ in range(args.repeat):
        for backend, variant, count in configurations:
            folder = work / f"{backend}-{variant}-{count}-{round_}"
            folder.mkdir()
            src = variants.get(variant) if count != TRITON else None
            with _server(backend, count, repositories.get(backend, work), folder, src, variant_flags.get(variant)) as endpoints:
                for encoding in encodings:
                    loadgen.sanity_check(*endpoints.address(encoding), encoding, PAYLOAD)
                    for c in levels:
                        marks: list[dict[str, float]] = []
                        mark = functools.partial(_mark, marks, endpoints.pid)
                        res = loadgen.run_trial(
                            *endpoints.address(encoding), encoding, c, args.warmup, args.duration, PAYLOAD,
                            endpoints.pid, 50, progress=None, on_begin=mark, on_end=mark,
                        )
                        if res.errors or not res.requests or res.server_cpu_s is None:
                            raise SystemExit(f"{backend} {variant} workers={count} {encoding} c={c}: {res.errors} errors, {res.first_error}")
                        got = {"req_per_s": res.req_per_s, "p99_ms": res.p99_ms or 0.0,
                               "server_us": 1e6 * res.server_cpu_s / res.requests,
                               **{part: 1e6 * (marks[1][part] - marks[0][part]) / res.requests for part in PARTS},
                               "server_cpu_pct": res.server_cpu_pct or 0.0, "client_cpu_pct": res.client_cpu_pct,
                               "machine_busy_cores": res.machine_busy_cores or 0.0}
                        samples.setdefault((backend, encoding, variant, count, c), []).append(got)
                        log(f"round {round_ + 1} {backend} {variant} workers={count} {encoding} c={c}: {got}")
    named = len(variants) > 1
    lines = [
        f"| model | encoding | {'quiver | ' if named else ''}frontend workers | c | req/s | p99 ms | server CPU us/request | "
        "model side us | frontend workers us | Python model process us | model-side ceiling req/s | server CPU % | "
        "client CPU % | machine busy cores |",
        f"|---|---|{'---|' if named else ''}---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[dict[str, Any]] = []
    for (backend, encoding, variant, count, c), trials in sorted(samples.items(), key=lambda item: _order(item[0], list(variants))):
        med = {k: statistics.median(s[k] for s in trials) for k in trials[0]}
        med["model_side_ceiling_req_per_s"] = 1e6 / med["model_side_us"] if med["model_side_us"] else 0.0
        column = f"{variant or '-'} | " if named else ""
        lines.append(
            f"| {backend} | {encoding} | {column}{count} | {c} | {med['req_per_s']:,.0f} | {med['p99_ms']:.2f} | "
            f"{med['server_us']:.0f} | {med['model_side_us']:.0f} | {med['frontend_us']:.0f} | "
            f"{med['model_processes_us']:.0f} | {med['model_side_ceiling_req_per_s']:,.0f} | "
            f"{med['server_cpu_pct']:.0f} | {med['client_cpu_pct']:.0f} | {med['machine_busy_cores']:.2f} |"
        )
        rows.append({"model": backend, "encoding": encoding, "variant": variant, "workers": count, "concurrency": c,
                     "median": med, "samples": trials})
    markdown = "\n".join(lines)
    print(markdown)
    header = (
        "# Frontend workers\n\n"
        f"`{common.command_line()}`\n\n{args.duration:g} s per trial after {args.warmup:g} s, "
        f"{args.repeat} rounds alternating; medians. Load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}. Frontend workers 0 and 1 are the same "
        "single-process server.\n\n"
        "CPU per answered request: `server CPU` is every server process together; `model side` the "
        "server process itself (it parses nothing when workers serve the protocols, and it is the one part "
        "that does not grow with the workers), `frontend workers` theirs together, `Python model process` "
        "the Python model's own process (the `python` rows). `model-side ceiling` = 1e6 / model side us: "
        "about where requests/s would stop growing with more cores and workers.\n\n"
    )
    report = {"command": common.command_line(), "environment": common.environment(("quiver", "uvicorn", "onnxruntime")),
              "rows": rows}
    print(common.write_results(args.output_dir, args.output_name, header + markdown, report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
