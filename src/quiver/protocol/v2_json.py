"""KServe v2 JSON inference bodies with Triton's binary tensor extension.

A request body is a JSON header, optionally followed by raw tensor bytes; the length of the
header is the ``Inference-Header-Content-Length`` HTTP header. Inputs whose parameters carry
``binary_data_size`` take their data, in order, from the bytes after the header. Responses
follow the same scheme for outputs asked for with ``binary_data``.

This module checks that a body is well formed (types, shapes against the data, sizes);
checks against the model's configuration live in the service.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from quiver import messages
from quiver.errors import InvalidArgumentError
from quiver.protocol.bytes_codec import serialize_bytes
from quiver.protocol.limits import (
    MAX_JSON_DEPTH,
    MAX_RANK,
    check_depth,
    element_count,
    may_nest_too_deep,
)
from quiver.protocol.raw import array_from_raw
from quiver.shared_memory import REGION, placement
from quiver.types import (
    BY_WIRE_NAME,
    HAVE_BF16,
    DataType,
    InferenceRequest,
    InferenceResponse,
    Placement,
    RequestedOutput,
    Tensor,
)

#: A header shorter than this cannot nest MAX_JSON_DEPTH deep: every bracket is closed.
_DEPTH_SCAN_BYTES = 2 * MAX_JSON_DEPTH
#: Element counts up to this need no more checks (2**40 elements of 8 bytes fit an array).
_SMALL_COUNT = 1 << 40
_INT_KINDS = frozenset("iu")
#: An input's data until the service reads it from its shared-memory region.
_EMPTY: np.ndarray[Any, Any] = np.empty(0, dtype=np.uint8)
_NUMBER_KINDS = frozenset("iuf")


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message)


def _shape(value: Any, name: str, datatype: DataType) -> tuple[tuple[int, ...], int]:
    """The shape and its element count (limits.element_count checks rank and size)."""
    if not isinstance(value, list):
        raise _bad(f"input '{name}': 'shape' must be a list of integers")
    if len(value) <= MAX_RANK:
        for dim in value:
            if type(dim) is not int:
                raise _bad(
                    f"input '{name}': 'shape' must be a list of non-negative integers, got {value}"
                )
        if value and min(value) > 0:  # the common case: no 0 or negative dimension
            count = math.prod(value)
            if count <= _SMALL_COUNT:
                return tuple(value), count
    shape = tuple(value)
    return shape, element_count(shape, name, datatype)


def _parameters(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"{where}: 'parameters' must be a JSON object")
    return value


def _flatten_strings(data: list[Any], name: str) -> list[bytes]:
    """Every string of a (nested) list, in order, UTF-8 encoded. Iterative: the nesting is
    bounded by the parse-time depth check anyway, but nothing here recurses."""
    if set(map(type, data)) == {str}:
        return [item.encode("utf-8") for item in data]
    out: list[bytes] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, str):
                out.append(item.encode("utf-8"))
            elif isinstance(item, list):
                stack.append(iter(item))
                break
            else:
                raise _bad(f"input '{name}': BYTES data must be strings, got {type(item).__name__}")
        else:
            stack.pop()
    return out


def _all_ints(data: list[Any]) -> bool:
    # recursion bounded by MAX_JSON_DEPTH: decode_request checked the nesting first
    return all(_all_ints(v) if isinstance(v, list) else type(v) is int for v in data)


def _json_array(
    data: Any, datatype: DataType, shape: tuple[int, ...], count: int, name: str
) -> np.ndarray[Any, Any]:
    if not isinstance(data, list):
        data = [data]
    if datatype is DataType.BYTES:
        flat = _flatten_strings(data, name)
        if len(flat) != count:
            raise _bad(
                f"input '{name}': shape {list(shape)} needs {count} elements but 'data' has "
                f"{len(flat)}"
            )
        array = np.empty(len(flat), dtype=object)
        array[:] = flat
    else:
        try:
            raw = np.asarray(data)
        except ValueError:
            raise _bad(f"input '{name}': 'data' is a ragged nested list") from None
        kind = raw.dtype.kind
        if raw.size == 0:
            raw = raw.astype(datatype.numpy_dtype)
        elif datatype is DataType.BOOL:
            if kind != "b":
                raise _bad(f"input '{name}': BOOL data must be true/false values")
        elif datatype.numpy_dtype.kind in _INT_KINDS:
            if kind not in _INT_KINDS and _all_ints(data):
                # integers past int64 (UINT64's upper half): numpy guessed float or object
                try:
                    raw = np.array(data, dtype=datatype.numpy_dtype)
                except (OverflowError, ValueError):
                    raise _bad(f"input '{name}': a value is out of range for {datatype.value}") from None
            elif kind not in _INT_KINDS:
                raise _bad(f"input '{name}': {datatype.value} data must be integers")
            else:
                info = np.iinfo(datatype.numpy_dtype)
                if raw.min() < info.min or raw.max() > info.max:
                    raise _bad(f"input '{name}': a value is out of range for {datatype.value}")
        elif kind not in _NUMBER_KINDS:
            raise _bad(f"input '{name}': {datatype.value} data must be numbers")
        if datatype is DataType.BF16 and not HAVE_BF16:
            raise _bad(f"input '{name}': BF16 needs the ml_dtypes package on the server")
        array = raw.astype(datatype.numpy_dtype, copy=False).reshape(-1)
    if array.size != count:
        raise _bad(
            f"input '{name}': shape {list(shape)} needs {count} elements but 'data' has {array.size}"
        )
    return array.reshape(shape)


def _loads_nonfinite(raw: bytes, error: orjson.JSONDecodeError, model_name: str) -> Any:
    """A header orjson refused: Triton's parser (rapidjson with ``kParseNanAndInfFlag``) also
    takes ``NaN``, ``Infinity`` and ``-Infinity``, which ``tritonclient`` writes for
    non-finite JSON input data; Python's parser takes them too. Anything else is malformed."""
    if b"NaN" in raw or b"Infinity" in raw:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            pass
    raise _bad(f"malformed JSON in inference request for model '{model_name}': {error}") from None
