"""Server CPU per request: what one inference costs the server, in microseconds of CPU time.

Run: ``.venv/bin/python -m benchmarks.request_cpu`` from the repository root; ``--help`` for
options.

Throughput on a shared machine moves with whatever else runs on it; the CPU time the server
process (with its children) spends per answered request moves much less, so this is the number
to compare when cutting a request's cost. For each variant of the server (``--src`` adds one:
the ``src`` folder of another checkout, put first on the server's ``PYTHONPATH``), model
(``tiny``, the Triton Python model unchanged, and ``tiny`` as ONNX) and encoding (HTTP JSON,
HTTP binary, gRPC), ``benchmarks/loadgen.py`` drives ``--concurrency`` requests in flight for
``--duration`` seconds after a warm-up; the server's CPU seconds over the window divided by the
requests answered in it is one sample. Variants alternate trial by trial (``--repeat`` rounds),
so a busy moment on the machine hits all of them alike; the table gives each cell's median and
its spread (min-max), and the ratio of each variant to the first.

Results: a markdown table on stdout and in ``benchmarks/results/request_cpu.md``, the same as
JSON in ``request_cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common, loadgen
from benchmarks.common import ROOT
from benchmarks.peers import tiny
from benchmarks.peers.quiver import ONNX_CONFIG, QuiverServer

ENCODINGS = ("json", "binary", "grpc")
BACKENDS = ("python", "onnx")
#: Triton's Python model unchanged: the benchmark peer's config without Quiver's opt-in.
PYTHON_CONFIG = "\n".join(
    line for line in tiny.PYTHON_CONFIG.splitlines()
    if "EXECUTE_ON_EVENT_LOOP" not in line and not line.startswith("# Quiver:")
) + "\n"
X = (np.arange(16, dtype=np.float32).reshape(tiny.SHAPE) / 4 - 1)
PAYLOAD = loadgen.Payload(tiny.MODEL, {tiny.INPUT: X}, expected={tiny.OUTPUT: X * 2})


def log(message: str) -> None:
    print(f"[request_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_repository(folder: Path, backend: str) -> Path:
    repository = folder / f"repository-{backend}"
    version = repository / tiny.MODEL / "1"
    version.mkdir(parents=True)
    if backend == "python":
        (repository / tiny.MODEL / "config.pbtxt").write_text(PYTHON_CONFIG)
        (version / "model.py").write_text(tiny.PYTHON_MODEL)
    else:
        (repository / tiny.MODEL / "config.pbtxt").write_text(ONNX_CONFIG)
        (version / "model.onnx").write_bytes(tiny.onnx_model())
    return repository


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", action="append", default=[], metavar="NAME=DIR",
                        help="a server variant: NAME=the src folder of a checkout (repeatable); "
                        "default one variant, 'this', from this checkout")
    parser.add_argument("--backends", default="python,onnx", help="of: python,onnx")
    parser.add_argument("--encodings", default="json,binary,grpc", help="of: json,binary,grpc")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flags", default="", help="extra `quiver serve` flags (one string)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="request_cpu")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.encodings = [e for e in args.encodings.split(",") if e]
    if set(args.backends) - set(BACKENDS) or set(args.encodings) - set(ENCODINGS):
        parser.error(f"backends of {BACKENDS}, encodings of {ENCODINGS}")
    variants = {}
    for spec in args.src or [f"this={ROOT / 'src'}"]:
        name, _, folder = spec.partition("=")
        if not folder or not (Path(folder) / "quiver").is_dir():
            parser.error(f"--src {spec!r}: want NAME=DIR with DIR/quiver a package")
        variants[name] = str(Path(folder).resolve())
    args.variants = variants
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    samples: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    work = Path(tempfile.mkdtemp(prefix="request_cpu-"))
    try:
        repositories = {b: write_repository(work, b) for b in args.backends}
        for round_ in range(args.repeat):
            for backend in args.backends:
                for name, src in args.variants.items():
                    env = {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
                    folder = work / f"{name}-{backend}-{round_}"
                    folder.mkdir()
                    with QuiverServer(
                        repositories[backend], args.flags.split(), log=folder / "server.log", env=env,
                        cwd=folder, ready_path=f"/v2/models/{tiny.MODEL}/ready", name=name,
                    ) as server:
                        endpoints = server.endpoints
                        for encoding in args.encodings:
                            loadgen.sanity_check(*endpoints.address(encoding), encoding, PAYLOAD)
                            res = loadgen.run_trial(
                                *endpoints.address(encoding), encoding, args.concurrency, args.warmup,
                                args.duration, PAYLOAD, endpoints.pid, 50, progress=None,
                            )
                            if res.errors or not res.requests or res.server_cpu_s is None:
                                raise SystemExit(f"{name} {backend} {encoding}: {res.errors} errors, {res.first_error}")
                            us = 1e6 * res.server_cpu_s / res.requests
                            samples.setdefault((backend, encoding, name), []).append(
                                {"us_per_request": us, "req_per_s": res.req_per_s, "server_cpu_pct": res.server_cpu_pct or 0.0}
                            )
                            log(f"round {round_ + 1}/{args.repeat} {name} {backend} {encoding}: "
                                f"{us:.0f} us/request, {res.req_per_s:,.0f} req/s, server CPU {res.server_cpu_pct:.0f}%")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    markdown, rows = table(args, samples)
    print(markdown)
    report: dict[str, Any] = {
        "command": common.command_line(),
        "environment": common.environment(("quiver", "uvicorn", "httptools", "grpcio", "protobuf", "onnxruntime")),
        "settings": {k: getattr(args, k) for k in ("concurrency", "duration", "warmup", "repeat", "flags", "variants")},
        "rows": rows,
    }
    header = (
        "# Server CPU per request\n\n"
        f"`{common.command_line()}`\n\n"
        f"Concurrency {args.concurrency}, {args.duration:g} s per trial after {args.warmup:g} s warm-up, "
        f"{args.repeat} rounds (variants alternating); median (min-max) of the server's CPU "
        "microseconds per answered request.\n\n"
    )
    print(common.write_results(args.output_dir, args.stem, header + markdown + "\n", report), file=sys.stderr)
    return 0


def table(args: argparse.Namespace, samples: dict[tuple[str, str, str], list[dict[str, float]]]) -> tuple[str, list[dict[str, Any]]]:
    names = list(args.variants)
    head = "| model | encoding | " + " | ".join(f"{n} us/req" for n in names)
    head += "".join(f" | {n} / {names[0]}" for n in names[1:]) + " | " + " | ".join(f"{n} req/s" for n in names) + " |"
    lines = [head, "|---|---|" + "---:|" * (2 * len(names) + len(names) - 1)]
    rows = []
    for backend in args.backends:
        for encoding in args.encodings:
            cells, ratios, rates = [], [], []
            medians = {}
            for name in names:
                got = samples.get((backend, encoding, name), [])
                us = [s["us_per_request"] for s in got]
                medians[name] = statistics.median(us)
                cells.append(f"{medians[name]:.0f} ({min(us):.0f}-{max(us):.0f})")
                rates.append(f"{statistics.median(s['req_per_s'] for s in got):,.0f}")
                rows.append({"model": backend, "encoding": encoding, "variant": name, "samples": got,
                             "median_us_per_request": medians[name]})
            for name in names[1:]:
                ratios.append(f"{medians[name] / medians[names[0]]:.2f}x")
            lines.append(f"| {backend} | {encoding} | " + " | ".join(cells + ratios + rates) + " |")
    return "\n".join(lines), rows


if __name__ == "__main__":
    sys.exit(main())
