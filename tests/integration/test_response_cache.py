"""Triton's response cache end to end: ``response_cache { enable: true }`` with
``--cache-config local,size=N`` (or ``--response-cache-byte-size``); hits answered without
running the model; statistics (HTTP and gRPC) and metrics; least recently used out under
the size; ensembles cached at the top level; decoupled and sequence models refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from support.models import write_config, write_python
from support.server import QuiverServer

#: Counts its executions: CALLS says how many times it ran when it answered.
COUNTER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.calls += 1
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", data),
                pb_utils.Tensor("CALLS", np.array([self.calls], dtype=np.int64)),
            ]))
        return responses
"""

COUNTER_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "CALLS" data_type: TYPE_INT64 dims: [ 1 ] }}
]
{cache}
"""

ENSEMBLE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "STEP_CALLS" data_type: TYPE_INT64 dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "step" model_version: -1
    input_map { key: "INPUT0" value: "IN" }
    output_map { key: "OUTPUT0" value: "OUT" } output_map { key: "CALLS" value: "STEP_CALLS" } }
] }
response_cache { enable: true }
"""

DECOUPLED = """
name: "decoupled_cached"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
response_cache { enable: true }
"""

SEQUENCE = """
name: "sequence_cached"
backend: "identity"
max_batch_size: 4
sequence_batching { }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
response_cache { enable: true }
"""

BATCHED = """
name: "batched_cached"
backend: "identity"
max_batch_size: 8
dynamic_batching { }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
response_cache { enable: true }
"""

ON = "response_cache { enable: true }"


def _counter(repo: Path, name: str, cache: str = ON) -> None:
    write_python(repo, name, COUNTER, COUNTER_CONFIG.format(name=name, cache=cache))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("cache_repo")
    _counter(repo, "counter")
    _counter(repo, "uncached", cache="")
    _counter(repo, "step", cache="")
    write_config(repo, "pipeline", ENSEMBLE)
    write_config(repo, "batched_cached", BATCHED)
    write_python(repo, "decoupled_cached", COUNTER, DECOUPLED)
    write_config(repo, "sequence_cached", SEQUENCE)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[QuiverServer]:
    with QuiverServer(repository, args=("--cache-config", "local,size=1048576", "--exit-on-error=false")) as running:
        yield running


def _http(server: QuiverServer, model: str, values: list[float], name: str = "INPUT0") -> httpclient.InferResult:
    with httpclient.InferenceServerClient(server.url) as client:
        tensor = httpclient.InferInput(name, [4], "FP32")
        tensor.set_data_from_numpy(np.array(values, dtype=np.float32))
        return client.infer(model, [tensor])


def _grpc(server: QuiverServer, model: str, values: list[float]) -> grpcclient.InferResult:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(np.array(values, dtype=np.float32))
        return client.infer(model, [tensor])


def _calls(result: httpclient.InferResult | grpcclient.InferResult, name: str = "CALLS") -> int:
    return int(result.as_numpy(name)[0])


def _stats(server: QuiverServer, model: str) -> dict[str, object]:
    with httpclient.InferenceServerClient(server.url) as client:
        stats: dict[str, object] = client.get_inference_statistics(model)["model_stats"][0]
        return stats


