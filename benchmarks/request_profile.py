"""Where a request's server CPU goes, by process and by function: ``quiver serve`` (the tiny
model as ONNX or as Triton's Python model, ``--frontend-workers N``) profiled with cProfile
(``QUIVER_PROFILE_DIR``, :mod:`quiver.profiling`) under ``benchmarks.loadgen`` load, then each
kind of process's profile (the model side, the frontend workers together, the Python model's
process) printed as its top functions, per request.

Run: ``.venv/bin/python -m benchmarks.request_profile --backend python --workers 0`` from the
repository root; ``--help``. cProfile roughly doubles the cost of Python code and sees only
the thread that started it (each process's event loop, the Python model's serving thread), so
read the shares, not the totals; the profiles stay in ``--keep DIR`` when given.
"""

from __future__ import annotations

import argparse
import pstats
import sys
import tempfile
from pathlib import Path

from benchmarks import loadgen
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
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="request_profile-"))
    profiles = args.keep or work / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    repository = write_repository(work, args.backend)
    with QuiverServer(
        repository, ["--frontend-workers", str(args.workers)], log=work / "server.log", cwd=work,
        ready_path=f"/v2/models/{tiny.MODEL}/ready", env={"QUIVER_PROFILE_DIR": str(profiles)},
    ) as server:
        endpoints = server.endpoints
        res = loadgen.run_trial(*endpoints.address(args.encoding), args.encoding, args.concurrency, 0.5,
                                args.duration, PAYLOAD, endpoints.pid, 50, progress=None)
    # The profiles cover the whole run, warm-up included.
    requests = res.requests + int(res.req_per_s * 0.5)
    print(f"{args.backend} workers={args.workers} {args.encoding} c={args.concurrency}: {res.req_per_s:,.0f} req/s "
          f"while profiled, about {requests:,} requests")
    for kind in KINDS:
        files = sorted(str(p) for p in profiles.glob(f"{kind}-*.prof"))
        if not files:
            continue
        stats = pstats.Stats(*files, stream=sys.stdout)
        total = stats.total_tt  # type: ignore[attr-defined]
        print(f"\n== {kind} ({len(files)} process(es)): {1e6 * total / requests:.1f} us of profiled time per request")
        stats.sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
