"""The example repository's two pipelines end to end, as ``make serve`` serves them.

image: IMAGE (encoded JPEG/PNG, BYTES) -> preprocess (Python, Pillow) -> ResNet-50 (ONNX or
TorchScript) -> OUTPUT FP32[1000]; text: TEXT (BYTES) -> tokenizer (Python, tokenizers) ->
minilm (ONNX) -> postprocess (Python, numpy) -> EMBEDDING FP32[384]. The repository is built
with ``examples/build_repository.py`` once and cached under pytest's cache directory, keyed by
the builder's hash (building exports ResNet-50 twice and MiniLM once: 10 to 50 s on 2 cores).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import io
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import build_repository
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from support.server import QuiverServer

# Building the repository (first run) and loading two ResNet-50s take longer than the default.
pytestmark = pytest.mark.timeout(600)

SENTENCES = [
    "A man is eating food.",
    "Quiver serves Triton model repositories unchanged.",
    "",  # [CLS] [SEP] only
    "naïve café, 東京 and emoji 🙂",
    " ".join(["truncated"] * 600),  # far past the model's 256 tokens: cut, not a crash
]


@pytest.fixture(scope="session")
def example_repository(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    builder = Path(build_repository.__file__)
    key = hashlib.sha256(builder.read_bytes()).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)
    base = Path(cache.mkdir("example-repository")) if cache is not None else tmp_path_factory.mktemp("examples")
    root = base / key
    if not (root / ".built").exists():
        for stale in base.iterdir():  # other versions of the builder
            shutil.rmtree(stale, ignore_errors=True)
        partial = base / f"{key}.partial"
        build_repository.build(partial)
        (partial / ".built").touch()
        partial.rename(root)
    return root


@pytest.fixture(scope="module")
def server(example_repository: Path) -> Iterator[QuiverServer]:
    with QuiverServer(example_repository, timeout=300) as running:
        yield running


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, server: QuiverServer) -> Iterator[tuple[Any, Any]]:
    if request.param == "http":
        http = httpclient.InferenceServerClient(server.url, network_timeout=120)
        yield httpclient, http
        http.close()
    else:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        yield grpcclient, grpc
        grpc.close()


def infer(client: tuple[Any, Any], model: str, name: str, rows: list[Any], output: str, class_count: int = 0) -> Any:
    module, connection = client
    data = np.array(rows, dtype=np.object_).reshape(len(rows), 1)
    tensor = module.InferInput(name, list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    requested = module.InferRequestedOutput(output, class_count=class_count)
    return connection.infer(model, [tensor], outputs=[requested]).as_numpy(output)


def load_model_py(path: Path, name: str) -> ModuleType:
    """A Python model's model.py as a module (the server runs the same file)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """A JPEG photo-sized noise image and a small, tall PNG with alpha (upscaled by the resize)."""
    rng = np.random.default_rng(7)
    noise = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    gradient = np.zeros((180, 120, 4), dtype=np.uint8)
    gradient[..., 0] = np.linspace(0, 255, 120, dtype=np.uint8)[None, :]
    gradient[..., 1] = np.linspace(255, 0, 180, dtype=np.uint8)[:, None]
    gradient[..., 2] = 90
    gradient[..., 3] = 255
    return [encode(noise, "JPEG"), encode(Image.fromarray(gradient, "RGBA"), "PNG")]


