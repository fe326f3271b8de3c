"""Dynamic batching on a ResNet-50-sized ONNX model: Quiver over HTTP next to onnxruntime's ceiling.

Run: ``.venv/bin/python -m benchmarks.batching`` from the repository root (or ``make
bench-batching``); ``--help`` for options.

What it measures:

* ``ceiling``: the same model called in-process with onnxruntime (default session options, as
  ``quiver serve`` opens it), one ``InferenceSession.run`` after another, at every batch size in
  ``--ceiling-batches`` (default 1..32): images/s per batch size, and the best. No server can
  beat the best on this machine; it is the line the server rows are compared with.
* ``quiver``: ``quiver serve`` on a temporary repository holding the model with
  ``max_batch_size: 32``, once without ``dynamic_batching`` (each request runs alone) and once per
  ``--variants`` entry with it (``max_queue_delay_microseconds`` and optionally
  ``preferred_batch_size``, instance count, ``intra_op_thread_count``), driven over HTTP/1.1 with
  the binary tensor extension (one FP32 [1, 3, 224, 224] image, 602,112 bytes, per request; the
  output FP32 [1, 1000] asked for as binary) at each ``--concurrency``: one keep-alive connection
  per concurrent request, a fixed ``--duration`` measured after a ``--warmup``.

The load generator is ``benchmarks/loadgen.py`` (as in ``http_throughput.py``): one process, one
uvloop event loop, ``asyncio.Protocol`` connections writing one pre-encoded request and framing
responses by their head. Every status is checked; each connection's first answer and one in ``--check-every``
is decoded and compared with onnxruntime's answer for the same image. Client CPU
(``time.process_time``) and server CPU (psutil or /proc) over the measured window are reported
as a percentage of one core.

Results: a markdown table on stdout and in ``benchmarks/results/batching.md``, JSON in
``benchmarks/results/batching.json``, and with ``--plot`` ``benchmarks/results/batching.png``
(drawn by the throwaway matplotlib venv, ``common.plot_in_venv``; ``--plot-from batching.json``
draws it again from an earlier run).

``benchmarks/resnet50.py`` holds the model builder, ``resnet50_onnx()``, for reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common, loadgen
from benchmarks.common import ROOT
from benchmarks.peers.quiver import QuiverServer
from benchmarks.resnet50 import CLASSES, IMAGE_SHAPE, INPUT, OUTPUT, parameter_count, resnet50_onnx

MODEL = "resnet50"
INFER_PATH = f"/v2/models/{MODEL}/infer"
MAX_BATCH = 32

CONFIG = """
name: "resnet50"
backend: "onnxruntime"
max_batch_size: {max_batch}
input [ {{ name: "{input}" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ {classes} ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
{parameters}
{batching}
model_warmup [ {{ name: "one_image" batch_size: 1
  inputs {{ key: "{input}" value: {{ data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true }} }} }} ]
"""


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- server configurations -----------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One server configuration: ``delay_us`` None means no dynamic batching."""

    delay_us: int | None
    preferred: tuple[int, ...] = ()
    instances: int = 1
    intra_threads: int = 0  # 0: onnxruntime's default

    @property
    def label(self) -> str:
        if self.delay_us is None:
            text = "no dynamic batching"
        else:
            text = f"dynamic batching, delay {self.delay_us} us"
            if self.preferred:
                text += f", preferred {'/'.join(map(str, self.preferred))}"
        if self.instances != 1:
            text += f", {self.instances} instances"
        if self.intra_threads:
            text += f", intra_op {self.intra_threads}"
        return text

    def config(self) -> str:
        batching = ""
        if self.delay_us is not None:
            preferred = "".join(f" preferred_batch_size: {p}" for p in self.preferred)
            batching = f"dynamic_batching {{ max_queue_delay_microseconds: {self.delay_us}{preferred} }}"
        parameters = ""
        if self.intra_threads:
            parameters = (
                f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{self.intra_threads}" }} }}'
            )
        return CONFIG.format(
            max_batch=MAX_BATCH, input=INPUT, output=OUTPUT, classes=CLASSES,
            instances=self.instances, parameters=parameters, batching=batching,
        )


def parse_variant(text: str) -> Variant:
    """``none`` | ``DELAY_US[:p=P/P][:i=N][:t=N]`` (preferred sizes, instances, intra-op threads)."""
    parts = text.strip().split(":")
    delay = None if parts[0] == "none" else int(parts[0])
    preferred: tuple[int, ...] = ()
    instances, threads = 1, 0
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key == "p":
            preferred = tuple(int(v) for v in value.split("/") if v)
        elif key == "i":
            instances = int(value)
        elif key == "t":
            threads = int(value)
        else:
            raise argparse.ArgumentTypeError(f"variant '{text}': unknown part '{part}'")
    return Variant(delay, preferred, instances, threads)


# -- load ----------------------------------------------------------------------------------


def image_payload(image: np.ndarray[Any, Any], expected: np.ndarray[Any, Any]) -> loadgen.Payload:
    """One image as binary tensors, the output asked for as binary, checked against onnxruntime's."""
    return loadgen.Payload(MODEL, {INPUT: image}, expected={OUTPUT: expected}, rtol=1e-3, atol=1e-3)


@dataclass
class TrialResult(loadgen.TrialResult):
    """A row of the table: a load generator trial against one server configuration."""

    variant: str = ""
    mean_batch: float | None = None  # rows per execution over the window, from the server's statistics
    compute_pct: float | None = None  # executions' compute time over the window / window, per instance
    ceiling_ratio: float | None = None
    load_avg: float = 0.0  # the machine's 1-minute load average at the end: other work on the cores shows here


def server_stats(host: str, port: int) -> tuple[int, int, int]:
    """(inference_count, execution_count, compute ns summed over executions), from the statistics extension."""
    with urllib.request.urlopen(f"http://{host}:{port}/v2/models/{MODEL}/stats", timeout=30) as resp:
        stats = json.loads(resp.read())["model_stats"][0]
    compute = sum(
        int(b[phase]["ns"]) for b in stats.get("batch_stats", []) for phase in ("compute_input", "compute_infer", "compute_output")
    )
    return int(stats["inference_count"]), int(stats["execution_count"]), compute


def run_trial(
    host: str, port: int, pid: int, variant: str, concurrency: int, args: argparse.Namespace,
    request: loadgen.Payload, instances: int = 1,
) -> TrialResult:
    counts: list[tuple[int, int, int]] = []  # the server's statistics as the window opens, and as it closes

    def read_stats() -> None:
        counts.append(server_stats(host, port))

    result = loadgen.run_trial(
        host, port, "binary", concurrency, args.warmup, args.duration, request, pid, args.check_every,
        result=TrialResult(variant=variant), on_begin=read_stats, on_end=read_stats, drain_timeout_s=120,
    )
    assert isinstance(result, TrialResult)
    result.load_avg = os.getloadavg()[0]
    if len(counts) == 2:
        (rows0, executions0, compute0), (rows1, executions1, compute1) = counts
        if executions1 > executions0:
            result.mean_batch = (rows1 - rows0) / (executions1 - executions0)
            result.compute_pct = 100 * (compute1 - compute0) / 1e9 / result.seconds / instances
    return result


# -- the ceiling ---------------------------------------------------------------------------


def run_ceiling(model_path: Path, batches: list[int], seconds: float, image: np.ndarray[Any, Any]) -> dict[int, float]:
    """Images/s of in-process onnxruntime per batch size (default session options)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model_path), sess_options=options, providers=["CPUExecutionProvider"])
    rates: dict[int, float] = {}
    for batch in batches:
        feed = {INPUT: np.repeat(image, batch, axis=0)}
        session.run([OUTPUT], feed)  # first run of a shape allocates
        runs, start = 0, time.perf_counter()
        while runs < 2 or time.perf_counter() - start < seconds:
            session.run([OUTPUT], feed)
            runs += 1
        rates[batch] = runs * batch / (time.perf_counter() - start)
        log(f"  ceiling batch {batch:2d}: {rates[batch]:6.1f} images/s")
    return rates


# -- reporting -----------------------------------------------------------------------------


def markdown_table(results: list[TrialResult], ceiling: float, best_batch: int) -> str:
    rows = [
        "| server | concurrency | req/s | % of ceiling | mean batch | instance busy % | p50 ms | p90 ms | p99 ms | errors | client CPU % | server CPU % | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| ceiling: onnxruntime in-process, best batch size {best_batch} | - | {ceiling:.1f} img/s | 100 | {best_batch} | 100 | - | - | - | - | - | - | - |",
    ]
    for r in results:
        latency = " | ".join(common.dash(ms, ".0f") for ms in (r.p50_ms, r.p90_ms, r.p99_ms))
        rows.append(
            f"| {r.variant} | {r.concurrency} | {r.req_per_s:.1f} | {r.ceiling_ratio or 0:.0f} | {common.dash(r.mean_batch, '.1f')} "
            f"| {common.dash(r.compute_pct, '.0f')} | {latency} | {r.errors} "
            f"| {r.client_cpu_pct:.0f} | {r.server_cpu_pct or 0:.0f} | {r.load_avg:.1f} |"
        )
    return "\n".join(rows)


def _ints(text: str) -> list[int]:
    items: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            items += range(int(lo), int(hi) + 1)
        elif part.strip():
            items.append(int(part))
    if not items or min(items) < 1:
        raise argparse.ArgumentTypeError("expected positive integers: 1,4,16 or 1-32")
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(
            "Throughput of `quiver serve` with and without dynamic batching on a ResNet-50-sized ONNX "
            "model (HTTP, binary tensors), next to the best in-process onnxruntime throughput. Writes "
            "benchmarks/results/batching.{md,json}."
        )
    )
    parser.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 32], metavar="N,N", help="default: 1,4,16,32")
    parser.add_argument("--duration", type=float, default=20.0, metavar="S", help="measured seconds per trial (default: 20)")
    parser.add_argument("--warmup", type=float, default=6.0, metavar="S", help="warm-up seconds per trial (default: 6)")
    parser.add_argument(
        "--variants",
        type=lambda t: [parse_variant(v) for v in t.split(",")],
        default=[parse_variant(v) for v in ("none", "0", "5000", "20000:p=16/32", "0:i=2:t=1")],
        metavar="V,V",
        help=(
            "server configurations: 'none' (no dynamic batching) or DELAY_US[:p=P/P][:i=INSTANCES][:t=THREADS]"
            " (default: none,0,5000,20000:p=16/32,0:i=2:t=1)"
        ),
    )
    parser.add_argument("--ceiling-batches", type=_ints, default=list(range(1, 33)), metavar="B", help="default: 1-32")
    parser.add_argument("--ceiling-seconds", type=float, default=3.0, metavar="S", help="per batch size (default: 3)")
    parser.add_argument("--check-every", type=int, default=20, metavar="N", help="check one answer in N (default: 20)")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "benchmarks" / "results", metavar="DIR")
    parser.add_argument("--plot", action="store_true", help="also write batching.png (with the plotting venv)")
    parser.add_argument(
        "--plot-from", type=Path, default=None, metavar="JSON",
        help="only draw OUTPUT_DIR/batching.png from an earlier batching.json (with the plotting venv)",
    )
    parser.add_argument("--quiver", default=None, metavar="PATH", help="the quiver executable (default: the one next to this Python, else .venv/bin/quiver)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra `quiver serve` argument (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_from is not None:
        return common.plot_from("batching", args.plot_from, args.output_dir / "batching.png")
    env = common.environment(("onnxruntime", "onnx", "quiver", "uvloop"))
    cmd = common.command_line()
    results: list[TrialResult] = []
    notes: list[str] = []
    status = 0
    image = np.random.default_rng(7).random((1, *IMAGE_SHAPE), dtype=np.float32)

    with tempfile.TemporaryDirectory(prefix="quiver-batching-") as tmp:
        repo = Path(tmp) / "repository"
        import onnx
        import onnxruntime as ort

        model = resnet50_onnx()
        onnx.checker.check_model(model)
        model_path = common.test_support("models").write_onnx(repo, MODEL, model, None) / "1" / "model.onnx"
        log(f"ResNet-50: {parameter_count(model):,} parameters, {model_path.stat().st_size / 1e6:.0f} MB")
        expected = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run([OUTPUT], {INPUT: image})[0]
        request = image_payload(image, expected)

        log(f"ceiling: onnxruntime in-process over batch sizes {args.ceiling_batches[0]}..{args.ceiling_batches[-1]}")
        rates = run_ceiling(model_path, args.ceiling_batches, args.ceiling_seconds, image)
        best_batch = max(rates, key=lambda b: rates[b])
        ceiling = rates[best_batch]
        ceiling_load = os.getloadavg()[0]
        log(f"ceiling: {ceiling:.1f} images/s at batch size {best_batch}")

        for variant in args.variants:
            (repo / MODEL / "config.pbtxt").write_text(variant.config())
            server = QuiverServer(
                repo, ["--allow-grpc=false", "--allow-metrics=false", *args.server_arg], log=Path(tmp) / "server.log",
                listeners=("HTTP",), executable=args.quiver, ready_path=f"/v2/models/{MODEL}/ready", timeout=300.0,
                stop_timeout=60.0,
            )
            log(f"{variant.label}: starting {shlex.join(server.argv)}")
            try:
                host, port = server.start().address("binary")
                loadgen.sanity_check(host, port, "binary", request, timeout=60)
                for concurrency in args.concurrency:
                    log(f"{variant.label} c={concurrency}: {args.warmup:g} s warm-up + {args.duration:g} s ...")
                    res = run_trial(host, port, server.pid, variant.label, concurrency, args, request, variant.instances)
                    res.ceiling_ratio = 100 * res.req_per_s / ceiling
                    results.append(res)
                    log(
                        f"  {res.req_per_s:.1f} req/s ({res.ceiling_ratio:.0f}% of ceiling), mean batch "
                        f"{res.mean_batch or 0:.1f}, instance busy {res.compute_pct or 0:.0f}%, p50 {res.p50_ms or 0:.0f} ms, p99 {res.p99_ms or 0:.0f} ms, "
                        f"errors {res.errors}, load {res.load_avg:.1f}, client CPU {res.client_cpu_pct:.0f}%, server CPU {res.server_cpu_pct or 0:.0f}%"
                    )
                    if res.first_error:
                        log(f"  first error: {res.first_error}")
            except (RuntimeError, OSError) as exc:
                log(f"error: {exc}")
                notes.append(f"{variant.label}: aborted: {exc}")
                status = 1
            finally:
                code = server.stop()
                if code != 0:
                    notes.append(f"{variant.label}: server exit code {code} after SIGTERM (expected 0)")
                    status = 1

    if any(r.errors for r in results):
        notes.append("errors: " + "; ".join(f"{r.variant}/c{r.concurrency}: {r.first_error}" for r in results if r.errors))
        status = 1
    batched = [r for r in results if r.concurrency == 16 and r.variant != "no dynamic batching"]
    best16 = max(batched, key=lambda r: r.req_per_s, default=None)
    table = markdown_table(results, ceiling, best_batch)
    print(table)
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    goal = ""
    if best16 is not None:
        goal = (
            f"- At concurrency 16 the best dynamic-batching configuration ({best16.variant}) serves "
            f"{best16.req_per_s:.1f} images/s, {best16.ceiling_ratio:.0f}% of the ceiling (goal: 90%)."
        )
    report = [
        "# Dynamic batching: ResNet-50 (ONNX, FP32 [3, 224, 224]) over HTTP with binary tensors",
        "",
        f"- Command: `{cmd}`",
        f"- Date: {env['date']}",
        f"- Machine: {env['nproc']} cores, {env['cpu_model']} ({env['platform']}), no GPU",
        f"- Versions: Python {env['python']}, onnxruntime {env['onnxruntime']}, onnx {env['onnx']}, quiver {env['quiver']}",
        f"- Model: `benchmarks/resnet50.py`, ResNet-50 v1.5 with batch norm folded, random weights, opset 17,"
        f" {parameter_count(model):,} parameters; `max_batch_size: {MAX_BATCH}`, one instance unless the row says otherwise.",
        f"- Trials: {args.warmup:g} s warm-up, then {args.duration:g} s measured; one HTTP/1.1 keep-alive connection"
        " per concurrent request, one image (602,112 bytes) per request. `mean batch` is rows per execution over"
        " the window and `instance busy %` the share of the window the instance spent executing (server"
        " statistics: compute input + infer + output, per instance). CPU % is of one core (200% is the whole machine); the client shares it.",
        "- Ceiling: the same model in-process, `InferenceSession.run` back to back at each batch size "
        f"{args.ceiling_batches[0]}..{args.ceiling_batches[-1]}: "
        + ", ".join(f"{b}: {rates[b]:.1f}" for b in sorted(rates))
        + f" images/s (load average {ceiling_load:.1f} at the end).",
        goal,
        "",
        table,
    ]
    if notes:
        report += ["", *[f"- {n}" for n in notes]]
    payload = {
        "benchmark": "batching",
        "command": cmd,
        "environment": env,
        "settings": {
            **common.trial_settings(args),
            "variants": [asdict(v) | {"label": v.label} for v in args.variants],
            "max_batch_size": MAX_BATCH,
        },
        "ceiling": {"load_avg": ceiling_load, "best_images_per_s": ceiling, "best_batch_size": best_batch, "images_per_s_by_batch": rates},
        "notes": notes,
        "results": [{"variant": r.variant, **r.to_dict()} for r in results],
    }
    log(common.write_results(out, "batching", "\n".join(report), payload))
    if args.plot:
        log(f"plot: {common.plot_in_venv('batching', out / 'batching.json', out / 'batching.png')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
