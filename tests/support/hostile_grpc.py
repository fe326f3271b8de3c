"""Hostile gRPC messages for the fuzz suite: any message of ``inference.GRPCInferenceService``
with random field values (built from the message descriptors of ``tritonclient``'s
``service_pb2``, so every field of every request is reached), ``ModelInferRequest``s built
from :mod:`support.hostile`'s abstract requests with gRPC's own ways to be wrong (contents in
the wrong field, raw buffers that do not match the inputs), and a raw channel that sends any
bytes as a serialized message."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import grpc
import numpy as np
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from support.hostile import (
    INTERESTING_INTS,
    PARAMETER_KEYS,
    In,
    ModelSpec,
    Req,
    datatypes,
    dims,
    model_names,
    mutated_requests,
    raw_encode,
    versions,
)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
METHODS = {method.name: method for method in SERVICE.methods}
UNARY = sorted(name for name, method in METHODS.items() if not method.client_streaming)
PREFIX = "/inference.GRPCInferenceService/"

_F = FieldDescriptor
_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1), _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1), _F.TYPE_SINT64: (-(2**63), 2**63 - 1), _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}


def message_class(descriptor: Descriptor) -> type[Any]:
    return message_factory.GetMessageClass(descriptor)  # type: ignore[no-any-return]


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in INTERESTING_INTS if low <= v <= high] + [low, high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def scalars(field: FieldDescriptor, overrides: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Values for one scalar field: by its name where ``overrides`` knows it, else by type."""
    if field.name in overrides:
        return overrides[field.name]
    kind = field.type
    if kind in _RANGES:
        return _ints(*_RANGES[kind])
    if kind == _F.TYPE_BOOL:
        return st.booleans()
    if kind == _F.TYPE_STRING:
        return st.one_of(st.text(max_size=16), st.sampled_from(["", "\x00", "a" * 300, "../x", "true", "-1"]))
    if kind == _F.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == _F.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == _F.TYPE_DOUBLE:
        return st.floats()
    if kind == _F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 100))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _fill(draw: st.DrawFn, message: Any, field: FieldDescriptor, overrides: dict[str, Any], depth: int) -> None:
    target = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        for _ in range(draw(st.integers(0, 3))):
            key = draw(overrides.get(f"{field.name}.key", scalars(key_field, {})))
            if value_field.message_type is not None:
                target[key].CopyFrom(draw(messages(value_field.message_type, overrides, depth + 1)))
            else:
                target[key] = draw(scalars(value_field, {}))
        return
    if field.label == _F.LABEL_REPEATED:
        if field.message_type is not None:
            for _ in range(draw(st.integers(0, 3 if depth < 2 else 1))):
                target.add().CopyFrom(draw(messages(field.message_type, overrides, depth + 1)))
        else:
            target.extend(draw(st.lists(scalars(field, overrides), max_size=6)))
        return
    if field.message_type is not None:
        if depth < 4:
            target.CopyFrom(draw(messages(field.message_type, overrides, depth + 1)))
        return
    setattr(message, field.name, draw(scalars(field, overrides)))


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, overrides: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A message of ``descriptor`` with a random subset of its fields set to random values
    (maps, repeated fields, nested messages and oneofs included)."""
    message = message_class(descriptor)()
    for field in descriptor.fields:
        if draw(st.booleans()):
            _fill(draw, message, field, overrides or {}, depth)
    return message


def field_overrides(real_models: list[str], *, exclude: tuple[str, ...] = ()) -> dict[str, st.SearchStrategy[Any]]:
    """Field values by name: model names and versions from the hostile lists, datatypes,
    shapes, and parameter names Quiver reads."""
    names = model_names(real_models, exclude=exclude)
    return {
        "name": names,
        "model_name": names,
        "version": versions(),
        "model_version": versions(),
        "datatype": datatypes(),
        "shape": dims(wide=False).map(lambda d: max(min(d, 2**63 - 1), -(2**63))),
        "parameters.key": st.one_of(st.sampled_from([*PARAMETER_KEYS, "config", "file:1/model.onnx", "unload_dependents"]), st.text(max_size=8)),
        "settings.key": st.one_of(st.sampled_from(LOG_KEYS), st.text(max_size=8)),
    }


LOG_KEYS = ["log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format"]


def defang_log_settings(message: Any) -> Any:
    """A LogSettingsRequest that cannot make the server open a file: a ``log_file`` string
    becomes "" unless it is one that no ``open`` can succeed with."""
    if "log_file" in message.settings:
        value = message.settings["log_file"]
        if value.WhichOneof("parameter_choice") == "string_param" and value.string_param not in SAFE_LOG_FILES:
            value.string_param = ""
    return message


SAFE_LOG_FILES = ("", "\x00", "a\x00b", "/nonexistent-quiver-fuzz/dir/x.log", "/proc/self/nonexistent/x", "/", "/dev/null/x")


def protected(method: str, message: Any, names: Iterable[str]) -> bool:
    """Whether ``message`` would load or unload one of ``names`` (the canary's model)."""
    return method in ("RepositoryModelLoad", "RepositoryModelUnload") and message.model_name in set(names)


# -- raw calls -------------------------------------------------------------------------------


def call_unary(channel: grpc.Channel, method: str, payload: bytes, timeout: float, metadata: Any = None) -> tuple[str, str, bytes]:
    """``payload`` as the serialized request of ``method``: (status name, details, answer)."""
    stub = channel.unary_unary(PREFIX + method, request_serializer=None, response_deserializer=None)
    try:
        answer = stub(payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or "", b""
    return "OK", "", answer


def call_stream(channel: grpc.Channel, payloads: list[bytes], timeout: float) -> tuple[str, str, list[bytes]]:
    """``payloads`` on one ModelStreamInfer stream: (final status, details, answers)."""
    stub = channel.stream_stream(PREFIX + "ModelStreamInfer", request_serializer=None, response_deserializer=None)
    answers: list[bytes] = []
    try:
        for answer in stub(iter(payloads), timeout=timeout):
            answers.append(answer)
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or "", answers
    return "OK", "", answers


# -- ModelInferRequest from abstract requests -------------------------------------------------

CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
CONTENTS_FIELDS = sorted(set(CONTENTS.values()))


def _fit(field: str, values: list[Any]) -> list[Any]:
    """``values`` made acceptable to the contents field (wrapped into its integer range)."""
    out: list[Any] = []
    for value in values:
        if field == "bytes_contents":
            out.append(value.encode("utf-8") if isinstance(value, str) else str(value).encode())
        elif field == "bool_contents":
            out.append(bool(value))
        elif field in ("fp32_contents", "fp64_contents"):
            out.append(float(value) if isinstance(value, int | float) else 0.0)
        else:
            low, high = {"int_contents": (-(2**31), 2**31 - 1), "int64_contents": (-(2**63), 2**63 - 1),
                         "uint_contents": (0, 2**32 - 1), "uint64_contents": (0, 2**64 - 1)}[field]
            number = int(value) if isinstance(value, int | float) and math.isfinite(value) else 0
            out.append(low + (number - low) % (high - low + 1))
    return out


def set_parameter(target: Any, key: str, value: Any) -> None:
    param = target[key]
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            param.int64_param = value
        elif 0 <= value < 2**64:
            param.uint64_param = value
        else:
            param.string_param = str(value)
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = value if isinstance(value, str) else repr(value)


def _shape(shape: Any) -> list[int]:
    if not isinstance(shape, list):
        return []
    return [max(min(d, 2**63 - 1), -(2**63)) if isinstance(d, int) else 0 for d in shape]


def encode_request(req: Req) -> Any:
    """The ModelInferRequest of an abstract request: typed contents, or raw buffers for every
    input when any input is binary (what a client must send)."""
    message = pb.ModelInferRequest(model_name=req.model, model_version=req.version, id=str(req.id))
    for key, value in req.parameters.items():
        set_parameter(message.parameters, str(key), value)
    raw = any(t.form == "binary" for t in req.inputs)
    for tensor in req.inputs:
        entry = message.inputs.add(name=str(tensor.name), datatype=str(tensor.datatype), shape=_shape(tensor.shape))
        for key, value in tensor.parameters.items():
            set_parameter(entry.parameters, str(key), value)
        if raw:
            if tensor.form == "binary":
                message.raw_input_contents.append(tensor.raw)
            else:
                message.raw_input_contents.append(_raw_or_empty(tensor))
        else:
            field = CONTENTS.get(str(tensor.datatype))
            if field is not None and tensor.flat:
                getattr(entry.contents, field).extend(_fit(field, tensor.flat))
    for out in req.outputs or []:
        entry = message.outputs.add(name=str(out.name))
        for key, value in out.parameters.items():
            set_parameter(entry.parameters, str(key), value)
    return message


def _raw_or_empty(tensor: In) -> bytes:
    try:
        return raw_encode(str(tensor.datatype), tensor.flat)
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
        return b""


@st.composite
def grpc_infer_requests(draw: st.DrawFn, catalog: list[ModelSpec], **options: Any) -> tuple[Req, Any]:
    """(abstract request, ModelInferRequest): a valid request, :mod:`support.hostile`'s
    mutations, then 0..2 of gRPC's own (counted in ``req.mutations``)."""
    req = draw(mutated_requests(catalog, http=False, **options))
    # one form for the whole request, as a client sends it (mixing is a mutation below)
    if any(t.form == "binary" for t in req.inputs) and not req.mutations:
        for tensor in req.inputs:
            if tensor.form != "binary":
                tensor.form, tensor.raw = "binary", raw_encode(tensor.datatype, tensor.flat)
    message = encode_request(req)
    for _ in range(draw(st.integers(0, 2)) if options.get("only") is None else 0):
        kind = draw(st.sampled_from(["raw_count", "contents_and_raw", "wrong_contents", "two_contents", "param_types", "empty_name"]))
        req.mutations.append(kind)
        inputs = message.inputs
        if kind == "raw_count":
            if message.raw_input_contents and draw(st.booleans()):
                del message.raw_input_contents[-1]
            else:
                message.raw_input_contents.append(draw(st.binary(max_size=16)))
        elif kind == "contents_and_raw" and inputs:
            getattr(inputs[0].contents, draw(st.sampled_from(CONTENTS_FIELDS))).extend([])
            inputs[0].contents.int_contents.append(1)
            if not message.raw_input_contents:
                message.raw_input_contents.extend([b"\x00" * 4] * len(inputs))
        elif kind in ("wrong_contents", "two_contents") and inputs:
            target = inputs[draw(st.integers(0, len(inputs) - 1))]
            if kind == "wrong_contents":
                target.ClearField("contents")
            name = draw(st.sampled_from(CONTENTS_FIELDS))
            getattr(target.contents, name).extend(_fit(name, draw(st.lists(st.integers(-5, 5), max_size=20))))
        elif kind == "param_types":
            where = message.parameters if not inputs or draw(st.booleans()) else inputs[0].parameters
            key = draw(st.sampled_from(PARAMETER_KEYS))
            choice = draw(st.sampled_from(["bool_param", "int64_param", "uint64_param", "double_param", "string_param"]))
            value = {"bool_param": st.booleans(), "int64_param": _ints(-(2**63), 2**63 - 1), "uint64_param": _ints(0, 2**64 - 1),
                     "double_param": st.floats(), "string_param": st.text(max_size=8)}[choice]
            setattr(where[key], choice, draw(value))
        elif kind == "empty_name":
            message.model_name = draw(st.sampled_from(["", "\x00", "a" * 5000]))
    return req, message


def grpc_outputs(answer: Any) -> dict[str, tuple[str, np.ndarray[Any, Any]]]:
    """name -> (datatype, array) of a ModelInferResponse (every output raw, as Triton sends)."""
    from support.fuzz import decode_binary

    out = {}
    for index, tensor in enumerate(answer.outputs):
        out[tensor.name] = (tensor.datatype, decode_binary(tensor.datatype, answer.raw_output_contents[index], list(tensor.shape)))
    return out

