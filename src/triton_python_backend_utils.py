"""Quiver's ``triton_python_backend_utils``: the module Triton Python models import.

Models written for Triton's Python backend do ``import triton_python_backend_utils as
pb_utils``; this module gives them the same names and behaviour, for models that run on CPU,
in a worker process of their own (the default) or in the server's.
It imports only numpy and Quiver's worker-safe modules, so it runs under a model's own
Python environment too (``EXECUTION_ENV_PATH``). It is written from Triton's documented API
(python_backend ``README.md`` and the stub's ``c_python_backend_utils`` bindings).

Decoupled mode (``get_response_sender``), request cancellation and BLS (including
``exec(decoupled=True)``) are served by the Python backend, in a worker or in-process. Not
available here: the model-control functions
(``load_model``, ``unload_model``, ``is_model_ready``), custom metrics
(``MetricFamily``) and GPU tensors.
"""

from __future__ import annotations

import copy
import enum
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from quiver.errors import InvalidArgumentError
from quiver.protocol.bytes_codec import deserialize_bytes, element_count, serialize_bytes
from quiver.types import HAVE_BF16, DataType

__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceTrace",
    "Logger",
    "ModelConfig",
    "PreferredMemory",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "numpy_to_pb_dtype",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "using_decoupled_model_transaction_policy",
]

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


# --------------------------------------------------------------------------- datatypes

#: TRITONSERVER_DataType values, as ``Tensor.triton_dtype()`` returns them (from the one
#: datatype table, ``quiver.types.DataType``).
TYPE_INVALID = 0
TYPE_BOOL = DataType.BOOL.triton_value
TYPE_UINT8 = DataType.UINT8.triton_value
TYPE_UINT16 = DataType.UINT16.triton_value
TYPE_UINT32 = DataType.UINT32.triton_value
TYPE_UINT64 = DataType.UINT64.triton_value
TYPE_INT8 = DataType.INT8.triton_value
TYPE_INT16 = DataType.INT16.triton_value
TYPE_INT32 = DataType.INT32.triton_value
TYPE_INT64 = DataType.INT64.triton_value
TYPE_FP16 = DataType.FP16.triton_value
TYPE_FP32 = DataType.FP32.triton_value
TYPE_FP64 = DataType.FP64.triton_value
TYPE_BYTES = DataType.BYTES.triton_value
TYPE_BF16 = DataType.BF16.triton_value

#: The datatypes with a numpy type here (BF16 only with ml_dtypes, as in Triton's stub).
_NUMPY_DATATYPES = [dt for dt in DataType if dt is not DataType.BF16 or HAVE_BF16]
_TRITON_TO_NUMPY: dict[int, Any] = {dt.triton_value: dt.numpy_dtype.type for dt in _NUMPY_DATATYPES}
_NUMPY_TO_TRITON: dict[np.dtype[Any], int] = {
    np.dtype(np_type): code for code, np_type in _TRITON_TO_NUMPY.items()
}

#: config.pbtxt datatype names -> numpy type, as ``triton_string_to_numpy`` returns (Triton's
#: own table gives Python's ``bool`` for TYPE_BOOL).
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    dt.config_name: bool if dt is DataType.BOOL else dt.numpy_dtype.type for dt in _NUMPY_DATATYPES
}


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type for a TRITONSERVER_DataType value (``11`` -> ``np.float32``).

    Returns None for a value that has no numpy type, as Triton does.
    """
    return _TRITON_TO_NUMPY.get(int(data_type))


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The TRITONSERVER_DataType value for a numpy type or dtype, or None."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    found = _NUMPY_TO_TRITON.get(dtype)
    if found is not None:
        return found
    if dtype.kind in ("O", "S"):
        return TYPE_BYTES
    return None


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """The numpy type for a config datatype name (``"TYPE_FP32"`` -> ``np.float32``)."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def numpy_to_pb_dtype(data_type: Any) -> str | None:
    """The config datatype name for a numpy type (``np.float32`` -> ``"TYPE_FP32"``)."""
    code = numpy_to_triton_type(data_type)
    if code is None:
        return None
    return DataType.from_triton_value(code).config_name


# ------------------------------------------------------------------- BYTES encoding


