"""Conversions at the Python backend's boundary: model exceptions to Quiver errors, config
dicts to JSON-ready values, ``pb_utils`` tensors, requests and responses to Quiver's and back
(for execute results and BLS calls).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

import triton_python_backend_utils as pb_utils
from quiver.errors import (
    ErrorCode,
    QuiverError,
    error_for_code,
)
from quiver.types import DataType, InferenceRequest, InferenceResponse, RequestedOutput, Tensor


def _error_code(exc: BaseException) -> ErrorCode:
    """The Triton error code an exception raised by model code stands for."""
    if isinstance(exc, pb_utils.TritonError):
        return ErrorCode[exc.code().name]
    if isinstance(exc, QuiverError):
        return exc.code
    return ErrorCode.INTERNAL


def _model_error(exc: BaseException, message: str) -> QuiverError:
    return error_for_code(_error_code(exc), message)


def _json_ready(value: Any) -> Any:
    """Numpy scalars and tuples in a config dict, made JSON-plain."""
    return json.loads(json.dumps(value, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# -------------------------------------------------------------- tensor conversion


def _as_bytes(item: Any) -> bytes:
    if type(item) is bytes:
        return item
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, str):
        return item.encode("utf-8")
    return str(item).encode("utf-8")  # what Triton's serialize_byte_tensor does


def _bytes_array(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An object array of ``bytes`` with the same shape."""
    if array.dtype.kind == "O":
        flat = array.reshape(-1)
        if all(type(item) is bytes for item in flat):
            return array
        items = [_as_bytes(item) for item in flat]
    else:  # "U" or "S"
        items = [_as_bytes(item) for item in array.reshape(-1).tolist()]
    result = np.empty(len(items), dtype=np.object_)
    result[:] = items
    return result.reshape(array.shape)


def _output_tensor(tensor: Any) -> Tensor:
    """A model's pb_utils.Tensor as a Quiver Tensor; ValueError says what is wrong."""
    if not isinstance(tensor, pb_utils.Tensor):
        raise ValueError(
            f"output_tensors contains a {type(tensor).__name__}, not a pb_utils.Tensor"
        )
    name = tensor.name()
    array = tensor.as_numpy()
    if not isinstance(array, np.ndarray):
        raise ValueError(f"output '{name}' holds a {type(array).__name__}, not a numpy array")
    if array.dtype.kind in ("O", "U", "S"):
        return Tensor(name, DataType.BYTES, tuple(array.shape), _bytes_array(array))
    try:
        datatype = DataType.from_numpy(array.dtype)
    except KeyError:
        raise ValueError(
            f"output '{name}' has numpy dtype {array.dtype}, which has no Triton datatype"
        ) from None
    return Tensor(name, datatype, tuple(array.shape), array)


def _quiver_request(request: pb_utils.InferenceRequest) -> InferenceRequest:
    inputs = []
    for tensor in request.inputs():
        array = tensor.as_numpy()
        if array.dtype.kind in ("O", "U", "S"):
            inputs.append(
                Tensor(tensor.name(), DataType.BYTES, tuple(array.shape), _bytes_array(array))
            )
        else:
            inputs.append(
                Tensor(tensor.name(), DataType.from_numpy(array.dtype), tuple(array.shape), array)
            )
    names = request.requested_output_names()
    parameters: dict[str, Any] = json.loads(request.parameters() or "{}")
    if request.correlation_id():
        flags = request.flags()
        parameters["sequence_id"] = request.correlation_id()
        parameters["sequence_start"] = bool(
            flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        )
        parameters["sequence_end"] = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    if request.timeout():
        parameters["timeout"] = request.timeout()
    version = request.model_version()
    parent = request.trace()._server  # the calling request's trace, when it was passed on
    return InferenceRequest(
        model_name=request.model_name(),
        model_version="" if version < 0 else str(version),
        inputs=inputs,
        outputs=[RequestedOutput(name) for name in sorted(names)] if names else None,
        id=request.request_id(),
        parameters=parameters,
        trace=parent.spawn() if parent is not None else None,
    )


#: Request parameters Triton turns into request properties instead of passing them on.
_RESERVED_PARAMETERS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "binary_data_output",
        "binary_data_size",
        "classification",
    }
)


def _request_fields(request: InferenceRequest, all_outputs: list[str]) -> dict[str, Any]:
    """What a model sees of a request besides its inputs (``pb_utils.InferenceRequest``'s
    fields): sequence flags and correlation id, timeout, the parameters passed on, the outputs."""
    params = request.parameters
    correlation_id = params.get("sequence_id", 0)
    if isinstance(correlation_id, bool) or not isinstance(correlation_id, (int, str)):
        correlation_id = 0
    flags = 0
    if params.get("sequence_start"):
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    if params.get("sequence_end"):
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    try:
        timeout = int(params.get("timeout", 0) or 0)
    except (TypeError, ValueError):
        timeout = 0
    passed = {k: v for k, v in params.items() if k not in _RESERVED_PARAMETERS}
    if request.outputs is None:
        requested = list(all_outputs)
    else:
        requested = [output.name for output in request.outputs]
    return {
        "request_id": request.id,
        "correlation_id": correlation_id,
        "requested_output_names": requested,
        "model_name": request.model_name,
        "flags": flags,
        "timeout": timeout,
        "parameters_json": json.dumps(passed, default=str),
    }


def _pb_response(response: InferenceResponse) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse([pb_utils.Tensor(t.name, t.data) for t in response.outputs])


def _pb_error(code: ErrorCode, message: str) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code.value))
    )
