"""The soak: one ``quiver serve`` under mixed traffic for a long time (30 minutes by default),
sampled from outside; does anything grow, and does any request fail?

Run: ``.venv/bin/python -m benchmarks.soak`` from the repository root (``make bench-soak``;
``ARGS="--duration 120"`` for a short run); ``--help`` for options.

**The server** (``benchmarks/peers/quiver.py``'s ``QuiverServer``): ``--model-control-mode on_demand``
with a ``--model-memory-limit`` that holds about ``--room`` of the repository's ``--models``
models, and ``--load-model soak_pipeline``. The repository, built in a temporary folder:

- ``model_00000`` .. ``model_000NN``: ``OUTPUT0 = INPUT0 + i`` on FP32 [batch, 4], even ``i``
  ONNX (``tests/support/archives.py``'s ``weighted_add``: weights read at run time, so they
  stay in memory), odd ``i`` Python (``model.py`` holding a numpy ballast), each holding
  ``--weight-mb`` of weights. A Zipf mix over them loads models on demand and evicts others
  all the time.
- ``soak_pipeline``: an ensemble, ``soak_double`` (Python, ``x * 2``) then ``soak_shift``
  (ONNX, ``+ 1``, dynamic batching), loaded at start; it is used often enough to stay
  resident (if it is evicted, it loads again on its next request, and that shows in the
  loads).

**The traffic** (``benchmarks/loadgen.py``: every stream a trial of its own, all at once on one
event loop, each paced at a fixed rate, ``--concurrency`` requests in flight at most):

- the Zipf(``--zipf``) mix over the models (ONNX and Python alike) over HTTP JSON, HTTP
  binary and gRPC, ``--rate`` requests/s each (different draws of the mix);
- the ensemble over HTTP JSON, HTTP binary and gRPC, ``--ensemble-rate`` requests/s each;
- a trickle of bad requests (``--bad-rate`` per second over HTTP, half that over gRPC):
  malformed JSON, an unknown model, a wrong shape, a wrong datatype. Each must be refused with
  its exact status (400, 404; gRPC ``INVALID_ARGUMENT``, ``NOT_FOUND``): such refusals are
  counted as *rejected*, not as errors; any other answer is an error.

An error is a status other than the one expected (a non-200 for a good request), a wrong
answer (one answer in ``--check-every`` is decoded and compared in full, and each model's
first), a request unanswered after ``--request-timeout`` seconds, a request lost with its
connection, or a ``/metrics`` scrape that failed.

**The sampling**, every ``--sample-interval`` seconds, from outside the server (psutil on its
pid): RSS, open file descriptors, threads, CPU time, and from its ``/metrics``
``quiver_model_memory_used_bytes`` (what the budget counts), ``quiver_loaded_model_count``,
loads, evictions; and the requests, rejections and errors of each stream so far.

**The verdict.** The first ``--warmup-fraction`` of the run is left out (models, caches and
pools fill up). Over the rest, each series is fitted with a least-squares line: *slope* per
hour, *drift* = slope x the window's length (what the line says it grew over the window), and
*noise* = the standard deviation of the samples around the line. A series is **flat within
noise** when ``|drift| <= max(2 x noise, one unit)`` (one unit: 1 MiB for memory, 1 for
files and threads): the growth the line claims is no larger than the samples' own scatter.
Fitted: RSS, RSS minus the model memory the server accounts for (the server's own overhead:
the models coming and going are most of RSS's noise), open files, threads.

**Output**: ``OUTPUT_DIR/soak.md`` (the tables), ``OUTPUT_DIR/soak.png`` (RSS, files, threads and
the traffic over time; drawn by the throwaway matplotlib venv, ``common.plot_in_venv``), and the
raw samples ``OUTPUT_DIR/raw/soak.json`` (git-ignored) with the server's log beside it. Exit
status 1 if any error was counted, the server died or exited non-zero; ``--plot-from
raw/soak.json [--png PATH]`` only draws the plot again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import ROOT

RESULTS = ROOT / "benchmarks" / "results"
MiB = 1 << 20

PIPELINE = "soak_pipeline"
#: the server's own metrics sampled (unlabelled samples)
METRICS = (
    "quiver_model_memory_used_bytes",
    "quiver_model_memory_limit_bytes",
    "quiver_loaded_model_count",
    "quiver_model_loading_time_us_count",
    "quiver_model_evictions_total",
    "quiver_model_load_failures_total",
    "quiver_model_cache_hit_total",
    "quiver_model_cache_miss_total",
)
#: the series fitted: key in a sample, label, unit, resolution (one unit)
SERIES = (
    ("rss_mib", "RSS (MiB)", "MiB", 1.0),
    ("rss_minus_models_mib", "RSS minus model memory (MiB)", "MiB", 1.0),
    ("fds", "open files (fds)", "", 1.0),
    ("threads", "threads", "", 1.0),
)


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the repository -------------------------------------------------------------------------

def config(name: str, kind: str, extra: str = "") -> str:
    """A model of the soak's ``config.pbtxt``: FP32 [batch, 4] in and out, batches of 8 at most;
    ``kind`` is its ``backend:`` or ``platform:`` line."""
    return f"""
