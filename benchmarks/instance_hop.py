"""The cost of handing one call from the event loop to a model instance's thread and back.

Run: ``.venv/bin/python -m benchmarks.instance_hop`` from the repository root.

Every execution that does not run inline on the event loop (a Python model, a TorchScript,
TensorFlow or slow ONNX model) pays this hop once. Two ways, each awaited through
``asyncio.shield`` as ``ThreadedInstance.run`` awaits it, on uvloop, ``--calls`` times after a
warm-up, alternating ``--repeat`` times:

* ``run_in_executor``: ``loop.run_in_executor`` on a one-thread ``ThreadPoolExecutor`` (what
  ``ThreadedInstance`` used before);
* ``InstanceThread.call``: ``quiver.backends.instance_thread`` (a ``SimpleQueue`` and one
  ``call_soon_threadsafe``).

The table gives this process's CPU microseconds and wall microseconds per hop (median over
rounds) and writes ``benchmarks/results/instance_hop.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import ROOT, run_async
from quiver.backends.instance_thread import InstanceThread


def _identity(x: int) -> int:
    return x


async def _measure(hop: Callable[[], Awaitable[Any]], calls: int) -> tuple[float, float]:
    for _ in range(min(1000, calls)):
        await asyncio.shield(hop())
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await asyncio.shield(hop())
    return 1e6 * (time.process_time() - cpu) / calls, 1e6 * (time.perf_counter() - wall) / calls


async def executor_round(calls: int) -> tuple[float, float]:
    executor = ThreadPoolExecutor(max_workers=1)
    loop = asyncio.get_running_loop()
    try:
        return await _measure(lambda: loop.run_in_executor(executor, _identity, 1), calls)
    finally:
        executor.shutdown()


async def instance_thread_round(calls: int) -> tuple[float, float]:
    thread = InstanceThread("quiver-bench")
    try:
        return await _measure(lambda: thread.call(_identity, 1), calls)
    finally:
        thread.shutdown()


WAYS = {"run_in_executor": executor_round, "InstanceThread.call": instance_thread_round}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    samples: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for _ in range(args.repeat):
        for way, round_ in WAYS.items():
            samples[way].append(run_async(round_(args.calls)))
    lines = ["| hand-off | CPU us per call | wall us per call |", "|---|---:|---:|"]
    rows = []
    for way, got in samples.items():
        cpu = statistics.median(s[0] for s in got)
        wall = statistics.median(s[1] for s in got)
        lines.append(f"| {way} | {cpu:.1f} | {wall:.1f} |")
        rows.append({"way": way, "cpu_us": cpu, "wall_us": wall, "samples": got})
    markdown = "\n".join(lines)
    print(markdown)
    header = (
        "# Event loop -> instance thread -> event loop\n\n"
        f"`{common.command_line()}`\n\n{args.calls} calls per round, {args.repeat} rounds "
        "alternating; medians.\n\n"
    )
    report = {"command": common.command_line(), "environment": common.environment(("uvloop",)), "rows": rows}
    print(common.write_results(args.output_dir, "instance_hop", header + markdown, report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
