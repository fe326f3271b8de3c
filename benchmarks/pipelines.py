"""The example pipelines end to end over HTTP, next to the same steps called in-process.

Run: ``.venv/bin/python -m benchmarks.pipelines`` from the repository root (or ``make
bench-pipelines``); ``--help`` for options. Needs the ``examples`` extra (installed by ``make``).

What it measures, for ``image_pipeline_onnx``, ``image_pipeline_pt`` (one 640x480 JPEG per
request -> preprocess -> ResNet-50 -> FP32[1000]) and ``text_pipeline`` (one sentence per
request -> tokenizer -> MiniLM-L6 -> mean pooling -> FP32[384]):

* ``floor``: the pipeline's own steps called in-process, one request after another, right
  before the pipeline's server rows (the server idle meanwhile):
  the repository's ``preprocess``/``tokenizer``/``postprocess`` model.py functions, the ONNX
  models through onnxruntime (default session options, as ``quiver serve`` opens them) and the
  TorchScript model through ``torch.jit.load``. Batch 1 is what one request costs; ``batch N``
  (``--floor-batch``) runs N requests' worth of rows at once, what perfect dynamic batching could
  reach on this machine.
* ``quiver``: ``quiver serve`` on the example repository (``examples/build_repository.py``,
  built if missing or older than the builder), driven with ``aiohttp`` over HTTP/1.1 with the
  binary tensor extension (request and output), at each ``--concurrency``: that many keep-alive
  connections each sending its next request as soon as the last one is answered, for
  ``--duration`` seconds after ``--warmup``. Every status is checked and each target's first
  answer is compared with the floor's output. The composing models batch across requests
  (``dynamic_batching`` in their configs); the mean batch size of the network over the measured
  window comes from the statistics extension.

Results: a markdown table on stdout and in ``benchmarks/results/pipelines.md``, JSON in
``benchmarks/results/pipelines.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import numpy as np
import tritonclient.http as httpclient

from benchmarks.common import ROOT, command_line, cpu_seconds, dash, environment, write_results
from benchmarks.peers import Endpoints
from benchmarks.peers.quiver import QuiverServer
from examples import build_repository

RESULTS = ROOT / "benchmarks" / "results"
SENTENCE = "The quick brown fox jumps over the lazy dog while the server batches requests."


@dataclass
class Pipeline:
    model: str  # the ensemble
    network: str  # the composing model whose batching is reported
    input: str
    output: str
    payload: bytes


@dataclass
class Row:
    pipeline: str
    target: str
    concurrency: int
    requests: int
    seconds: float
    req_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    mean_batch: float | None
    server_cpu_pct: float | None
    load_avg: float


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def test_image() -> bytes:
    """A 640x480 JPEG with smooth structure (a photo's size on the wire, ~30 KB), fixed seed."""
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:640].astype(np.float32)
    channels = [
        127 + 100 * np.sin(x / (20 + 10 * c) + c) * np.cos(y / (30 + 5 * c)) + rng.normal(0, 8, x.shape)
        for c in range(3)
    ]
    pixels = np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def ensure_repository(path: Path) -> Path:
    """The example repository at ``path``, rebuilt as ``make serve`` would when it is stale."""
    stamp = path / ".built"
    builder = Path(build_repository.__file__)
    if not stamp.exists() or stamp.stat().st_mtime < builder.stat().st_mtime:
        log(f"building the example repository in {path} ...")
        started = time.monotonic()
        build_repository.build(path)
        stamp.touch()
        log(f"built in {time.monotonic() - started:.0f} s")
    return path