def test_hits_skip_execution(server: QuiverServer) -> None:
    first = _http(server, "counter", [1, 2, 3, 4])
    again = _grpc(server, "counter", [1, 2, 3, 4])  # the same request over gRPC: a hit
    other = _http(server, "counter", [5, 6, 7, 8])
    assert _calls(first) == 1 and _calls(again) == 1 and _calls(other) == 2
    np.testing.assert_array_equal(again.as_numpy("OUTPUT0"), [1, 2, 3, 4])
    assert _calls(_http(server, "counter", [5, 6, 7, 8])) == 2
    # Triton's statistics: hits are successes, not inferences or executions.
    stats = _stats(server, "counter")
    inference = stats["inference_stats"]
    assert inference["cache_hit"]["count"] == 2  # type: ignore[index]
    assert inference["cache_miss"]["count"] == 2  # type: ignore[index]
    assert inference["success"]["count"] == 4  # type: ignore[index]
    assert stats["inference_count"] == 2 and stats["execution_count"] == 2
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        grpc_stats = client.get_inference_statistics("counter", as_json=True)["model_stats"][0]["inference_stats"]
    assert grpc_stats["cache_hit"]["count"] == "2" and int(grpc_stats["cache_hit"]["ns"]) > 0
    assert grpc_stats["cache_miss"]["count"] == "2"
    metrics = requests.get(server.metrics_url, timeout=10).text
    assert 'nv_cache_num_hits_per_model{model="counter",version="1"} 2' in metrics
    assert 'nv_cache_num_misses_per_model{model="counter",version="1"} 2' in metrics
    assert 'nv_cache_hit_duration_per_model{model="counter",version="1"}' in metrics
    assert 'model="uncached"' not in "".join(line for line in metrics.splitlines() if line.startswith("nv_cache_"))


def test_models_without_cache_always_run(server: QuiverServer) -> None:
    calls = [_calls(_http(server, "uncached", [1, 1, 1, 1])) for _ in range(3)]
    assert calls == [1, 2, 3]
    inference = _stats(server, "uncached")["inference_stats"]
    assert inference["cache_hit"] == {"count": 0, "ns": 0}  # type: ignore[index]
    assert inference["cache_miss"] == {"count": 0, "ns": 0}  # type: ignore[index]


def test_key_covers_shape_and_requested_outputs(server: QuiverServer) -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        def infer(shape: list[int], outputs: list[str] | None = None) -> httpclient.InferResult:
            tensor = httpclient.InferInput("INPUT0", shape, "FP32")
            tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(shape))
            requested = [httpclient.InferRequestedOutput(name) for name in outputs] if outputs else None
            return client.infer("batched_cached", [tensor], outputs=requested)

        assert infer([1, 4]).as_numpy("OUTPUT0").shape == (1, 4)
        # The same bytes in another shape are another request (Triton's key would mix them).
        assert infer([2, 2]).as_numpy("OUTPUT0").shape == (2, 2)
        assert infer([1, 4], ["OUTPUT0"]).as_numpy("OUTPUT0").shape == (1, 4)
        assert infer([1, 4]).as_numpy("OUTPUT0").shape == (1, 4)
    stats = _stats(server, "batched_cached")
    assert stats["inference_stats"]["cache_hit"]["count"] == 1  # type: ignore[index]
    assert stats["execution_count"] == 3


def test_ensemble_cached_at_the_top_level(server: QuiverServer) -> None:
    results = [_http(server, "pipeline", [9, 9, 9, 9], name="IN") for _ in range(3)]
    assert [_calls(r, "STEP_CALLS") for r in results] == [1, 1, 1]
    ensemble = _stats(server, "pipeline")["inference_stats"]
    assert ensemble["cache_hit"]["count"] == 2 and ensemble["cache_miss"]["count"] == 1  # type: ignore[index]
    step = _stats(server, "step")
    assert step["execution_count"] == 1
    assert step["inference_stats"]["cache_hit"]["count"] == 0  # type: ignore[index]


def test_decoupled_and_sequence_models_refuse_the_cache(server: QuiverServer) -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["decoupled_cached"]["state"] == "UNAVAILABLE"
    assert (
        "Response Cache does not currently support model decoupled_cached with 'decoupled' transaction policy"
        in index["decoupled_cached"]["reason"]
    )
    assert index["sequence_cached"]["state"] == "UNAVAILABLE"
    assert "with sequence batching scheduler" in index["sequence_cached"]["reason"]


