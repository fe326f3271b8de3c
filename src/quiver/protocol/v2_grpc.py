"""KServe v2 gRPC messages (``tritonclient.grpc.service_pb2``) to and from Quiver's types.

Inputs come either as typed ``contents`` (one repeated field per datatype family, Triton's
rules: INT8/16/32 in ``int_contents``, UINT8/16/32 in ``uint_contents``, FP16 and BF16 only
raw) or as ``raw_input_contents``: one buffer per input, in input order, for every input.
Raw BYTES use Triton's 4-byte-length-prefixed encoding. Responses carry every output in
``raw_output_contents``, one buffer per output in the order of ``outputs``, as Triton does.

This module checks that a message is well formed (datatypes, shapes against the data,
sizes); checks against the model's configuration live in the service, as for HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from quiver import messages
from quiver.errors import InvalidArgumentError
from quiver.protocol.bytes_codec import serialize_bytes
from quiver.protocol.limits import MAX_RANK, element_count
from quiver.protocol.raw import array_from_raw
from quiver.shared_memory import placement
from quiver.types import (
    HAVE_BF16,
    DataType,
    InferenceRequest,
    InferenceResponse,
    Placement,
    RequestedOutput,
    Tensor,
)

#: wire name -> (datatype, numpy dtype, bytes per element when a raw buffer can go straight to
#: ``np.frombuffer``, else 0: BYTES, and BF16 without ml_dtypes, take :func:`_from_raw`).
_DECODE: dict[str, tuple[DataType, np.dtype[Any], int]] = {
    dt.value: (
        dt,
        dt.numpy_dtype,
        0 if dt is DataType.BYTES or (dt is DataType.BF16 and not HAVE_BF16) else dt.itemsize,
    )
    for dt in DataType
}

#: datatype -> the InferTensorContents field that carries it (None: raw only).
CONTENTS_FIELD: dict[DataType, str | None] = {
    DataType.BOOL: "bool_contents",
    DataType.INT8: "int_contents",
    DataType.INT16: "int_contents",
    DataType.INT32: "int_contents",
    DataType.INT64: "int64_contents",
    DataType.UINT8: "uint_contents",
    DataType.UINT16: "uint_contents",
    DataType.UINT32: "uint_contents",
    DataType.UINT64: "uint64_contents",
    DataType.FP32: "fp32_contents",
    DataType.FP64: "fp64_contents",
    DataType.BYTES: "bytes_contents",
    DataType.FP16: None,
    DataType.BF16: None,
}

#: Types narrower than their contents field: values are range-checked before the cast.
_NARROW = frozenset({DataType.INT8, DataType.INT16, DataType.UINT8, DataType.UINT16})

_INT64_MAX = (1 << 63) - 1
#: An input's data until the service reads it from its shared-memory region.
_EMPTY: np.ndarray[Any, Any] = np.empty(0, dtype=np.uint8)
#: Element counts up to this need no more checks (2**40 elements of 8 bytes fit an array).
_SMALL_COUNT = 1 << 40


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message)


# -- parameters --------------------------------------------------------------------------


def parameters_to_dict(params: Mapping[str, Any]) -> dict[str, Any]:
    """``map<string, InferParameter>`` -> plain dict (a parameter with no value is skipped)."""
    if not params:
        return {}
    out: dict[str, Any] = {}
    for key, param in params.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out


def set_parameters(target: Any, values: Mapping[str, Any]) -> None:
    """Fill a ``map<string, InferParameter>`` from a dict of bool, int, float or str values."""
    for key, value in values.items():
        param = target[key]
        if isinstance(value, bool | np.bool_):
            param.bool_param = bool(value)
        elif isinstance(value, int | np.integer):
            number = int(value)
            if number > _INT64_MAX:
                param.uint64_param = number
            else:
                param.int64_param = number
        elif isinstance(value, float | np.floating):
            param.double_param = float(value)
        else:
            param.string_param = value if isinstance(value, str) else str(value)


# -- requests ----------------------------------------------------------------------------


def _checked(shape: tuple[int, ...], name: str, datatype: DataType) -> int:
    """The element count of a shape whose rank, dims and size pass limits.element_count."""
    # The common case inline: a small rank and a count that is positive (so no dim is 0 or
    # negative: an even number of negative dims could make a positive product) and small.
    if len(shape) <= MAX_RANK and (not shape or min(shape) > 0):
        count = math.prod(shape)
        if count <= _SMALL_COUNT:
            return count
    return element_count(shape, name, datatype)


def _from_raw(buffer: bytes, datatype: DataType, shape: tuple[int, ...], name: str) -> np.ndarray[Any, Any]:
    count = _checked(shape, name, datatype)
    size = len(buffer)
    if datatype is DataType.BYTES and count * 4 > size:  # each element has a 4-byte length
        raise _bad(
            f"input '{name}': shape {list(shape)} of BYTES needs at least {count * 4} bytes "
            f"but its raw_input_contents has {size}"
        )
    return array_from_raw(buffer, datatype, shape, count, name, "its raw_input_contents has")


def _from_contents(
    contents: Any | None, datatype: DataType, shape: tuple[int, ...], name: str
) -> np.ndarray[Any, Any]:
    expected_field = CONTENTS_FIELD[datatype]
    values: Any = ()
    if contents is not None:
        for descriptor, field_values in contents.ListFields():
            if descriptor.name != expected_field:
                if expected_field is None:
                    raise _bad(
                        f"input '{name}': {datatype.value} data can only be sent in "
                        "raw_input_contents"
                    )
                raise _bad(
                    f"input '{name}': {datatype.value} data goes in contents.{expected_field}, "
                    f"got contents.{descriptor.name}"
                )
            values = field_values
    count = _checked(shape, name, datatype)
    given = len(values)
    if given != count:
        if expected_field is None:
            raise _bad(
                f"input '{name}': {datatype.value} data can only be sent in raw_input_contents"
            )
        raise _bad(
            f"input '{name}': shape {list(shape)} needs {count} elements but "
            f"contents.{expected_field} has {given}"
        )
    dtype = datatype.numpy_dtype
    if datatype is DataType.BYTES:
        array = np.empty(count, dtype=object)
        if count:
            array[:] = list(values)
        return array.reshape(shape)
    if not count:
        return np.empty(shape, dtype=dtype)
    if datatype in _NARROW:
        wide = np.fromiter(values, dtype=np.int64, count=count)
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise _bad(f"input '{name}': a value is out of range for {datatype.value}")
        return wide.astype(dtype).reshape(shape)
    return np.fromiter(values, dtype=dtype, count=count).reshape(shape)


def decode_infer_request(message: Any) -> InferenceRequest:
    """``ModelInferRequest`` -> :class:`InferenceRequest`, checking the message is well formed."""
    model = message.model_name
    raw = message.raw_input_contents
    raw_count = len(raw)
    tensors = message.inputs
    inputs: list[Tensor] = []
    append = inputs.append
    input_placements: dict[str, Placement] | None = None
    raw_index = 0
    # This loop is on every gRPC request: the common case (raw fixed-size tensors, no
    # parameters) is inlined; the checks and their messages are _shape's and _from_raw's.
    for tensor in tensors:
        name = tensor.name
        decode = _DECODE.get(tensor.datatype)
        if decode is None:
            raise _bad(f"input '{name}': unknown datatype '{tensor.datatype}'")
        datatype, dtype, itemsize = decode
        shape = tuple(tensor.shape[:])  # a slice is a list: quicker than iterating the field
        count = _checked(shape, name, datatype)
        params: dict[str, Any] = {}
        if tensor.parameters:
            params = parameters_to_dict(tensor.parameters)
            where = placement(params, name, grpc=True) if params else None
            if where is not None:
                if tensor.HasField("contents"):
                    raise _bad(messages.shm_input_with_contents(name, model))
                if input_placements is None:
                    input_placements = {}
                input_placements[name] = where
                append(Tensor(name, datatype, shape, _EMPTY, params))
                continue
        if raw_count:
            if tensor.HasField("contents"):
                raise _bad(messages.grpc_contents_with_raw(name, model))
            if raw_index >= raw_count:
                raise _bad(messages.grpc_input_data_missing(name, model))
            buffer = raw[raw_index]
            raw_index += 1
            if itemsize and len(buffer) == count * itemsize:
                data = np.frombuffer(buffer, dtype=dtype).reshape(shape)
            else:  # BYTES, or a size that is wrong: _from_raw says what is wrong
                data = _from_raw(buffer, datatype, shape, name)
        else:
            contents = tensor.contents if tensor.HasField("contents") else None
            data = _from_contents(contents, datatype, shape, name)
        append(Tensor(name, datatype, shape, data, params))
    if raw_index != raw_count:
        raise _bad(
            f"expected {raw_index} raw_input_contents, one per input not in shared memory, but "
            f"got {raw_count} for model '{model}'"
        )

    outputs: list[RequestedOutput] | None = None
    output_placements: dict[str, Placement] | None = None
    if message.outputs:
        outputs = []
        for requested in message.outputs:
            out_params = parameters_to_dict(requested.parameters)
            if out_params:
                where = placement(out_params, requested.name, grpc=True)
                if where is not None:
                    if "classification" in out_params:
                        raise _bad(messages.shm_with_classification(grpc=True))
                    if output_placements is None:
                        output_placements = {}
                    output_placements[requested.name] = where
            outputs.append(RequestedOutput(requested.name, out_params))
    return InferenceRequest(
        model_name=model,
        model_version=message.model_version,
        inputs=inputs,
        outputs=outputs,
        id=message.id,
        parameters=parameters_to_dict(message.parameters) if message.parameters else {},
        input_placements=input_placements,
        output_placements=output_placements,
    )


def decode_cost(message: Any) -> int:
    """About the nanoseconds :func:`decode_infer_request` takes (after the message is
    parsed), from the shapes: BYTES and typed ``contents`` cost about 250 per element
    (v2_json's costs); raw fixed-size tensors are views of the message's buffers."""
    raw = len(message.raw_input_contents) > 0
    cost = 0
    for tensor in message.inputs:
        if raw and tensor.datatype != "BYTES":
            continue
        shape = tensor.shape
        if len(shape) <= MAX_RANK:  # else refused before any work
            cost += 250 * abs(math.prod(shape))
    return cost


def encode_cost(response: InferenceResponse) -> int:
    """About the nanoseconds :func:`encode_infer_response` and serializing its message take:
    BYTES elements about 100 each, other tensors about a nanosecond per byte (copied
    twice)."""
    cost = 0
    for tensor in response.outputs:
        data: Any = tensor.data
        if isinstance(data, np.ndarray):
            cost += 100 * data.size if tensor.datatype is DataType.BYTES else data.nbytes
    return cost


def encode_infer_request(request: InferenceRequest, *, raw: bool = True) -> Any:
    """:class:`InferenceRequest` -> ``ModelInferRequest`` (raw or typed contents).

    The server never sends requests; this is for tests, tools and a future gRPC client path.
    """
    message = pb.ModelInferRequest(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    set_parameters(message.parameters, request.parameters)
    for tensor in request.inputs:
        entry = message.inputs.add(name=tensor.name, datatype=tensor.datatype.value, shape=tensor.shape)
        set_parameters(entry.parameters, tensor.parameters)
        if raw:
            message.raw_input_contents.append(_raw_bytes(tensor))
            continue
        field = CONTENTS_FIELD[tensor.datatype]
        if field is None:
            raise ValueError(f"{tensor.datatype.value} can only be sent in raw_input_contents")
        flat = tensor.data.reshape(-1)
        if tensor.datatype is DataType.BYTES:
            items = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in flat]
            entry.contents.bytes_contents.extend(items)
        else:
            getattr(entry.contents, field).extend(flat.tolist())
    if request.outputs is not None:
        for requested in request.outputs:
            out = message.outputs.add(name=requested.name)
            set_parameters(out.parameters, requested.parameters)
    return message


# -- responses ---------------------------------------------------------------------------


def _raw_bytes(tensor: Tensor) -> bytes:
    if tensor.datatype is DataType.BYTES:
        return serialize_bytes(tensor.data)
    data = tensor.data
    if type(data) is np.ndarray:
        return data.tobytes()  # C order whatever the layout: no contiguous copy first
    return np.ascontiguousarray(data).tobytes()


def encode_infer_response(response: InferenceResponse) -> Any:
    """:class:`InferenceResponse` -> ``ModelInferResponse``, every output raw, as Triton sends it."""
    message = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    if response.parameters:
        set_parameters(message.parameters, response.parameters)
    add = message.outputs.add
    buffers: list[bytes] = []
    in_regions = response.shared_memory_outputs
    for tensor in response.outputs:
        datatype = tensor.datatype
        entry = add(name=tensor.name, datatype=datatype.value, shape=tensor.shape)
        if tensor.parameters:
            set_parameters(entry.parameters, tensor.parameters)
        data = tensor.data
        if in_regions and tensor.name in in_regions:
            buffers.append(b"")  # written into the client's region; Triton sends it empty
        elif datatype is not DataType.BYTES and type(data) is np.ndarray:
            buffers.append(data.tobytes())  # C order whatever the layout (as _raw_bytes)
        else:
            buffers.append(_raw_bytes(tensor))
    message.raw_output_contents.extend(buffers)
    return message


def decode_infer_response(message: Any) -> InferenceResponse:
    """``ModelInferResponse`` -> :class:`InferenceResponse` (raw outputs; for tests and tools)."""
    outputs: list[Tensor] = []
    raw = message.raw_output_contents
    for index, tensor in enumerate(message.outputs):
        datatype = DataType.from_wire(tensor.datatype)
        shape = tuple(tensor.shape)
        if index < len(raw):
            data = _from_raw(raw[index], datatype, shape, tensor.name)
        else:
            data = _from_contents(
                tensor.contents if tensor.HasField("contents") else None, datatype, shape, tensor.name
            )
        outputs.append(Tensor(tensor.name, datatype, shape, data, parameters_to_dict(tensor.parameters)))
    return InferenceResponse(
        model_name=message.model_name,
        model_version=message.model_version,
        outputs=outputs,
        id=message.id,
        parameters=parameters_to_dict(message.parameters),
    )


__all__ = [
    "CONTENTS_FIELD",
    "decode_cost",
    "decode_infer_request",
    "decode_infer_response",
    "encode_cost",
    "encode_infer_request",
    "encode_infer_response",
    "parameters_to_dict",
    "set_parameters",
]
