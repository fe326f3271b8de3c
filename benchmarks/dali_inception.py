"""The seed's DALI + Inception v3 ensemble over HTTP, with and without dynamic batching, next to
the same two steps called in-process.

Run: ``.venv/bin/python -m benchmarks.dali_inception`` (or ``make bench-dali-inception``);
``--help`` for options. Needs the ``tensorflow`` and ``dali`` extras (``make`` installs them).

What it measures (one JPEG, 500x375, per request):

* ``floor``: the seed's DALI pipeline built for the CPU (``nvidia.dali``, ``num_threads`` as the
  server gives it) and the frozen Inception v3 in one ``tf.compat.v1.Session``, called directly,
  one after the other, at batch 1 and at ``--floor-batch``: images/s. No server can beat the
  best on this machine.
* ``quiver``: ``quiver serve`` on the seed's repository (``examples/seed_ensemble.py``: the
  seed's configurations and serialized GPU pipeline, which Quiver rewrites for the CPU; a
  random-weight Inception v3), once as the seed writes it (no ``dynamic_batching``: each
  request runs alone) and once with ``dynamic_batching { max_queue_delay_microseconds: D }`` on
  the ``dali`` and ``inception_graphdef`` models, driven by ``benchmarks/loadgen.py`` over
  HTTP/1.1 with the binary tensor extension at each ``--concurrency``. The first answer of each
  connection and one in ``--check-every`` is compared with the floor's. The mean batch of the
  Inception step comes from the statistics extension.

Results: a markdown table on stdout and in ``benchmarks/results/dali_inception.md``, JSON in
``benchmarks/results/dali_inception.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import loadgen
from benchmarks.common import command_line, environment
from benchmarks.peers.quiver import QuiverServer
from examples import seed_ensemble as seed

HERE = Path(__file__).resolve().parent


MODEL = seed.ENSEMBLE
RESULTS = HERE / "results"
STEPS = ("dali", "inception_graphdef")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def jpeg(width: int = 500, height: int = 375) -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) % 256)], axis=-1).astype(np.uint8)
    pixels = np.clip(pixels.astype(np.int16) + rng.integers(-20, 20, pixels.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


# -- the floor ----------------------------------------------------------------------------------


class Floor:
    """The two steps in-process: DALI built for the CPU, then the frozen graph."""

    def __init__(self, graphdef: bytes, threads: int, max_batch: int) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        self.pipe = seed.seed_pipeline("cpu", batch_size=max_batch)
        self.pipe = type(self.pipe).deserialize(
            serialized_pipeline=self.pipe.serialize(), batch_size=max_batch, num_threads=threads, device_id=None
        )
        self.pipe.build()
        graph_def = tf.compat.v1.GraphDef()
        graph_def.ParseFromString(graphdef)
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        self.session = tf.compat.v1.Session(graph=graph)
        self.output = f"{seed.INCEPTION_OUTPUT}:0"
        self.input = f"{seed.INCEPTION_INPUT}:0"

    def run(self, images: list[bytes]) -> np.ndarray[Any, Any]:
        return self.classify(self.preprocess(images))

    def preprocess(self, images: list[bytes]) -> np.ndarray[Any, Any]:
        self.pipe.feed_input("DALI_INPUT_0", [np.frombuffer(i, np.uint8) for i in images])
        (out,) = self.pipe.run()
        return np.stack([np.array(out[i]) for i in range(len(out))])

    def classify(self, batch: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return self.session.run(self.output, {self.input: batch})  # type: ignore[no-any-return]

    def rate(self, image: bytes, batch: int, seconds: float, step: str = "both") -> float:
        """Images/s of both steps one after the other, or of one step alone."""
        images = [image] * batch
        preprocessed = self.preprocess(images)

        def once() -> None:
            if step == "dali":
                self.preprocess(images)
            elif step == "inception":
                self.classify(preprocessed)
            else:
                self.run(images)

        once()  # warm
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            once()
            done += batch
        return done / (time.perf_counter() - start)


# -- the server ---------------------------------------------------------------------------------


def _stats(http: str, model: str) -> tuple[int, int]:
    """(inference count, execution count) of ``model``, from the server's statistics."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=30) as resp:
        stats = json.loads(resp.read())["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


@dataclass
class Row:
    variant: str
    concurrency: int
    images_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    mean_batch: float | None
    errors: int
    server_cpu_pct: float | None


def write_repository(root: Path, graphdef: bytes, dali_file: bytes, delay_us: int | None) -> None:
    seed.build_seed_ensemble(root, graphdef=graphdef, dali_file=dali_file)
    if delay_us is None:
        return
    for step in STEPS:
        config = root / step / "config.pbtxt"
        config.write_text(
            config.read_text() + f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
        )


def run_variant(
    name: str, repository: Path, args: argparse.Namespace, payload: loadgen.Payload, tmp: Path
) -> list[Row]:
    server = QuiverServer(
        repository, ("--allow-grpc=false", "--allow-metrics=false"), log=tmp / f"{name}.log",
        listeners=("HTTP",), timeout=300.0, stop_timeout=60.0,
    )  # fmt: skip
    rows = []
    try:
        log(f"{name}: starting quiver serve (TensorFlow and DALI load with the models)")
        endpoints = server.start()
        assert endpoints.http is not None
        http = endpoints.http
        host, port = endpoints.address("binary")
        for concurrency in args.concurrency:
            marks: list[tuple[int, int]] = []
            result = loadgen.run_trial(
                host, port, "binary", concurrency, args.warmup, args.duration, payload,
                endpoints.pid, args.check_every, progress=None,
                on_begin=lambda marks=marks: marks.append(_stats(http, "inception_graphdef")),
                on_end=lambda marks=marks: marks.append(_stats(http, "inception_graphdef")),
                drain_timeout_s=120,
            )  # fmt: skip
            mean_batch = None
            if len(marks) == 2 and marks[1][1] > marks[0][1]:
                mean_batch = (marks[1][0] - marks[0][0]) / (marks[1][1] - marks[0][1])
            row = Row(name, concurrency, result.req_per_s, result.p50_ms, result.p99_ms, mean_batch,
                      result.errors, result.server_cpu_pct)
            log(f"{name} c={concurrency}: {row.images_per_s:.2f} img/s, p50 {row.p50_ms} ms, "
                f"batch {mean_batch}, errors {result.errors} {result.first_error or ''}")
            rows.append(row)
    finally:
        server.stop()
    return rows


def markdown(
    rows: list[Row], floors: dict[int, float], steps: dict[str, float], env: dict[str, Any],
    args: argparse.Namespace, load: tuple[float, float],
) -> str:
    best = max(floors.values())
    lines = [
        f"# The seed's DALI + Inception v3 ensemble ({env['date']})",
        "",
        f"- Machine: {env['nproc']} cores, {env['cpu_model']}; Python {env['python']}; load "
        f"average {load[0]:.1f} before the run, {load[1]:.1f} after",
        f"- Command: `{command_line()}`",
        f"- One 500x375 JPEG per request; {args.duration:.0f} s measured after {args.warmup:.0f} s of warm-up",
        "",
        "| what | concurrency | images/s | vs best floor | p50 ms | p99 ms | Inception mean batch | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, rate in floors.items():
        lines.append(f"| floor, in-process, batch {batch} | - | {rate:.2f} | {rate / best:.0%} | - | - | {batch} | 0 |")
    for what, rate in steps.items():
        lines.append(f"| ({what}, in-process) | - | {rate:.2f} | - | - | - | - | - |")
    for row in rows:
        p50 = f"{row.p50_ms:.0f}" if row.p50_ms is not None else "-"
        p99 = f"{row.p99_ms:.0f}" if row.p99_ms is not None else "-"
        batch_text = f"{row.mean_batch:.2f}" if row.mean_batch is not None else "-"
        lines.append(
            f"| quiver, {row.variant} | {row.concurrency} | {row.images_per_s:.2f} | "
            f"{row.images_per_s / best:.0%} | {p50} | {p99} | {batch_text} | {row.errors} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 8])
    parser.add_argument("--duration", type=float, default=20.0, help="measured seconds per trial")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--delay-us", type=int, default=20000, help="dynamic batching queue delay")
    parser.add_argument("--floor-batch", type=int, default=8)
    parser.add_argument("--floor-seconds", type=float, default=15.0)
    parser.add_argument("--check-every", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    env = environment(("tensorflow-cpu", "nvidia-dali-cuda130", "quiver"))
    load_before = os.getloadavg()[0]
    image = jpeg()
    log("building the random-weight Inception v3 GraphDef and the seed's model.dali")
    graphdef = seed.inception_v3_graphdef()
    dali_file = seed.seed_model_dali()
    threads = min(12, os.cpu_count() or 1)  # the seed's num_threads, as the server caps it
    floor = Floor(graphdef, threads, max(args.floor_batch, 1))
    expected = floor.run([image])
    floors: dict[int, float] = {}
    steps: dict[str, float] = {}
    for batch in sorted({1, args.floor_batch}):
        floors[batch] = floor.rate(image, batch, args.floor_seconds)
        log(f"floor batch {batch}: {floors[batch]:.2f} img/s")
        for step in ("dali", "inception"):
            steps[f"{step} alone, batch {batch}"] = floor.rate(image, batch, args.floor_seconds / 2, step)
            log(f"{step} alone, batch {batch}: {steps[f'{step} alone, batch {batch}']:.2f} img/s")
    del floor
    payload = loadgen.Payload(
        model=MODEL, inputs={"INPUT": np.frombuffer(image, np.uint8)[None]},
        expected={"OUTPUT": expected}, atol=1e-5,
    )
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="quiver-dali-inception-") as folder:
        tmp = Path(folder)
        for name, delay in (("as the seed (no dynamic batching)", None),
                            (f"dynamic batching ({args.delay_us} us)", args.delay_us)):
            repository = tmp / f"repo-{delay}"
            write_repository(repository, graphdef, dali_file, delay)
            rows += run_variant(name, repository, args, payload, tmp)
    report = markdown(rows, floors, steps, env, args, (load_before, os.getloadavg()[0]))
    print(report)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "dali_inception.md").write_text(report)
    (args.output_dir / "dali_inception.json").write_text(
        json.dumps({"environment": env, "command": command_line(), "floors": floors, "steps": steps,
                    "rows": [asdict(r) for r in rows]}, indent=2) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
