"""``quiver serve --ray`` on a real local Ray cluster with 2 replicas.

The cluster is started by ``ray start --head`` on loopback, and Quiver attaches to it with
``--ray-address``, as an operator attaches to an existing cluster. The models are Python models
that hold a block of memory (so the memory budget sees them) and write one line to a shared log
each time a replica loads them: the loads are counted from that log, not from Quiver's own
statistics.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.archives import single_archive
from support.models import write_python
from support.s3 import free_port

pytest.importorskip("ray.serve")

BIN = Path(sys.executable).parent
MODELS = 8  # the skewed mix's models
MORE_MODELS = 16  # all the models: more than the two replicas hold, to make Quiver evict
ARCHIVES = 12  # .tar.gz models, fetched through each replica's disk cache
WEIGHT_MB = 24
# Room for about 7 models on one replica: the 8 of the mix fit in the two replicas when each
# model stays on the replica that has it (affinity), with room for hot models on both;
# routed at random, every replica would need all 8 and would keep evicting.
MEMORY_LIMIT_MB = 7 * WEIGHT_MB + 20

MODEL_SOURCE = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.block = np.full({weight} * 1024 * 1024 // 4, {value}, dtype=np.float32)  # touched: counted
        with open({log!r}, "a") as log:
            log.write(args["model_name"] + " " + str(os.getpid()) + "\\n")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + self.block[0])]))
        return responses
"""

BROKEN_SOURCE = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights are corrupt")

    def execute(self, requests):
        return []
"""

SLOW_SOURCE = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({seconds})
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
"""

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

STARTED = re.compile(r"started HTTP service at ([\d.]+):(\d+)")


def model_name(i: int) -> str:
    return f"m{i:02d}"


@dataclass
class Answer:
    status: int
    body: bytes
    replica: str


@dataclass
class Cluster:
    address: str
    port: int
    load_log: Path
    process: subprocess.Popen[str]
    log_path: Path
    cache_dir: Path

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 60) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return Answer(response.status, response.read(), response.getheader("quiver-replica") or "")
        finally:
            conn.close()

    def get(self, path: str) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return Answer(response.status, response.read(), response.getheader("quiver-replica") or "")
        finally:
            conn.close()

    def infer(self, model: str, x: list[float]) -> Answer:
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": x}]}
        return self.post(f"/v2/models/{model}/infer", json.dumps(body).encode())

    def loads(self) -> Counter[str]:
        if not self.load_log.exists():
            return Counter()
        return Counter(line.split()[0] for line in self.load_log.read_text().splitlines() if line)

    def views(self) -> list[dict[str, list[str]]]:
        """Per replica: the models Ray routes to it, and the models Quiver holds there
        (read from the Serve controller, in a separate process so Ray stays out of pytest's)."""
        script = """
import json, ray
ray.init(address=ADDRESS, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")
controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
out = []
for deployment, replicas in ray.get(controller._all_running_replicas.remote()).items():
    if deployment.name != "QuiverReplica":
        continue
    for info in replicas:
        out.append({"ray": sorted(info.multiplexed_model_ids),
                    "quiver": sorted((info.routing_stats or {}).get("quiver_resident_models", [])),
                    "used": (info.routing_stats or {}).get("quiver_memory_used_bytes", 0)})
print(json.dumps(out))
""".replace("ADDRESS", repr(self.address))
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


def replica_pids() -> list[int]:
    import psutil

    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "ServeReplica:quiver:QuiverReplica" in " ".join(proc.info["cmdline"] or []):
                pids.append(proc.info["pid"])
    return pids


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("ray")
    repo = root / "models"
    load_log = root / "loads.log"
    for i in range(MORE_MODELS):
        write_python(repo, model_name(i), MODEL_SOURCE.format(weight=WEIGHT_MB, value=float(i + 1), log=str(load_log)), CONFIG)
    write_python(repo, "broken", BROKEN_SOURCE, CONFIG)
    write_python(repo, "slow", SLOW_SOURCE.format(seconds=3), CONFIG)
    write_python(repo, "hot", SLOW_SOURCE.format(seconds=0.25), CONFIG)
    for i in range(ARCHIVES):
        (repo / f"plus{i}.tar.gz").write_bytes(single_archive(float(i)))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    gcs_port = free_port()
    started = subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
         "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={root / 'ray'}"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    address = f"127.0.0.1:{gcs_port}"
    log_path = root / "quiver.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [str(BIN / "quiver"), "serve", "--ray", "--ray-address", address, "--ray-replicas", "2",
         "--ray-max-ongoing-requests", "16", "--model-repository", str(repo),
         "--http-port", str(free_port()), "--model-memory-limit", f"{MEMORY_LIMIT_MB}M",
         # the budget is sized for in-process models (a worker process adds its interpreter)
         "--backend-config=python,in-process=true",
         "--model-cache-dir", str(root / "cache")],
        stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**env, "SAGEMAKER_MULTI_MODEL": "true"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        port = 0
        while time.monotonic() < deadline and not port:
            assert process.poll() is None, log_path.read_text()[-3000:]
            match = STARTED.search(log_path.read_text())
            port = int(match.group(2)) if match else 0
            time.sleep(0.5)
        assert port, "quiver --ray did not start in 180 s:\n" + log_path.read_text()[-3000:]
        yield Cluster(address, port, load_log, process, log_path, root / "cache")
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120, env=env)
        shutil.rmtree(root / "ray", ignore_errors=True)


