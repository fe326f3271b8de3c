"""On-demand loading under a memory budget: single flight, eviction, pins, failures."""

from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from support.models import make_model, write_onnx, write_python
from support.server import QuiverServer

MB = 1 << 20
#: Each model holds this much weight, so its measured footprint is well above noise.
WEIGHT_MB = 16

CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""


def heavy_model(value: float) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + value, carrying WEIGHT_MB of weights read at run time (indices that
    depend on the input, so no graph optimization can fold the weights away)."""
    rows = WEIGHT_MB * MB // (4 * 4)
    weight = np.zeros((rows, 4), np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["INPUT0", "starts", "ends", "axes"], ["first"]),  # [batch, 1]
            helper.make_node("Mul", ["first", "zero"], ["nothing"]),
            helper.make_node("Cast", ["nothing"], ["index"], to=TensorProto.INT64),
            helper.make_node("Gather", ["W", "index"], ["rows"], axis=0),  # [batch, 1, 4] zeros
            helper.make_node("ReduceSum", ["rows", "axes"], ["picked"], keepdims=0),  # [batch, 4]
            helper.make_node("Add", ["INPUT0", "picked"], ["shifted"]),
            helper.make_node("Add", ["shifted", "C"], ["OUTPUT0"]),
        ],
        "heavy",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        initializer=[
            numpy_helper.from_array(weight, "W"),
            numpy_helper.from_array(np.array([0], np.int64), "starts"),
            numpy_helper.from_array(np.array([1], np.int64), "ends"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
            helper.make_tensor("C", TensorProto.FLOAT, [1], [value]),
        ],
    )
    return make_model(graph)


SLOW_MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep({init_delay})
        self.ballast = np.ones({ballast_mb} * 1024 * 1024 // 8)  # memory the budget must see

    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""

SLOW_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

FLAKY_MODEL = """
from pathlib import Path
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        marker = Path(args["model_repository"]) / "tried"
        if not marker.exists():
            marker.write_text("once")
            raise RuntimeError("first load fails on purpose")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
