"""Inference requests and responses as they cross a frontend worker's link
(:mod:`quiver.frontends.worker_link`): flat tuples of plain values, pickled with the frame.

Pickling the dataclasses themselves costs 7-10 us per message each way (a slotted dataclass's
state is gathered by Python code, every enum and array by a ``__reduce__``), about a fifth of
what the model side spends on a request that a worker hands it. A tuple of strings, ints and
buffers pickles and unpickles in C; the arrays travel as their bytes (``PickleBuffer``: no
extra copy) with their dtype and shape, and come back as ``np.frombuffer`` views.

What the common request does not use travels as before, the whole object pickled: a request
with a trace, shared-memory placements, a cancellation or a stream, and BYTES tensors (numpy
object arrays), which keep numpy's own pickling. :func:`unpack_request` and
:func:`unpack_response` take either form.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from quiver.types import BY_WIRE_NAME, InferenceRequest, InferenceResponse, RequestedOutput, Tensor

_DTYPES: dict[str, np.dtype[Any]] = {}

# A packed tensor: (name, datatype wire name, shape, numpy dtype str, array shape, buffer,
# parameters or None); a BYTES tensor: (name, "BYTES", shape, None, None, object array, parameters).
_Packed = tuple[Any, ...]


def _pack_tensor(tensor: Tensor) -> _Packed:
    data = tensor.data
    dtype = data.dtype
    if dtype.hasobject:
        return (tensor.name, tensor.datatype.wire, tensor.shape, None, None, data, tensor.parameters or None)
    # A PickleBuffer: no extra copy, and the array comes back writable if it was.
    buffer = pickle.PickleBuffer(data) if data.flags.c_contiguous else data.tobytes()  # type: ignore[arg-type]
    return (tensor.name, tensor.datatype.wire, tensor.shape, dtype.str, data.shape, buffer, tensor.parameters or None)


def _unpack_tensor(packed: _Packed) -> Tensor:
    name, datatype, shape, dtype_str, array_shape, buffer, parameters = packed
    if dtype_str is None:
        data = buffer
    else:
        dtype = _DTYPES.get(dtype_str)
        if dtype is None:
            dtype = _DTYPES[dtype_str] = np.dtype(dtype_str)
        data = np.frombuffer(buffer, dtype=dtype).reshape(array_shape)
    return Tensor(name, BY_WIRE_NAME[datatype], shape, data, parameters if parameters is not None else {})


def pack_request(request: InferenceRequest) -> tuple[Any, ...] | InferenceRequest:
    """The request as a tuple, or the request itself when it uses what the tuple leaves out."""
    if (request.trace is not None or request.input_placements is not None or request.output_placements is not None
            or request.cancellation is not None or request.stream is not None):
        return request
    outputs = request.outputs
    return (request.model_name, request.model_version, [_pack_tensor(t) for t in request.inputs],
            None if outputs is None else [(o.name, o.parameters or None) for o in outputs],
            request.id, request.parameters or None, request.raw)


def unpack_request(packed: tuple[Any, ...] | InferenceRequest) -> InferenceRequest:
    if type(packed) is not tuple:
        return packed  # type: ignore[return-value]
    model_name, model_version, inputs, outputs, ident, parameters, raw = packed
    return InferenceRequest(
        model_name, model_version, [_unpack_tensor(t) for t in inputs],
        None if outputs is None else [RequestedOutput(name, p if p is not None else {}) for name, p in outputs],
        ident, parameters if parameters is not None else {}, raw=raw,
    )


def pack_response(response: InferenceResponse) -> tuple[Any, ...]:
    return (response.model_name, response.model_version, [_pack_tensor(t) for t in response.outputs],
            response.id, response.parameters or None, response.shared_memory_outputs or None)


def unpack_response(packed: tuple[Any, ...] | InferenceResponse) -> InferenceResponse:
    if type(packed) is not tuple:
        return packed  # type: ignore[return-value]
    model_name, model_version, outputs, ident, parameters, shared = packed
    return InferenceResponse(
        model_name, model_version, [_unpack_tensor(t) for t in outputs], ident,
        parameters if parameters is not None else {}, shared if shared is not None else frozenset(),
    )


__all__ = ["pack_request", "pack_response", "unpack_request", "unpack_response"]
