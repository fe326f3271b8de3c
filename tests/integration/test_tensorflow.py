"""TensorFlow GraphDef and SavedModel models through a real server and tritonclient."""

from __future__ import annotations

import asyncio
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from support.server import QuiverServer

pytest.importorskip("tensorflow", reason="needs quiver[tensorflow] (pip install 'quiver[tensorflow]')")

from support import tf_models as tfm

ADD_SUB = """
name: "{name}"
platform: "tensorflow_graphdef"
max_batch_size: 8
{extra}
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }}
]
"""


def write(repo: Path, name: str, config: str | None, files: dict[str, bytes] | None = None) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    for relative, data in (files or {}).items():
        (folder / relative).write_bytes(data)
    return folder


def build(repo: Path) -> Path:
    repo.mkdir()
    add_sub = tfm.add_sub_graphdef()
    write(repo, "tf_add_sub", ADD_SUB.format(
        name="tf_add_sub",
        extra="dynamic_batching { max_queue_delay_microseconds: 200000 preferred_batch_size: [ 8 ] }",
    ), {"1/model.graphdef": add_sub})
    write(repo, "tf_two_instances", ADD_SUB.format(
        name="tf_two_instances", extra="instance_group [ { count: 2 kind: KIND_CPU } ]",
    ), {"1/model.graphdef": add_sub})
    write(repo, "tf_strings", """
        platform: "tensorflow_graphdef"
        input [ { name: "text" data_type: TYPE_STRING dims: [ -1, -1 ] } ]
        output [
          { name: "upper" data_type: TYPE_STRING dims: [ -1, -1 ] },
          { name: "length" data_type: TYPE_INT32 dims: [ -1, -1 ] }
        ]
        """, {"1/model.graphdef": tfm.strings_graphdef()})
    write(repo, "tf_batch_of_one", """
        platform: "tensorflow_graphdef"
        max_batch_size: 4
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
        output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
        """, {"1/model.graphdef": tfm.scale_graphdef_fixed_batch_of_one()})
    saved = write(repo, "tf_saved_auto", None)
    tfm.write_saved_model(saved / "1" / "model.savedmodel")
    partial = write(repo, "tf_saved_backend_only", 'backend: "tensorflow"\n')
    tfm.write_saved_model(partial / "1" / "model.savedmodel")
    bad_signature = write(repo, "tf_saved_no_signature", """
        platform: "tensorflow_savedmodel"
        parameters { key: "TF_SIGNATURE_DEF" value { string_value: "predict" } }
        """)
    tfm.write_saved_model(bad_signature / "1" / "model.savedmodel")
    write(repo, "tf_not_a_graph", ADD_SUB.format(name="tf_not_a_graph", extra=""),
          {"1/model.graphdef": b"\xff\xfe this is not a protobuf \x00\x01"})
    write(repo, "tf_wrong_names", ADD_SUB.format(name="tf_wrong_names", extra="").replace(
        '"INPUT1"', '"INPUT9"'), {"1/model.graphdef": add_sub})
    write(repo, "tf_wrong_type", ADD_SUB.format(name="tf_wrong_type", extra="").replace(
        'name: "INPUT0" data_type: TYPE_FP32', 'name: "INPUT0" data_type: TYPE_INT32'),
        {"1/model.graphdef": add_sub})
    write(repo, "tf_no_io", 'platform: "tensorflow_graphdef"\n', {"1/model.graphdef": add_sub})
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = build(tmp_path_factory.mktemp("tf") / "models")
    env = {"SAGEMAKER_TRITON_TENSORFLOW_VERSION": "1"}
    with QuiverServer(repo, args=("--exit-on-error=false",), env=env, timeout=180) as running:
        yield running
    assert running.process is not None
    assert running.process.returncode == 0, running.log