def _check_depth(header: dict[str, Any]) -> None:
    """Each field of the request, and of each input and output, held to MAX_JSON_DEPTH."""
    for key, value in header.items():
        if key in ("inputs", "outputs") and type(value) is list:
            for tensor in value:
                if type(tensor) is not dict:
                    check_depth(tensor, f"inference request: '{key}'")
                    continue
                name = tensor.get("name")
                where = f"{key[:-1]} '{name}'" if isinstance(name, str) else f"an entry of '{key}'"
                for field, item in tensor.items():
                    check_depth(item, f"{where}: '{field}'")
        else:
            check_depth(value, f"inference request: '{key}'")


def decode_request(
    body: bytes, header_length: int | None, model_name: str, model_version: str
) -> InferenceRequest:
    """Parse an infer request body (JSON header plus optional binary tensors)."""
    size = len(body)
    if header_length is None:
        header_length = size
    elif header_length < 0 or header_length > size:
        raise _bad(
            f"Inference-Header-Content-Length is {header_length} but the body has only {size} bytes"
        )
    raw_header = body[:header_length] if header_length != size else body
    try:
        header = orjson.loads(raw_header)
    except orjson.JSONDecodeError as exc:
        header = _loads_nonfinite(raw_header, exc, model_name)
    if not isinstance(header, dict):
        raise _bad("inference request must be a JSON object")
    if header_length >= _DEPTH_SCAN_BYTES and may_nest_too_deep(body, header_length):
        _check_depth(header)
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list):
        raise _bad("inference request needs 'inputs', a list of tensors")

    view = memoryview(body)
    offset = header_length
    inputs: list[Tensor] = []
    input_placements: dict[str, Placement] | None = None
    output_placements: dict[str, Placement] | None = None
    for raw in raw_inputs:
        if not isinstance(raw, dict):
            raise _bad("each of 'inputs' must be a JSON object")
        name = raw.get("name")
        if not isinstance(name, str):
            raise _bad("an input has no 'name'")
        wire_type = raw.get("datatype")
        datatype = BY_WIRE_NAME.get(wire_type) if isinstance(wire_type, str) else None
        if datatype is None:
            raise _bad(f"input '{name}': unknown datatype {wire_type!r}")
        shape, count = _shape(raw.get("shape"), name, datatype)
        params = raw.get("parameters")
        if type(params) is not dict:  # (the message is built only when it is needed)
            params = {} if params is None else _parameters(params, f"input '{name}'")
        binary_size = params.get("binary_data_size")
        where = placement(params, name, grpc=False) if params and REGION in params else None
        has_data = "data" in raw
        if has_data + (binary_size is not None) + (where is not None) != 1:
            raise _bad(messages.input_data_fields(has_data, binary_size is not None, where is not None))
        if where is not None:
            if input_placements is None:
                input_placements = {}
            input_placements[name] = where
            data = _EMPTY  # read from the region by the service
        elif binary_size is not None:
            if type(binary_size) is not int or binary_size < 0:
                raise _bad(f"input '{name}': 'binary_data_size' must be a non-negative integer")
            end = offset + binary_size
            if end > size:
                raise _bad(
                    f"input '{name}': binary_data_size {binary_size} runs past the end of the "
                    f"body ({size - offset} bytes remain)"
                )
            chunk = view[offset:end]
            offset = end
            data = array_from_raw(chunk, datatype, shape, count, name, "binary_data_size is")
        else:
            data = _json_array(raw["data"], datatype, shape, count, name)
        inputs.append(Tensor(name, datatype, shape, data, params))
    if offset != size:
        raise _bad(
            f"inference request body has {size - offset} bytes after the last binary input; "
            "Inference-Header-Content-Length or binary_data_size is wrong"
        )

    outputs: list[RequestedOutput] | None = None
    raw_outputs = header.get("outputs")
    if raw_outputs == []:
        raw_outputs = None  # an empty list asks for nothing in particular: every output
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise _bad("'outputs' must be a list")
        outputs = []
        for raw in raw_outputs:
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                raise _bad("each of 'outputs' must be an object with a 'name'")
            out_name = raw["name"]
            out_params = raw.get("parameters")
            if type(out_params) is not dict:
                out_params = {} if out_params is None else _parameters(out_params, f"output '{out_name}'")
            if out_params and REGION in out_params:
                if "classification" in out_params:
                    raise _bad(messages.shm_with_classification())
                if out_params.get("binary_data") is True:
                    raise _bad(messages.SHM_WITH_BINARY_DATA)
                where = placement(out_params, out_name, grpc=False)
                if where is not None:
                    if output_placements is None:
                        output_placements = {}
                    output_placements[out_name] = where
            outputs.append(RequestedOutput(out_name, out_params))
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise _bad("'id' must be a string")
    return InferenceRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=inputs,
        outputs=outputs,
        id=request_id,
        parameters=_parameters(header.get("parameters"), "inference request"),
        input_placements=input_placements,
        output_placements=output_placements,
    )