name: "{name}"
{kind}
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}"""


ONNX = 'backend: "onnxruntime"'
PYTHON = 'backend: "python"'

DOUBLE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)]
            )
            for r in requests
        ]
"""

PIPELINE_STEPS = """
ensemble_scheduling {
  step [
    {
      model_name: "soak_double"
      model_version: -1
      input_map { key: "INPUT0" value: "INPUT0" }
      output_map { key: "OUTPUT0" value: "doubled" }
    },
    {
      model_name: "soak_shift"
      model_version: -1
      input_map { key: "INPUT0" value: "doubled" }
      output_map { key: "OUTPUT0" value: "OUTPUT0" }
    }
  ]
}
"""


def model_name(i: int) -> str:
    return f"model_{i:05d}"


def build_repository(root: Path, models: int, weight_mb: int) -> None:
    """The models (even: ONNX, odd: Python; ``OUTPUT0 = INPUT0 + i``) and the ensemble."""
    archives, support = common.test_support("archives"), common.test_support("models")
    for i in range(models):
        name = model_name(i)
        if i % 2 == 0:
            support.write_onnx(root, name, archives.weighted_add(float(i), weight_mb), config(name, ONNX))
        else:
            support.write_python(root, name, common.ballast_model(weight_mb, float(i)), config(name, PYTHON))
    support.write_python(root, "soak_double", DOUBLE_MODEL, config("soak_double", PYTHON))
    support.write_onnx(root, "soak_shift", support.add_constant_onnx(1.0), config("soak_shift", ONNX, "dynamic_batching { }"))
    support.write_config(root, PIPELINE, config(PIPELINE, 'platform: "ensemble"', PIPELINE_STEPS))


def memory_limit(room: int, weight_mb: int) -> int:
    """Bytes for about ``room`` models: each is measured at its weights and about half a MiB
    more (counted at 1 MiB more here); plus 16 MiB for ONNX Runtime's one-time cost (charged
    to the first ONNX model loaded) and 4 MiB for the ensemble's two small models (the server
    counts no model below 2 MiB)."""
    return (room * (weight_mb + 1) + 16 + 4) * MiB


# -- the traffic ----------------------------------------------------------------------------


@dataclass
class Stream:
    """One loadgen trial of the soak."""

    key: str
    label: str
    encoding: str
    concurrency: int
    rate: float
    payloads: list[Any]
    mix: list[int] | None = None
    bad: bool = False  # every request of it must be refused
    result: Any = None  # its loadgen.TrialResult, filled in while it runs


