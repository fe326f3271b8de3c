"""DALI models through a real server: the seed's serialized GPU pipeline (mixed decoder,
device_id=0) runs on this CPU-only machine, bit-identical to the pipeline built for the CPU."""

from __future__ import annotations

import asyncio
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

pytest.importorskip("nvidia.dali", reason="needs quiver[dali] (pip install 'quiver[dali]')")

from quiver.backends.dali import PipelineDef
from support import dali_models as dm

BYTES_CONFIG = dm.DALI_CONFIG.replace('name: "dali"', 'name: "dali_bytes"').replace(
    "data_type: TYPE_UINT8\n    dims: [ -1 ]", "data_type: TYPE_STRING\n    dims: [ 1 ]"
)

AUTOSERIALIZED = '''
import nvidia.dali as dali
import nvidia.dali.types as types
from nvidia.dali.plugin.triton import autoserialize


@autoserialize
@dali.pipeline_def(batch_size=3, num_threads=1, device_id=0)
def pipe():
    images = dali.fn.external_source(device="cpu", name="DALI_INPUT_0")
    images = dali.fn.decoders.image(images, device="mixed", output_type=types.RGB)
    images = dali.fn.resize(images, resize_x=299, resize_y=299)
    return dali.fn.crop_mirror_normalize(
        images, crop=(299, 299), mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255], output_layout="HWC")
'''


def write(repo: Path, name: str, config: str, files: dict[str, bytes]) -> None:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(config.replace('name: "dali"', f'name: "{name}"'))
    for relative, data in files.items():
        (folder / relative).write_bytes(data)


def unknown_version_pipeline() -> bytes:
    """The seed's pipeline with an argument this DALI does not know (as a newer one may write)."""
    message = PipelineDef()
    message.ParseFromString(dm.seed_model_dali())
    for op in message.op:
        if op.name == "Resize":
            arg = op.args.add(name="antialias_from_the_future", is_vector=False)
            arg.strings.append("yes")
    return bytes(message.SerializeToString())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("dali") / "models"
    repo.mkdir()
    seed = dm.seed_model_dali()
    write(repo, "dali", dm.DALI_CONFIG.replace("max_batch_size: 256", textwrap.dedent(
        """max_batch_size: 256
        dynamic_batching { max_queue_delay_microseconds: 300000 }""")), {"1/model.dali": seed})
    write(repo, "dali_bytes", BYTES_CONFIG, {"1/model.dali": seed})
    write(repo, "dali_autoserialized", dm.DALI_CONFIG, {"1/dali.py": AUTOSERIALIZED.encode()})
    write(repo, "dali_gpu_only", dm.DALI_CONFIG, {"1/model.dali": dm.gpu_only_model_dali()})
    write(repo, "dali_not_a_pipeline", dm.DALI_CONFIG, {"1/model.dali": b"\x0b\x0c garbage \xff"})
    write(repo, "dali_future", dm.DALI_CONFIG, {"1/model.dali": unknown_version_pipeline()})
    write(repo, "dali_misnamed", dm.DALI_CONFIG.replace("DALI_INPUT_0", "IMAGE"), {"1/model.dali": seed})
    with QuiverServer(repo, args=("--exit-on-error=false",), timeout=180) as running:
        yield running
    assert running.process is not None
    assert running.process.returncode == 0, running.log


@pytest.fixture(scope="module")
def client(server: QuiverServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url)


IMAGES = [dm.jpeg(320, 240, 1), dm.jpeg(120, 200, 2), dm.jpeg(64, 64, 3, fmt="PNG")]


def uint8_input(rows: np.ndarray) -> list[httpclient.InferInput]:
    inp = httpclient.InferInput("DALI_INPUT_0", list(rows.shape), "UINT8")
    inp.set_data_from_numpy(rows)
    return [inp]