#: Triton's JSON tokens for non-finite floats (orjson would write ``null``).
_NAN, _INF, _NEG_INF = b"NaN", b"Infinity", b"-Infinity"


def _finite(flat: np.ndarray[Any, Any]) -> bool:
    """Whether a float array has only finite values. A few values are summed in Python (a
    third of numpy's fixed cost; a sum that overflows only costs the exact check after)."""
    if flat.size <= 64:
        return math.isfinite(sum(flat.tolist()))
    return bool(np.isfinite(flat).all())


def _nonfinite_data(flat: np.ndarray[Any, Any]) -> Any:
    """A float array's JSON with Triton's tokens for non-finite values: its HTTP server writes
    with rapidjson's ``kWriteNanAndInfFlag`` (``NaN``, ``Infinity``, ``-Infinity``), which
    ``tritonclient`` (python-rapidjson) and Python's ``json`` read back. orjson writes each
    non-finite element of a float array as ``null`` (and nothing else is ``null`` there), so
    the nulls are replaced in order."""
    bad = flat[~np.isfinite(flat)]
    if not bad.size:
        return flat  # the sum overflowed: all finite after all
    parts = orjson.dumps(flat, option=orjson.OPT_SERIALIZE_NUMPY).split(b"null")
    if len(parts) != bad.size + 1:  # pragma: no cover - orjson wrote something unexpected
        return orjson.Fragment(json.dumps(flat.tolist()).encode())
    out = [parts[0]]
    for value, part in zip(bad.tolist(), parts[1:], strict=True):
        out.append(_NAN if value != value else _INF if value > 0 else _NEG_INF)
        out.append(part)
    return orjson.Fragment(b"".join(out))


