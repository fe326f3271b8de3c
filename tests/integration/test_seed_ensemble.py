"""The seed documents' ensemble end to end: ``model_tf_dali.tar.gz`` (the seed's DALI pipeline
serialized for a GPU with device_id=0, a random-weight Inception v3 GraphDef, the seed's three
configurations) in an S3 store, invoked by TargetModel over SageMaker's /invocations as the
seed does, and by key over v2."""

from __future__ import annotations

import functools
import http.client
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from support.s3 import SeaweedS3
from support.server import QuiverServer

pytest.importorskip("tensorflow", reason="needs quiver[tensorflow] (pip install 'quiver[tensorflow]')")
pytest.importorskip("nvidia.dali", reason="needs quiver[dali] (pip install 'quiver[dali]')")

import seed_ensemble as seed
import tensorflow as tf

from support import dali_models as dm

BUCKET = "sagemaker-bucket"
PREFIX = "triton-mme-gpu-ensemble"
TARGET = "X-Amzn-SageMaker-Target-Model"
CHW_ARCHIVE = "model_tf_dali_chw.tar.gz"
IMAGES = [dm.jpeg(500, 375, 7), dm.jpeg(299, 299, 8)]
#: The first invocation downloads the archive and loads TensorFlow and DALI cold: on a busy
#: 2-core machine that has taken over two minutes, past the suite's default timeout.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def graphdef() -> bytes:
    return seed.inception_v3_graphdef()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, graphdef: bytes) -> Iterator[SeaweedS3]:
    hwc = tmp_path_factory.mktemp("model_repository")
    seed.build_seed_ensemble(hwc, graphdef=graphdef)
    chw = tmp_path_factory.mktemp("model_repository_chw")
    seed.build_seed_ensemble(chw, graphdef=graphdef, dali_file=seed.seed_model_dali(layout="CHW"))
    with SeaweedS3(tmp_path_factory.mktemp("s3_seed"), volume_max=24) as server:
        client = server.client(timeout=120.0)
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{seed.ARCHIVE}", Body=seed.tar_repository(hwc))
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{CHW_ARCHIVE}", Body=seed.tar_repository(chw))
        yield server


@pytest.fixture(scope="module")
def server(s3: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    args = (
        "--model-repository", f"s3://{BUCKET}/{PREFIX}",
        "--model-control-mode=on_demand",
        "--model-cache-dir", str(tmp_path_factory.mktemp("seed_cache") / "cache"),
        "--model-load-wait-timeout", "170",
    )  # fmt: skip
    env = {
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": s3.endpoint,
        "SAGEMAKER_MULTI_MODEL": "true",
    }
    with QuiverServer(args=args, env=env, timeout=120) as running:
        yield running
    assert running.process is not None
    assert running.process.returncode == 0, running.log


def invoke(server: QuiverServer, target: str, body: bytes, content_type: str) -> tuple[int, str, bytes]:
    host, port = server.sagemaker_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=180)
    try:
        conn.request("POST", "/invocations", body=body, headers={"Content-Type": content_type, TARGET: target})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def seed_payload(image: bytes) -> dict[str, Any]:
    """The seed's request: the JPEG as a [1, N] UINT8 list, in JSON."""
    rv = np.expand_dims(np.array(list(image)).astype(np.uint8), 0)
    return {"inputs": [{"name": "INPUT", "shape": rv.shape, "datatype": "UINT8", "data": rv.tolist()}]}


def in_process(images: list[bytes], graphdef: bytes) -> np.ndarray:
    """The floor: the CPU-built DALI pipeline, then the frozen graph in a TF session."""
    return _in_process(tuple(images), graphdef)


@functools.lru_cache(maxsize=4)
def _in_process(images: tuple[bytes, ...], graphdef: bytes) -> np.ndarray:
    preprocessed = np.stack(dm.cpu_reference(list(images)))
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString(graphdef)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        return session.run(f"{seed.INCEPTION_OUTPUT}:0", {f"{seed.INCEPTION_INPUT}:0": preprocessed})  # type: ignore[no-any-return]


def test_the_seed_invocation_by_target_model(server: QuiverServer, graphdef: bytes) -> None:
    body = json.dumps(seed_payload(IMAGES[0])).encode()
    status, _, data = invoke(server, seed.ARCHIVE, body, "application/octet-stream")
    assert status == 200, data[:500]
    reply = json.loads(data)
    (output,) = reply["outputs"]
    assert output["name"] == "OUTPUT" and output["shape"] == [1, 1001] and output["datatype"] == "FP32"
    probabilities = np.array(output["data"], np.float32)
    assert abs(float(probabilities.sum()) - 1.0) < 1e-4
    assert np.allclose(probabilities, in_process(IMAGES[:1], graphdef)[0], atol=1e-6)


