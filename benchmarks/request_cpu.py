"""Server CPU per request: what one inference costs the server, in microseconds of CPU time.

Run: ``.venv/bin/python -m benchmarks.request_cpu`` from the repository root; ``--help`` for
options.

Throughput on a shared machine moves with whatever else runs on it; the CPU time the server
process (with its children) spends per answered request moves much less, so this is the number
to compare when cutting a request's cost. For each variant of the server (``--src`` adds one:
the ``src`` folder of another checkout, put first on the server's ``PYTHONPATH``), model
(``python``: ``tiny``, the Triton Python model unchanged; ``onnx``: ``tiny`` as ONNX;
``simple``: Triton's ``simple`` ONNX model, INT32[1,16] x2 -> sum and difference), encoding
(HTTP JSON, HTTP binary, gRPC) and concurrency (``--concurrency 1,8,32``: each level in
turn), ``benchmarks/loadgen.py`` drives that many requests in flight for
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
BACKENDS = ("python", "onnx", "simple")
X = (np.arange(16, dtype=np.float32).reshape(tiny.SHAPE) / 4 - 1)
PAYLOAD = loadgen.Payload(tiny.MODEL, {tiny.INPUT: X}, expected={tiny.OUTPUT: X * 2})
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = (np.arange(16, dtype=np.int32) * 3 - 7).reshape(1, 16)
SIMPLE = loadgen.Payload("simple", {"INPUT0": A, "INPUT1": B}, expected={"OUTPUT0": A + B, "OUTPUT1": A - B})
PAYLOADS = {"python": PAYLOAD, "onnx": PAYLOAD, "simple": SIMPLE}


def log(message: str) -> None:
    print(f"[request_cpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_repository(folder: Path, backend: str) -> Path:
    repository = folder / f"repository-{backend}"
    if backend == "simple":
        from examples.build_repository import SIMPLE_CONFIG, simple_onnx

        common.test_support("models").write_onnx(repository, "simple", simple_onnx(), SIMPLE_CONFIG)
        return repository
    version = repository / tiny.MODEL / "1"
    version.mkdir(parents=True)
    if backend == "python":
        (repository / tiny.MODEL / "config.pbtxt").write_text(tiny.PYTHON_CONFIG)
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
    parser.add_argument("--backends", default="python,onnx", help="of: python,onnx,simple")
    parser.add_argument("--encodings", default="json,binary,grpc", help="of: json,binary,grpc")
    parser.add_argument("--concurrency", default="8", help="requests in flight: one level or several (1,8,32)")
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flags", default="", help="extra `quiver serve` flags (one string)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="request_cpu")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.encodings = [e for e in args.encodings.split(",") if e]
    args.levels = [int(c) for c in str(args.concurrency).split(",") if c]
    if set(args.backends) - set(BACKENDS) or set(args.encodings) - set(ENCODINGS):
        parser.error(f"backends of {BACKENDS}, encodings of {ENCODINGS}")
    args.variants = common.source_variants(parser, args.src, ROOT / "src")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    samples: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    work = Path(tempfile.mkdtemp(prefix="request_cpu-"))
    try:
        repositories = {b: write_repository(work, b) for b in args.backends}
        for round_ in range(args.repeat):
            for backend in args.backends:
                for name, src in args.variants.items():
                    env = {"PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
                    folder = work / f"{name}-{backend}-{round_}"
                    folder.mkdir()
                    payload = PAYLOADS[backend]
                    with QuiverServer(
                        repositories[backend], args.flags.split(), log=folder / "server.log", env=env,
                        cwd=folder, ready_path=f"/v2/models/{payload.model}/ready", name=name,
                    ) as server:
                        endpoints = server.endpoints
                        for encoding in args.encodings:
                            loadgen.sanity_check(*endpoints.address(encoding), encoding, payload)
                            for level in args.levels:
                                res = loadgen.run_trial(
                                    *endpoints.address(encoding), encoding, level, args.warmup,
                                    args.duration, payload, endpoints.pid, 50, progress=None,
                                )
                                if res.errors or not res.requests or res.server_cpu_s is None:
                                    raise SystemExit(f"{name} {backend} {encoding} c={level}: {res.errors} errors, {res.first_error}")
                                us = 1e6 * res.server_cpu_s / res.requests
                                samples.setdefault((backend, encoding, level, name), []).append(
                                    {"us_per_request": us, "req_per_s": res.req_per_s, "server_cpu_pct": res.server_cpu_pct or 0.0,
                                     "p99_ms": res.p99_ms}
                                )
                                log(f"round {round_ + 1}/{args.repeat} {name} {backend} {encoding} c={level}: "
                                    f"{us:.0f} us/request, {res.req_per_s:,.0f} req/s, server CPU {res.server_cpu_pct:.0f}%")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    markdown, rows = table(args, samples)
    print(markdown)
    report: dict[str, Any] = {
        "command": common.command_line(),
        "environment": common.environment(("quiver", "uvicorn", "httptools", "grpcio", "protobuf", "onnxruntime")),
        "settings": {k: getattr(args, k) for k in ("levels", "duration", "warmup", "repeat", "flags", "variants")},
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    header = (
        "# Server CPU per request\n\n"
        f"`{common.command_line()}`\n\n"
        f"Concurrency {', '.join(map(str, args.levels))}, {args.duration:g} s per trial after {args.warmup:g} s warm-up, "
        f"{args.repeat} rounds (variants alternating); median (min-max) of the server's CPU "
        "microseconds per answered request, and the median requests/s.\n\n"
    )
    print(common.write_results(args.output_dir, args.stem, header + markdown + "\n", report), file=sys.stderr)
    return 0


def table(args: argparse.Namespace, samples: dict[tuple[str, str, int, str], list[dict[str, Any]]]) -> tuple[str, list[dict[str, Any]]]:
    """One row per model, encoding and concurrency: each variant's CPU per request (median and
    min-max), its requests/s (median), and both as ratios to the first variant."""
    names = list(args.variants)
    head = "| model | encoding | c | " + " | ".join(f"{n} us/req" for n in names)
    head += "".join(f" | {n} / {names[0]} CPU" for n in names[1:]) + " | " + " | ".join(f"{n} req/s" for n in names)
    head += "".join(f" | {n} / {names[0]} req/s" for n in names[1:]) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * (2 * len(names) + 2 * (len(names) - 1))]
    rows = []
    for backend in args.backends:
        for encoding in args.encodings:
            for level in args.levels:
                cells, cpu_ratios, rates, rate_ratios = [], [], [], []
                medians: dict[str, float] = {}
                per_s: dict[str, float] = {}
                for name in names:
                    got = samples.get((backend, encoding, level, name), [])
                    us = [s["us_per_request"] for s in got]
                    medians[name] = statistics.median(us)
                    per_s[name] = statistics.median(s["req_per_s"] for s in got)
                    cells.append(f"{medians[name]:.0f} ({min(us):.0f}-{max(us):.0f})")
                    rates.append(f"{per_s[name]:,.0f}")
                    rows.append({"model": backend, "encoding": encoding, "concurrency": level, "variant": name,
                                 "samples": got, "median_us_per_request": medians[name], "median_req_per_s": per_s[name]})
                for name in names[1:]:
                    cpu_ratios.append(f"{medians[name] / medians[names[0]]:.2f}x")
                    rate_ratios.append(f"{per_s[name] / per_s[names[0]]:.2f}x")
                lines.append(f"| {backend} | {encoding} | {level} | " + " | ".join(cells + cpu_ratios + rates + rate_ratios) + " |")
    return "\n".join(lines), rows


if __name__ == "__main__":
    sys.exit(main())