def streams(args: argparse.Namespace) -> list[Stream]:
    import numpy as np

    from benchmarks.loadgen import Payload, zipf_sequence

    x = np.array([[0.5, -1.25, 3.0, 7.75]], dtype=np.float32)
    models = [
        Payload(model_name(i), {"INPUT0": x}, expected={"OUTPUT0": x + np.float32(i)}, atol=1e-6)
        for i in range(args.models)
    ]
    pipeline = Payload(PIPELINE, {"INPUT0": x}, expected={"OUTPUT0": x * 2 + 1}, atol=1e-6)
    unknown = Payload("no_such_model", {"INPUT0": x}, status=404, grpc_status="NOT_FOUND")
    shape = Payload(PIPELINE, {"INPUT0": np.zeros((1, 5), np.float32)}, status=400, grpc_status="INVALID_ARGUMENT")
    datatype = Payload(PIPELINE, {"INPUT0": np.zeros((1, 4), np.int32)}, status=400, grpc_status="INVALID_ARGUMENT")
    malformed = Payload(PIPELINE, {}, body=b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2,', status=400)
    length = max(10_000, int(args.rate * args.duration) + 1)
    out = []
    for seed, (encoding, label) in enumerate((("json", "HTTP JSON"), ("binary", "HTTP binary"), ("grpc", "gRPC")), start=args.seed):
        mix = zipf_sequence(args.models, args.zipf, length, seed=seed)
        out.append(Stream(f"models-{encoding}", f"Zipf over {args.models} models (ONNX + Python), {label}",
                          encoding, args.concurrency, args.rate, models, mix))
    for encoding, label in (("json", "HTTP JSON"), ("binary", "HTTP binary"), ("grpc", "gRPC")):
        out.append(Stream(f"ensemble-{encoding}", f"ensemble {PIPELINE}, {label}", encoding, args.concurrency,
                          args.ensemble_rate, [pipeline]))
    out.append(Stream("bad-http", "bad requests, HTTP (malformed JSON, unknown model, wrong shape, wrong datatype)",
                      "json", 1, args.bad_rate, [malformed, unknown, shape, datatype], bad=True))
    out.append(Stream("bad-grpc", "bad requests, gRPC (unknown model, wrong shape, wrong datatype)",
                      "grpc", 1, args.bad_rate / 2, [unknown, shape, datatype], bad=True))
    return out


def sanity_checks(endpoints: Any, args: argparse.Namespace) -> None:
    """One request of each kind checked in full before the soak starts (a model of each
    backend and the ensemble, in every encoding)."""
    import numpy as np

    from benchmarks.loadgen import Payload, sanity_check

    x = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    checks = [Payload(PIPELINE, {"INPUT0": x}, expected={"OUTPUT0": x * 2 + 1})]
    checks += [Payload(model_name(i), {"INPUT0": x}, expected={"OUTPUT0": x + i}) for i in range(min(2, args.models))]
    for payload in checks:
        for encoding in ("json", "binary", "grpc"):
            sanity_check(*endpoints.address(encoding), encoding, payload, timeout=args.request_timeout)


# -- sampling -------------------------------------------------------------------------------


def read_server(process: Any, metrics_url: str) -> dict[str, Any]:
    """One sample of the server, from outside (blocking: run it in a thread)."""
    import psutil

    sample: dict[str, Any] = {}
    try:
        with process.oneshot():
            sample["rss_mib"] = process.memory_info().rss / MiB
            sample["fds"] = process.num_fds()
            sample["threads"] = process.num_threads()
            sample["cpu_s"] = float(sum(process.cpu_times()[:2]))
        children = process.children(recursive=True)
        sample["children"] = len(children)
        sample["children_rss_mib"] = sum(c.memory_info().rss for c in children) / MiB if children else 0.0
    except psutil.Error as exc:
        sample["server_gone"] = f"{type(exc).__name__}: {exc}"
        return sample
    try:
        sample["metrics"] = common.scrape(metrics_url, METRICS, timeout=10)
    except Exception as exc:  # any failure to scrape is reported as such
        sample["scrape_error"] = f"{type(exc).__name__}: {exc}"
        return sample
    used = sample["metrics"].get("quiver_model_memory_used_bytes")
    if used is not None:
        sample["model_memory_mib"] = used / MiB
        sample["rss_minus_models_mib"] = sample["rss_mib"] - used / MiB
    return sample


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def errors_of(result: Any) -> int:
    return int(result.non_200 + result.wrong_answers + result.connection_errors + result.timeouts)


async def sample_loop(pid: int, metrics_url: str, soak: list[Stream], interval: float, done: asyncio.Event) -> list[dict[str, Any]]:
    """A sample now, then every ``interval`` seconds, and a last one once ``done`` is set."""
    import psutil

    process = psutil.Process(pid)
    loop = asyncio.get_running_loop()
    start = loop.time()
    seen = {s.key: 0 for s in soak}  # latencies read so far per stream
    samples: list[dict[str, Any]] = []
    tick = 0
    while True:
        sample = await asyncio.to_thread(read_server, process, metrics_url)
        sample["t"] = round(loop.time() - start, 3)
        sample["requests"] = {s.key: len(s.result.latencies_ns) for s in soak}
        sample["rejected"] = {s.key: s.result.rejected for s in soak}
        sample["errors"] = {s.key: errors_of(s.result) for s in soak}
        fresh = []  # latencies of good requests since the last sample
        for s in soak:
            lat = s.result.latencies_ns
            if not s.bad:
                fresh += lat[seen[s.key] :]
            seen[s.key] = len(lat)
        p50, p99 = percentile(fresh, 50), percentile(fresh, 99)
        sample["p50_ms"] = None if p50 is None else round(p50 / 1e6, 3)
        sample["p99_ms"] = None if p99 is None else round(p99 / 1e6, 3)
        if done.is_set():
            sample["final"] = True  # after the traffic: connections closed; not fitted
        samples.append(sample)
        log(describe(sample))
        if done.is_set() or "server_gone" in sample:
            return samples
        tick += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=max(0.0, start + tick * interval - loop.time()))