def test_least_recently_used_out_under_the_size(repository: Path) -> None:
    # Each answer of 'counter' takes 408 bytes of the cache: two fit in 900.
    with QuiverServer(repository, args=("--response-cache-byte-size", "900", "--exit-on-error=false")) as server:
        a, b, c = [1.0] * 4, [2.0] * 4, [3.0] * 4
        calls = [_calls(_http(server, "counter", values)) for values in (a, b, a, c, a, b)]
        # a, b run; a hits; c runs and evicts b (least recently used); a hits; b runs again.
        assert calls == [1, 2, 1, 3, 1, 4]
        metrics = requests.get(server.metrics_url, timeout=10).text
        assert "nv_cache_num_entries 2" in metrics
        assert "nv_cache_num_evictions 2" in metrics
    with QuiverServer(repository, args=("--cache-config", "local,size=300", "--exit-on-error=false")) as server:
        calls = [_calls(_http(server, "counter", a)) for _ in range(2)]
        assert calls == [1, 2]  # larger than the whole cache: never kept
        assert "Failed to insert a response of model 'counter' into the response cache" in server.log


def test_no_cache_without_cache_config(repository: Path) -> None:
    with QuiverServer(repository, args=("--exit-on-error=false",)) as server:
        assert [_calls(_http(server, "counter", [1, 2, 3, 4])) for _ in range(2)] == [1, 2]
        metrics = requests.get(server.metrics_url, timeout=10).text
        assert "nv_cache_num_hits_per_model" not in metrics


def test_cache_flags_are_checked(repository: Path) -> None:
    for flags, message in (
        (("--response-cache-byte-size", "12345", "--cache-config", "local,size=67890"), "Incompatible flags"),
        (("--cache-config", "local,size=8192", "--cache-config", "redis,host=x"), "multiple cache configurations"),
        (("--cache-config", "size=8192"), "No cache specified"),
        (("--cache-config", "redis,host=localhost"), "cache 'redis' is not available"),
        (("--cache-config", "local,size=lots"), "--cache-config local,size must be a number of bytes"),
    ):
        server = QuiverServer(repository, args=flags)
        with pytest.raises(RuntimeError, match="exited with 2") as failed:
            server.start()
        assert message in str(failed.value)


def test_a_model_loaded_again_does_not_get_the_old_answers(repository: Path) -> None:
    args = ("--cache-config", "local,size=1048576", "--model-control-mode=explicit", "--load-model=counter")
    with QuiverServer(repository, args=args) as server:
        assert [_calls(_http(server, "counter", [4, 3, 2, 1])) for _ in range(2)] == [1, 1]
        with httpclient.InferenceServerClient(server.url) as client:
            client.unload_model("counter")
            client.load_model("counter")
        _http(server, "counter", [4, 3, 2, 1])
        stats = _stats(server, "counter")
        assert stats["execution_count"] == 1  # it ran: the answer cached before the reload is not used
        assert stats["inference_stats"]["cache_hit"]["count"] == 0  # type: ignore[index]


def test_hits_through_the_asyncio_clients(server: QuiverServer) -> None:
    import asyncio

    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http.aio as httpaio

    data = np.array([7, 7, 7, 0], dtype=np.float32)

    async def scenario() -> list[int]:
        http = httpaio.InferenceServerClient(server.url)
        grpc = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            http_input = httpaio.InferInput("INPUT0", [4], "FP32")
            http_input.set_data_from_numpy(data)
            grpc_input = grpcaio.InferInput("INPUT0", [4], "FP32")
            grpc_input.set_data_from_numpy(data)
            first = await http.infer("counter", [http_input])
            second = await grpc.infer("counter", [grpc_input])
            return [_calls(first), _calls(second)]
        finally:
            await http.close()
            await grpc.close()

    before = _stats(server, "counter")["inference_stats"]["cache_hit"]["count"]  # type: ignore[index]
    first, second = asyncio.run(scenario())
    assert first == second  # the second was answered from the cache
    assert _stats(server, "counter")["inference_stats"]["cache_hit"]["count"] == before + 1  # type: ignore[index]
