"""Raw binary requests: a body that is the one input, its name, datatype and shape deduced
from the model configuration, as Triton does for ``Inference-Header-Content-Length: 0``.

Triton's rules (core ``InferenceRequest::Normalize``): the model has exactly one input; its
shape is the configured dims (with a batch of 1 first when the model batches); at most one
dim may be variable (-1), and it is deduced from the body's size; a BYTES input must have
the shape [1], and the body is its one element. Outputs then default to binary.
"""

from __future__ import annotations

import math

import numpy as np

from quiver import messages
from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError
from quiver.types import DataType, InferenceRequest, Tensor

#: The name a raw request's one input has until it is deduced (Triton's ``raw_input``).
RAW_INPUT_NAME = "raw_input"


def raw_request(body: bytes, model_name: str, model_version: str) -> InferenceRequest:
    """The request a raw body stands for, before :func:`deduce` gives its input a meaning."""
    data = np.frombuffer(body, dtype=np.uint8)
    return InferenceRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=[Tensor(RAW_INPUT_NAME, DataType.UINT8, (len(body),), data)],
        raw=True,
    )


def deduce(config: ModelConfig, request: InferenceRequest) -> None:
    """Give a raw request's one input the model's input name, datatype and shape."""
    if len(request.inputs) != 1 or len(config.inputs) != 1:
        raise InvalidArgumentError(
            messages.raw_input_count(len(request.inputs), len(config.inputs), config.name)
        )
    spec = config.inputs[0]
    raw = request.inputs[0].data
    size = raw.size
    shape: list[int] = [1] if config.max_batch_size > 0 else []
    dynamic = -1
    count = 1
    for dim in spec.dims:
        if dim == -1:
            if dynamic != -1:
                raise InvalidArgumentError(messages.raw_input_variable_dims(spec.name))
            dynamic = len(shape)
        else:
            count *= dim
        shape.append(dim)
    if spec.datatype is DataType.BYTES:
        if dynamic != -1 or count != 1:
            raise InvalidArgumentError(messages.raw_input_bytes_shape(spec.name))
        data = np.empty(1, dtype=object)
        data[0] = raw.tobytes()
    else:
        itemsize = spec.datatype.itemsize
        if dynamic != -1:
            shape[dynamic] = size // (count * itemsize) if count else 0
        expected = math.prod(shape) * itemsize
        if expected != size:
            raise InvalidArgumentError(
                messages.input_byte_size_mismatch(spec.name, config.name, expected, size)
            )
        data = raw.view(spec.datatype.numpy_dtype)
    request.inputs = [Tensor(spec.name, spec.datatype, tuple(shape), data.reshape(shape))]


__all__ = ["RAW_INPUT_NAME", "deduce", "raw_request"]