def test_the_seed_pipeline_runs_on_the_cpu_bit_for_bit(client: httpclient.InferenceServerClient, server: QuiverServer) -> None:
    out = client.infer("dali", uint8_input(dm.padded(IMAGES))).as_numpy("DALI_OUTPUT_0")
    assert out.shape == (3, 299, 299, 3) and out.dtype == np.float32
    reference = dm.cpu_reference(IMAGES)
    for got, want in zip(out, reference, strict=True):
        assert np.array_equal(got, want)
    assert "made CPU operators" in server.log and "__Image_0 (mixed)" in server.log


def test_bytes_input_one_file_per_row_over_grpc(server: QuiverServer) -> None:
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    data = np.array([[i] for i in IMAGES], dtype=np.object_)
    inp = grpcclient.InferInput("DALI_INPUT_0", [3, 1], "BYTES")
    inp.set_data_from_numpy(data)
    out = grpc.infer("dali_bytes", [inp]).as_numpy("DALI_OUTPUT_0")
    for got, want in zip(out, dm.cpu_reference(IMAGES), strict=True):
        assert np.array_equal(got, want)


def test_an_autoserialized_python_definition_loads(client: httpclient.InferenceServerClient) -> None:
    out = client.infer("dali_autoserialized", uint8_input(dm.padded(IMAGES[:1]))).as_numpy("DALI_OUTPUT_0")
    assert np.array_equal(out[0], dm.cpu_reference(IMAGES[:1])[0])


def test_concurrent_requests_batch_and_a_bad_image_fails_alone(server: QuiverServer, client: httpclient.InferenceServerClient) -> None:
    before = client.get_inference_statistics("dali")["model_stats"][0]["execution_count"]
    bad = np.frombuffer(b"this is not an image at all" * 4, np.uint8)[None]

    async def run() -> list[object]:
        aio = aiohttpclient.InferenceServerClient(server.url)
        try:
            async def one(rows: np.ndarray) -> object:
                inp = aiohttpclient.InferInput("DALI_INPUT_0", list(rows.shape), "UINT8")
                inp.set_data_from_numpy(rows)
                try:
                    return (await aio.infer("dali", [inp])).as_numpy("DALI_OUTPUT_0")
                except InferenceServerException as exc:
                    return exc

            batches = [dm.padded([image]) for image in IMAGES] + [bad] + [dm.padded(IMAGES[:2])]
            return list(await asyncio.gather(*(one(b) for b in batches)))
        finally:
            await aio.close()

    results = asyncio.run(run())
    reference = dm.cpu_reference(IMAGES)
    for i in range(3):
        assert isinstance(results[i], np.ndarray) and np.array_equal(results[i][0], reference[i])
    failure = results[3]
    assert isinstance(failure, InferenceServerException)
    assert failure.status() == "400" and "model 'dali'" in str(failure) and "decode" in str(failure)
    assert isinstance(results[4], np.ndarray) and np.array_equal(results[4][1], reference[1])
    stats = client.get_inference_statistics("dali")["model_stats"][0]
    assert stats["execution_count"] - before < 5  # requests ran together
    # the pipeline was rebuilt after DALI's error: still serving
    again = client.infer("dali", uint8_input(dm.padded(IMAGES[2:]))).as_numpy("DALI_OUTPUT_0")
    assert np.array_equal(again[0], reference[2])


@pytest.mark.parametrize(
    ("model", "fragments"),
    [
        ("dali_gpu_only", ["DALI operator 'experimental__Dilate'", "has no CPU version"]),
        ("dali_not_a_pipeline", ["model 'dali_not_a_pipeline'", "not a serialized DALI pipeline"]),
        ("dali_future", ["model 'dali_future'", "cannot load the pipeline", "another DALI version"]),
        ("dali_misnamed", ["input(s) IMAGE are not external sources", "DALI_INPUT_0"]),
    ],
)
def test_bad_pipelines_are_unavailable_with_the_reason(
    client: httpclient.InferenceServerClient, model: str, fragments: list[str]
) -> None:
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index[model]["state"] == "UNAVAILABLE"
    for fragment in fragments:
        assert fragment in index[model]["reason"], index[model]["reason"]
    assert client.is_model_ready("dali")
