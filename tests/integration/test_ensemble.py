"""Ensembles end to end: data flow through composing models, errors, loading with dependencies."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from support.models import add_constant_onnx, write_config, write_onnx, write_python
from support.server import QuiverServer

ADD = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}
"""

DOUBLE_MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if (x < 0).any():
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return out
"""

DOUBLE_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

#: IN -> add_one -> double -> DOUBLED, and in parallel IN -> add_ten -> PLUS_TEN.
PIPELINE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [
  {{ name: "DOUBLED" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "PLUS_TEN" data_type: TYPE_FP32 dims: [ 4 ] }}
]
ensemble_scheduling {{ step [
  {{ model_name: "{first}" model_version: -1 input_map {{ key: "INPUT0" value: "IN" }} output_map {{ key: "OUTPUT0" value: "plus_one" }} }},
  {{ model_name: "double" model_version: -1 input_map {{ key: "X" value: "plus_one" }} output_map {{ key: "Y" value: "DOUBLED" }} }},
  {{ model_name: "add_ten" model_version: -1 input_map {{ key: "INPUT0" value: "IN" }} output_map {{ key: "OUTPUT0" value: "PLUS_TEN" }} }}
] }}
"""


def build(repo: Path) -> None:
    write_onnx(
        repo, "add_one", add_constant_onnx(1.0),
        ADD.format(name="add_one", extra="dynamic_batching { max_queue_delay_microseconds: 50000 }"),
    )
    write_onnx(repo, "add_ten", add_constant_onnx(10.0), ADD.format(name="add_ten", extra=""))
    write_python(repo, "double", DOUBLE_MODEL, DOUBLE_CONFIG)
    write_config(repo, "pipeline", PIPELINE.format(name="pipeline", first="add_one"))
    write_config(repo, "broken_pipeline", PIPELINE.format(name="broken_pipeline", first="ghost"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("ensemble")
    build(repo)
    with QuiverServer(repo, args=("--exit-on-error=false",)) as running:
        yield running


def inputs(values: np.ndarray) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("IN", list(values.shape), "FP32")
    inp.set_data_from_numpy(values)
    return [inp]


def test_data_flows_through_the_steps(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    x = np.array([[1, 2, 3, 4], [0, 0, 0, 0]], dtype=np.float32)
    result = client.infer("pipeline", inputs(x))
    np.testing.assert_array_equal(result.as_numpy("DOUBLED"), (x + 1) * 2)
    np.testing.assert_array_equal(result.as_numpy("PLUS_TEN"), x + 10)
    only = client.infer("pipeline", inputs(x), outputs=[httpclient.InferRequestedOutput("PLUS_TEN")])
    assert only.as_numpy("DOUBLED") is None
    # gRPC sees the same ensemble.
    g = grpcclient.InferenceServerClient(server.grpc_url)
    gin = grpcclient.InferInput("IN", [2, 4], "FP32")
    gin.set_data_from_numpy(x)
    np.testing.assert_array_equal(g.infer("pipeline", [gin]).as_numpy("DOUBLED"), (x + 1) * 2)


def test_the_ensemble_looks_like_one_model(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    metadata = client.get_model_metadata("pipeline")
    assert metadata["platform"] == "ensemble"
    assert [i["name"] for i in metadata["inputs"]] == ["IN"]
    assert [o["name"] for o in metadata["outputs"]] == ["DOUBLED", "PLUS_TEN"]
    config = client.get_model_config("pipeline")
    assert len(config["ensemble_scheduling"]["step"]) == 3
    client.infer("pipeline", inputs(np.ones((1, 4), np.float32)))
    stats = client.get_inference_statistics("pipeline")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] >= 1


def test_a_failing_step_names_the_step_and_model(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("pipeline", inputs(np.full((1, 4), -5, np.float32)))
    assert info.value.status() == "400"
    assert "ensemble 'pipeline': step 1 (model 'double') failed" in info.value.message()
    assert "negative input" in info.value.message()
    assert client.infer("pipeline", inputs(np.ones((1, 4), np.float32))).as_numpy("DOUBLED") is not None


def test_missing_composing_model_makes_the_ensemble_unavailable(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    assert not client.is_model_ready("broken_pipeline")
    with pytest.raises(InferenceServerException) as info:
        client.infer("broken_pipeline", inputs(np.ones((1, 4), np.float32)))
    assert info.value.status() == "503"
    assert "composing model 'ghost' is not in the model repository" in info.value.message()


def test_composing_models_batch_across_ensemble_requests(server: QuiverServer) -> None:
    before = httpclient.InferenceServerClient(server.url).get_inference_statistics("add_one")["model_stats"][0]

    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(server.url) as client:

            async def one(i: int) -> None:
                inp = aiohttpclient.InferInput("IN", [1, 4], "FP32")
                inp.set_data_from_numpy(np.full((1, 4), i, np.float32))
                result = await client.infer("pipeline", [inp])
                np.testing.assert_array_equal(result.as_numpy("DOUBLED"), np.full((1, 4), (i + 1) * 2))

            await asyncio.gather(*(one(i) for i in range(16)))

    asyncio.run(main())
    after = httpclient.InferenceServerClient(server.url).get_inference_statistics("add_one")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 16
    assert executions < inferences


def test_explicit_loading_follows_dependencies(tmp_path: Path) -> None:
    build(tmp_path)
    with QuiverServer(tmp_path, args=("--model-control-mode=explicit",)) as server:
        client = httpclient.InferenceServerClient(server.url)
        client.load_model("pipeline")
        for name in ("pipeline", "add_one", "add_ten", "double"):
            assert client.is_model_ready(name), name
        # Unloading a composing model takes the ensemble down with it.
        client.unload_model("double")
        assert not client.is_model_ready("pipeline")
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["pipeline"]["reason"] == "composing model 'double' was unloaded"
        # Loading it again reloads what it needs; unload_dependents takes them all down.
        client.load_model("pipeline")
        assert client.is_model_ready("double")
        client.unload_model("pipeline", unload_dependents=True)
        for name in ("pipeline", "add_one", "add_ten", "double"):
            assert not client.is_model_ready(name), name
        with pytest.raises(InferenceServerException) as info:
            client.load_model("broken_pipeline")
        assert "composing model 'ghost' is not in the model repository" in info.value.message()


BLS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            model = "add_ten" if x.sum() >= 0 else "missing_model"
            call = pb_utils.InferenceRequest(
                model_name=model, requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", x)],
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            y = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", y * 3)]))
        return responses
"""

ASYNC_BLS_MODEL = """
import asyncio
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            calls = [
                pb_utils.InferenceRequest(model_name=name, requested_output_names=["OUTPUT0"],
                                          inputs=[pb_utils.Tensor("INPUT0", x)]).async_exec()
                for name in ("add_one", "add_ten")
            ]
            one, ten = await asyncio.gather(*calls)
            total = (pb_utils.get_output_tensor_by_name(one, "OUTPUT0").as_numpy()
                     + pb_utils.get_output_tensor_by_name(ten, "OUTPUT0").as_numpy())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", total)]))
        return responses
"""

BLS_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def test_python_models_call_other_models(tmp_path: Path) -> None:
    build(tmp_path)
    write_python(tmp_path, "bls", BLS_MODEL, BLS_CONFIG)
    write_python(tmp_path, "bls_async", ASYNC_BLS_MODEL, BLS_CONFIG)
    with QuiverServer(tmp_path, args=("--exit-on-error=false",)) as server:
        client = httpclient.InferenceServerClient(server.url)
        x = np.array([[1, 2, 3, 4]], dtype=np.float32)
        inp = inputs(x)
        np.testing.assert_array_equal(client.infer("bls", inp).as_numpy("OUT"), (x + 10) * 3)
        np.testing.assert_array_equal(client.infer("bls_async", inp).as_numpy("OUT"), (x + 1) + (x + 10))
        with pytest.raises(InferenceServerException) as info:
            client.infer("bls", inputs(-x))
        assert info.value.status() == "404" and "missing_model" in info.value.message()
        # The called model counts the BLS traffic like any other.
        stats = client.get_inference_statistics("add_ten")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] >= 2