@pytest.fixture(scope="module")
def client(server: QuiverServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


def add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput("INPUT0", list(a.shape), "FP32"), httpclient.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_graphdef_by_tensor_name_over_http_and_grpc(server: QuiverServer, client: httpclient.InferenceServerClient) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.ones((2, 4), np.float32)
    result = client.infer("tf_add_sub", add_sub_inputs(a, b))
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [grpcclient.InferInput("INPUT0", [2, 4], "FP32"), grpcclient.InferInput("INPUT1", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    only = [grpcclient.InferRequestedOutput("OUTPUT1")]
    result = grpc.infer("tf_add_sub", inputs, outputs=only)
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0") is None


async def _concurrently(url: str, model: str, arrays: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    client = aiohttpclient.InferenceServerClient(url)
    try:

        async def one(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            inputs = [aiohttpclient.InferInput("INPUT0", list(a.shape), "FP32"),
                      aiohttpclient.InferInput("INPUT1", list(b.shape), "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = await client.infer(model, inputs)
            return result.as_numpy("OUTPUT0")  # type: ignore[no-any-return]

        return list(await asyncio.gather(*(one(a, b) for a, b in arrays)))
    finally:
        await client.close()


def test_dynamic_batching_joins_concurrent_requests(server: QuiverServer, client: httpclient.InferenceServerClient) -> None:
    before = client.get_inference_statistics("tf_add_sub")["model_stats"][0]["execution_count"]
    ones = np.ones((1, 4), np.float32)
    arrays = [(np.full((1, 4), float(i), np.float32), ones) for i in range(8)]
    outputs = asyncio.run(_concurrently(server.url, "tf_add_sub", arrays))
    for i, out in enumerate(outputs):
        assert np.array_equal(out, np.full((1, 4), i + 1.0, np.float32))
    stats = client.get_inference_statistics("tf_add_sub")["model_stats"][0]
    assert stats["execution_count"] - before < 8  # some requests ran together


def test_two_instances_serve(server: QuiverServer) -> None:
    a = np.ones((3, 4), np.float32)
    outputs = asyncio.run(_concurrently(server.url, "tf_two_instances", [(a, a)] * 8))
    assert all(np.array_equal(r, 2 * a) for r in outputs)


def test_bytes_in_and_out(client: httpclient.InferenceServerClient) -> None:
    text = np.array([[b"hello", b"quiver"], [b"t\xc3\xa9", b""]], dtype=np.object_)
    inp = httpclient.InferInput("text", [2, 2], "BYTES")
    inp.set_data_from_numpy(text)
    result = client.infer("tf_strings", [inp])
    assert result.as_numpy("upper").tolist() == [[b"HELLO", b"QUIVER"], [b"T\xc3\xa9", b""]]
    assert result.as_numpy("length").tolist() == [[5, 6], [3, 0]]


def test_a_graph_with_a_fixed_batch_of_one_runs_row_by_row(client: httpclient.InferenceServerClient) -> None:
    x = np.array([[1, 2, 3], [0, 0, 1], [2, 2, 2]], np.float32)
    inp = httpclient.InferInput("x", [3, 3], "FP32")
    inp.set_data_from_numpy(x)
    y = client.infer("tf_batch_of_one", [inp]).as_numpy("y")
    assert np.allclose(y, 2 * x + x.sum(axis=1, keepdims=True))


def test_saved_model_auto_completes_from_its_signature(client: httpclient.InferenceServerClient) -> None:
    for name in ("tf_saved_auto", "tf_saved_backend_only"):
        config = client.get_model_config(name)
        assert config["platform"] == "tensorflow_savedmodel"
        assert config["backend"] == "tensorflow"
        assert config["max_batch_size"] == 4
        assert "dynamic_batching" in config
        inputs = {i["name"]: (i["data_type"], i["dims"]) for i in config["input"]}
        outputs = {o["name"]: (o["data_type"], o["dims"]) for o in config["output"]}
        assert inputs == {"features": ("TYPE_FP32", [3]), "tag": ("TYPE_STRING", [])}
        assert outputs == {"scores": ("TYPE_FP32", [2]), "tag_upper": ("TYPE_STRING", [])}
        metadata = client.get_model_metadata(name)
        assert metadata["platform"] == "tensorflow_savedmodel"
        features = np.array([[1, 0, 0], [0, 1, 1]], np.float32)
        tag = np.array([b"a", b"bc"], dtype=np.object_)
        inputs_ = [httpclient.InferInput("features", [2, 3], "FP32"), httpclient.InferInput("tag", [2], "BYTES")]
        inputs_[0].set_data_from_numpy(features)
        inputs_[1].set_data_from_numpy(tag)
        result = client.infer(name, inputs_)
        assert np.allclose(result.as_numpy("scores"), features @ np.array([[1, 2], [3, 4], [5, 6]], np.float32))
        assert result.as_numpy("tag_upper").tolist() == [b"A", b"BC"]


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("tf_not_a_graph", ["model 'tf_not_a_graph'", "not a TensorFlow GraphDef"]),
        ("tf_saved_no_signature", ["model 'tf_saved_no_signature'", "expected 'predict' signature", "serving_default"]),
        ("tf_wrong_names", ["unexpected inference input 'INPUT9'", "allowed inputs are: INPUT0, INPUT1"]),
        ("tf_wrong_type", ["configuration expects datatype TYPE_INT32 for input 'INPUT0', model provides TYPE_FP32"]),
        ("tf_no_io", ["must declare its inputs and outputs", "INPUT0, INPUT1"]),
    ],
)
def test_bad_models_are_unavailable_with_the_reason(
    client: httpclient.InferenceServerClient, model: str, fragments: list[str]
) -> None:
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index[model]["state"] == "UNAVAILABLE"
    for fragment in fragments:
        assert fragment in index[model]["reason"], index[model]["reason"]
    with pytest.raises(InferenceServerException):
        client.infer(model, add_sub_inputs(np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)))
    assert client.is_model_ready("tf_add_sub")


def test_a_shape_tensorflow_refuses_is_a_400_naming_the_model(client: httpclient.InferenceServerClient) -> None:
    text = np.array([b"one", b"two"], dtype=np.object_)  # rank 1; the placeholder is rank 2
    inp = httpclient.InferInput("text", [2], "BYTES")
    inp.set_data_from_numpy(text)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tf_strings", [inp])
    assert "tf_strings" in str(caught.value)
    assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_tensorflow_version_variable_is_accepted(server: QuiverServer) -> None:
    assert "SAGEMAKER_TRITON_TENSORFLOW_VERSION=1" in server.log


def test_the_import_of_tensorflow_is_logged_with_its_cost(server: QuiverServer) -> None:
    found = re.search(r"backend 'tensorflow' ready: its import took [\d.]+ s and (\d+) MB", server.log)
    assert found, server.log
    assert int(found.group(1)) > 100  # TensorFlow is hundreds of MB
