"""The SageMaker platform's flow on the container entrypoint, and what CloudWatch publishing
costs inference.

``quiver sagemaker-serve`` in multi-model mode (as the image starts it), the platform played
from here: each TargetModel archive is extracted to ``<models>/<hash>/model``, then

- ``POST /models`` for each of ``--models`` models: the load latency (copy into the disk cache,
  load, register), median and 95th percentile;
- ``POST /models/<hash>/invoke`` from ``--concurrency`` clients for ``--seconds`` seconds,
  spread over the loaded models, with CloudWatch publishing off, on (into moto's CloudWatch
  Logs server, in a process of its own, every ``--interval`` seconds), and on but CloudWatch
  unreachable; and with the metrics on but not published (what publishing needs anyway):
  requests per second and latency, each next to publishing off (the ratio, same run).

Run: ``python -m benchmarks.sagemaker_platform [--models 20] [--seconds 10] [--concurrency 8]``.
Writes ``benchmarks/results/sagemaker_platform.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import command_line, environment, test_support, write_results
from benchmarks.peers import Server
from benchmarks.peers.quiver import QUIVER

HERE = Path(__file__).resolve().parent
ROW = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1.0, 2.0, 3.0, 4.0]}]}


def extract(archive: bytes, models: Path, name: str) -> Path:
    folder = models / name / "model"
    folder.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")
    return folder


def wait_for_port(host: str, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"moto's server did not listen on {host}:{port} in {timeout:g} s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load_all(base: str, folders: dict[str, Path]) -> list[float]:
    times = []
    async with aiohttp.ClientSession() as session:
        for name, folder in folders.items():
            start = time.perf_counter()
            async with session.post(f"{base}/models", json={"model_name": name, "url": str(folder)}) as reply:
                body = await reply.read()
                if reply.status != 200:
                    raise RuntimeError(f"POST /models {name}: {reply.status} {body!r}")
            times.append(time.perf_counter() - start)
    return times


async def drive(base: str, names: list[str], seconds: float, concurrency: int) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    body = json.dumps(ROW).encode()

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal errors
        i = index
        while time.perf_counter() < deadline:
            name = names[i % len(names)]
            i += concurrency
            start = time.perf_counter()
            async with session.post(
                f"{base}/models/{name}/invoke", data=body, headers={"Content-Type": "application/json"}
            ) as reply:
                await reply.read()
                if reply.status != 200:
                    errors += 1
            latencies.append(time.perf_counter() - start)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(i, session) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


def start(root: Path, log: Path, env: dict[str, str]) -> Server:
    argv = [str(QUIVER), "sagemaker-serve", "--model-root", str(root / "unused"),
            "--multi-model-repository", str(root / "sagemaker")]  # fmt: skip
    base_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SAGEMAKER_")},
        "SAGEMAKER_MULTI_MODEL": "true",
        "SAGEMAKER_BIND_TO_PORT": "0",
        "SAGEMAKER_TRITON_LOG_VERBOSE": "false",
        "QUIVER_CACHE_DIR": str(root / "cache"),
        **env,
    }
    return Server("quiver sagemaker-serve", argv, log=log, listeners=("SageMaker",), ready_path=None, env=base_env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", type=int, default=20, help="models loaded with POST /models (default: 20)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of traffic per configuration (default: 10)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients in flight (default: 8)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between CloudWatch publications (default: 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the configurations (default: 3)")
    parser.add_argument("--output-dir", type=Path, default=HERE / "results")
    args = parser.parse_args()
    archives = test_support("archives")
    # moto's server in a process of its own: in this one it would take CPU from the clients.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        host, port = probe.getsockname()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(host, port)
    aws = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    publish = {
        "SAGEMAKER_TRITON_ALLOW_METRICS": "true",
        "SAGEMAKER_TRITON_METRICS_PORT": "0",
        "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH": "true",
        "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP": "/aws/SageMaker/Endpoints/TritonMetrics/bench",
        "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE": "/aws/SageMaker/Endpoints/TritonMetrics/bench",
        "SAGEMAKER_TRITON_ADDITIONAL_ARGS": f"--cloudwatch-interval={args.interval}",
        **aws,
    }
    configurations = {
        "CloudWatch off": {},
        "metrics on, CloudWatch off": {"SAGEMAKER_TRITON_ALLOW_METRICS": "true", "SAGEMAKER_TRITON_METRICS_PORT": "0"},
        "CloudWatch on (moto)": {**publish, "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": f"http://{host}:{port}"},
        "CloudWatch on, unreachable": {**publish, "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": "http://127.0.0.1:9"},
    }
    trials: dict[str, list[dict[str, Any]]] = {label: [] for label in configurations}
    loads: list[float] = []
    order = list(configurations.items())
    runs = [item for r in range(args.rounds) for item in (order if r % 2 == 0 else order[::-1])]
    try:
        with tempfile.TemporaryDirectory(prefix="quiver-bench-sagemaker-") as tmp:
            for index, (label, env) in enumerate(runs):
                root = Path(tmp) / f"run{index}"
                root.mkdir(parents=True)
                folders = {}
                for i in range(args.models):
                    name = hashlib.sha256(f"m{i}.tar.gz".encode()).hexdigest()[:32]
                    archive = archives.single_archive(float(i), folder=f"m{i}", name=f"m{i}")
                    folders[name] = extract(archive, root / "models", name)
                print(f"{label}: starting", file=sys.stderr)
                with start(root, root / "server.log", env) as server:
                    base = f"http://127.0.0.1:{server.addresses['SageMaker'].rsplit(':', 1)[1]}"
                    times = asyncio.run(load_all(base, folders))
                    if not loads:
                        loads = times
                    trials[label].append(asyncio.run(drive(base, list(folders), args.seconds, args.concurrency)))
                print(f"{label}: {trials[label][-1]}", file=sys.stderr)
    finally:
        moto.terminate()
        moto.wait(30)
    # Each configuration's trial of median throughput (rounds alternate the order, so drift in
    # the machine's load falls on every configuration alike).
    results = {label: sorted(t, key=lambda r: r["rps"])[len(t) // 2] for label, t in trials.items()}
    off = results["CloudWatch off"]
    env_info = environment(["boto3", "moto", "aiohttp"])
    lines = [
        "# SageMaker platform flow and CloudWatch publishing",
        "",
        f"`{command_line()}`, {env_info['date']}, {env_info['nproc']} cores ({env_info['cpu_model']}), "
        f"Python {env_info['python']}. The machine is shared: compare ratios within this run.",
        "",
        f"`POST /models` of {args.models} single-model folders (extracted as the platform does), one after "
        f"another: median {statistics.median(loads) * 1e3:.1f} ms, p95 {percentile(loads, 0.95) * 1e3:.1f} ms.",
        "",
        f"`POST /models/<hash>/invoke` (JSON, one row) from {args.concurrency} clients for {args.seconds:g} s "
        f"over the {args.models} models; CloudWatch publications every {args.interval:g} s; "
        f"{args.rounds} rounds in alternating order, each configuration's median-throughput round:",
        "",
        "| configuration | requests/s | vs off | p50 ms | p99 ms | errors |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['rps']:.0f} | {r['rps'] / off['rps']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |"
        )
    report = {
        "environment": env_info,
        "command": command_line(),
        "settings": vars(args) | {"output_dir": str(args.output_dir)},
        "load_seconds": loads,
        "results": results,
        "trials": trials,
    }
    print("\n".join(lines))
    print(write_results(args.output_dir, "sagemaker_platform", "\n".join(lines), report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