def _json_data(tensor: Tensor) -> Any:
    data = tensor.data
    if tensor.datatype is DataType.BYTES:
        flat = data.reshape(-1)
        if flat.size <= _JSON_CHUNK:
            return _json_strings(flat)
        out: list[str] = []  # a chunk at a time, as _dumps_response writes them
        for start in range(0, flat.size, _JSON_CHUNK):
            out.extend(_json_strings(flat[start : start + _JSON_CHUNK]))
        return out
    if tensor.datatype is DataType.BF16:
        return data.astype(np.float32).reshape(-1)
    return data.reshape(-1)


def _json_strings(flat: np.ndarray[Any, Any]) -> list[str]:
    items = flat.tolist()
    kinds = set(map(type, items))
    if kinds == {str}:
        return items  # type: ignore[no-any-return]
    if kinds == {bytes}:
        return [v.decode("utf-8", errors="replace") for v in items]
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in items]


def _binary_data(tensor: Tensor) -> bytes:
    if not tensor.datatype.itemsize:  # BYTES (reading DataType.BYTES costs more than this)
        return serialize_bytes(tensor.data)
    return np.ascontiguousarray(tensor.data).tobytes()


def _binary_outputs(request: InferenceRequest) -> tuple[bool, dict[str, bool]]:
    """Whether outputs go binary by default, and for the outputs the request names."""
    binary_default = request.raw or bool(request.parameters.get("binary_data_output", False))
    wanted: dict[str, bool] = {}
    if request.outputs is not None:
        for requested in request.outputs:
            flag = requested.parameters.get("binary_data")
            wanted[requested.name] = binary_default if flag is None else bool(flag)
    return binary_default, wanted


# -- costs: how long decode_request and encode_response take, roughly ---------------------
#
# The frontends decode and encode on a thread when these say the work is long enough to
# hold the event loop (frontends/offload.py). Nanoseconds, measured on the dev machine and
# rounded up: parsing JSON about 8 per byte; a BYTES element about 250 (64 per byte of its
# binary data: an element is at least 4); a JSON or BYTES element on the way out about 100;
# copying about 0.5 per byte. A binary tensor of a fixed-size type is a view: no work.


#: Up to this, encode_cost answers its upper bound (at most 0.1 ms: no need to be precise).
_SMALL_COST = 100_000


def decode_cost(body: bytes, header_length: int | None) -> int:
    """About the nanoseconds :func:`decode_request` takes for this body. A binary part is
    costed as BYTES when the JSON header could ask for them: it says ``BYTES``, or it has
    an escape, which could spell it."""
    size = len(body)
    json_size = header_length if header_length is not None and 0 <= header_length <= size else size
    cost = 8 * json_size
    if json_size < size and (
        body.find(b"BYTES", 0, json_size) >= 0 or body.find(b"\\", 0, json_size) >= 0
    ):
        cost += 64 * (size - json_size)
    return cost