def load_model_py(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Floors:
    """Each pipeline's steps in-process; ``run(name, rows)`` answers ``rows`` requests at once."""

    def __init__(self, repository: Path) -> None:
        import onnxruntime as ort
        import torch

        self.preprocess = load_model_py(repository / "preprocess" / "1" / "model.py", "_bench_preprocess")
        tokenizer = load_model_py(repository / "tokenizer" / "1" / "model.py", "_bench_tokenizer")
        self.tokenize = tokenizer.tokenize
        self.tokenizer = tokenizer.load_tokenizer(
            str(repository / "tokenizer" / "1" / "tokenizer.json"), build_repository.minilm_max_length()
        )
        self.mean_pool = load_model_py(repository / "postprocess" / "1" / "model.py", "_bench_postprocess").mean_pool
        cpu = ["CPUExecutionProvider"]
        self.resnet_onnx = ort.InferenceSession(str(repository / "resnet50_onnx" / "1" / "model.onnx"), providers=cpu)
        self.minilm = ort.InferenceSession(str(repository / "minilm" / "1" / "model.onnx"), providers=cpu)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resnet_pt = torch.jit.load(str(repository / "resnet50_pt" / "1" / "model.pt"))
        self.torch = torch

    def run(self, pipeline: Pipeline, rows: int) -> np.ndarray[Any, Any]:
        if pipeline.model == "text_pipeline":
            ids, mask = self.tokenize(self.tokenizer, [pipeline.payload.decode()] * rows)
            (tokens,) = self.minilm.run(["TOKEN_EMBEDDINGS"], {"INPUT_IDS": ids, "ATTENTION_MASK": mask})
            return self.mean_pool(tokens, mask)  # type: ignore[no-any-return]
        batch = np.stack([self.preprocess.preprocess_image(pipeline.payload) for _ in range(rows)])
        if pipeline.model == "image_pipeline_onnx":
            (logits,) = self.resnet_onnx.run(["OUTPUT0"], {"INPUT0": batch})
            return logits  # type: ignore[no-any-return]
        with self.torch.inference_mode():
            return self.resnet_pt(self.torch.from_numpy(batch)).numpy()  # type: ignore[no-any-return]

    def measure(self, pipeline: Pipeline, rows: int, seconds: float, warmup: float) -> Row:
        deadline = time.monotonic() + warmup
        while time.monotonic() < deadline:
            self.run(pipeline, rows)
        latencies: list[float] = []
        started = time.monotonic()
        while time.monotonic() - started < seconds or len(latencies) < 3:
            t0 = time.perf_counter()
            self.run(pipeline, rows)
            latencies.append(time.perf_counter() - t0)
        elapsed = time.monotonic() - started
        return _row(pipeline, f"floor: in-process, batch {rows}", 1, len(latencies) * rows, elapsed, latencies, 0, float(rows), None)


def _row(
    pipeline: Pipeline, target: str, concurrency: int, requests: int, seconds: float,
    latencies: list[float], errors: int, mean_batch: float | None, server_cpu: float | None,
) -> Row:
    ms = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    return Row(
        pipeline.model, target, concurrency, requests, round(seconds, 2), round(requests / seconds, 2),
        round(float(np.percentile(ms, 50)), 2), round(float(np.percentile(ms, 90)), 2),
        round(float(np.percentile(ms, 99)), 2), errors,
        None if mean_batch is None else round(mean_batch, 2),
        None if server_cpu is None else round(server_cpu, 0), round(os.getloadavg()[0], 2),
    )


def counts(http: str, model: str) -> tuple[int, int]:
    """``model``'s (inference_count, execution_count), from the statistics extension."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=30) as resp:
        stats = json.loads(resp.read())["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def encode_request(pipeline: Pipeline) -> tuple[bytes, dict[str, str]]:
    tensor = httpclient.InferInput(pipeline.input, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[pipeline.payload]], dtype=np.object_), binary_data=True)
    output = httpclient.InferRequestedOutput(pipeline.output, binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([tensor], outputs=[output])
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


def sanity_check(endpoints: Endpoints, pipeline: Pipeline, expected: np.ndarray[Any, Any]) -> None:
    client = httpclient.InferenceServerClient(endpoints.http, network_timeout=300)
    tensor = httpclient.InferInput(pipeline.input, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[pipeline.payload]], dtype=np.object_))
    answer = client.infer(pipeline.model, [tensor]).as_numpy(pipeline.output)
    np.testing.assert_allclose(answer, expected[:1], rtol=0, atol=1e-3, err_msg=pipeline.model)
    client.close()


async def drive(endpoints: Endpoints, pipeline: Pipeline, concurrency: int, warmup: float, duration: float) -> Row:
    body, headers = encode_request(pipeline)
    url = f"http://{endpoints.http}/v2/models/{pipeline.model}/infer"
    latencies: list[float] = []
    errors = 0
    measuring = False
    stop_at = time.monotonic() + warmup + duration

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as resp:
                await resp.read()
                ok = resp.status == 200
            if measuring:
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        measuring = True
        before = counts(endpoints.http, pipeline.network)
        cpu_before = cpu_seconds(endpoints.pid)
        started = time.monotonic()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        cpu_after = cpu_seconds(endpoints.pid)
        after = counts(endpoints.http, pipeline.network)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    mean_batch = inferences / executions if executions else None
    server_cpu = 100 * (cpu_after - cpu_before) / elapsed
    return _row(pipeline, "quiver, HTTP binary", concurrency, len(latencies), elapsed, latencies, errors, mean_batch, server_cpu)


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| pipeline | target | concurrency | req/s | p50 ms | p90 ms | p99 ms | errors | network mean batch | server CPU % | load avg |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.pipeline} | {r.target} | {r.concurrency} | {r.req_per_s:,.1f} | {r.p50_ms:.1f} | {r.p90_ms:.1f} "
            f"| {r.p99_ms:.1f} | {r.errors} | {dash(r.mean_batch, '.1f')} | {dash(r.server_cpu_pct, '.0f')} | {r.load_avg:.1f} |"
        )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "examples" / "model_repository",
                        help="the example repository (built there if missing or stale)")
    parser.add_argument("--pipelines", default="image_pipeline_onnx,image_pipeline_pt,text_pipeline")
    parser.add_argument("--image-concurrency", type=_ints, default=[1, 4, 8])
    parser.add_argument("--text-concurrency", type=_ints, default=[1, 8, 32])
    parser.add_argument("--floor-batch", type=_ints, default=[8, 32], metavar="IMAGE,TEXT",
                        help="the batch size of the second floor row for images and for text")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each row")
    parser.add_argument("--server-args", default="", help="extra `quiver serve` flags")
    parser.add_argument("--no-save", action="store_true", help="print only; keep benchmarks/results as is")
    parser.add_argument("--output-dir", type=Path, default=RESULTS, help="where pipelines.{md,json} go (default: benchmarks/results)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    repository = ensure_repository(args.repository.resolve())
    image, sentence = test_image(), SENTENCE.encode()
    catalogue = {
        "image_pipeline_onnx": Pipeline("image_pipeline_onnx", "resnet50_onnx", "IMAGE", "OUTPUT", image),
        "image_pipeline_pt": Pipeline("image_pipeline_pt", "resnet50_pt", "IMAGE", "OUTPUT", image),
        "text_pipeline": Pipeline("text_pipeline", "minilm", "TEXT", "EMBEDDING", sentence),
    }
    pipelines = [catalogue[name] for name in args.pipelines.split(",") if name]
    env = environment(("quiver", "onnxruntime", "torch", "tokenizers", "pillow"))
    rows: list[Row] = []

    floors = Floors(repository)
    expected = {p.model: floors.run(p, 1) for p in pipelines}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    server_log = Path(tempfile.gettempdir()) / "quiver-bench-pipelines.log"
    log(f"serving {repository} (log: {server_log})")
    flags = shlex.split(args.server_args)
    with QuiverServer(repository, flags, log=server_log, ready_path=None, timeout=300.0, stop_timeout=60.0) as server:
        endpoints = server.endpoints
        # Each pipeline's floors run right before its server rows (the server idle meanwhile),
        # so both see the machine in the same state.
        for p in pipelines:
            big = args.floor_batch[0] if p.model.startswith("image") else args.floor_batch[-1]
            for batch in (1, big):
                rows.append(floors.measure(p, batch, args.duration / 2, args.warmup / 2))
                log(f"  {p.model} in-process batch {batch}: {rows[-1].req_per_s:.1f} req/s")
            sanity_check(endpoints, p, expected[p.model])
            for concurrency in args.image_concurrency if p.model.startswith("image") else args.text_concurrency:
                row = asyncio.run(drive(endpoints, p, concurrency, args.warmup, args.duration))
                rows.append(row)
                log(f"  {p.model} c={concurrency}: {row.req_per_s:.1f} req/s p50 {row.p50_ms:.1f} ms "
                    f"errors {row.errors} batch {row.mean_batch}")

    rows.sort(key=lambda r: [p.model for p in pipelines].index(r.pipeline))
    table = markdown_table(rows)
    print(table)
    if not args.no_save:
        report = [
            "# Example pipelines over HTTP",
            "",
            f"`{command_line()}` on {env['nproc']} cores ({env['cpu_model']}), {env['date']}; "
            f"quiver {env['quiver']}, onnxruntime {env['onnxruntime']}, torch {env['torch']}, "
            f"tokenizers {env['tokenizers']}, pillow {env['pillow']}.",
            "",
            "One request is one image (a 640x480 JPEG, "
            f"{len(image):,} bytes) or one sentence ({len(sentence)} bytes), sent with the binary tensor "
            "extension; `floor` rows call the same steps in-process with no server, batch 1 one request "
            "after another and a larger batch as perfect batching would. `network mean batch` is the "
            "ResNet-50's or MiniLM's rows per execution over the measured window (statistics extension). "
            "`load avg` is the machine's 1-minute load average at the end of the row.",
            "",
            table,
            "",
        ]
        data = {"environment": env, "command": command_line(), "rows": [asdict(r) for r in rows]}
        log(write_results(args.output_dir, "pipelines", "\n".join(report), data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
