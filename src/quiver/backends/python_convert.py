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
    InternalError,
    QuiverError,
    error_for_code,
)
from quiver.ipc.channel import dumps
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


def request_fields(request: InferenceRequest) -> dict[str, Any]:
    """What a model sees of a request besides its inputs (``pb_utils.InferenceRequest``'s
    fields), only those that differ from :data:`DEFAULT_FIELDS` (all outputs requested: no
    ``requested_output_names``): sequence flags and correlation id, timeout, the parameters
    passed on, the outputs asked for, the request id."""
    fields: dict[str, Any] = {}
    if request.id:
        fields["request_id"] = request.id
    if request.outputs is not None:
        fields["requested_output_names"] = [output.name for output in request.outputs]
    params = request.parameters
    if not params:
        return fields
    correlation_id = params.get("sequence_id", 0)
    if correlation_id and not isinstance(correlation_id, bool) and isinstance(correlation_id, (int, str)):
        fields["correlation_id"] = correlation_id
    flags = 0
    if params.get("sequence_start"):
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    if params.get("sequence_end"):
        flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    if flags:
        fields["flags"] = flags
    try:
        timeout = int(params.get("timeout", 0) or 0)
    except (TypeError, ValueError):
        timeout = 0
    if timeout:
        fields["timeout"] = timeout
    passed = {k: v for k, v in params.items() if k not in _RESERVED_PARAMETERS}
    if passed:
        fields["parameters_json"] = dumps(passed, default=str)[0].decode("utf-8")
    return fields


#: A request's fields when it has no id, no parameters and asks for every output.
DEFAULT_FIELDS: dict[str, Any] = {"request_id": "", "correlation_id": 0, "flags": 0, "timeout": 0, "parameters_json": "{}"}


def _request_fields(request: InferenceRequest, all_outputs: list[str]) -> dict[str, Any]:
    """Every field of :func:`request_fields`, defaults filled in, and the model's name."""
    return {
        **DEFAULT_FIELDS,
        "requested_output_names": list(all_outputs),
        "model_name": request.model_name,
        **request_fields(request),
    }


def _pb_response(response: InferenceResponse) -> pb_utils.InferenceResponse:
    parameters = {
        k: v for k, v in response.parameters.items() if isinstance(k, str) and isinstance(v, (bool, int, str))
    }
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(t.name, t.data) for t in response.outputs], parameters=parameters or None
    )


def _pb_error(code: ErrorCode, message: str) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code.value))
    )


def model_response(
    item: Any, where: str, model: str, version: str, request_id: str, index: int
) -> InferenceResponse | QuiverError:
    """A response the model returned or sent for request ``index``, as Quiver's (or its
    error); ``where`` names the model in messages."""
    if not isinstance(item, pb_utils.InferenceResponse):
        return InternalError(
            f"{where}: execute() returned a {type(item).__name__} for request "
            f"{index}, expected a pb_utils.InferenceResponse"
        )
    if item.has_error():
        error = item.error()
        assert error is not None
        return error_for_code(ErrorCode[error.code().name], error.message())
    outputs: list[Tensor] = []
    for tensor in item.output_tensors():
        try:
            outputs.append(_output_tensor(tensor))
        except ValueError as exc:
            return InternalError(f"{where}: response to request {index}: {exc}")
    try:
        parameters = json.loads(item.parameters())
    except (TypeError, ValueError):
        parameters = {}
    return InferenceResponse(
        model_name=model,
        model_version=version,
        outputs=outputs,
        id=request_id,
        parameters=parameters if isinstance(parameters, dict) else {},
    )