def expected(model: str, x: list[float]) -> list[float]:
    return [v + int(model[1:]) + 1 for v in x]


def test_skewed_mix_is_answered_right_and_loads_stop_growing(cluster: Cluster) -> None:
    rng = random.Random(7)
    weights = [1 / (i + 1) for i in range(MODELS)]  # Zipf, s=1
    names = [model_name(i) for i in range(MODELS)]
    replicas_by_model: dict[str, Counter[str]] = {}

    def wave(size: int) -> int:
        """``size`` requests of the mix, 8 at a time, every answer checked; the loads they caused."""
        mix = rng.choices(names, weights, k=size)
        before = sum(cluster.loads().values())
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: (mix[i], cluster.infer(mix[i], [float(i), 1.0, 2.0, 3.0])), range(size)))
        for i, (model, answer) in enumerate(answers):
            assert answer.status == 200, (model, answer.body)
            got = json.loads(answer.body)["outputs"][0]["data"]
            assert got == expected(model, [float(i), 1.0, 2.0, 3.0]), (model, got)
            replicas_by_model.setdefault(model, Counter())[answer.replica] += 1
        return sum(cluster.loads().values()) - before

    first = wave(320)
    second = wave(320)
    # Affinity: each model is loaded on one replica, or two when a hot one spills or two of its
    # first requests race Ray's routers, and then the loads stop. Routed at random, both
    # replicas would need all 8 models in room for about 7, and would keep loading.
    assert first <= 2 * MODELS, (first, cluster.loads(), replicas_by_model)
    assert second <= 3, (second, cluster.loads(), replicas_by_model)
    assert len({r for counts in replicas_by_model.values() for r in counts}) == 2, replicas_by_model


def test_rays_routing_view_follows_quivers_residency_through_evictions(cluster: Cluster) -> None:
    # Touch 16 models in a round robin, in room for about 14: Quiver evicts as they go. Ray's
    # view must end up equal to Quiver's on every replica.
    before = sum(cluster.loads().values())
    for _round in range(2):
        for i in range(MORE_MODELS):
            answer = cluster.infer(model_name(i), [0.0, 0.0, 0.0, 0.0])
            assert answer.status == 200, answer.body
    deadline = time.monotonic() + 20
    while True:
        views = cluster.views()
        if len(views) == 2 and all(v["ray"] == v["quiver"] for v in views):
            break
        assert time.monotonic() < deadline, views
        time.sleep(1)
    for view in views:
        assert view["used"] <= MEMORY_LIMIT_MB * 1024 * 1024, view
    assert sum(cluster.loads().values()) - before > MORE_MODELS - MODELS, "nothing was evicted"
    assert all(v["quiver"] for v in views), views


def test_a_hot_model_spreads_to_the_other_replica_under_load(cluster: Cluster) -> None:
    # 28 requests at once for a model that takes 0.25 s each, one at a time: more than the 16
    # one replica takes (--ray-max-ongoing-requests), so Ray sends the rest to the other
    # replica, which loads the model too.
    assert cluster.infer("hot", [1.0, 1.0, 1.0, 1.0]).status == 200
    with ThreadPoolExecutor(28) as pool:
        answers = list(pool.map(lambda i: cluster.infer("hot", [float(i)] * 4), range(28)))
    assert all(a.status == 200 for a in answers), [a.body for a in answers if a.status != 200]
    assert len({a.replica for a in answers}) == 2, Counter(a.replica for a in answers)  # so loaded on both


def test_replicas_sharing_a_cache_folder_each_fetch_archives_into_their_own(cluster: Cluster) -> None:
    # Each new model goes to the replica with the fewer models, so new archives end up on both.
    replicas = set()
    for i in range(ARCHIVES):
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
        answer = cluster.post(f"/v2/models/plus{i}.tar.gz/infer", json.dumps(body).encode())
        assert answer.status == 200, answer.body
        assert json.loads(answer.body)["outputs"][0]["data"] == [1 + i, 2 + i, 3 + i, 4 + i]
        replicas.add(answer.replica)
        if len(replicas) == 2 and i >= 3:
            break
    assert len(replicas) == 2, replicas
    slots = sorted(p.name for p in cluster.cache_dir.iterdir() if p.is_dir())
    assert slots == ["replica-0", "replica-1"], slots
    assert all(any((cluster.cache_dir / slot).rglob("model.onnx")) for slot in slots)