"""


def x(value: float = 0.0) -> list[aiohttpclient.InferInput]:
    inp = aiohttpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return [inp]


def ready(client: httpclient.InferenceServerClient) -> list[str]:
    return [e["name"] for e in client.get_model_repository_index() if e.get("state") == "READY"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("ondemand")
    for i in range(12):
        write_onnx(repo, f"m{i:02d}", heavy_model(float(i)), CONFIG.format(name=f"m{i:02d}"))
    return repo


def test_skewed_load_over_more_models_than_fit(repository: Path) -> None:
    """A Zipf-like mix over 12 models with memory for about 3: every answer right, never more
    models resident than fit, each model loaded once per miss and evicted by the policy."""
    args = ("--model-control-mode=on_demand", "--model-memory-limit", f"{3 * WEIGHT_MB + 20}M")
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        assert ready(client) == []
        rng = random.Random(7)
        weights = [1 / (rank + 1) ** 1.2 for rank in range(12)]
        trace = rng.choices(range(12), weights, k=120)
        most = 0

        async def main() -> None:
            nonlocal most
            async with aiohttpclient.InferenceServerClient(server.url) as aclient:
                for start in range(0, len(trace), 6):
                    chunk = trace[start : start + 6]
                    results = await asyncio.gather(*(aclient.infer(f"m{i:02d}", x(1.0)) for i in chunk))
                    for i, result in zip(chunk, results, strict=True):
                        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 1.0 + i))
                    resident = ready(client)
                    most = max(most, len(resident))

        asyncio.run(main())
        sizes = {m: int(b) for m, b in re.findall(r"loaded model '(m\d\d)' version.* it takes (\d+) bytes", server.log)}
        limit = (3 * WEIGHT_MB + 20) * MB
        assert most < 12 and sum(sizes[m] for m in ready(client)) <= limit
        assert min(sizes.values()) > WEIGHT_MB * MB // 2  # the footprint was really measured
        def counts() -> tuple[int, int, int]:
            loads = len(re.findall(r"loaded model 'm\d\d' version", server.log))
            evictions = len(re.findall(r"evicted to make room", server.log))
            return loads, evictions, len(ready(client))

        deadline = time.monotonic() + 10  # an eviction ahead of need may still be unloading
        while (c := counts())[0] != c[1] + c[2] and time.monotonic() < deadline:
            time.sleep(0.1)
        loads, evictions, resident = counts()
        assert loads == evictions + resident  # every resident or evicted model loaded once per miss
        assert evictions > 0
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert any(e.get("reason", "").startswith("evicted to make room") for e in index.values())


def test_concurrent_first_requests_load_once(repository: Path) -> None:
    with QuiverServer(repository, args=("--model-control-mode=on_demand",)) as server:

        async def main() -> None:
            async with aiohttpclient.InferenceServerClient(server.url) as client:
                results = await asyncio.gather(*(client.infer("m05", x()) for _ in range(10)))
                for result in results:
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 5.0))

        asyncio.run(main())
        # the load is logged after the answers are written, and the log read by a thread
        assert server.wait_for_log("loaded model 'm05' version")
        time.sleep(0.2)  # a second load, had there been one, is logged as soon
        assert server.log.count("loaded model 'm05' version") == 1


def test_a_model_in_use_is_never_evicted(tmp_path: Path) -> None:
    write_python(tmp_path, "busy", SLOW_MODEL.format(init_delay=0, ballast_mb=WEIGHT_MB), SLOW_CONFIG)
    for i in range(3):
        write_onnx(tmp_path, f"h{i}", heavy_model(float(i)), CONFIG.format(name=f"h{i}"))
    # In-process: the budget is sized for the model's own weights, without a worker process's
    # interpreter (test_python_worker.py covers how a worker's memory is counted).
    args = ("--model-control-mode=on_demand", "--model-memory-limit", f"{WEIGHT_MB + 12}M",
            "--backend-config=python,in-process=true")
    with QuiverServer(tmp_path, args=args) as server:

        async def main() -> None:
            async with aiohttpclient.InferenceServerClient(server.url) as client:
                await client.infer("busy", x())  # loaded, now idle
                finished: dict[str, float] = {}

                async def call(model: str, value: float) -> None:
                    result = await client.infer(model, x(value))
                    # "busy" echoes its input; "h0" adds 0.0
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), value))
                    finished[model] = time.monotonic()

                slow = asyncio.ensure_future(call("busy", 3.0))  # in flight for 1 s: pinned
                await asyncio.sleep(0.3)
                await call("h0", 0.0)  # needs the room "busy" holds: waits for its request
                await slow
                assert finished["h0"] >= finished["busy"]

        asyncio.run(main())
        assert "evicted to make room for model 'h0'" in server.log


def test_unknown_model_and_bad_names(repository: Path) -> None:
    with QuiverServer(repository, args=("--model-control-mode=on_demand",)) as server:
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("nope", x())
        assert info.value.status() == "404"
        with pytest.raises(InferenceServerException) as info:
            client.infer("..", x())
        assert info.value.status() in ("400", "404")


def test_slow_load_times_out_then_serves(tmp_path: Path) -> None:
    write_python(tmp_path, "slowload", SLOW_MODEL.format(init_delay=1.5, ballast_mb=1), SLOW_CONFIG)
    args = ("--model-control-mode=on_demand", "--model-load-wait-timeout", "0.3")
    with QuiverServer(tmp_path, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("slowload", x())
        assert info.value.status() == "503" and "still loading" in info.value.message()
        deadline = time.monotonic() + 10
        while not client.is_model_ready("slowload") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.infer("slowload", x(2.0)).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]


def test_a_failed_load_is_reported_then_retried(tmp_path: Path) -> None:
    write_python(tmp_path, "flaky", FLAKY_MODEL, SLOW_CONFIG)
    with QuiverServer(tmp_path, args=("--model-control-mode=on_demand",)) as server:
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("flaky", x())
        assert info.value.status() == "503" and "first load fails on purpose" in info.value.message()
        assert client.infer("flaky", x(4.0)).as_numpy("OUTPUT0").tolist() == [[4.0] * 4]


def test_a_model_larger_than_the_budget(repository: Path) -> None:
    args = ("--model-control-mode=on_demand", "--model-memory-limit", "4M")
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("m01", x())
        assert info.value.status() == "503" and "not enough memory to load model 'm01'" in info.value.message()


def test_multi_model_metrics(repository: Path) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    args = ("--model-control-mode=on_demand", "--model-memory-limit", f"{WEIGHT_MB + 12}M")
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        for name in ("m00", "m00", "m01", "m00"):
            client.infer(name, x())
        with urllib.request.urlopen(server.metrics_url) as response:
            text = response.read().decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert samples[("quiver_model_cache_miss_total", ())] == 3  # m00, m01, m00 again
        assert samples[("quiver_model_cache_hit_total", ())] == 1
        assert samples[("quiver_model_evictions_total", ())] == 2
        assert samples[("quiver_loaded_model_count", ())] == 1
        assert samples[("quiver_model_loading_time_us_count", ())] == 3
        assert samples[("quiver_model_loading_wait_time_us_count", ())] == 3
        assert samples[("quiver_model_eviction_age_seconds_count", ())] == 2
        assert samples[("quiver_model_resident_bytes", (("model", "m00"),))] > WEIGHT_MB * MB // 2
        assert 0 < samples[("quiver_model_memory_used_bytes", ())] <= samples[("quiver_model_memory_limit_bytes", ())]


def test_looking_at_a_model_is_not_using_it(repository: Path) -> None:
    """Readiness, metadata and config requests run nothing: under LRU, a model only looked at
    since its last request is still the least recently used and goes first (a probe polling
    readiness does not keep a model in memory)."""
    args = ("--model-control-mode=on_demand", "--model-memory-limit", f"{2 * WEIGHT_MB + 10}M",
            "--model-eviction-policy=lru", "--no-model-evict-ahead")  # fmt: skip
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        client.infer("m00", x())
        client.infer("m01", x())
        assert sorted(ready(client)) == ["m00", "m01"]
        for _ in range(3):  # looked at after m01's request, never used
            assert client.is_model_ready("m00")
            assert client.get_model_metadata("m00")["name"] == "m00"
            assert client.get_model_config("m00")["name"] == "m00"
            client.get_inference_statistics("m00")
        client.infer("m02", x())
        assert sorted(ready(client)) == ["m01", "m02"]
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["m00"]["reason"] == "evicted to make room for model 'm02'"
