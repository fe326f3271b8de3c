"""What crosses a worker's boundary, as its model sees it: the requests of an ``execute``
message as ``pb_utils.InferenceRequest`` objects over views of the server's pool, and what the
model returns as a response message, its tensors written into the worker's pool. Worker-safe
(see :mod:`quiver.backends.python_stub`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

import triton_python_backend_utils as pb_utils
from quiver.backends.python_convert import _output_tensor
from quiver.backends.python_stub_senders import WorkerSenders
from quiver.ipc import tensors
from quiver.ipc.shm import Arena, Mapper, PoolFullError
from quiver.types import DataType

#: TRITONSERVER_DataType values by datatype name.
_TRITON_TYPES: dict[str, int] = {t.value: t.triton_value for t in DataType}
#: The numpy dtype and TRITONSERVER_DataType value of each fixed-size datatype.
_FIXED_TYPES: dict[str, tuple[np.dtype[Any], int]] = {
    t.value: (t.numpy_dtype, t.triton_value) for t in DataType if t is not DataType.BYTES
}
#: The Triton datatype of each numpy dtype that has one (BYTES aside).
_WIRE_TYPES: dict[Any, str] = {t.numpy_dtype: t.value for t in DataType if t is not DataType.BYTES}


def tensor_wire(tensor: Any) -> tuple[str, str, Any]:
    """A pb_utils.Tensor as (name, datatype, numpy array) for the pool; ValueError when its
    array has no Triton datatype."""
    if type(tensor) is pb_utils.Tensor:
        array = tensor.as_numpy()
        if type(array) is np.ndarray:
            datatype = _WIRE_TYPES.get(array.dtype)
            if datatype is not None:
                return tensor.name(), datatype, array
    converted = _output_tensor(tensor)  # BYTES, and what is wrong
    return converted.name, converted.datatype.value, converted.data


class _WorkerRequest(pb_utils.InferenceRequest):
    """A request as a worker's model receives it: its response sender and cancellation come
    from its batch's :class:`WorkerSenders` by index (no callables made per request)."""

    __slots__ = ("_batch", "_index")

    _batch: WorkerSenders
    _index: int

    def get_response_sender(self) -> Any:
        return self._batch.get(self._index)

    def is_cancelled(self) -> bool:
        return self._batch.is_cancelled(self._index)


_new_request = partial(_WorkerRequest.__new__, _WorkerRequest)
_new_tensor = partial(pb_utils.Tensor.__new__, pb_utils.Tensor)


def requests_from(
    items: list[dict[str, Any]], ids: list[str], senders: WorkerSenders, mapper: Mapper, outputs: set[str],
    model_name: str, version: int,
) -> list[pb_utils.InferenceRequest]:
    """The ``execute`` message's requests (``items``, named ``ids``) as the model sees them:
    inputs are views of the server's pool (``mapper``), each request's response sender comes
    from ``senders``; ``outputs``: the model's outputs, what a request that names none asks for
    (each request gets a copy)."""
    new_request, new_tensor = _new_request, _new_tensor
    view, fixed, ndarray = mapper.view, _FIXED_TYPES, np.ndarray
    requests: list[pb_utils.InferenceRequest] = []
    for index, item in enumerate(items):
        inputs = []
        for descriptor in item["tensors"]:
            name, datatype, shape, segment, offset, nbytes = descriptor
            types = fixed.get(datatype)
            tensor = new_tensor()
            tensor._name = name
            if types is not None and nbytes:
                # the usual: a view of the server's pool (the server wrote the descriptor
                # from the array itself; numpy refuses a shape the block cannot hold)
                tensor._array = ndarray(shape, types[0], view(segment, offset, nbytes))
                tensor._dtype = types[1]
            else:  # BYTES, empty tensors
                _, datatype, _, tensor._array = tensors.read(mapper, descriptor)
                tensor._dtype = _TRITON_TYPES[datatype]
            inputs.append(tensor)
        request = new_request()
        request._inputs = inputs
        request._model_name = model_name
        request._model_version = version
        request._preferred_memory = None  # a server's request has none (CPU)
        request._trace = None  # made when asked for
        request._sender_factory = None
        request._cancelled = None
        request._batch = senders
        request._index = index
        fields = item.get("fields")  # only what differs from the defaults
        if fields is None:  # the usual
            request._request_id = ""
            request._correlation_id = 0
            request._requested_output_names = outputs.copy()
            request._flags = 0
            request._timeout = 0
            request._parameters = "{}"
        else:
            requested = fields.get("requested_output_names")
            request._request_id = fields.get("request_id", "")
            request._correlation_id = fields.get("correlation_id", 0)
            request._requested_output_names = outputs.copy() if requested is None else set(requested)
            request._flags = fields.get("flags", 0)
            request._timeout = fields.get("timeout", 0)
            request._parameters = fields.get("parameters_json", "{}")
        if item.get("traced"):
            request.trace()._server = ids[index]  # the server finds the trace by this id
        requests.append(request)
    return requests


def response_message(item: Any, index: int, arena: Arena, where: str) -> dict[str, Any]:
    """What ``execute`` returned for request ``index`` as a response message: its output
    tensors written into the worker's pool (``arena``), or the error to answer with."""
    if type(item) is pb_utils.InferenceResponse:  # the usual: read its fields
        error, outputs, parameters = item._error, item._output_tensors, item._parameters
    elif isinstance(item, pb_utils.InferenceResponse):
        error, outputs, parameters = item.error(), item.output_tensors(), item.parameters()
    else:
        return {
            "error": [
                "INTERNAL",
                f"{where}: execute() returned a {type(item).__name__} for request {index}, "
                "expected a pb_utils.InferenceResponse",
            ]
        }
    if error is not None:
        return {"error": [error.code().name, error.message()]}
    blocks: list[tuple[str, int]] = []
    descriptors = []
    put, wire_types, tensor_type, ndarray = arena.put, _WIRE_TYPES, pb_utils.Tensor, np.ndarray
    name = ""
    try:
        for tensor in outputs:
            if type(tensor) is tensor_type and type(array := tensor._array) is ndarray and (
                datatype := wire_types.get(array.dtype)
            ):
                # the usual: a numpy array of a Triton datatype
                name, nbytes = tensor._name, array.nbytes
                if nbytes:
                    try:
                        block = put(array, nbytes)
                    except (TypeError, ValueError, BufferError):  # strided: tensors.write copies it
                        descriptors.append(tensors.write(arena, name, datatype, array, blocks))
                        continue
                    blocks.append(block)
                    # (the shape a tuple: the message's JSON writes it as a list)
                    descriptors.append([name, datatype, array.shape, block[0], block[1], nbytes])
                else:
                    descriptors.append([name, datatype, array.shape, "", 0, 0])
            else:
                name, datatype, array = tensor_wire(tensor)
                descriptors.append(tensors.write(arena, name, datatype, array, blocks))
    except PoolFullError as exc:
        arena.free_many(blocks)
        return {"error": ["INTERNAL", f"{where}: response to request {index}: output '{name}' does not fit: {exc}"]}
    except ValueError as exc:
        arena.free_many(blocks)
        return {"error": ["INTERNAL", f"{where}: response to request {index}: {exc}"]}
    if parameters == "{}":
        return {"tensors": descriptors}
    return {"tensors": descriptors, "parameters": parameters}


__all__ = ["requests_from", "response_message", "tensor_wire"]