def describe(sample: dict[str, Any]) -> str:
    if "server_gone" in sample:
        return f"{sample['t']:7.1f} s: the server is gone ({sample['server_gone']})"
    m = sample.get("metrics", {})
    models = (f"{m['quiver_loaded_model_count']:.0f} models loaded ({sample['model_memory_mib']:.1f} MiB), "
              f"{m.get('quiver_model_loading_time_us_count', 0):.0f} loads, "
              if "model_memory_mib" in sample else f"metrics: {sample.get('scrape_error')}, ")
    return (
        f"{sample['t']:7.1f} s: RSS {sample['rss_mib']:.1f} MiB, fds {sample['fds']}, threads {sample['threads']}, "
        f"{models}{sum(sample['requests'].values()):,} requests, p99 {sample['p99_ms']} ms, "
        f"rejected {sum(sample['rejected'].values())}, errors {sum(sample['errors'].values())}"
    )


async def soak_run(endpoints: Any, soak: list[Stream], args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.loadgen import TrialResult, run_trial_async

    trials = []
    for s in soak:
        s.result = TrialResult()
        trials.append(run_trial_async(
            *endpoints.address(s.encoding), s.encoding, s.concurrency, 0.0, args.duration, s.payloads, mix=s.mix,
            check_every=args.check_every, progress=None, result=s.result, rate=s.rate,
            request_timeout_s=args.request_timeout, drain_timeout_s=args.request_timeout + 5,
        ))
    done = asyncio.Event()
    sampler = asyncio.get_running_loop().create_task(
        sample_loop(endpoints.pid, f"http://{endpoints.metrics}/metrics", soak, args.sample_interval, done)
    )
    try:
        await asyncio.gather(*trials)
    finally:
        done.set()
    return await sampler


# -- analysis -------------------------------------------------------------------------------


def fit(ts: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b t``: (b, a, standard deviation of the residuals, n - 2 dof)."""
    n = len(ts)
    mt, my = sum(ts) / n, sum(ys) / n
    stt = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / stt if stt else 0.0
    intercept = my - slope * mt
    residual = sum((y - intercept - slope * t) ** 2 for t, y in zip(ts, ys, strict=True))
    return slope, intercept, math.sqrt(residual / (n - 2)) if n > 2 else 0.0


def trend(samples: list[dict[str, Any]], key: str, resolution: float, warmup_fraction: float) -> dict[str, Any]:
    """The fitted line of ``key`` over the samples after the warm-up, and the verdict."""
    points = [(s["t"], float(s[key])) for s in samples if s.get(key) is not None and not s.get("final")]
    if not points:
        return {"verdict": "no samples"}
    end = points[-1][0]
    window = [(t, y) for t, y in points if t >= warmup_fraction * end]
    ts, ys = [t for t, _ in window], [y for _, y in window]
    out: dict[str, Any] = {
        "start": points[0][1], "window_start": ys[0] if ys else None, "end": points[-1][1],
        "min": min(ys) if ys else None, "max": max(ys) if ys else None, "samples": len(window),
        "window_s": (ts[-1] - ts[0]) if ts else 0.0,
    }
    if len(window) < 3:
        out["verdict"] = "too few samples"
        return out
    slope, intercept, noise = fit(ts, ys)
    drift = slope * (ts[-1] - ts[0])
    limit = max(2 * noise, resolution)
    out.update({
        "slope_per_hour": slope * 3600, "intercept": intercept, "drift": drift, "noise": noise,
        "fit_t": [ts[0], ts[-1]], "flat": abs(drift) <= limit,
        "verdict": "flat within noise" if abs(drift) <= limit else ("GROWS" if drift > 0 else "falls"),
    })
    return out


def server_log_summary(path: Path) -> dict[str, Any]:
    """Warning and error lines of the server's log, and the first few distinct ones."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"warnings": None, "errors": None, "tracebacks": None, "first": []}
    level = re.compile(r"^\S+ ([WEC]) (\S+)\] (.*)")
    first: list[str] = []
    counts = {"W": 0, "E": 0, "C": 0}
    for line in lines:
        match = level.match(line)
        if match:
            counts[match.group(1)] += 1
            text = f"{match.group(1)} {match.group(2)}] {re.sub(r'[0-9]+', 'N', match.group(3))[:160]}"
            if text not in first and len(first) < 8:
                first.append(text)
    return {"warnings": counts["W"], "errors": counts["E"] + counts["C"],
            "tracebacks": sum(1 for line in lines if line.startswith("Traceback")), "first": first}


def analyse(samples: list[dict[str, Any]], soak: list[Stream], args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    trends = {key: {"label": label, "unit": unit, **trend(samples, key, resolution, args.warmup_fraction)}
              for key, label, unit, resolution in SERIES}
    kinds = []
    for s in soak:
        r = s.result
        lat = r.latencies_ns
        kinds.append({
            "key": s.key, "label": s.label, "bad": s.bad, "encoding": s.encoding, "concurrency": s.concurrency, "rate": s.rate,
            "requests": len(lat), "req_per_s": r.req_per_s, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms,
            "rejected": r.rejected, "errors": errors_of(r), "non_200": r.non_200, "wrong_answers": r.wrong_answers,
            "connection_errors": r.connection_errors, "timeouts": r.timeouts, "answers_checked": r.answers_checked,
            "first_error": r.first_error, "model_requests": r.model_requests,
        })
    scrape_failures = sum(1 for s in samples if "scrape_error" in s)
    metric_samples = [s["metrics"] for s in samples if "metrics" in s]
    first_m, last_m = (metric_samples[0], metric_samples[-1]) if metric_samples else ({}, {})

    def grew(name: str) -> float | None:
        return last_m[name] - first_m[name] if name in last_m and name in first_m else None

    limit = last_m.get("quiver_model_memory_limit_bytes")
    used = [m["quiver_model_memory_used_bytes"] for m in metric_samples if "quiver_model_memory_used_bytes" in m]
    loaded = [m["quiver_loaded_model_count"] for m in metric_samples if "quiver_loaded_model_count" in m]
    server = {
        "loads": grew("quiver_model_loading_time_us_count"),
        "evictions": grew("quiver_model_evictions_total"),
        "load_failures": grew("quiver_model_load_failures_total"),
        "cache_hits": grew("quiver_model_cache_hit_total"),
        "cache_misses": grew("quiver_model_cache_miss_total"),
        "most_models_loaded": max(loaded) if loaded else None,
        "fewest_models_loaded": min(loaded) if loaded else None,
        "memory_limit_mib": limit / MiB if limit else None,
        "peak_model_memory_mib": max(used) / MiB if used else None,
        "samples_over_limit": sum(1 for u in used if limit and u > limit),
        "cpu_pct": None,
    }
    alive = [s for s in samples if "cpu_s" in s]
    if len(alive) > 1 and alive[-1]["t"] > alive[0]["t"]:
        server["cpu_pct"] = 100 * (alive[-1]["cpu_s"] - alive[0]["cpu_s"]) / (alive[-1]["t"] - alive[0]["t"])
    errors = sum(k["errors"] for k in kinds) + scrape_failures
    return {
        "trends": trends, "kinds": kinds, "server": server, "scrape_failures": scrape_failures,
        "requests": sum(k["requests"] for k in kinds if not k["bad"]),
        "rejected": sum(k["rejected"] for k in kinds), "errors": errors,
        "server_gone": next((s["server_gone"] for s in samples if "server_gone" in s), None), **extra,
    }


# -- the report -----------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def markdown(report: dict[str, Any]) -> str:
    a, s, env = report["analysis"], report["settings"], report["environment"]
    minutes = s["duration_s"] / 60
    lines = [
        f"# Soak: {minutes:g} minutes of mixed traffic on one `quiver serve`",
        "",
        f"- Command: `{report['command']}`",
        f"- Date: {env['date']}; {env['nproc']} cores ({env['cpu_model']}), Python {env['python']}, "
        f"load average at start {report['load_average_start']}, at end {report['load_average_end']}.",
        f"- Server: `quiver serve --model-control-mode on_demand --model-memory-limit {s['memory_limit_bytes']} "
        f"--load-model {PIPELINE}` on {s['models']} models (even ONNX, odd Python, {s['weight_mb']} MiB of weights each; "
        f"the limit holds about {s['room']}) and the ensemble `{PIPELINE}` (Python x2 -> ONNX +1).",
        f"- Traffic (benchmarks/loadgen.py, paced): Zipf({s['zipf']}) over the models at {s['rate']:g} req/s in each of "
        f"HTTP JSON, HTTP binary and gRPC; the ensemble at {s['ensemble_rate']:g} req/s in each; bad requests at "
        f"{s['bad_rate']:g}/s over HTTP and {s['bad_rate'] / 2:g}/s over gRPC; at most {s['concurrency']} in flight per stream; "
        f"one answer in {s['check_every']} checked in full; timeout {s['request_timeout_s']:g} s.",
        f"- Sampled every {s['sample_interval_s']:g} s from outside (psutil on the server's pid, and its /metrics). "
        f"Trends are fitted after the first {100 * s['warmup_fraction']:g}% of the run.",
        "",
        "## Resources",
        "",
        "| measure | start | after warm-up | end | min | max | slope per hour | drift over the window | noise (sd) | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in a["trends"].values():
        digits = 1 if t["unit"] else 0
        lines.append(
            f"| {t['label']} | {fmt(t.get('start'), digits)} | {fmt(t.get('window_start'), digits)} | {fmt(t.get('end'), digits)} "
            f"| {fmt(t.get('min'), digits)} | {fmt(t.get('max'), digits)} | {fmt(t.get('slope_per_hour'), 2)} "
            f"| {fmt(t.get('drift'), 2)} | {fmt(t.get('noise'), 2)} | **{t['verdict']}** |"
        )
    lines += [
        "",
        "Slope: least squares over the samples after the warm-up; drift: slope x the window's length, what the "
        "line says the series grew over it; noise: the standard deviation of those samples around the line. "
        "**Flat within noise** means |drift| <= max(2 sd, one unit), one unit being 1 MiB or 1 file or thread. "
        "RSS minus model memory is RSS less `quiver_model_memory_used_bytes` (what the budget counts), "
        "the server's own overhead without the models coming and going.",
        "",
        "## Requests",
        "",
        "| stream | requests | req/s | p50 ms | p99 ms | rejected as expected | errors | wrong status | wrong answers | connection | timeouts | answers checked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in a["kinds"]:
        lines.append(
            f"| {k['label']} | {k['requests']:,} | {k['req_per_s']:.1f} | {fmt(k['p50_ms'], 2)} | {fmt(k['p99_ms'], 2)} "
            f"| {k['rejected']:,} | **{k['errors']}** | {k['non_200']} | {k['wrong_answers']} | {k['connection_errors']} "
            f"| {k['timeouts']} | {k['answers_checked']:,} |"
        )
    lines.append(f"| GET /metrics (the sampler) | {len(report['samples'])} | - | - | - | - | **{a['scrape_failures']}** | - | - | - | - | - |")
    lines += ["", f"**Errors: {a['errors']}** ({a['requests']:,} good requests, {a['rejected']:,} bad ones refused as expected)."]
    first = [f"- {k['label']}: {k['first_error']}" for k in a["kinds"] if k["first_error"]]
    if first:
        lines += ["", "First error of each stream:", "", *first]
    if a["server_gone"]:
        lines += ["", f"**The server died during the run**: {a['server_gone']}"]
    srv, slog = a["server"], a["server_log"]
    lines += [
        "",
        "## The server",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| model loads / evictions / failed loads | {fmt(srv['loads'], 0)} / {fmt(srv['evictions'], 0)} / {fmt(srv['load_failures'], 0)} |",
        f"| requests that found their model loaded / waited for a load | {fmt(srv['cache_hits'], 0)} / {fmt(srv['cache_misses'], 0)} |",
        f"| models loaded at once, fewest / most | {fmt(srv['fewest_models_loaded'], 0)} / {fmt(srv['most_models_loaded'], 0)} |",
        f"| model memory used, peak / limit (MiB) | {fmt(srv['peak_model_memory_mib'])} / {fmt(srv['memory_limit_mib'])} |",
        f"| server CPU, mean over the run (% of one core) | {fmt(srv['cpu_pct'])} |",
        f"| server log: warnings / errors / tracebacks | {fmt(slog['warnings'])} / {fmt(slog['errors'])} / {fmt(slog['tracebacks'])} |",
        f"| server exit code after SIGTERM | {fmt(a['server_exit_code'])} |",
    ]
    if slog["first"]:
        lines += ["", "Distinct warning and error lines of the server's log (digits as N):", "",
                  *[f"- `{line}`" for line in slog["first"]]]
    if srv["samples_over_limit"]:
        lines += ["", f"**The model memory used was over the limit in {srv['samples_over_limit']} of "
                  f"{len(report['samples'])} samples.**"]
    return "\n".join(lines) + "\n"


# -- main -----------------------------------------------------------------------------------


#: The numeric options: flag, type, default, metavar, help (the default is added to it).
OPTIONS: tuple[tuple[str, type, float, str, str], ...] = (
    ("--duration", float, 1800, "S", "seconds of traffic"),
    ("--sample-interval", float, 5, "S", "seconds between samples"),
    ("--warmup-fraction", float, 0.1, "F", "share of the run left out of the fits"),
    ("--models", int, 24, "N", "models in the repository, half ONNX, half Python"),
    ("--room", int, 8, "N", "models the memory limit holds, about"),
    ("--weight-mb", int, 8, "MB", "weights each model holds"),
    ("--zipf", float, 1.0, "S", "Zipf exponent of the mix over the models"),
    ("--rate", float, 5, "R", "requests/s over the models, in each encoding"),
    ("--ensemble-rate", float, 10, "R", "requests/s to the ensemble, in each encoding"),
    ("--bad-rate", float, 1, "R", "bad requests/s over HTTP; half that over gRPC"),
    ("--concurrency", int, 2, "N", "requests in flight at most, per stream"),
    ("--check-every", int, 10, "N", "check one answer in N in full"),
    ("--request-timeout", float, 30, "S", "a request unanswered this long is an error"),
    ("--seed", int, 1, "SEED", "seed of the Zipf draws"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="A soak of one quiver serve under mixed traffic: RSS, open files and threads sampled over time.")
    add = parser.add_argument
    for flag, kind, default, metavar, text in OPTIONS:
        add(flag, type=kind, default=default, metavar=metavar, help=f"{text} (default: {default})")
    add("--output-dir", type=Path, default=RESULTS, metavar="DIR", help="where soak.md and soak.png go; raw/ under it (default: benchmarks/results)")
    add("--no-plot", action="store_true", help="do not draw soak.png")
    add("--plot-from", type=Path, metavar="JSON", help="only draw the plot of an earlier run's raw JSON")
    add("--png", type=Path, metavar="PATH", help="with --plot-from: where the PNG goes (default: beside the JSON)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_from is not None:
        return common.plot_from("soak", args.plot_from, args.png or args.plot_from.with_suffix(".png"))
    if args.duration <= 0 or args.sample_interval <= 0 or not 0 <= args.warmup_fraction < 1 or args.models < 2 or args.room < 1:
        raise SystemExit("need --duration > 0, --sample-interval > 0, 0 <= --warmup-fraction < 1, --models >= 2, --room >= 1")

    from benchmarks.peers import PeerError
    from benchmarks.peers.quiver import QuiverServer

    env = common.environment(["onnxruntime", "numpy", "psutil", "grpcio", "uvicorn"])
    out: Path = args.output_dir
    raw = out / "raw"
    limit = memory_limit(args.room, args.weight_mb)
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="quiver-soak-") as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repository"
        log(f"building {args.models} models of {args.weight_mb} MiB and the ensemble in {repository}")
        build_repository(repository, args.models, args.weight_mb)
        flags = ["--model-control-mode", "on_demand", "--model-memory-limit", str(limit), "--load-model", PIPELINE]
        server = QuiverServer(repository, flags, log=tmp / "server" / "server.log", cwd=tmp,
                              ready_path=f"/v2/models/{PIPELINE}/ready")
        try:
            endpoints = server.start()
        except PeerError as exc:
            log(f"the server did not start: {exc}")
            return 1
        log(f"quiver serve (pid {endpoints.pid}) at HTTP {endpoints.http}, gRPC {endpoints.grpc}, metrics {endpoints.metrics}; "
            f"model memory limit {limit / MiB:.0f} MiB")
        try:
            try:
                sanity_checks(endpoints, args)
            except RuntimeError as exc:
                log(f"a request checked before the soak failed: {exc}")
                return 1
            soak = streams(args)
            log(f"{len(soak)} streams for {args.duration:g} s, a sample every {args.sample_interval:g} s")
            samples = common.run_async(soak_run(endpoints, soak, args))
        finally:
            exit_code = server.stop()
        raw.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copyfile(server.log, raw / "soak-server.log")
        extra = {"server_exit_code": exit_code, "server_log": server_log_summary(server.log)}

    analysis = analyse(samples, soak, args, extra)
    settings = {
        "duration_s": args.duration, "sample_interval_s": args.sample_interval, "warmup_fraction": args.warmup_fraction,
        "models": args.models, "room": args.room, "weight_mb": args.weight_mb, "memory_limit_bytes": limit,
        "zipf": args.zipf, "rate": args.rate, "ensemble_rate": args.ensemble_rate, "bad_rate": args.bad_rate,
        "concurrency": args.concurrency, "check_every": args.check_every, "request_timeout_s": args.request_timeout,
        "seed": args.seed,
    }
    report = {
        "benchmark": "soak", "command": common.command_line(), "environment": env, "settings": settings,
        "load_average_start": load_start, "load_average_end": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "analysis": analysis, "samples": samples,
    }
    raw_json = raw / "soak.json"
    raw_json.write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.md").write_text(text)
    print(text)
    log(f"wrote {out / 'soak.md'}, raw samples in {raw_json}")
    if not args.no_plot:
        log(f"plot: {common.plot_in_venv('soak', raw_json, out / 'soak.png')}")
    failed = analysis["errors"] or analysis["server_gone"] or exit_code != 0
    if failed:
        log(f"FAILED: {analysis['errors']} errors, server gone: {analysis['server_gone']}, exit code {exit_code}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
