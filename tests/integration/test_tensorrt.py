"""TensorRT plans are refused clearly (no NVIDIA GPU, no TensorRT here): the model is
UNAVAILABLE with the reason, in the index and in load errors, and the other models of the same
repository or archive keep loading and serving."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.archives import ADD, onnx_bytes, tar_gz
from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer

REASON = "requires an NVIDIA GPU and TensorRT"

TRT = """
name: "{name}"
platform: "tensorrt_plan"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

#: The seed's second ensemble, in miniature: a TensorRT step, then an ONNX one.
ENSEMBLE = """
name: "ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "bert-trt" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "postprocess" model_version: -1 input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""

PLAN = b"\x00not a real engine, and no GPU to run one anyway"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("trt") / "models"
    repo.mkdir()
    for name, config in (("resnet_trt", TRT.format(name="resnet_trt")), ("configless_trt", None)):
        folder = repo / name / "1"
        folder.mkdir(parents=True)
        (folder / "model.plan").write_bytes(PLAN)
        if config:
            (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
    write_onnx(repo, "add", add_constant_onnx(1.0), ADD.format(name="add"))
    archive = tar_gz(
        {
            "ensemble/config.pbtxt": textwrap.dedent(ENSEMBLE).encode(),
            "bert-trt/config.pbtxt": textwrap.dedent(TRT.format(name="bert-trt")).encode(),
            "bert-trt/1/model.plan": PLAN,
            "postprocess/config.pbtxt": textwrap.dedent(ADD.format(name="postprocess")).encode(),
            "postprocess/1/model.onnx": onnx_bytes(add_constant_onnx(2.0)),
        },
        dirs=("ensemble", "ensemble/1"),
    )
    (repo / "model_trt_python.tar.gz").write_bytes(archive)
    args = ("--model-control-mode=on_demand", "--load-model=*", "--exit-on-error=false")
    with QuiverServer(repo, args=args) as running:
        yield running


def test_the_index_says_why_a_plan_is_unavailable(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    index = {e["name"]: e for e in client.get_model_repository_index()}
    for name in ("resnet_trt", "configless_trt"):
        assert index[name]["state"] == "UNAVAILABLE"
        assert REASON in index[name]["reason"], index[name]
        assert f"model '{name}'" in index[name]["reason"]
    assert index["add"]["state"] == "READY"
    assert "resnet_trt" in server.log and REASON in server.log


def test_loading_a_plan_fails_with_the_reason_and_others_keep_serving(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("resnet_trt")
    assert REASON in str(caught.value)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("resnet_trt", _x())
    assert REASON in str(caught.value) or "not ready" in str(caught.value)
    out = client.infer("add", _x()).as_numpy("OUTPUT0")
    assert np.array_equal(out, np.full((1, 4), 1.0, np.float32))


def test_an_archive_with_a_tensorrt_step_names_the_step(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    inp = httpclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("model_trt_python.tar.gz", [inp])
    message = str(caught.value)
    assert "model_trt_python.tar.gz::bert-trt" in message and REASON in message, message
    assert "composing model" in message
    assert client.infer("add", _x()).as_numpy("OUTPUT0")[0, 0] == 1.0


def _x() -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    return [inp]