def encode_cost(response: InferenceResponse, request: InferenceRequest) -> int:
    """About the nanoseconds :func:`encode_response` takes for this response."""
    bound = 0  # 100 per element is the most any output costs (binary: at most 4 per element)
    for tensor in response.outputs:
        data: Any = tensor.data
        if isinstance(data, np.ndarray):
            bound += 100 * data.size
    if bound <= _SMALL_COST:
        return bound
    binary_default, wanted = _binary_outputs(request)
    cost = 0
    for tensor in response.outputs:
        data = tensor.data
        if not isinstance(data, np.ndarray):
            continue
        if tensor.datatype is not DataType.BYTES and wanted.get(tensor.name, binary_default):
            cost += data.nbytes // 2
        else:
            cost += 100 * data.size
    return cost


def encode_response(
    response: InferenceResponse, request: InferenceRequest
) -> tuple[bytes, int | None]:
    """Serialise a response; returns the body and the JSON header length if binary follows."""
    binary_default, wanted = _binary_outputs(request)
    outputs: list[dict[str, Any]] = []
    buffers: list[bytes] = []
    in_regions = response.shared_memory_outputs
    for tensor in response.outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype.wire,
            "shape": list(tensor.shape),
        }
        if in_regions and tensor.name in in_regions:
            pass  # written into the client's shared-memory region: metadata only
        elif wanted.get(tensor.name, binary_default):
            raw = _binary_data(tensor)
            entry["parameters"] = {"binary_data_size": len(raw)}
            buffers.append(raw)
        else:
            data = _json_data(tensor)
            if tensor.datatype is not DataType.BYTES and data.dtype.kind == "f" and not _finite(data):
                data = _nonfinite_data(data)
            entry["data"] = data
        outputs.append(entry)
    body: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id:
        body["id"] = response.id
    if response.parameters:
        body["parameters"] = response.parameters
    body["outputs"] = outputs
    header = _dumps_response(body)
    if not buffers:
        return header, None
    return b"".join([header, *buffers]), len(header)


#: JSON ``data`` of more elements is written this many at a time (see _dumps_response).
_JSON_CHUNK = 1 << 16


def _data_length(entry: dict[str, Any]) -> int:
    """Elements of an output's JSON ``data``; 0 for data already written (the ``orjson.Fragment``
    of an output with non-finite values), which goes out as it is."""
    data = entry.get("data", ())
    return 0 if isinstance(data, orjson.Fragment) else len(data)


def _dumps_response(body: dict[str, Any]) -> bytes:
    """``orjson.dumps(body)``, byte for byte; ``outputs`` (the last key) with long ``data``
    are written a chunk at a time, so that no single call holds the GIL (and the event
    loop, when this runs on a codec thread) for the whole of a large response."""
    outputs: list[dict[str, Any]] = body["outputs"]
    for entry in outputs:
        if _data_length(entry) > _JSON_CHUNK:
            break
    else:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    option = orjson.OPT_SERIALIZE_NUMPY
    parts = [orjson.dumps({**body, "outputs": []}, option=option)[:-2]]  # ... "outputs":[
    for index, entry in enumerate(outputs):
        if index:
            parts.append(b",")
        data = entry.get("data", ())
        if _data_length(entry) <= _JSON_CHUNK:
            parts.append(orjson.dumps(entry, option=option))
            continue
        meta = {key: value for key, value in entry.items() if key != "data"}  # data is last
        parts.append(orjson.dumps(meta, option=option)[:-1] + b',"data":[')
        parts.append(
            b",".join(
                orjson.dumps(data[start : start + _JSON_CHUNK], option=option)[1:-1]
                for start in range(0, len(data), _JSON_CHUNK)
            )
        )
        parts.append(b"]}")
    parts.append(b"]}")
    return b"".join(parts)


def encode_json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
