"""The multi-model workload: a skewed (Zipf) mix over many models with memory for a few.

Builds N small ONNX models (``model_00000`` .. , each ``OUTPUT0 = INPUT0 + i``) in a local
repository, serves them with ``quiver serve --model-control-mode on_demand
--model-memory-limit ...`` sized to hold about ``--resident`` of them, and replays a Zipf
trace one request at a time. Each request is classified as a hit or a miss exactly, from
the server's own ``quiver_model_cache_miss_total`` counter read after it. Reported:

- the server's hit rate next to the same trace replayed through ``lifecycle.eviction``'s
  simulator with LRU, and Belady's MIN (the offline optimum for equal sizes: no policy can
  get more hits on this trace with this room);
- loads per second, p50/p99 latency of hits and of misses;
- time to first inference for a cold model next to the floor: creating the same
  onnxruntime session and running it once, in-process.

Run: ``python benchmarks/multi_model.py [--models 1000 --resident 100 --requests 5000]``.
Writes ``benchmarks/results/multi_model.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from quiver.lifecycle.eviction import GreedyDualSizePolicy, LRUPolicy, belady, simulate, zipf_trace

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


def model(value: float) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "C"], ["OUTPUT0"])],
        "add",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        initializer=[helper.make_tensor("C", TensorProto.FLOAT, [1], [value])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return bytes(proto.SerializeToString())


def build(root: Path, count: int) -> list[str]:
    names = [f"model_{i:05d}" for i in range(count)]
    for i, name in enumerate(names):
        folder = root / name / "1"
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(model(float(i)))
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    return names


def log(message: str) -> None:
    print(f"[multi-model {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def post(url: str, body: bytes) -> dict[str, object]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: {exc.code} {exc.read().decode(errors='replace')}") from None


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=1000, help="models in the repository (default: 1000)")
    parser.add_argument("--resident", type=int, default=100, help="models the memory budget holds (default: 100)")
    parser.add_argument("--requests", type=int, default=5000, help="requests in the trace (default: 5000)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the mix (default: 1.0)")
    parser.add_argument("--seed", type=int, default=1, help="trace seed (default: 1)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args()

    trace_ranks = zipf_trace(args.models, args.requests, args.zipf, args.seed)
    trace = [f"model_{int(name.split('_')[1]):05d}" for name in trace_ranks]
    with tempfile.TemporaryDirectory(prefix="quiver-mm-") as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        log(f"building {args.models} models")
        build(repo, args.models)
        sample = repo / "model_00000" / "1" / "model.onnx"
        # The budget: what `resident` models take as the server counts them (it never counts
        # a model below what its files suggest: overhead + file bytes).
        per_model = 2 * 1024 * 1024 + sample.stat().st_size * 2
        # plus the one-time cost the first onnxruntime session of a process pays (measured
        # into the first model loaded), so the budget holds `resident` models after it
        limit = per_model * args.resident + 16 * 1024 * 1024
        exe = str(Path(sys.executable).parent / "quiver")
        cmd = [
            exe, "serve", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
            "--metrics-port", "0", "--model-control-mode", "on_demand", "--model-memory-limit",
            str(limit),
        ]
        log(" ".join(cmd))
        logfile = Path(tmp) / "server.log"
        with logfile.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            http = metrics = ""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (http and metrics):
                text = logfile.read_text()
                if m := re.search(r"started HTTP service at ([\d.]+:\d+)", text):
                    http = m.group(1)
                if m := re.search(r"started Metrics service at ([\d.]+:\d+)", text):
                    metrics = m.group(1)
                time.sleep(0.1)
            if not (http and metrics):
                raise RuntimeError(f"server did not start:\n{logfile.read_text()}")
            metrics_url = f"http://{metrics}/metrics"
            hits: list[float] = []
            misses: list[float] = []
            missed_models: list[str] = []
            x = np.arange(4, dtype=np.float32)
            started = time.monotonic()
            previous_misses = 0.0
            most_loaded = 0
            for index, name in enumerate(trace):
                body = json.dumps(
                    {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": x.tolist()}]}
                ).encode()
                t0 = time.perf_counter()
                answer = post(f"http://{http}/v2/models/{name}/infer", body)
                elapsed = (time.perf_counter() - t0) * 1000
                value = int(name.split("_")[1])
                got = answer["outputs"][0]["data"]  # type: ignore[index]
                if got != (x + value).tolist():
                    raise RuntimeError(f"wrong answer from {name}: {got}")
                now_misses = metric(metrics_url, "quiver_model_cache_miss_total")
                if now_misses > previous_misses:
                    misses.append(elapsed)
                    missed_models.append(name)
                else:
                    hits.append(elapsed)
                previous_misses = now_misses
                if index % 10 == 0 or index == len(trace) - 1:
                    most_loaded = max(most_loaded, int(metric(metrics_url, "quiver_loaded_model_count")))
                if index % 500 == 0:
                    log(f"{index}/{len(trace)} requests, hit rate so far {len(hits) / (index + 1):.3f}")
            wall = time.monotonic() - started
            evictions = metric(metrics_url, "quiver_model_evictions_total")
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        # Floor: the same model's session created and run once, in-process.
        import onnxruntime as ort

        floor = []
        for i in range(20):
            data = (repo / f"model_{i:05d}" / "1" / "model.onnx").read_bytes()
            t0 = time.perf_counter()
            session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
            session.run(None, {"INPUT0": x.reshape(1, 4)})
            floor.append((time.perf_counter() - t0) * 1000)

    # The simulations get the room the server really had: the most models it held at once.
    capacity = most_loaded or args.resident
    sizes = dict.fromkeys(set(trace), 1)
    lru = simulate(LRUPolicy(), trace, sizes, capacity)
    gds = simulate(GreedyDualSizePolicy(), trace, sizes, capacity)
    best = belady(trace, sizes, capacity)
    served_hit_rate = len(hits) / len(trace)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"nproc": os.cpu_count()},
        "models": args.models,
        "resident": args.resident,
        "requests": args.requests,
        "zipf": args.zipf,
        "distinct_models_requested": len(set(trace)),
        "most_models_loaded_at_once": capacity,
        "server_hit_rate": served_hit_rate,
        "lru_simulated_hit_rate": lru.hit_rate,
        "gds_simulated_hit_rate": gds.hit_rate,
        "belady_hit_rate": best.hit_rate,
        "loads": len(misses),
        "evictions": evictions,
        "loads_per_second": len(misses) / wall,
        "requests_per_second": len(trace) / wall,
        "hit_ms": {"p50": percentile(hits, 50), "p99": percentile(hits, 99)},
        "miss_ms": {"p50": percentile(misses, 50), "p99": percentile(misses, 99)},
        "cold_floor_ms": {"p50": statistics.median(floor)},
        "server_exit_code": code,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "multi_model.json").write_text(json.dumps(result, indent=2) + "\n")
    table = "\n".join(
        [
            f"# Multi-model: Zipf({args.zipf}) over {args.models} models, memory for {args.resident}",
            "",
            f"- Command: `python benchmarks/{result['command']}`",
            f"- Date: {result['date']}; {os.cpu_count()} cores; {args.requests} requests one at a "
            f"time over HTTP (JSON), {result['distinct_models_requested']} distinct models requested.",
            "- Hit or miss is exact per request: the server's `quiver_model_cache_miss_total` read after each.",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| most models loaded at once (the room the simulations get) | {capacity} |",
            f"| hit rate, Quiver (LRU) | {served_hit_rate:.3f} |",
            f"| hit rate, LRU simulated on the same trace | {lru.hit_rate:.3f} |",
            f"| hit rate, GreedyDual-Size simulated on the same trace | {gds.hit_rate:.3f} |",
            f"| hit rate, offline optimum (Belady MIN) | {best.hit_rate:.3f} |",
            f"| loads (misses) / evictions | {len(misses)} / {int(evictions)} |",
            f"| loads per second | {result['loads_per_second']:.1f} |",
            f"| requests per second (one at a time) | {result['requests_per_second']:.1f} |",
            f"| hit latency p50 / p99 ms | {percentile(hits, 50):.2f} / {percentile(hits, 99):.2f} |",
            f"| miss latency p50 / p99 ms (time to first inference of a cold model) | {percentile(misses, 50):.2f} / {percentile(misses, 99):.2f} |",
            f"| floor: same session created and run once in-process, p50 ms | {statistics.median(floor):.2f} |",
            "",
        ]
    )
    (args.output_dir / "multi_model.md").write_text(table)
    print(table)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