def serialize_byte_tensor(input_tensor: np.ndarray[Any, Any]) -> bytes | None:
    """Encode a BYTES tensor as Triton sends it: each element as a 4-byte little-endian
    length followed by its bytes, in C order (Quiver's one BYTES codec).

    Elements that are not ``bytes`` are converted with ``str(element).encode("utf-8")``.
    Returns the encoded ``bytes`` (``b""`` for an empty tensor), or None when the dtype
    is not a BYTES one (object, ``np.bytes_`` or ``np.str_``).
    """
    if input_tensor.dtype.kind not in ("O", "S", "U"):
        return None
    return serialize_bytes(np.asarray(input_tensor))


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray[Any, Any]:
    """Decode length-prefixed bytes into a 1-D numpy object array of ``bytes``."""
    data = bytes(encoded_tensor)
    try:
        return deserialize_bytes(data, element_count(data), "")
    except InvalidArgumentError as exc:
        raise TritonModelException(f"Invalid bytes tensor data: {exc}") from None


# --------------------------------------------------------------------------- errors


class _ErrorCode(enum.IntEnum):
    """TRITONSERVER_Error_Code values: ``quiver.errors.ErrorCode``'s members, numbered in
    their order (a test holds the two together)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TritonError(Exception):
    """An error to return in an :class:`InferenceResponse`.

    ``TritonError("bad input", TritonError.INVALID_ARG)``. In Triton this is not an
    exception class; here it is one too, so ``raise TritonError(...)`` inside
    ``execute`` fails the batch with the error's code.
    """

    UNKNOWN = _ErrorCode.UNKNOWN
    INTERNAL = _ErrorCode.INTERNAL
    NOT_FOUND = _ErrorCode.NOT_FOUND
    INVALID_ARG = _ErrorCode.INVALID_ARG
    UNAVAILABLE = _ErrorCode.UNAVAILABLE
    UNSUPPORTED = _ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = _ErrorCode.ALREADY_EXISTS
    CANCELLED = _ErrorCode.CANCELLED

    def __init__(self, message: str, code: int = _ErrorCode.INTERNAL) -> None:
        if message is None:
            raise TypeError("TritonError(): 'message' must be a string, not None")
        if code is None:
            raise TypeError("TritonError(): 'code' must be a TritonError code, not None")
        try:
            error_code = _ErrorCode(code)
        except ValueError:
            raise ValueError(f"TritonError(): unknown error code {code!r}") from None
        super().__init__(message)
        self._message = str(message)
        self._code = error_code

    def message(self) -> str:
        return self._message

    def code(self) -> _ErrorCode:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, TritonError.{self._code.name})"


class TritonModelException(Exception):
    """The exception the backend raises to a model (and a model may raise)."""

    def __init__(self, message: Any = None) -> None:
        super().__init__(message)
        self._message = message

    def message(self) -> Any:
        return self._message

    def __str__(self) -> str:
        return "" if self._message is None else str(self._message)


# --------------------------------------------------------------------------- tensors


class _CapsuleHolder:
    """Lets ``np.from_dlpack`` consume a bare DLPack capsule."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)


_DLPACK_CPU = 1
_DLPACK_CUDA_HOST = 3


