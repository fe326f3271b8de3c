"""DALI pipelines for tests: the seed's (from ``examples/seed_ensemble.py``, which explains
how it is serialized without a GPU and why it asks for HWC), its CPU-built twin run directly,
a GPU-only one, and JPEG/PNG files.

Importing this module imports DALI: callers skip first when it is not installed."""

from __future__ import annotations

import io

import numpy as np
import nvidia.dali as dali
import nvidia.dali.types as types
from PIL import Image
from seed_ensemble import DALI_CONFIG, MEAN, STD, seed_model_dali, seed_pipeline

from quiver.backends.dali import PipelineDef

__all__ = ["DALI_CONFIG", "MEAN", "STD", "cpu_reference", "gpu_only_model_dali", "jpeg", "padded",
           "seed_model_dali", "seed_pipeline"]


def cpu_reference(images: list[bytes], layout: str = "HWC") -> list[np.ndarray]:
    """The same pipeline built for the CPU, run directly: what the served model must equal."""
    pipe = seed_pipeline("cpu", layout, batch_size=max(len(images), 1))
    pipe.build()
    pipe.feed_input("DALI_INPUT_0", [np.frombuffer(i, np.uint8) for i in images])
    (out,) = pipe.run()
    return [np.array(out[i]) for i in range(len(out))]


def gpu_only_model_dali() -> bytes:
    """A pipeline with an operator DALI has only for the GPU (``experimental.dilate``)."""

    @dali.pipeline_def(batch_size=2, num_threads=1, device_id=None)  # type: ignore[misc]
    def pipe() -> object:
        images = dali.fn.external_source(device="cpu", name="DALI_INPUT_0")
        images = dali.fn.decoders.image(images, device="mixed", output_type=types.RGB)
        return dali.fn.experimental.dilate(images)

    message = PipelineDef()
    message.ParseFromString(pipe().serialize())
    message.device_id = 0
    return bytes(message.SerializeToString())


def jpeg(width: int, height: int, seed: int = 0, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[: height // 2] //= 2  # some structure, so the resize has something to do
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def padded(images: list[bytes]) -> np.ndarray:
    """Triton's UINT8 form: one row per image, zero-padded to the longest."""
    length = max(len(i) for i in images)
    rows = np.zeros((len(images), length), np.uint8)
    for row, image in zip(rows, images, strict=True):
        row[: len(image)] = np.frombuffer(image, np.uint8)
    return rows