def test_binary_invocation_with_top_k_labels(server: QuiverServer, graphdef: bytes) -> None:
    rows = dm.padded(IMAGES)
    inp = httpclient.InferInput("INPUT", list(rows.shape), "UINT8")
    inp.set_data_from_numpy(rows)
    outputs = [httpclient.InferRequestedOutput("OUTPUT", class_count=3)]
    body, header = httpclient.InferenceServerClient.generate_request_body([inp], outputs=outputs)
    status, content_type, data = invoke(
        server, seed.ARCHIVE, body, f"application/vnd.sagemaker-triton.binary+json;json-header-size={header}"
    )
    assert status == 200, data[:500]
    size = int(content_type.rsplit("=", 1)[1]) if "json-header-size" in content_type else None
    result = httpclient.InferenceServerClient.parse_response_body(data, header_length=size)
    top = result.as_numpy("OUTPUT")
    assert top.shape == (2, 3)
    expected = in_process(IMAGES, graphdef)
    labels = seed.inception_labels()
    for row, probabilities in zip(top, expected, strict=True):
        # The seed's ensemble output has no label_filename of its own: it has the labels of
        # the inception step's output that produces it, as Triton completes an ensemble's
        # labels: "score:index:label".
        # (Random weights give near-uniform scores: compare scores, not the order of ties.)
        entries = [entry.decode().split(":", 2) for entry in row]
        assert all(len(e) == 3 for e in entries)
        assert [label for _, _, label in entries] == [labels[int(index)] for _, index, _ in entries]
        scores = np.array([float(score) for score, _, _ in entries])
        assert np.allclose(scores, np.sort(probabilities)[::-1][:3], atol=1e-5)
        assert np.allclose(probabilities[[int(index) for _, index, _ in entries]], scores, atol=1e-5)


def test_top_k_labels_of_the_inception_step(server: QuiverServer, graphdef: bytes) -> None:
    """inception_graphdef's output carries the seed's 1001 labels; asked directly (with the
    DALI step's preprocessing) it answers "score:index:label"."""
    client = httpclient.InferenceServerClient(server.url, network_timeout=180)
    client.infer(seed.ARCHIVE, [_uint8("INPUT", dm.padded(IMAGES[:1]))])  # the archive is loaded
    preprocessed = np.stack(dm.cpu_reference(IMAGES))
    inp = httpclient.InferInput("input", list(preprocessed.shape), "FP32")
    inp.set_data_from_numpy(preprocessed)
    top = client.infer(
        f"{seed.ARCHIVE}::inception_graphdef", [inp],
        outputs=[httpclient.InferRequestedOutput(seed.INCEPTION_OUTPUT, class_count=3)],
    ).as_numpy(seed.INCEPTION_OUTPUT)
    labels = seed.inception_labels()
    assert len(labels) == 1001
    for row, probabilities in zip(top, in_process(IMAGES, graphdef), strict=True):
        entries = [entry.decode().split(":", 2) for entry in row]
        indices = [int(index) for _, index, _ in entries]
        assert [label for _, _, label in entries] == [labels[i] for i in indices]
        scores = np.array([float(score) for score, _, _ in entries])
        assert np.allclose(scores, np.sort(probabilities)[::-1][:3], atol=1e-5)
        assert np.allclose(probabilities[indices], scores, atol=1e-5)


def _uint8(name: str, rows: np.ndarray) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(rows.shape), "UINT8")
    inp.set_data_from_numpy(rows)
    return inp


def test_v2_by_key_and_the_dali_step_bit_for_bit(server: QuiverServer, graphdef: bytes) -> None:
    client = httpclient.InferenceServerClient(server.url, network_timeout=180)
    rows = dm.padded(IMAGES)
    inp = httpclient.InferInput("INPUT", list(rows.shape), "UINT8")
    inp.set_data_from_numpy(rows)
    out = client.infer(seed.ARCHIVE, [inp]).as_numpy("OUTPUT")
    assert out.shape == (2, 1001)
    assert np.allclose(out.sum(axis=1), 1.0, atol=1e-4)
    assert np.allclose(out, in_process(IMAGES, graphdef), atol=1e-6)
    # Each image alone gives its row of the batch (batch consistency).
    single = httpclient.InferInput("INPUT", [1, len(IMAGES[1])], "UINT8")
    single.set_data_from_numpy(np.frombuffer(IMAGES[1], np.uint8)[None])
    assert np.allclose(client.infer(seed.ARCHIVE, [single]).as_numpy("OUTPUT")[0], out[1], atol=1e-6)
    # The DALI step (the archive's composing model, served while the archive is loaded)
    # equals the pipeline built for the CPU, bit for bit.
    dali_in = httpclient.InferInput("DALI_INPUT_0", list(rows.shape), "UINT8")
    dali_in.set_data_from_numpy(rows)
    preprocessed = client.infer(f"{seed.ARCHIVE}::dali", [dali_in]).as_numpy("DALI_OUTPUT_0")
    for got, want in zip(preprocessed, dm.cpu_reference(IMAGES), strict=True):
        assert np.array_equal(got, want)
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index[seed.ARCHIVE]["state"] == "READY"


def test_a_chw_pipeline_fails_the_inception_step_by_shape(server: QuiverServer) -> None:
    body = json.dumps(seed_payload(IMAGES[1])).encode()
    status, _, data = invoke(server, CHW_ARCHIVE, body, "application/json")
    assert status == 400, data[:500]
    message = json.loads(data)["error"]
    assert "inception_graphdef" in message and "3,299,299" in message.replace(" ", ""), message


def test_a_jpeg_that_does_not_decode_is_a_400_naming_the_step(server: QuiverServer) -> None:
    broken = IMAGES[0][: len(IMAGES[0]) // 3]  # a truncated JPEG
    body = json.dumps(seed_payload(broken)).encode()
    status, _, data = invoke(server, seed.ARCHIVE, body, "application/json")
    assert status == 400, data[:500]
    message = json.loads(data)["error"]
    assert "dali" in message, message
    status, _, data = invoke(server, seed.ARCHIVE, json.dumps(seed_payload(IMAGES[1])).encode(), "application/json")
    assert status == 200, data[:500]