class Tensor:
    """A named tensor: an input of a request or an output of a response.

    ``Tensor("OUTPUT0", numpy_array)``. BYTES tensors are numpy object arrays whose
    elements are ``bytes``.
    """

    __slots__ = ("_array", "_dtype", "_name")

    def __init__(self, name: str, numpy_array: Any) -> None:
        if type(name) is not str and not isinstance(name, str):
            raise TypeError(f"Tensor name must be a string, got {type(name).__name__}")
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        array = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        dtype: int | None = _NUMPY_TO_TRITON.get(array.dtype)  # the common case, one lookup
        if dtype is not None:
            pass
        elif array.dtype.kind == "U":
            # Triton rejects numpy unicode arrays; Quiver accepts them and sends the
            # strings as UTF-8 BYTES.
            dtype = TYPE_BYTES
        else:
            dtype = numpy_to_triton_type(array.dtype)
        if dtype is None:
            raise TritonModelException(
                f"Tensor '{name}': NumPy dtype {array.dtype} is not supported; use one of "
                "bool, (u)int8-64, float16/32/64, bfloat16, or np.object_ for BYTES."
            )
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        self._name = name
        self._array = array
        self._dtype = dtype

    @classmethod
    def _wrap(cls, name: str, array: np.ndarray[Any, Any], dtype: int) -> Tensor:
        """Build without checks or copies (the backend's inputs)."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        tensor._dtype = dtype
        return tensor

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        return self._array

    def triton_dtype(self) -> int:
        """The TRITONSERVER_DataType value (``TYPE_FP32`` is 11)."""
        return self._dtype

    def shape(self) -> list[int]:
        return [int(dim) for dim in self._array.shape]

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data (shared, not copied)."""
        if self._dtype == TYPE_BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        try:
            return self._array.__dlpack__()
        except (BufferError, TypeError) as exc:
            raise TritonModelException(
                f"Tensor '{self._name}': cannot export DLPack: {exc}"
            ) from None

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        if self._dtype == TYPE_BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        if stream is not None:
            raise BufferError("stream must be None for a CPU tensor")
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A Tensor sharing the memory of a DLPack capsule or of an object that has
        ``__dlpack__``/``__dlpack_device__`` (a torch CPU tensor, a numpy array...)."""
        if not isinstance(name, str) or name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        source: Any
        if hasattr(capsule, "__dlpack__"):
            if not hasattr(capsule, "__dlpack_device__"):
                raise TritonModelException(
                    "Provided tensor is not supported. Tensor must be a DLPack capsule "
                    "or have `__dlpack__` and `__dlpack_device__` attributes"
                )
            device = capsule.__dlpack_device__()
            device_type = int(device[0])
            if device_type not in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
                raise TritonModelException(
                    f"DLDevice type {device_type} is not supported: Quiver's Python backend "
                    "runs on CPU only"
                )
            source = capsule
        elif type(capsule).__name__ == "PyCapsule":
            source = _CapsuleHolder(capsule)
        else:
            raise TritonModelException(
                "Provided tensor is not supported. Tensor must be a DLPack capsule "
                "or have `__dlpack__` and `__dlpack_device__` attributes"
            )
        try:
            array = np.from_dlpack(source)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            raise TritonModelException(f"Tensor '{name}': cannot import DLPack: {exc}") from None
        if not array.flags.c_contiguous:
            raise TritonModelException(
                "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are "
                "stored in C-Order are supported."
            )
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, dtype={self._array.dtype}, shape={self.shape()})"


# ------------------------------------------------------------- requests and responses


class PreferredMemory:
    """Where BLS outputs should be placed; accepted for compatibility (CPU only)."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1


class InferenceTrace:
    """The trace of a request. Pass it on, ``InferenceRequest(..., trace=request.trace())``,
    and a traced request's BLS request is traced with it (a trace of its own whose
    ``parent_id`` is this request's), as Triton traces BLS requests."""

    __slots__ = ("_context", "_server")

    def __init__(self, context: str | None = None) -> None:
        self._context = context
        self._server: Any = None  # the server's trace of the request, when it is traced

    def get_context(self) -> str | None:
        return self._context


_REQUIRED: Any = object()


class _BlsExecutor(Protocol):
    def exec(self, request: InferenceRequest) -> InferenceResponse: ...

    def async_exec(self, request: InferenceRequest) -> Awaitable[InferenceResponse]: ...

    def exec_decoupled(self, request: InferenceRequest) -> Any: ...

    def async_exec_decoupled(self, request: InferenceRequest) -> Awaitable[Any]: ...


_bls: list[_BlsExecutor] = []


def _set_bls_executor(executor: _BlsExecutor) -> None:
    """Installed by the server's Python backend; models never call this."""
    _bls[:] = [executor]


def _bls_executor() -> _BlsExecutor:
    if not _bls:
        raise TritonModelException("BLS requests can only run inside the Quiver server")
    return _bls[0]


def _parameters_to_json(parameters: Any) -> str:
    if parameters is None:
        return "{}"
    if not isinstance(parameters, Mapping):
        raise TritonModelException(
            f"Expect parameters to be a dict, found type {type(parameters).__name__}"
        )
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key).__name__}"
            )
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                "Expect parameters values to have type bool/int/str, found type "
                f"{type(value).__name__}"
            )
    return json.dumps(dict(parameters))


