"""The server's spin for a Python worker's answer (``answer-spin-microseconds``), alone: the
``tiny`` model's ``run()`` in a worker, called in this process on uvloop as the server calls it,
with a gap of busy work between two calls (as the server's HTTP work leaves one at concurrency
1), each mode in turn per round:

- ``sleep``: ``answer-spin-microseconds=0`` (the loop sleeps until the answer wakes it);
- ``default``: the default spin, which waits only while a core is spare (CPU pressure under
  ``answer-spin-pressure``, 10%);
- ``ungated``: the spin whatever the CPU pressure (``answer-spin-pressure=100``).

Placements: ``free`` (the scheduler's choice), ``same`` (this process and the worker on the first
vCPU), ``split`` (this process on the first, the worker on the second): a process woken on
another vCPU than the one that woke it costs both more, and the spin saves exactly that wake-up.

Run: ``python -m benchmarks.answer_spin`` (``--help``); writes ``results/answer_spin.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from benchmarks import common
from benchmarks.peers import tiny
from benchmarks.python_worker import _children_cpu, _repository
from quiver.ipc.inbox import cpu_pressure

RESULTS = Path(__file__).parent / "results"
MODES = {
    "sleep": {"answer-spin-microseconds": "0"},
    "default": {},
    "ungated": {"answer-spin-pressure": "100"},
}
PLACEMENTS = ("free", "same", "split")


def log(message: str) -> None:
    print(f"[answer_spin] {message}", file=sys.stderr, flush=True)


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _measure(mode: str, placement: str, gap_us: float, calls: int) -> dict[str, Any]:
    from quiver.backends.base import SERVER, InstanceSpec, ModelFiles
    from quiver.backends.python import BACKEND
    from quiver.config import ModelConfig, parse_model_config
    from quiver.types import DataType, InferenceRequest, Tensor

    repository = _repository(Path(tempfile.mkdtemp(prefix="quiver-answer-spin-")))
    path = repository / tiny.MODEL / "config.pbtxt"
    config = ModelConfig.from_proto(parse_model_config(path.read_text(), path, tiny.MODEL), str(path))
    files = ModelFiles(repository=repository, model_dir=repository / tiny.MODEL, version=1)
    spec = InstanceSpec(group=config.instance_groups[0], index=0)
    request = InferenceRequest(
        tiny.MODEL, "", [Tensor(tiny.INPUT, DataType.FP32, tiny.SHAPE, np.ones(tiny.SHAPE, np.float32))]
    )
    SERVER.backend_config = {"python": {"in-process": "false", **MODES[mode]}}
    instance = BACKEND.create_instance(config, files, spec)
    cpus = sorted(os.sched_getaffinity(0))

    async def run() -> tuple[list[float], float, float]:
        SERVER.loop = asyncio.get_running_loop()
        for _ in range(300):
            _busy(gap_us / 1e6)
            await instance.run([request])
        if placement != "free" and len(cpus) >= 2:
            os.sched_setaffinity(0, {cpus[0]})
            for child in psutil.Process().children():
                os.sched_setaffinity(child.pid, {cpus[0]} if placement == "same" else {cpus[1]})
        samples = []
        cpu, workers = time.process_time(), _children_cpu(os.getpid())
        for _ in range(calls):
            _busy(gap_us / 1e6)
            began = time.perf_counter_ns()
            await instance.run([request])
            samples.append((time.perf_counter_ns() - began) / 1000)
        return samples, time.process_time() - cpu, _children_cpu(os.getpid()) - workers

    try:
        samples, cpu, workers = common.run_async(run())
    finally:
        instance.unload()
        SERVER.loop = None
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, set(cpus))
    samples.sort()
    return {
        "mode": mode, "placement": placement, "calls": calls,
        "p50_us": round(statistics.median(samples), 1),
        "p90_us": round(samples[int(len(samples) * 0.9)], 1),
        "server_cpu_us": round(cpu / calls * 1e6 - gap_us, 1),  # the gap's busy work taken out
        "worker_cpu_us": round(workers / calls * 1e6, 1),
    }


def markdown(report: dict[str, Any]) -> str:
    env, settings = report["environment"], report["settings"]
    lines = [
        "# The server's spin for a Python worker's answer",
        "",
        f"`{report['command']}`, {env['date']}, {env['nproc']} cores ({env['cpu_model']}). The `tiny` "
        f"Python model's `run()` in a worker, {settings['calls']} calls per trial after 300 of warm-up, "
        f"{settings['gap_us']:g} us of busy work between two calls (this process's CPU per call is "
        f"given without it); modes taken in turn in each of {settings['rounds']} rounds; median over "
        "the rounds, range in brackets. CPU pressure (some avg10) before the run: "
        f"{report['pressure']['before']}, after: {report['pressure']['after']}.",
        "",
        "| placement | mode | p50 us | p90 us | server CPU us/call | worker CPU us/call | total |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for placement in settings["placements"]:
        for mode in settings["modes"]:
            rows = [r for r in report["trials"] if r["placement"] == placement and r["mode"] == mode]
            if not rows:
                continue

            def cell(key: str, rows: list[dict[str, Any]] = rows) -> str:
                values = [r[key] for r in rows]
                return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"

            total = statistics.median(r["server_cpu_us"] + r["worker_cpu_us"] for r in rows)
            lines.append(f"| {placement} | {mode} | {cell('p50_us')} | {cell('p90_us')} | {cell('server_cpu_us')} | "
                         f"{cell('worker_cpu_us')} | {total:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.answer_spin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="measured calls per trial (default 3000)")
    parser.add_argument("--gap-us", type=float, default=150.0, help="busy work between two calls (default 150)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each mode in turn (default 3)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--output-name", default="answer_spin")
    args = parser.parse_args(argv)
    pressure_before = cpu_pressure()
    trials = []
    for round_ in range(args.rounds):
        for placement in args.placements:
            for mode in args.modes:
                row = _measure(mode, placement, args.gap_us, args.calls) | {"round": round_}
                log(f"{placement} {mode}: p50 {row['p50_us']} us, CPU per call server {row['server_cpu_us']} "
                    f"+ worker {row['worker_cpu_us']} us")
                trials.append(row)
    report = {
        "command": common.command_line(),
        "environment": common.environment(["numpy"]),
        "settings": {"calls": args.calls, "gap_us": args.gap_us, "rounds": args.rounds, "modes": args.modes,
                     "placements": args.placements},
        "pressure": {"before": pressure_before, "after": cpu_pressure()},
        "trials": trials,
    }
    text = markdown(report)
    print(text)
    log(common.write_results(args.output_dir, args.output_name, text, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
