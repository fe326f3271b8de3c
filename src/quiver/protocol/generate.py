"""Triton's generate extension: a flat JSON object in, a flat JSON object out.

Request (``POST /v2/models/{m}[/versions/{v}]/generate`` and ``generate_stream``): every
member whose name is one of the model's inputs becomes that input (a value or a 1-D array,
shaped to the input's dims: fixed dims take what they divide, the innermost variable one
the rest, other variable ones 1); every other member becomes a request parameter (a
string, integer, boolean or number; anything else is an error). ``"parameters"`` is an
object whose members are mapped the same way; ``"id"`` (a string) is also the request id.

Response: ``id`` (when not empty), ``model_name``, ``model_version``, each response parameter,
and each output: a one-element tensor as its value, others as a flat array (BYTES as
strings). Error messages are Triton's.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError, UnsupportedError
from quiver.protocol.limits import check_body_depth
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

#: The reserved member whose object's members are mapped like top-level ones.
PARAMETERS = "parameters"


class _Members(list[tuple[str, Any]]):
    """A JSON object's members in order, duplicates kept (``json``'s pairs hook)."""


def _load(body: bytes) -> _Members:
    if not body.strip():
        return _Members()  # Triton allows an empty body (then inputs are missing)
    try:
        plain = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(plain, dict):
        raise InvalidArgumentError("failed to parse the request JSON buffer: the generate request must be a JSON object")
    check_body_depth(plain, body, "generate request")
    members: _Members = json.loads(body, object_pairs_hook=_Members)
    return members


_TYPE_ERRORS = {
    "string": "attempt to access JSON non-string as string",
    "bool": "attempt to access JSON non-boolean as boolean",
    "int": "attempt to access JSON non-signed-integer as signed-integer",
    "uint": "attempt to access JSON non-unsigned-integer as unsigned-integer",
    "number": "attempt to access JSON non-number as double",
}


def _element(value: Any, datatype: DataType) -> Any:
    """One JSON element as a value of ``datatype``; InvalidArgumentError with TritonJson's
    words when it is not one."""
    if datatype is DataType.BYTES:
        if not isinstance(value, str):
            raise InvalidArgumentError(f"Unable to parse JSON bytes array: {_TYPE_ERRORS['string']}")
        return value.encode("utf-8")
    if datatype is DataType.BOOL:
        if not isinstance(value, bool):
            raise InvalidArgumentError(_TYPE_ERRORS["bool"])
        return value
    if datatype.value.startswith("UINT"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgumentError(_TYPE_ERRORS["uint"])
        return value
    if datatype.value.startswith("INT"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(_TYPE_ERRORS["int"])
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(_TYPE_ERRORS["number"])
    return value


def _flat(value: Any) -> list[Any]:
    if isinstance(value, _Members):
        return [value]  # an object where a value belongs: the element check names it
    if isinstance(value, list):
        out: list[Any] = []
        for item in value:
            out.extend(_flat(item))
        return out
    return [value]


def _shape(name: str, count: int, dims: list[int]) -> tuple[int, ...]:
    """Triton's two passes: fixed dims take what they divide, the innermost variable dim the
    rest, other variable dims 1."""
    shape = list(dims)
    remaining = count
    for dim in reversed(shape):
        if dim != -1:
            if dim == 0 or remaining % dim:
                raise InvalidArgumentError(f"The schema can not convert input '{name}' to tensor with proper shape")
            remaining //= dim
    for index in range(len(shape) - 1, -1, -1):
        if shape[index] == -1:
            shape[index] = remaining
            remaining = 1
    if remaining != 1:
        raise InvalidArgumentError(f"The schema can not convert input '{name}' to tensor with proper shape")
    return tuple(shape)


class _Builder:
    def __init__(self, config: ModelConfig, max_input_size: int) -> None:
        self.config = config
        self.inputs = config.input_map
        self.batch = config.max_batch_size
        self.max_input_size = max_input_size
        self.tensors: dict[str, Tensor] = {}
        self.parameters: dict[str, Any] = {}
        self.consumed = 0

    def member(self, name: str, value: Any) -> None:
        spec = self.inputs.get(name)
        if spec is None:
            self.parameter(name, value)
        else:
            self.tensor(name, value, spec.datatype, spec.full_shape(self.batch))

    def parameter(self, name: str, value: Any) -> None:
        if isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            self.parameters[name] = value
            return
        raise InvalidArgumentError(
            f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'."
        )

    def tensor(self, name: str, value: Any, datatype: DataType, dims: list[int]) -> None:
        if name in self.tensors:
            raise InvalidArgumentError(f"input '{name}' already exists in request")
        items = [_element(item, datatype) for item in _flat(value)]
        size = sum(len(item) + 4 for item in items) if datatype is DataType.BYTES else len(items) * datatype.itemsize
        if size + self.consumed > self.max_input_size:
            raise InvalidArgumentError(
                f"request size of {self.consumed} bytes with input '{name}' of size {size} bytes "
                f"exceeds the maximum allowed input size of {self.max_input_size}. Use "
                "--http-max-input-size to increase the limit."
            )
        self.consumed += size
        if not items:
            shape: tuple[int, ...] = tuple(0 if d == -1 else d for d in dims) if dims else (0,)
            if math.prod(shape) != 0:
                shape = (0,)
        else:
            shape = _shape(name, len(items), dims)
        if datatype is DataType.BYTES:
            data = np.empty(len(items), dtype=np.object_)
            data[:] = items
        else:
            data = np.array(items, dtype=datatype.numpy_dtype)
        self.tensors[name] = Tensor(name, datatype, shape, data.reshape(shape))


def decode_generate(
    body: bytes, config: ModelConfig, model: str, version: str, max_input_size: int
) -> InferenceRequest:
    """A generate request body -> the request for ``config``'s model."""
    members = _load(body)
    builder = _Builder(config, max_input_size)
    request_id = ""
    for name, value in members:
        if name == "id":
            if not isinstance(value, str):
                raise InvalidArgumentError("Unable to parse 'id': attempt to access JSON non-string as string")
            request_id = value
        if name == PARAMETERS:
            if name in builder.inputs:
                raise InvalidArgumentError(
                    f"Keyword '{name}' for nested schema also given as input tensor name"
                )
            if not isinstance(value, _Members):
                raise InvalidArgumentError(
                    f"Expected JSON object for keyword: '{name}': attempt to access JSON non-object as object"
                )
            try:
                for nested, nested_value in value:
                    builder.member(nested, nested_value)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"Converting keyword: '{name}': {exc.message}") from None
            continue
        builder.member(name, value)
    return InferenceRequest(
        model_name=model,
        model_version=version,
        inputs=list(builder.tensors.values()),
        id=request_id,
        parameters=builder.parameters,
    )


def _output_value(tensor: Tensor) -> Any:
    flat = tensor.data.reshape(-1)
    if tensor.datatype is DataType.BYTES:
        values: list[Any] = [
            v.decode("utf-8", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)
            for v in flat.tolist()
        ]
    elif tensor.datatype is DataType.BF16:
        values = flat.astype(np.float32).tolist()
    else:
        values = flat.tolist()
    return values[0] if len(values) == 1 else values


def encode_generate(response: InferenceResponse) -> dict[str, Any]:
    """A response as the generate extension's JSON object (members in name order, as
    Triton writes them)."""
    out: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        out["id"] = response.id
    for key, value in response.parameters.items():
        if isinstance(value, (bytes, bytearray)):
            raise UnsupportedError(
                f"Response parameter '{key}' has type 'TRITONSERVER_PARAMETER_BYTES' which is not "
                "currently supported"
            )
        out[key] = value
    for tensor in response.outputs:
        out[tensor.name] = _output_value(tensor)
    return dict(sorted(out.items()))


__all__ = ["decode_generate", "encode_generate"]