class InferenceRequest:
    """An inference request, as ``execute`` receives it.

    The constructor takes Triton's BLS keyword arguments (``model_name``,
    ``requested_output_names``, ``inputs``, ``request_id``, ``correlation_id``,
    ``model_version``, ``flags``, ``timeout``, ``preferred_memory``, ``trace``,
    ``parameters``); ``exec()`` and ``async_exec()`` run it on another model of the
    server (BLS), through the server's normal inference path.
    """

    # No attribute of a model's own, as in Triton (its class has none); and cheaper to make.
    __slots__ = (
        "_cancelled",
        "_correlation_id",
        "_flags",
        "_inputs",
        "_model_name",
        "_model_version",
        "_parameters",
        "_preferred_memory",
        "_request_id",
        "_requested_output_names",
        "_sender_factory",
        "_timeout",
        "_trace",
    )

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = _REQUIRED,
        requested_output_names: Sequence[str] = _REQUIRED,
        model_name: str = _REQUIRED,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> None:
        missing = [
            arg
            for arg, value in (
                ("inputs", inputs),
                ("requested_output_names", requested_output_names),
                ("model_name", model_name),
            )
            if value is _REQUIRED
        ]
        if missing:
            raise TypeError(
                f"InferenceRequest() missing required argument(s): {', '.join(missing)}"
            )
        if not isinstance(correlation_id, (int, str)) or isinstance(correlation_id, bool):
            raise TritonModelException("Correlation ID must be integer or string")
        for tensor in inputs:
            if not isinstance(tensor, Tensor):
                raise TypeError(
                    f"InferenceRequest(): inputs must be pb_utils.Tensor objects, got "
                    f"{type(tensor).__name__}"
                )
        self._request_id = str(request_id)
        self._correlation_id: int | str = correlation_id
        self._inputs = list(inputs)
        self._requested_output_names = {str(name) for name in requested_output_names}
        self._model_name = str(model_name)
        self._model_version = int(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._preferred_memory: PreferredMemory | None = preferred_memory or PreferredMemory(
            TRITONSERVER_MEMORY_CPU
        )
        self._trace: InferenceTrace | None = trace or InferenceTrace()
        self._parameters = _parameters_to_json(parameters)
        self._sender_factory: Callable[[], Any] | None = None
        self._cancelled: Callable[[], bool] | None = None

    @classmethod
    def _from_server(
        cls,
        *,
        request_id: str,
        correlation_id: int | str,
        inputs: list[Tensor],
        requested_output_names: set[str],
        model_name: str,
        model_version: int,
        flags: int,
        timeout: int,
        parameters_json: str,
        sender_factory: Any = None,
        cancelled: Any = None,
    ) -> InferenceRequest:
        """The backend's constructor: no checks, parameters already JSON; the backend's
        ``sender_factory()`` makes the response sender, ``cancelled()`` tells cancellation."""
        request = cls.__new__(cls)
        request._request_id = request_id
        request._correlation_id = correlation_id
        request._inputs = inputs
        request._requested_output_names = requested_output_names
        request._model_name = model_name
        request._model_version = model_version
        request._flags = flags
        request._timeout = timeout
        request._preferred_memory = None  # a server's request has none (CPU)
        request._trace = None  # made when asked for
        request._parameters = parameters_json
        request._sender_factory = sender_factory
        request._cancelled = cancelled
        return request

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        """The request's timeout in microseconds; 0 when it has none."""
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters as a JSON object string (``'{}'`` when none)."""
        return self._parameters

    def requested_output_names(self) -> set[str]:
        """The outputs to compute: a set, as in Triton (every configured output when the
        client asked for none)."""
        return self._requested_output_names

    def trace(self) -> InferenceTrace:
        trace = self._trace
        if trace is None:
            trace = self._trace = InferenceTrace()
        return trace

    def is_cancelled(self) -> bool:
        """Whether the client cancelled this request (or went away): a model may stop early."""
        return self._cancelled is not None and bool(self._cancelled())

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on ``model_name`` and wait for the response (BLS). Errors come
        back in the response (``has_error()``), as in Triton. With ``decoupled=True``: an
        iterator of the responses (a decoupled model's may end with an empty one), which
        ``cancel()`` cancels."""
        if decoupled:
            return _bls_executor().exec_decoupled(self)
        return _bls_executor().exec(self)

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """Like :meth:`exec`, for ``async def execute``: ``await request.async_exec()``."""
        if decoupled:
            return _bls_executor().async_exec_decoupled(self)
        return _bls_executor().async_exec(self)

    def get_response_sender(self) -> Any:
        """The request's InferenceResponseSender (one per request)."""
        if self._sender_factory is None:
            raise TritonModelException(
                "Unable to send response. Response sender has no reference to the decoupled "
                "state of the model."
            )
        return self._sender_factory()

    def __repr__(self) -> str:
        names = [tensor.name() for tensor in self._inputs]
        return f"InferenceRequest(request_id={self._request_id!r}, inputs={names})"


class InferenceResponse:
    """The response to one request: output tensors, or an error."""

    __slots__ = ("_error", "_output_tensors", "_parameters")

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> None:
        if output_tensors is None:
            output_tensors = []
        elif type(output_tensors) is not list and (
            isinstance(output_tensors, (str, bytes, Tensor)) or not isinstance(output_tensors, Sequence)
        ):
            raise TritonModelException(
                "InferenceResponse(): 'output_tensors' must be a list of pb_utils.Tensor, "
                f"got {type(output_tensors).__name__}"
            )
        for tensor in output_tensors:
            if type(tensor) is not Tensor and not isinstance(tensor, Tensor):
                raise TritonModelException(
                    "InferenceResponse(): 'output_tensors' must contain pb_utils.Tensor "
                    f"objects, found {type(tensor).__name__}"
                )
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException(
                "InferenceResponse(): 'error' must be a pb_utils.TritonError or None, got "
                f"{type(error).__name__}"
            )
        self._output_tensors = list(output_tensors)
        self._error = error
        self._parameters = "{}" if parameters is None else _parameters_to_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        """The response's parameters as a JSON object string."""
        return self._parameters

    def __repr__(self) -> str:
        if self._error is not None:
            return f"InferenceResponse(error={self._error!r})"
        names = [tensor.name() for tensor in self._output_tensors]
        return f"InferenceResponse(output_tensors={names})"


# --------------------------------------------------------------------------- lookups


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The input tensor called ``name``, or None."""
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The output tensor called ``name`` in a response, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The ``input`` entry called ``name`` of a model configuration dict, or None."""
    for entry in model_config.get("input", []) or []:
        if entry.get("name") == name:
            return entry  # type: ignore[no-any-return]
    return None


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The ``output`` entry called ``name`` of a model configuration dict, or None."""
    for entry in model_config.get("output", []) or []:
        if entry.get("name") == name:
            return entry  # type: ignore[no-any-return]
    return None


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """Whether the configuration sets ``model_transaction_policy { decoupled: true }``."""
    policy = model_config.get("model_transaction_policy")
    if isinstance(policy, Mapping):
        return bool(policy.get("decoupled", False))
    return False


# ---------------------------------------------------------------------- ModelConfig


class ModelConfig:
    """The configuration handed to ``auto_complete_config``; what it returns is used
    as the model's final configuration.

    Only ``max_batch_size``, ``input``, ``output``, ``dynamic_batching`` and
    ``model_transaction_policy`` can be changed, through the ``set_*``/``add_*`` methods.
    """

    _INPUT_KEYS = ("name", "data_type", "dims", "optional")
    _OUTPUT_KEYS = ("name", "data_type", "dims")

    def __init__(self, model_config: str | bytes | Mapping[str, Any]) -> None:
        if isinstance(model_config, (str, bytes)):
            config = json.loads(model_config)
        else:
            config = copy.deepcopy(dict(model_config))
        if not isinstance(config, dict):
            raise TypeError("ModelConfig() needs a JSON object")
        config.setdefault("name", "")
        config.setdefault("max_batch_size", 0)
        config.setdefault("input", [])
        config.setdefault("output", [])
        self._model_config: dict[str, Any] = config

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The configuration as a dict (treat it as read-only)."""
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size``; a configured non-zero value may not be lowered."""
        current = int(self._model_config.get("max_batch_size", 0) or 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but in "
                f"auto-complete-config function for model '{self._name}' specified "
                f"max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher, unless another scheduler is configured."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:
        """Add an input, or complete the configured one of the same name."""
        self._add_tensor("input", input, self._INPUT_KEYS)

    def add_output(self, output: Mapping[str, Any]) -> None:
        """Add an output, or complete the configured one of the same name."""
        self._add_tensor("output", output, self._OUTPUT_KEYS)

    def _add_tensor(self, kind: str, tensor: Mapping[str, Any], valid: tuple[str, ...]) -> None:
        if not isinstance(tensor, Mapping):
            raise TypeError(f"add_{kind}() takes a dict, got {type(tensor).__name__}")
        label = f"{kind} '{tensor['name']}'" if "name" in tensor else kind
        for key in tensor:
            if key not in valid:
                allowed = ", ".join(f"'{k}'" for k in valid)
                raise ValueError(
                    f"{label} in auto-complete-config function for model '{self._name}' "
                    f"contains property '{key}'; only {allowed} are allowed."
                )
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(
                    f"{label} in auto-complete-config function for model '{self._name}' "
                    f"is missing '{key}' property."
                )
        name = tensor["name"]
        data_type = tensor["data_type"]
        dims = [int(dim) for dim in tensor["dims"]]
        entries: list[dict[str, Any]] = self._model_config.setdefault(kind, [])
        for current in entries:
            if current.get("name") != name:
                continue
            current_type = current.get("data_type", "TYPE_INVALID")
            if current_type not in ("TYPE_INVALID", data_type):
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects datatype "
                    f"{current_type} for {kind} '{name}', model provides {data_type}"
                )
            current_dims = [int(dim) for dim in current.get("dims", []) or []]
            if current_dims and current_dims != dims:
                raise ValueError(
                    f"model '{self._name}', tensor '{name}': the model expects dims {dims} "
                    f"but the model configuration specifies dims {current_dims}"
                )
            if (
                "optional" in tensor
                and "optional" in current
                and bool(current["optional"]) != bool(tensor["optional"])
            ):
                raise ValueError(
                    f"model '{self._name}', tensor '{name}': the model expects optional "
                    f"{bool(tensor['optional'])} but the model configuration specifies "
                    f"optional {bool(current['optional'])}"
                )
            current["data_type"] = data_type
            current["dims"] = dims
            if "optional" in tensor:
                current["optional"] = bool(tensor["optional"])
            return
        entry: dict[str, Any] = {"name": name, "data_type": data_type, "dims": dims}
        if "optional" in tensor:
            entry["optional"] = bool(tensor["optional"])
        entries.append(entry)

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        """Set ``model_transaction_policy``; only ``decoupled`` may be given."""
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    "model transaction property in auto-complete-config function for model "
                    f"'{self._name}' contains property other than 'decoupled'."
                )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for model "
                    f"'{self._name}', which is already set to '{bool(policy['decoupled'])}'."
                )
            policy["decoupled"] = wanted

    def __repr__(self) -> str:
        return f"ModelConfig({json.dumps(self._model_config)})"


# --------------------------------------------------------------------------- logging


class _LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_PY_LEVELS = {
    _LogLevel.INFO: logging.INFO,
    _LogLevel.WARNING: logging.WARNING,
    _LogLevel.ERROR: logging.ERROR,
    _LogLevel.VERBOSE: logging.DEBUG,
}
_model_logger = logging.getLogger("quiver.python_model")


class Logger:
    """Triton's model logger, writing to the ``quiver.python_model`` logger."""

    LogLevel = _LogLevel
    INFO = _LogLevel.INFO
    WARNING = _LogLevel.WARNING
    ERROR = _LogLevel.ERROR
    VERBOSE = _LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = _LogLevel.INFO) -> None:
        _model_logger.log(_PY_LEVELS.get(_LogLevel(level), logging.INFO), "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        _model_logger.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _model_logger.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _model_logger.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _model_logger.debug("%s", message)
