"""What tracing costs and what the response cache saves, on one ``quiver serve``.

One server, HTTP with the binary tensor extension, each scenario at concurrency 1 and 8:

- ``identity``: the identity backend (the cheapest request there is, so tracing's cost shows
  most), with tracing off, then with every request traced to a trace file (``level=TIMESTAMPS``,
  ``rate=1``, turned on and off through the trace settings API in the same run);
- ``work``: a Python model that takes 2 ms per request, without the response cache;
- ``work, cache hits``: the same model with ``response_cache`` on, the same request again and
  again (every request after the first is a hit);
- ``work, cache misses``: the same, every request a different input (looked up, run, inserted).

The scenarios run in ``--rounds`` interleaved rounds and each row is the round with the median
throughput, so a neighbour's burst on a shared machine moves every scenario alike. In-process,
without HTTP: what one traced request's trace costs (sampled, 13 timestamps, written to a file)
and what the cache's key costs for inputs of 64 B to 16 MiB, and a hit.

Run: ``python -m benchmarks.trace_cache [--duration 3] [--warmup 1] [--rounds 3]``. Writes
``benchmarks/results/trace_cache.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests

from benchmarks.common import command_line, environment, test_support
from benchmarks.loadgen import Payload, run_trial
from benchmarks.peers.quiver import QuiverServer
from quiver.metrics.statistics import ModelStatistics
from quiver.response_cache import ResponseCache, request_key
from quiver.tracing import TraceManager
from quiver.tracing.config import from_flags
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

HERE = Path(__file__).resolve().parent

WORK_MODEL = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.002 * len(requests))
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""

WORK_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ count: 8 kind: KIND_CPU }} ]
{cache}
"""