@pytest.fixture(scope="module")
def reference_logits(example_repository: Path, images: list[bytes]) -> dict[str, np.ndarray]:
    """The same preprocessing (the repository's own model.py) and networks, run in-process."""
    import torch

    preprocess = load_model_py(example_repository / "preprocess" / "1" / "model.py", "_pipelines_preprocess")
    batch = np.stack([preprocess.preprocess_image(data) for data in images])
    assert batch.shape == (len(images), 3, 224, 224) and batch.dtype == np.float32
    session = ort.InferenceSession(
        str(example_repository / "resnet50_onnx" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    (onnx_logits,) = session.run(["OUTPUT0"], {"INPUT0": batch})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated, not gone
        network = torch.jit.load(str(example_repository / "resnet50_pt" / "1" / "model.pt"))
    with torch.inference_mode():
        pt_logits = network(torch.from_numpy(batch)).numpy()
    return {"image_pipeline_onnx": onnx_logits, "image_pipeline_pt": pt_logits}


@pytest.mark.parametrize("model", ["image_pipeline_onnx", "image_pipeline_pt"])
def test_image_pipeline_matches_in_process(
    client: tuple[Any, Any], model: str, images: list[bytes], reference_logits: dict[str, np.ndarray]
) -> None:
    logits = infer(client, model, "IMAGE", images, "OUTPUT")
    assert logits.shape == (len(images), 1000) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference_logits[model], rtol=0, atol=1e-4)


def test_onnx_and_torchscript_resnets_agree(server: QuiverServer, images: list[bytes]) -> None:
    client = (httpclient, httpclient.InferenceServerClient(server.url, network_timeout=120))
    onnx_logits = infer(client, "image_pipeline_onnx", "IMAGE", images, "OUTPUT")
    pt_logits = infer(client, "image_pipeline_pt", "IMAGE", images, "OUTPUT")
    np.testing.assert_allclose(onnx_logits, pt_logits, rtol=0, atol=1e-4)
    assert np.abs(onnx_logits).max() > 1e-2  # not trivially equal


@pytest.mark.parametrize("model", ["image_pipeline_onnx", "image_pipeline_pt"])
def test_classification_returns_imagenet_labels(
    client: tuple[Any, Any], model: str, images: list[bytes], reference_logits: dict[str, np.ndarray]
) -> None:
    labels = build_repository.imagenet_labels()
    assert labels[:3] == ["tench", "goldfish", "great white shark"]
    top = infer(client, model, "IMAGE", images[:1], "OUTPUT", class_count=5)
    assert top.shape == (1, 5)
    entries = [entry.decode().split(":", 2) for entry in top[0]]
    expected = np.argsort(-reference_logits[model][0])[:5]
    assert [int(index) for _, index, _ in entries] == expected.tolist()
    assert [label for _, _, label in entries] == [labels[i] for i in expected]
    scores = [float(value) for value, _, _ in entries]
    assert scores == sorted(scores, reverse=True)


def test_bytes_that_are_not_an_image_are_a_clear_400(client: tuple[Any, Any], images: list[bytes]) -> None:
    module, _ = client
    for model in ("image_pipeline_onnx", "image_pipeline_pt"):
        with pytest.raises(InferenceServerException) as info:
            infer(client, model, "IMAGE", [images[0], b"GIF89a? no: plain text"], "OUTPUT")
        status = "400" if module is httpclient else "StatusCode.INVALID_ARGUMENT"
        assert info.value.status() == status
        message = info.value.message()
        assert f"ensemble '{model}': step 0 (model 'preprocess') failed" in message, message
        assert "input IMAGE[1] is not a JPEG or PNG image (22 bytes" in message, message
    # A truncated JPEG is named too, and the pipeline still serves good images afterwards.
    with pytest.raises(InferenceServerException) as info:
        infer(client, "image_pipeline_onnx", "IMAGE", [images[0][: len(images[0]) // 2]], "OUTPUT")
    assert "(model 'preprocess') failed: input IMAGE[0] is not a decodable JPEG or PNG image" in info.value.message()
    assert infer(client, "image_pipeline_onnx", "IMAGE", images[1:], "OUTPUT").shape == (1, 1000)


@pytest.fixture(scope="module")
def sentence_transformer() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(build_repository.minilm_dir()), device="cpu")


def test_text_embeddings_match_sentence_transformers(client: tuple[Any, Any], sentence_transformer: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = sentence_transformer.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)
    embeddings = infer(client, "text_pipeline", "TEXT", [s.encode() for s in SENTENCES], "EMBEDDING")
    assert embeddings.shape == (len(SENTENCES), 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    cosine = (embeddings * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    assert (cosine > 0.9999).all(), cosine
    # One sentence alone gives what it gives in a batch (padding is masked out).
    alone = infer(client, "text_pipeline", "TEXT", [SENTENCES[0].encode()], "EMBEDDING")
    assert float(alone[0] @ embeddings[0]) > 0.9999


def test_text_is_truncated_at_the_models_maximum(example_repository: Path) -> None:
    tokenizer = load_model_py(example_repository / "tokenizer" / "1" / "model.py", "_pipelines_tokenizer")
    config = (example_repository / "tokenizer" / "config.pbtxt").read_text()
    assert build_repository.minilm_max_length() == 256
    assert 'key: "max_length" value: { string_value: "256" }' in config
    loaded = tokenizer.load_tokenizer(str(example_repository / "tokenizer" / "1" / "tokenizer.json"), 256)
    ids, mask = tokenizer.tokenize(loaded, [SENTENCES[-1], "short", ""])
    assert ids.shape == mask.shape == (3, 256)  # padded to the longest row, not to a fixed 128
    assert mask.sum(axis=1).tolist() == [256, 3, 2]
    ids, _ = tokenizer.tokenize(loaded, ["short", ""])
    assert ids.shape == (2, 3)


def test_an_empty_list_of_strings_is_a_400(client: tuple[Any, Any]) -> None:
    module, connection = client
    for model, name in (("text_pipeline", "TEXT"), ("image_pipeline_onnx", "IMAGE")):
        tensor = module.InferInput(name, [0, 1], "BYTES")
        tensor.set_data_from_numpy(np.zeros((0, 1), dtype=np.object_))
        with pytest.raises(InferenceServerException) as info:
            connection.infer(model, [tensor])
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert "inference request batch-size must be <= " in info.value.message()
        assert f"for '{model}' (got 0, input '{name}')" in info.value.message()


def _counts(server: QuiverServer, model: str) -> tuple[int, int]:
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_resnet_batches_across_image_pipeline_requests_over_http(server: QuiverServer, images: list[bytes]) -> None:
    before = _counts(server, "resnet50_onnx")

    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(server.url, conn_timeout=120) as client:

            async def one(data: bytes) -> None:
                tensor = aiohttpclient.InferInput("IMAGE", [1, 1], "BYTES")
                tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
                result = await client.infer("image_pipeline_onnx", [tensor])
                assert result.as_numpy("OUTPUT").shape == (1, 1000)

            await asyncio.gather(*(one(images[i % 2]) for i in range(8)))

    asyncio.run(main())
    inferences, executions = (a - b for a, b in zip(_counts(server, "resnet50_onnx"), before, strict=True))
    assert inferences == 8
    assert executions < inferences


def test_resnet_and_minilm_batch_across_requests_over_grpc(server: QuiverServer, images: list[bytes]) -> None:
    before = {m: _counts(server, m) for m in ("resnet50_pt", "minilm")}

    async def main() -> None:
        client = aiogrpcclient.InferenceServerClient(server.grpc_url)
        try:

            async def one(model: str, name: str, data: bytes, output: str) -> None:
                tensor = aiogrpcclient.InferInput(name, [1, 1], "BYTES")
                tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
                result = await client.infer(model, [tensor])
                assert result.as_numpy(output).shape[0] == 1

            await asyncio.gather(
                *(one("image_pipeline_pt", "IMAGE", images[i % 2], "OUTPUT") for i in range(6)),
                *(one("text_pipeline", "TEXT", f"sentence number {i}".encode(), "EMBEDDING") for i in range(16)),
            )
        finally:
            await client.close()

    asyncio.run(main())
    for model, requests in (("resnet50_pt", 6), ("minilm", 16)):
        inferences, executions = (a - b for a, b in zip(_counts(server, model), before[model], strict=True))
        assert inferences == requests, model
        assert executions < inferences, model
