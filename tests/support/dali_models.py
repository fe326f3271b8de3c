"""The seed's DALI preprocessing pipeline, serialized at test time.

The seed builds it with ``device_id=0`` and a ``device="mixed"`` JPEG decoder, which DALI can
only serialize where CUDA is: here it is built with ``device_id=None`` (the operators, their
devices and arguments are the same) and the serialized ``device_id`` field is then set to 0,
so the file is what the seed's notebook writes on its GPU machine.

``crop_mirror_normalize`` writes CHW unless told otherwise; the seed's configuration declares
``DALI_OUTPUT_0`` as ``[299, 299, 3]`` and Inception's input as NHWC ``[299, 299, 3]``, so the
pipeline must ask for ``output_layout="HWC"`` (the seed's text as published omits the
argument, and with it the ensemble fails its Inception step on a shape mismatch, in Triton as
here). ``layout`` chooses.

Importing this module imports DALI: callers skip first when it is not installed."""

from __future__ import annotations

import io
import textwrap

import numpy as np
import nvidia.dali as dali
import nvidia.dali.types as types
from PIL import Image

from quiver.backends.dali import PipelineDef

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def seed_pipeline(decoder: str = "mixed", layout: str = "HWC", device_id: int | None = None,
                  batch_size: int = 3) -> dali.Pipeline:
    @dali.pipeline_def(batch_size=batch_size, num_threads=1, device_id=device_id)  # type: ignore[misc]
    def pipe() -> object:
        images = dali.fn.external_source(device="cpu", name="DALI_INPUT_0")
        images = dali.fn.decoders.image(images, device=decoder, output_type=types.RGB)
        images = dali.fn.resize(images, resize_x=299, resize_y=299)
        images = dali.fn.crop_mirror_normalize(
            images, crop=(299, 299), mean=MEAN, std=STD, output_layout=layout
        )
        return images

    return pipe()  # type: ignore[no-any-return]


def seed_model_dali(layout: str = "HWC") -> bytes:
    """``model.dali`` as the seed writes it: a mixed decoder, GPU operators, device 0."""
    message = PipelineDef()
    message.ParseFromString(seed_pipeline("mixed", layout).serialize())
    message.device_id = 0
    return bytes(message.SerializeToString())


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


DALI_CONFIG = textwrap.dedent(
    """
    name: "dali"
    backend: "dali"
    max_batch_size: 256
    input [
      {
        name: "DALI_INPUT_0"
        data_type: TYPE_UINT8
        dims: [ -1 ]
      }
    ]
    output [
      {
        name: "DALI_OUTPUT_0"
        data_type: TYPE_FP32
        dims: [ 299, 299, 3 ]
      }
    ]
    parameters: [
      {
        key: "num_threads"
        value: { string_value: "12" }
      }
    ]
    """
)
