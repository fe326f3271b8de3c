"""Where a request's server CPU goes, by process and by function: ``quiver serve`` (the tiny
model as ONNX or as Triton's Python model, ``--frontend-workers N``) profiled with cProfile
(``QUIVER_PROFILE_DIR``, :mod:`quiver.profiling`) under ``benchmarks.loadgen`` load, then each
kind of process's profile (the model side, the frontend workers together, the Python model's
process) printed as its top functions, per request.

Run: ``.venv/bin/python -m benchmarks.request_profile --backend python --workers 0`` from the
repository root; ``--help``. cProfile roughly doubles the cost of Python code and sees only
the thread that started it (each process's event loop, the Python model's serving thread), so
read the shares, not the totals; the profiles stay in ``--keep DIR`` when given. ``--src DIR``
profiles another checkout's ``src`` (one that has ``quiver/profiling.py``).

Writes ``benchmarks/results/<--output-name>.md`` (the printed tables) and ``.json`` (each kind
of process's top functions: calls, own and cumulative microseconds per request).
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common, loadgen
from benchmarks.common import ROOT
from benchmarks.peers import tiny
from benchmarks.peers.quiver import QuiverServer
from benchmarks.request_cpu import PAYLOAD, write_repository

KINDS = ("server", "frontend", "python-model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="onnx", choices=("onnx", "python"))
    parser.add_argument("--workers", type=int, default=0, help="--frontend-workers (default: 0)")
    parser.add_argument("--encoding", default="binary", choices=("json", "binary", "grpc"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds (after 0.5 s of warm-up)")
    parser.add_argument("--top", type=int, default=25, help="functions shown per kind of process")
    parser.add_argument("--sort", default="tottime", help="pstats sort key (default: tottime)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the .prof files in this folder")
    parser.add_argument("--src", type=Path, default=None, help="the src folder of the checkout to profile (default: this one)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--output-name", default=None, help="write OUTPUT_DIR/NAME.md and .json (default: print only)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="request_profile-"))
    profiles = args.keep or work / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    repository = write_repository(work, args.backend)
    env = {"QUIVER_PROFILE_DIR": str(profiles)}
    if args.src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(args.src.resolve()), str(ROOT)])
    with QuiverServer(
        repository, ["--frontend-workers", str(args.workers)], log=work / "server.log", cwd=work,
        ready_path=f"/v2/models/{tiny.MODEL}/ready", env=env,
    ) as server:
        endpoints = server.endpoints
        res = loadgen.run_trial(*endpoints.address(args.encoding), args.encoding, args.concurrency, 0.5,
                                args.duration, PAYLOAD, endpoints.pid, 50, progress=None)
    # The profiles cover the whole run, warm-up included.
    requests = res.requests + int(res.req_per_s * 0.5)
    out = io.StringIO()
    out.write(f"{args.backend} workers={args.workers} {args.encoding} c={args.concurrency}: {res.req_per_s:,.0f} req/s "
              f"while profiled, about {requests:,} requests\n")
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        files = sorted(str(p) for p in profiles.glob(f"{kind}-*.prof"))
        if not files:
            continue
        stats = pstats.Stats(*files, stream=out)
        total = stats.total_tt  # type: ignore[attr-defined]
        out.write(f"\n== {kind} ({len(files)} process(es)): {1e6 * total / requests:.1f} us of wall time per request on its main thread (waits for work included)\n")
        stats.sort_stats(args.sort).print_stats(args.top)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.top]  # type: ignore[attr-defined]
        kinds[kind] = {
            "processes": len(files), "profiled_us_per_request": 1e6 * total / requests,
            "top": [{"function": f"{path}:{line}({name})", "calls": calls, "own_us_per_request": 1e6 * own / requests,
                     "cumulative_us_per_request": 1e6 * cumulative / requests}
                    for (path, line, name), (_, calls, own, cumulative, _) in rows],
        }
    text = out.getvalue()
    print(text)
    if args.output_name:
        header = (f"# Where a request's server CPU goes (cProfile)\n\n`{common.command_line()}`\n\n"
                  "Wall-clock profiles of each process's main thread (cProfile's default timer): read the shares, "
                  "not the totals (profiling roughly doubles the cost of Python code, and a call that blocks or is "
                  "preempted, such as a write that wakes another process, counts its wait).\n\n")
        report = {"command": common.command_line(), "req_per_s": res.req_per_s, "requests": requests, "kinds": kinds}
        print(common.write_results(args.output_dir, args.output_name, header + "```\n" + text + "```\n", report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
