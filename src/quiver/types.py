"""Value types shared by every layer: datatypes, tensors, requests and responses.

These are plain slotted dataclasses on the request path (construction cost matters
there); treat them as immutable once built.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

try:  # ml_dtypes ships with onnx; it gives numpy a real bfloat16.
    import ml_dtypes

    _BF16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    HAVE_BF16 = True
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = np.dtype(np.uint16)
    HAVE_BF16 = False

if TYPE_CHECKING:
    from quiver.streaming import Cancellation, ResponseStream


class DataType(enum.Enum):
    """Triton's tensor datatypes, by their wire name (``"FP32"``): the one datatype table.

    Each has its numpy dtype, its size, its config.pbtxt name (``TYPE_FP32``) and its number
    (``TRITONSERVER_DataType``, the same as the config protobuf's ``DataType`` enum, which
    ``triton_python_backend_utils`` calls ``TYPE_FP32``). Backends keep only their framework's
    names for these (onnxruntime's ``tensor(float)``, torch's dtypes).
    """

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"
    BYTES = "BYTES"
    BF16 = "BF16"

    # Plain attributes of each member, set below (a property costs a call and a lookup, and
    # the request path reads them for every tensor):
    #: The numpy dtype (object for BYTES).
    numpy_dtype: np.dtype[Any]
    #: Bytes per element; 0 for BYTES, whose elements have their own lengths.
    itemsize: int
    #: The wire name, ``value`` (which is a property of every enum: slower to read).
    wire: str

    @property
    def config_name(self) -> str:
        """The name used in config.pbtxt: ``TYPE_FP32``, ``TYPE_STRING`` for BYTES."""
        return "TYPE_STRING" if self is DataType.BYTES else "TYPE_" + self.value

    @property
    def triton_value(self) -> int:
        """``TRITONSERVER_DataType`` / the config protobuf's ``DataType`` number (FP32: 11)."""
        return _TRITON_VALUE[self]

    @classmethod
    def from_wire(cls, name: str) -> DataType:
        return _WIRE[name]

    @classmethod
    def from_triton_value(cls, value: int) -> DataType:
        return _FROM_TRITON_VALUE[value]

    @classmethod
    def from_config(cls, name: str) -> DataType:
        return _CONFIG[name]

    @classmethod
    def from_numpy(cls, dtype: np.dtype[Any]) -> DataType:
        found = _FROM_NUMPY.get(np.dtype(dtype))
        if found is None:
            if dtype.kind in ("O", "S", "U"):
                return DataType.BYTES
            raise KeyError(f"numpy dtype {dtype} has no Triton datatype")
        return found


_NUMPY: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.BYTES: np.dtype(np.object_),
    DataType.BF16: _BF16,
}
_ITEMSIZE = {dt: (0 if dt is DataType.BYTES else npd.itemsize) for dt, npd in _NUMPY.items()}
for _member in DataType:
    _member.numpy_dtype = _NUMPY[_member]
    _member.itemsize = _ITEMSIZE[_member]
    _member.wire = _member.value
del _member
_WIRE = {dt.value: dt for dt in DataType}
#: wire name -> datatype, for the protocol modules' lookups (``.get`` on the request path).
BY_WIRE_NAME: Mapping[str, DataType] = MappingProxyType(_WIRE)
#: The members stand in Triton's order: BOOL is 1 ... BF16 is 14 (0 is TYPE_INVALID).
_TRITON_VALUE = {dt: number for number, dt in enumerate(DataType, start=1)}
_FROM_TRITON_VALUE = {number: dt for dt, number in _TRITON_VALUE.items()}
_CONFIG = {dt.config_name: dt for dt in DataType}
_FROM_NUMPY = {npd: dt for dt, npd in _NUMPY.items() if dt is not DataType.BYTES}
if not HAVE_BF16:  # pragma: no cover
    _FROM_NUMPY[np.dtype(np.uint16)] = DataType.UINT16


Array = npt.NDArray[Any]


@dataclass(slots=True)
class Tensor:
    """A named tensor. BYTES data is a numpy object array of ``bytes``."""

    name: str
    datatype: DataType
    shape: tuple[int, ...]
    data: Array
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for, with its parameters (binary_data, classification)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def classification(self) -> int:
        value = self.parameters.get("classification", 0)
        return int(value) if value else 0


@dataclass(frozen=True, slots=True)
class Placement:
    """A tensor in a client's shared-memory region: ``byte_size`` bytes at ``offset``."""

    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class InferenceRequest:
    """One transport-neutral inference request.

    ``model_version`` is ``""`` or ``-1`` semantics: empty means "the version policy's
    latest". ``outputs`` is ``None`` when the client asked for every output.

    ``cancellation`` is set when the client cancelled or left (the model sees it); ``stream``
    receives the responses of a request to a decoupled model (:mod:`quiver.streaming`).
    """

    model_name: str
    model_version: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None = None
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    #: The request's trace (a ``quiver.tracing.Trace``) when it is sampled, else None.
    trace: Any = None
    #: A raw binary request (HTTP ``Inference-Header-Content-Length: 0``): its one input's
    #: name, datatype and shape come from the model configuration, outputs default to binary.
    raw: bool = False
    #: Inputs whose data is in a shared-memory region, and outputs to be written into one
    #: (by name); None when the request uses no shared memory.
    input_placements: dict[str, Placement] | None = None
    output_placements: dict[str, Placement] | None = None
    cancellation: Cancellation | None = None
    stream: ResponseStream | None = None

    def input(self, name: str) -> Tensor | None:
        for tensor in self.inputs:
            if tensor.name == name:
                return tensor
        return None


@dataclass(slots=True)
class InferenceResponse:
    """The answer to one request: outputs in the order they are to be sent."""

    model_name: str
    model_version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    #: Outputs written into shared-memory regions: the response carries only their metadata.
    shared_memory_outputs: frozenset[str] = frozenset()
