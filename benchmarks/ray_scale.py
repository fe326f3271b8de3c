"""``quiver serve --ray`` with 1 and with 2 replicas on the multi-model workload, next to the
single-process server: requests/s, latency, and model loads per request.

Run: ``.venv/bin/python -m benchmarks.ray_scale`` from the repository root (``make bench-ray``);
``--help`` for options.

The repository holds ``--models`` small Python models, each holding ``--weight-mb`` of memory
and writing one line to a shared log when a process loads it (the loads are counted from that
log). Every server gets the same memory budget per process (``--room`` models' worth), and the
client (``benchmarks/loadgen.py``) sends the same Zipf mix over the models to each, over HTTP
JSON, at ``--concurrency``.

What it shows: with Ray Serve's model-affinity routing, two replicas hold two budgets' worth of
models, so fewer requests wait for a load. On a 2-core machine the replicas share the cores with
Ray's proxy, the ingress and the client, so requests/s shows the cost of the extra hops, not
more throughput: this benchmark proves behaviour, not speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common, loadgen
from benchmarks.multi_model import lru_per_request
from benchmarks.peers import free_port
from benchmarks.peers.quiver import QuiverServer

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def log(message: str) -> None:
    print(f"[ray-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build(root: Path, count: int, weight_mb: int, load_log: Path) -> list[str]:
    names = []
    for i in range(count):
        name = f"m{i:03d}"
        folder = root / name
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(common.ballast_model(weight_mb, float(i), load_log))
        (folder / "config.pbtxt").write_text(CONFIG)
        names.append(name)
    return names


def server(repo: Path, replicas: int, memory_limit: str, workdir: Path) -> QuiverServer:
    """``quiver serve`` on a port of its own: single process (``replicas`` 0), or ``--ray`` with
    ``replicas`` on a local cluster. The Ray launcher is sent SIGTERM alone (it stops Ray's
    processes itself: a SIGTERM to all of them at once would cut its shutdown short), given 90 s."""
    flags = ["--model-control-mode", "on_demand", "--model-memory-limit", memory_limit, "--http-port", str(free_port())]
    options: dict[str, Any] = {}
    if replicas:
        flags += ["--ray", "--ray-replicas", str(replicas), "--ray-num-cpus", str(2 * replicas + 2)]
        options = {"listeners": ("HTTP",), "signal_group": False}
    return QuiverServer(
        repo, flags, log=workdir / f"server-{replicas or 'single'}.log", env={"RAY_USAGE_STATS_ENABLED": "0"},
        ready_path=None, timeout=240.0, stop_timeout=90.0, **options,
    )


def loads(load_log: Path) -> int:
    return len(load_log.read_text().splitlines()) if load_log.exists() else 0


def run_one(label: str, replicas: int, args: argparse.Namespace, workdir: Path, names: list[str], load_log: Path) -> dict[str, Any]:
    limit = f"{args.room * args.weight_mb + 24}M"
    log(f"{label}: starting ({limit} of model memory per process)")
    with server(workdir / "models", replicas, limit, workdir) as quiver:
        host, port = quiver.endpoints.address("json")
        payloads = []
        for i, name in enumerate(names):
            x = np.arange(4, dtype=np.float32)
            payloads.append(loadgen.Payload(name, {"INPUT0": x}, expected={"OUTPUT0": x + i}))
        mix = loadgen.zipf_sequence(len(names), args.zipf, 200_000, seed=args.seed)
        loadgen.sanity_check(host, port, "json", payloads[0])
        marks: dict[str, int] = {}
        result = loadgen.run_trial(
            host, port, "json", args.concurrency, args.warmup, args.duration, payloads, mix=mix,
            on_begin=lambda: marks.__setitem__("begin", loads(load_log)),
            on_end=lambda: marks.__setitem__("end", loads(load_log)),
        )  # fmt: skip
        window_loads = marks["end"] - marks["begin"]
        row = result.to_dict()
        row.update(label=label, replicas=replicas, loads=window_loads)
        row["loads_per_request"] = window_loads / max(1, result.requests)
        log(f"{label}: {result.req_per_s:,.0f} req/s, {window_loads} loads, {result.errors} errors")
        return row


def lru_misses(args: argparse.Namespace, room: int) -> float:
    """Loads per request of one LRU cache with room for ``room`` models on the same Zipf mix
    (after as many requests as fill it): the reference for one process, and for two replicas
    whose routing never puts a model on both."""
    mix = loadgen.zipf_sequence(args.models, args.zipf, 200_000, seed=args.seed)
    hits = lru_per_request([str(i) for i in mix], room)[20_000:]
    return 1 - sum(hits) / len(hits)


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], cmd: str, args: argparse.Namespace) -> str:
    lines = [
        "# Quiver on Ray Serve: 1 vs 2 replicas on the multi-model workload",
        "",
        f"{env['date']} · {env['nproc']} cores ({env['cpu_model']}) · Python {env['python']} · ray {env['ray']}",
        "",
        f"Command: `{cmd}`",
        "",
        f"{args.models} Python models of {args.weight_mb} MB each; room for {args.room} per process; "
        f"Zipf s={args.zipf}; HTTP JSON; concurrency {args.concurrency}; {args.duration:g} s after a "
        f"{args.warmup:g} s warm-up. Loads are counted in the measured window (after the warm-up filled the budgets).",
        "",
        "| server | req/s | p50 ms | p99 ms | errors | requests | loads | loads per request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['label']} | {r['req_per_s']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['errors']} "
            f"| {r['requests']:,} | {r['loads']} | {r['loads_per_request']:.3f} |"
        )
    lines += [
        "",
        f"Reference, one LRU cache simulated on the same mix, one request at a time: a miss ratio of "
        f"{lru_misses(args, args.room):.3f} with room for {args.room} models (one process) and "
        f"{lru_misses(args, 2 * args.room):.3f} with room for {2 * args.room} (two replicas that never "
        "hold a model twice). The servers count fewer loads than misses, since concurrent requests "
        "for a model that is loading share one load: compare the ratio between rows with the "
        "ratio between these two.",
        "",
        "On this 2-core machine the replicas, Ray's proxy, the ingress and the client share two cores:",
        "the request rate shows what Ray's extra hops cost, not what a second machine would add. The",
        "loads per request show the behaviour: each replica keeps its own budget's worth of models, and",
        "affinity routing sends each model's requests to a replica that holds it.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=40, help="models in the repository (default: 40)")
    parser.add_argument("--weight-mb", type=int, default=16, help="memory each model holds (default: 16)")
    parser.add_argument("--room", type=int, default=10, help="models that fit in one process's budget (default: 10)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the mix (default: 1.0)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds (default: 20)")
    parser.add_argument("--warmup", type=float, default=5.0, help="warm-up seconds (default: 5)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=common.ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    env = common.environment(["quiver", "ray", "numpy"])
    cmd = common.command_line()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="quiver-ray-bench-") as tmp:
        workdir = Path(tmp)
        load_log = workdir / "loads.log"
        names = build(workdir / "models", args.models, args.weight_mb, load_log)
        for label, replicas in (("single process (no Ray)", 0), ("Ray Serve, 1 replica", 1), ("Ray Serve, 2 replicas", 2)):
            try:
                rows.append(run_one(label, replicas, args, workdir, names, load_log))
            except Exception as exc:  # reported in the table; the others still run
                log(f"{label}: failed: {exc}")
                rows.append({"label": label, "replicas": replicas, "error": str(exc)[:300]})
    report = markdown(rows, env, cmd, args)
    settings = vars(args) | {"output_dir": str(args.output_dir)}
    common.write_results(args.output_dir, "ray_scale", report, {"environment": env, "command": cmd, "settings": settings, "results": rows})
    print(report)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