def test_a_model_that_fails_to_load_is_an_error_naming_it_and_others_keep_serving(cluster: Cluster) -> None:
    answer = cluster.infer("broken", [1.0, 2.0, 3.0, 4.0])
    assert answer.status in (400, 503), answer.status
    assert b"broken" in answer.body and b"weights are corrupt" in answer.body, answer.body
    ok = cluster.infer(model_name(0), [1.0, 2.0, 3.0, 4.0])
    assert ok.status == 200 and json.loads(ok.body)["outputs"][0]["data"] == expected(model_name(0), [1.0, 2.0, 3.0, 4.0])


def test_sagemaker_routes_on_the_ray_port(cluster: Cluster) -> None:
    assert cluster.get("/ping").status == 200
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]}
    answer = cluster.post(
        "/invocations", json.dumps(body).encode(), {"X-Amzn-SageMaker-Target-Model": model_name(2)}
    )
    assert answer.status == 200, answer.body
    assert json.loads(answer.body)["outputs"][0]["data"] == expected(model_name(2), [1, 2, 3, 4])


def test_sagemaker_registration_invoke_and_delete_over_ray(cluster: Cluster) -> None:
    folder = cluster.load_log.parent / "models" / model_name(3)
    registered = cluster.post("/models", json.dumps({"model_name": "alias-three", "url": str(folder)}).encode())
    assert registered.status == 200, registered.body
    time.sleep(1)  # Ray's routers learn where the name is (pushed within 0.1 s, then broadcast)
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]}
    for _ in range(3):
        answer = cluster.post("/models/alias-three/invoke", json.dumps(body).encode())
        assert answer.status == 200, answer.body
        assert json.loads(answer.body)["outputs"][0]["data"] == expected(model_name(3), [1, 2, 3, 4])
        assert answer.replica == registered.replica  # Ray routes the SageMaker name to its replica
    described = cluster.get("/models/alias-three")
    assert described.status == 200 and b"alias-three" in described.body, described.body
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=30)
    try:
        conn.request("DELETE", "/models/alias-three")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert cluster.post("/models/alias-three/invoke", json.dumps(body).encode()).status == 404


def test_server_metadata_and_unknown_models_over_ray(cluster: Cluster) -> None:
    meta = cluster.get("/v2")
    assert meta.status == 200 and json.loads(meta.body)["name"] == "quiver"
    missing = cluster.infer("no_such_model", [1.0, 2.0, 3.0, 4.0])
    assert missing.status in (400, 404) and b"no_such_model" in missing.body, missing.body


def test_killing_a_replica_mid_run_leaves_the_service_answering(cluster: Cluster) -> None:
    pids = replica_pids()
    assert len(pids) == 2, pids
    stop = threading.Event()
    results: list[tuple[int, bytes, float]] = []

    def hammer(worker: int) -> None:
        i = 0
        while not stop.is_set():
            model = model_name((worker + i) % 4)
            started = time.monotonic()
            try:
                answer = cluster.infer(model, [1.0, 1.0, 1.0, 1.0])
                results.append((answer.status, answer.body[:300], time.monotonic() - started))
            except OSError as exc:
                results.append((0, repr(exc).encode(), time.monotonic() - started))
            i += 1

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(2)
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(8)
    stop.set()
    for thread in threads:
        thread.join(90)
        assert not thread.is_alive(), "a request hung after a replica was killed"
    failures = [r for r in results if r[0] != 200]
    assert len(results) > 20, results
    # Requests the dead replica held are retried on the other one, or fail with a clear 503.
    for status, body, _ in failures:
        assert status == 503 and b"replica" in body, (status, body)
    assert len(failures) <= len(results) // 4, failures[:5]
    # And afterwards everything answers.
    for i in range(4):
        answer = cluster.infer(model_name(i), [1.0, 2.0, 3.0, 4.0])
        assert answer.status == 200, answer.body


def test_shutdown_drains_a_request_in_flight_first(cluster: Cluster) -> None:
    """The last test of the module: SIGTERM while a 3-second request is in flight. Ray stops
    the replicas gracefully (as on scale-in): the request is answered, then the server exits 0."""
    assert cluster.infer("slow", [1.0, 2.0, 3.0, 4.0]).status == 200  # loaded
    answers: list[Answer] = []
    thread = threading.Thread(target=lambda: answers.append(cluster.infer("slow", [4.0, 3.0, 2.0, 1.0])))
    thread.start()
    time.sleep(1.0)
    cluster.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert answers and answers[0].status == 200, answers
    assert json.loads(answers[0].body)["outputs"][0]["data"] == [4.0, 3.0, 2.0, 1.0]
    assert cluster.process.wait(90) == 0, cluster.log_path.read_text()[-2000:]


def test_an_unreachable_cluster_is_a_clear_error_naming_the_address(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [str(BIN / "quiver"), "serve", "--ray", "--ray-address", address, "--model-repository", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot reach the Ray cluster at {address}" in done.stderr, done.stderr


def test_the_single_process_server_never_imports_ray() -> None:
    code = "import sys, quiver.cli, quiver.runner, quiver.rayserve.routing; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