IDENTITY = """
name: "identity"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""


def build(repo: Path) -> None:
    models = test_support("models")
    models.write_config(repo, "identity", IDENTITY)
    models.write_python(repo, "work", WORK_MODEL, WORK_CONFIG.format(name="work", cache=""))
    models.write_python(
        repo, "work_cached", WORK_MODEL, WORK_CONFIG.format(name="work_cached", cache="response_cache { enable: true }")
    )


def payloads(model: str, count: int, first: int = 0) -> list[Payload]:
    """``count`` requests with different inputs (``first``, ``first + 1``, ...)."""
    out = []
    for i in range(first, first + count):
        data = np.full(16, float(i), dtype=np.float32)
        out.append(Payload(model, {"INPUT0": data}, expected={"OUTPUT0": data}))
    return out


def median_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, concurrency), the round with the median throughput, in first-seen order."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["concurrency"]), []).append(row)
    out = []
    for group in groups.values():
        ranked = sorted(group, key=lambda r: r["req_per_s"])
        out.append({**ranked[len(ranked) // 2], "rounds_req_per_s": [round(r["req_per_s"]) for r in group]})
    return sorted(out, key=lambda r: r["concurrency"])


def _median_us(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def in_process(folder: Path) -> dict[str, float]:
    """Microseconds per operation, without a server."""
    manager = TraceManager(from_flags([f"triton,file={folder / 'micro.json'}", "level=TIMESTAMPS", "rate=1"]))
    names = ["HTTP_RECV_START", "HTTP_RECV_END", "QUEUE_START", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START",
             "REQUEST_END", "HTTP_SEND_END"]  # fmt: skip

    def one_trace() -> None:
        trace = manager.sample("identity")
        assert trace is not None
        trace.start("identity", "", "", 1)
        trace.compute(2, 0, 0, 3)
        for name in names:
            trace.capture(name)
        trace.release()

    out = {"a traced request's trace (sampled, 13 timestamps, to the file)": _median_us(one_trace, 20000)}
    manager.close()
    untraced = TraceManager(from_flags([], environ={}))
    out["a request when tracing is off (the sampling check)"] = _median_us(lambda: untraced.sample("identity"), 20000)
    for label, size in (("64 B", 64), ("64 KiB", 1 << 16), ("1 MiB", 1 << 20), ("16 MiB", 1 << 24)):
        data = np.zeros(size // 4, dtype=np.float32)
        request = InferenceRequest("m", "", [Tensor("X", DataType.FP32, data.shape, data)])
        out[f"cache key of a {label} input"] = _median_us(lambda r=request: request_key("m", "1", r), 200 if size < 1 << 24 else 20)
    cache = ResponseCache(1 << 20)
    stats = ModelStatistics()
    small = InferenceRequest("m", "", [Tensor("X", DataType.FP32, (16,), np.zeros(16, dtype=np.float32))])

    async def answer(request: InferenceRequest) -> InferenceResponse:
        return InferenceResponse("m", "1", [Tensor("Y", DataType.FP32, (16,), np.zeros(16, dtype=np.float32))])

    asyncio.run(cache.infer("m", "1", small, stats, 1, answer))
    loop = asyncio.new_event_loop()
    out["a cache hit (key, look-up, answer) for a 64 B input"] = _median_us(
        lambda: loop.run_until_complete(cache.infer("m", "1", small, stats, 1, answer)), 5000
    )
    loop.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per trial (default: 3)")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per trial (default: 1)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is kept (default: 3)")
    parser.add_argument("--output-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build(repo)
        trace_file = Path(tmp) / "trace.json"
        flags = ["--cache-config", "local,size=268435456", "--trace-config", f"triton,file={trace_file}",
                 "--trace-config", "rate=1"]  # fmt: skip
        with QuiverServer(repo, flags, log=Path(tmp) / "server.log") as server:
            endpoints = server.endpoints
            host, port = endpoints.address("binary")
            settings = f"http://{endpoints.http}/v2/trace/setting"

            def trial(name: str, batch: list[Payload], concurrency: int) -> None:
                print(f"{name}, concurrency {concurrency}", file=sys.stderr)
                result = run_trial(
                    host, port, "binary", concurrency, args.warmup, args.duration, batch,
                    server_pid=endpoints.pid, progress=None,
                )  # fmt: skip
                if result.errors:
                    raise SystemExit(f"{name}: {result.errors} errors: {result.first_error}")
                rows.append({"scenario": name, **result.to_dict()})

            fresh = iter(range(1, 1 << 30, 30_000))  # inputs never sent before: every one a miss
            for _ in range(args.rounds):
                for concurrency in (1, 8):
                    scenarios: list[tuple[str, list[Payload], str | None]] = [
                        ("identity, tracing off", payloads("identity", 1), None),
                        ("identity, every request traced", payloads("identity", 1), "TIMESTAMPS"),
                        ("work (2 ms), no cache", payloads("work", 1), "OFF"),
                        ("work, cache hits", payloads("work_cached", 1), None),
                        ("work, cache misses", payloads("work_cached", 30_000, next(fresh)), None),
                    ]
                    for name, batch, level in scenarios:
                        if level is not None:
                            requests.post(settings, json={"trace_level": [level]}, timeout=10).raise_for_status()
                        trial(name, batch, concurrency)
                    requests.post(settings, json={"trace_level": ["OFF"]}, timeout=10).raise_for_status()
        micro = in_process(Path(tmp))
    rows = median_rounds(rows)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "trace_cache",
        "command": command_line(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "environment": environment(["numpy", "tritonclient"]),
        "rows": rows,
        "in_process": micro,
    }
    (args.output_dir / "trace_cache.json").write_text(json.dumps(report, indent=2))
    base = {
        (r["concurrency"], r["scenario"].split(",")[0]): r
        for r in rows
        if r["scenario"] in ("identity, tracing off", "work (2 ms), no cache")
    }
    lines = [
        f"# Tracing and the response cache ({report['when']})",
        "",
        f"`{report['command']}`; HTTP binary, {args.duration:g} s per trial after {args.warmup:g} s warm-up; "
        "ratios against the same model in the same run without tracing / without the cache.",
        "",
        "| scenario | concurrency | req/s | p50 ms | p99 ms | req/s vs base | server CPU % | req/s of each round |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        key = "identity" if row["scenario"].startswith("identity") else "work (2 ms)"
        ref = base.get((row["concurrency"], key))
        ratio = row["req_per_s"] / ref["req_per_s"] if ref and ref["req_per_s"] else float("nan")
        cpu = row.get("server_cpu_pct")
        lines.append(
            f"| {row['scenario']} | {row['concurrency']} | {row['req_per_s']:.0f} | {row['p50_ms']:.2f} | "
            f"{row['p99_ms']:.2f} | {ratio:.2f} | {cpu if cpu is None else f'{cpu:.0f}'} | "
            f"{', '.join(str(v) for v in row['rounds_req_per_s'])} |"
        )
    lines += [
        "",
        "In-process (median of many):",
        "",
        "| what | µs |",
        "|---|---:|",
    ]
    lines += [f"| {what} | {us:.1f} |" for what, us in micro.items()]
    text = "\n".join(lines) + "\n"
    (args.output_dir / "trace_cache.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
