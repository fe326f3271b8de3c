"""Hypothesis strategies of hostile values for the fuzz suite (``tests/integration/test_fuzz_*``).

Everything a careless or hostile client can put on the wire: JSON texts that are not quite
JSON (NaN tokens, huge numbers, lone surrogates, nesting past every limit), wrong types for
every field, model names and versions that try to leave their folder, shapes of rank 0..100
with zero, negative and 2**63 dimensions, datatypes that do not exist, binary sizes and
header lengths that lie, BYTES elements whose length prefixes lie, parameters of every type.

Inference requests are built in two steps: a *valid* request for one of the served models
(:func:`valid_requests`, an abstract :class:`Req` either transport can encode), then 0..3
hostile mutations of it (:func:`mutated_requests`), so the fuzzer reaches every check in the
decoding and validation path, not only the first one that refuses garbage.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

# -- JSON that is not quite JSON ------------------------------------------------------------


class Raw(bytes):
    """JSON text emitted verbatim by :func:`dumps` (a token, or nesting too deep to build)."""


#: Tokens a strict parser must refuse (or accept) without crashing: non-standard numbers,
#: numbers past every float and integer, lone surrogates, invalid UTF-8, truncated structure.
JSON_TOKENS = [
    b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"1e999", b"-1e999", b"1E-400",
    b"-0", b"-0.0", b"0e0", b"123456789012345678901234567890", b"-123456789012345678901234567890",
    b"18446744073709551616", b"9223372036854775808", b"-9223372036854775809", b"01", b"+1", b".5",
    b"1.", b"0x10", b"1_000", b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\u0000"', b'"\xff\xfe"',
    b'"\xc0\xae"', b'"\\x41"', b"'single'", b"[", b"{", b"]", b"}", b'"', b"", b"1 2", b"[1,]",
    b'{"a":1,}', b'{"a":1,"a":2}', b"[1 2]", b"tru", b"nul", b"None", b"undefined", b"\x00",
    b'"' + b"\\\\" * 50 + b'"',
]

#: Depths around the limits of parsers and recursion (Triton limits JSON nesting to 100).
NESTING_DEPTHS = [64, 65, 99, 100, 101, 127, 128, 254, 255, 256, 500, 999, 1000, 1023, 1024, 1025, 5000]


def nested(depth: int, kind: str, leaf: bytes = b'"x"') -> Raw:
    """JSON text nested ``depth`` deep: lists, objects, or both alternating."""
    if kind == "list":
        return Raw(b"[" * depth + leaf + b"]" * depth)
    if kind == "object":
        return Raw(b'{"a":' * depth + leaf + b"}" * depth)
    opens = b"".join(b'[{"a":' if i % 2 else b"[" for i in range(depth))
    closes = b"".join(b"}]" if i % 2 else b"]" for i in reversed(range(depth)))
    return Raw(opens + leaf + closes)


def deep_json() -> st.SearchStrategy[Raw]:
    return st.builds(
        nested,
        st.sampled_from(NESTING_DEPTHS),
        st.sampled_from(["list", "object", "mixed"]),
        st.sampled_from([b'"x"', b"1", b"1.5", b"true", b"null", b"[]", b"{}"]),
    )


#: Integers at the edges of every width a server might store them in.
INTERESTING_INTS = [
    0, 1, -1, 2, 3, 4, 7, 8, 9, 16, 17, 100, 127, 128, 255, 256, 1000, 2**15 - 1, 2**15, 2**16,
    2**24, 2**31 - 1, 2**31, -(2**31), 2**32 - 1, 2**32, 2**53, 2**53 + 1, 2**62, 2**63 - 1,
    2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, -(10**30), 10**400,
]


def ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(INTERESTING_INTS), st.integers())


def long_strings() -> st.SearchStrategy[str]:
    return st.sampled_from([256, 4096, 65_536, 300_000]).flatmap(
        lambda n: st.sampled_from(["x" * n, "é" * (n // 2), "\x00" * n, "../" * (n // 3)])
    )


def json_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        ints(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.sampled_from(JSON_TOKENS).map(Raw),
        deep_json(),
        long_strings(),
    )


#: Field names of every body Quiver reads: the fuzzer's random objects use them often.
KNOWN_KEYS = [
    "inputs", "outputs", "name", "datatype", "shape", "data", "parameters", "id",
    "binary_data_size", "binary_data", "binary_data_output", "classification", "sequence_id",
    "sequence_start", "sequence_end", "priority", "timeout", "shared_memory_region",
    "shared_memory_byte_size", "shared_memory_offset", "ready", "config", "file:1/model.onnx",
    "file:1/model.py", "unload_dependents", "log_file", "log_info", "log_warning", "log_error",
    "log_verbose_level", "log_format", "model_name", "url", "max_results", "next_page_token",
]


def json_keys() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12))


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value, and some that are not quite JSON (see :class:`Raw`)."""
    return st.recursive(
        json_leaves(),
        lambda children: st.one_of(
            st.lists(children, max_size=5), st.dictionaries(json_keys(), children, max_size=5)
        ),
        max_leaves=max_leaves,
    )


def dumps(value: Any) -> bytes:
    """Serialise what :func:`json_values` draws: NaN and infinities as the ``NaN`` and
    ``Infinity`` tokens (as Python's ``json`` writes them), :class:`Raw` verbatim."""
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, float):
        if math.isnan(value):
            return b"NaN"
        if math.isinf(value):
            return b"Infinity" if value > 0 else b"-Infinity"
        return repr(value).encode()
    if isinstance(value, list | tuple):
        return b"[" + b",".join(dumps(v) for v in value) + b"]"
    if isinstance(value, dict):
        return b"{" + b",".join(dumps(str(k)) + b":" + dumps(v) for k, v in value.items()) + b"}"
    if isinstance(value, np.generic):
        return dumps(value.item())
    return json.dumps(value).encode()


# -- names, versions, paths ------------------------------------------------------------------

#: Model names that try to leave their folder, break a filesystem call, or confuse a parser,
#: by kind (the fuzzer picks a kind, then a name, so each kind is tried often).
HOSTILE_NAME_KINDS = {
    "traversal": [
        "", ".", "..", "...", "../simple", "simple/..", "./simple", "..\\simple", "a/b", "a\\b", "%2e%2e",
        "..%2f..%2fetc", "/etc/passwd", "/dev/zero", "/proc/self/environ", "../../../../tmp/x",
    ],
    "control": ["simple\x00", "\x00", "\x00..", "a\x00b", "\n", "\r\n", "\t", "\u202e", "\ufeffsimple", "\x7f"],
    "long": ["a" * 255, "a" * 256, "a" * 1024, "a" * 5000, "\u00e9" * 200, "\u6a21" * 100, "a" * 300 + ".tar.gz", "a/" * 2100],
    "odd": [
        "\u6a21\u578b", "\U0001f600", " ", "simple ", " simple", "SIMPLE", "con", "nul", "-1", "*", "?", "#", "%", "~",
        "$HOME", "${jndi:x}", "'", '"', "<script>", "a;b", "a b",
    ],
    "keys": [
        "simple.tar.gz", "x.tar.gz", "x.tgz", "x.tar", "../x.tar.gz", ".hidden.tar.gz", "a..b.tar.gz",
        "s3://bucket/key", "file:///etc", "a::b", "simple::x", "::", "::simple", "pipeline::add_one", "-x.tar.gz",
    ],
    "special": ["broken", "victim", "pipeline", "add_one", "acc", "double"],
}
HOSTILE_NAMES = [name for names in HOSTILE_NAME_KINDS.values() for name in names]


def hostile_names() -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(HOSTILE_NAME_KINDS)).flatmap(lambda kind: st.sampled_from(HOSTILE_NAME_KINDS[kind]))


#: Versions: negative, zero, huge, not numbers, and digits that ``str.isdigit`` accepts
#: but ``int`` does not (superscripts) or reads as another number (Arabic-Indic digits).
HOSTILE_VERSIONS = [
    "", "-1", "0", "1", "2", "3", "01", "+1", "-0", "1.0", "1e9", "1000000000", "2147483648",
    "9223372036854775808", "99999999999999999999999999", "abc", " 1", "1 ", "0x1", "\u00b2", "\u0661",
    "\uff11", "\x00", "1\x00", "-2147483649", "NaN", "\u221e", "\u0663",
]


def model_names(real: list[str], *, exclude: tuple[str, ...] = ()) -> st.SearchStrategy[str]:
    """Names of served models, hostile names, and random text; never one in ``exclude``."""
    return st.one_of(st.sampled_from(real), hostile_names(), st.text(max_size=30)).filter(lambda n: n not in exclude)


def versions() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(HOSTILE_VERSIONS), st.integers(-3, 5).map(str), st.text(max_size=8))


def served_version(version: str) -> bool:
    """Whether a request may name ``version`` and be served: every model of the fuzzed
    repositories serves version 1 only, and "" means the latest. Triton reads versions with
    ``std::stoll``, so " 1", "1 ", "+1" and "01" are 1 too; anything else (0, negative, 2,
    not a decimal integer, digits of other scripts) must be refused: versions are positive
    integers."""
    text = version.strip().removeprefix("+")
    return version == "" or (text.isascii() and text.isdigit() and int(text) == 1)


#: Path segments sent as they are (not percent-encoded by the fuzzer): traversal in its
#: encoded forms, NUL, overlong UTF-8, broken escapes.
RAW_SEGMENTS = [
    "..", ".", "%2e%2e", "%2E%2E", ".%2e", "%2e.", "%2f", "%2F", "..%2f", "%00", "a%00b", "%ff",
    "%c0%ae%c0%ae", "%", "%zz", "%2", "a%2fb", ";", ";a=b", "%3b", "~", "%25", "%252e%252e",
    "%u002e", "a" * 8000, "%e6%a8%a1", "%f0%9f%98%80", "%0a", "%0d%0a", "%09", "%20",
]


def path_segments(real: list[str], *, exclude: tuple[str, ...] = ()) -> st.SearchStrategy[str]:
    """One path segment naming a model: a name percent-encoded, or a raw hostile segment."""
    return st.one_of(
        model_names(real, exclude=exclude).map(lambda n: quote(n, safe="")),
        st.sampled_from(RAW_SEGMENTS),
    ).filter(lambda s: s not in exclude)


def query_strings() -> st.SearchStrategy[str]:
    value = st.one_of(
        st.sampled_from(["", "0", "-1", "1", "1000", "1001", "1e3", "abc", "%00", "%ff", "9" * 40, "%C2%B2", "%D9%A1"]),
        st.text(max_size=10).map(lambda t: quote(t, safe="")),
    )
    key = st.sampled_from(["max_results", "next_page_token", "x", "", "max_results[]"])
    pair = st.tuples(key, value).map(lambda kv: f"{kv[0]}={kv[1]}")
    return st.lists(st.one_of(pair, st.sampled_from(["&", "=", "==", "a", "%"])), max_size=4).map("&".join)


# -- datatypes, shapes, values ------------------------------------------------------------------

DATATYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
    "FP32", "FP64", "BYTES", "BF16",
]
BOGUS_DATATYPES = ["", "FP8", "int32", "fp32", "STRING", "TYPE_FP32", "BYTES\x00", "INT128", " FP32", "FP32 "]

_NUMPY = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype(np.uint8), "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32), "UINT64": np.dtype(np.uint64), "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16), "INT32": np.dtype(np.int32), "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16), "FP32": np.dtype(np.float32), "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16), "BYTES": np.dtype(object),
}


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    return _NUMPY[datatype]


def datatypes() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(DATATYPES), st.sampled_from(BOGUS_DATATYPES), st.text(max_size=6))


#: Dimensions: zero, small, negative, and past every integer width.
HOSTILE_DIMS = [0, 1, 2, 3, 4, 8, 16, 17, -1, -2, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1]


def dims(*, wide: bool = True) -> st.SearchStrategy[int]:
    """One dimension; ``wide`` adds values past int64 (JSON can carry them, protobuf cannot)."""
    extra = [2**63, 2**64, 10**30, -(2**63)] if wide else [-(2**63)]
    return st.one_of(st.integers(0, 5), st.sampled_from(HOSTILE_DIMS + extra))


def shapes(*, wide: bool = True) -> st.SearchStrategy[list[int]]:
    """Rank 0..100, mostly small: 0..4, 63..66 (numpy's limit is 64) or 100."""
    rank = st.one_of(st.integers(0, 4), st.sampled_from([5, 8, 32, 63, 64, 65, 66, 100]))
    return rank.flatmap(lambda r: st.lists(dims(wide=wide), min_size=r, max_size=r))


#: Dimensions past what a buffer can hold: with a zero beside them the count is still 0.
HUGE_DIMS = [2**31, 2**32, 2**62, 2**63 - 1]
HUGER_DIMS = [2**63, 2**64, 10**30]


@st.composite
def _zero_shapes(draw: st.DrawFn, huge: list[int]) -> list[int]:
    rank = draw(st.sampled_from([1, 2, 3, 4, 32, 63, 64, 65, 66, 100]))
    dims = [draw(st.sampled_from([*huge, 1, 3])) for _ in range(min(rank - 1, 3))]
    dims += [dims[-1] if dims else 1] * (rank - 1 - len(dims))
    dims.insert(draw(st.integers(0, rank - 1)), 0)
    return dims


def shapes_like(count: int, *, wide: bool = True) -> st.SearchStrategy[list[int]]:
    """Shapes whose element count is still ``count`` (so the data agrees with them): the
    rank lifted with ones up to 0..100, split around ones, or (dropping the data) a zero
    beside huge dimensions."""
    huge = HUGE_DIMS + (HUGER_DIMS if wide else [])
    ranks = st.sampled_from([0, 1, 2, 3, 4, 32, 63, 64, 65, 66, 100])
    lifted = ranks.map(lambda r: [1] * max(0, r - 1) + [count] if r or count != 1 else [])
    return st.one_of(lifted, st.just([1, count, 1]), _zero_shapes(huge))


def values(datatype: str, count: int) -> st.SearchStrategy[list[Any]]:
    """``count`` valid values of ``datatype`` (Python scalars; BYTES as str)."""
    if datatype == "BOOL":
        element: st.SearchStrategy[Any] = st.booleans()
    elif datatype == "BYTES":
        element = st.text(max_size=12)
    elif datatype.startswith(("INT", "UINT")):
        info = np.iinfo(_NUMPY[datatype])
        element = st.integers(int(info.min), int(info.max))
    elif datatype == "FP16":
        element = st.floats(-65504, 65504, width=16)
    elif datatype in ("FP32", "BF16"):
        bound = float(np.float32(1e30))
        element = st.floats(-bound, bound, width=32)
    else:
        element = st.floats(allow_nan=False, allow_infinity=False)
    return st.lists(element, min_size=count, max_size=count)


def serialize_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def raw_encode(datatype: str, flat: list[Any]) -> bytes:
    """Triton's raw wire form of ``flat`` values (BYTES length-prefixed)."""
    if datatype == "BYTES":
        return serialize_bytes([v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in flat])
    return np.asarray(flat, dtype=_NUMPY[datatype]).tobytes()


# -- abstract inference requests ---------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    datatype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """What the fuzzer knows of a served model, to build requests it accepts."""

    name: str
    max_batch_size: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    #: A valid request must be answered 200 (not, e.g., a sequence model needing a sequence id).
    always_ok: bool = True


@dataclass
class In:
    name: Any
    datatype: Any
    shape: Any
    flat: list[Any]
    #: "json" (``data``), "binary" (HTTP binary extension / gRPC raw), or "contents" (gRPC typed).
    form: str = "json"
    raw: bytes = b""
    parameters: dict[str, Any] = field(default_factory=dict)
    #: HTTP only: what goes in ``data`` instead of ``flat`` (deep nesting, wrong types).
    data: Any = None


@dataclass
class Out:
    name: Any
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Req:
    model: str
    version: str = ""
    inputs: list[In] = field(default_factory=list)
    outputs: list[Out] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    id: Any = ""
    #: The mutations applied (empty: the request is valid for ``model``).
    mutations: list[str] = field(default_factory=list)
    #: HTTP only: JSON-level damage applied after encoding, and header or body lies.
    http_edits: list[tuple[str, Any]] = field(default_factory=list)


@st.composite
def valid_requests(draw: st.DrawFn, catalog: list[ModelSpec], *, forms: tuple[str, ...] = ("json", "binary")) -> Req:
    """A request ``model`` accepts: right names, datatypes, shapes, a batch within bounds."""
    spec = draw(st.sampled_from(catalog))
    batch = draw(st.integers(1, min(spec.max_batch_size, 3))) if spec.max_batch_size else 0
    free = {}  # one size per variable dimension, shared by the inputs (add_sub and friends)
    inputs = []
    for name, tensor in spec.inputs.items():
        shape = []
        for index, dim in enumerate(tensor.dims):
            if dim == -1:
                free.setdefault(index, draw(st.integers(0 if not batch else 1, 4)))
                shape.append(free[index])
            else:
                shape.append(dim)
        full = ([batch] if batch else []) + shape
        count = math.prod(full)
        flat = draw(values(tensor.datatype, count))
        form = draw(st.sampled_from(forms))
        if tensor.datatype == "BF16" and form == "contents":
            form = "binary"  # BF16 (and FP16) only travel raw over gRPC
        if tensor.datatype == "FP16" and form == "contents":
            form = "binary"
        raw = raw_encode(tensor.datatype, flat) if form == "binary" else b""
        inputs.append(In(name, tensor.datatype, full, flat, form, raw))
    outputs = None
    if draw(st.booleans()):
        outputs = []
        for name in draw(st.lists(st.sampled_from(sorted(spec.outputs)), unique=True, max_size=len(spec.outputs))):
            params: dict[str, Any] = {}
            if draw(st.booleans()):
                params["binary_data"] = draw(st.booleans())
            outputs.append(Out(name, params))
    parameters: dict[str, Any] = {}
    if draw(st.booleans()):
        parameters["binary_data_output"] = draw(st.booleans())
    request_id = draw(st.one_of(st.just(""), st.text(max_size=10)))
    return Req(spec.name, "", inputs, outputs, parameters, request_id)


#: Parameter names Quiver reads, at the request, input and output levels.
PARAMETER_KEYS = [
    "sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output",
    "binary_data", "binary_data_size", "classification", "shared_memory_region",
    "shared_memory_byte_size", "shared_memory_offset", "layout", "headers", "triton_enable_empty_final_response",
]


def parameter_values() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.booleans(), ints(), st.floats(), st.text(max_size=10), st.none(),
        st.sampled_from(["true", "1", "-1", "", "\x00"]), json_values(max_leaves=4),
    )


def parameter_maps() -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.one_of(st.sampled_from(PARAMETER_KEYS), st.text(max_size=8)), parameter_values(), max_size=4)


def _pick(draw: st.DrawFn, items: list[Any]) -> int:
    return draw(st.integers(0, len(items) - 1))


#: Groups of mutation kinds, for tests that focus on one part of the request.
SHAPE_KINDS = ("shape", "shape_keeps_count", "shape_keeps_count", "datatype", "raw", "bytes_prefix", "binary_size", "values", "form")
NESTING_KINDS = ("deep", "deep", "params", "outputs", "classify", "field")
NAME_KINDS = ("model", "version", "name", "drop_input", "dup_input")


@st.composite
def mutate(draw: st.DrawFn, request: Req, *, http: bool = True, only: tuple[str, ...] = ()) -> Req:
    """One hostile change to ``request`` (a copy); its name goes in ``mutations``."""
    req = replace(
        request,
        inputs=[replace(i, parameters=dict(i.parameters), flat=list(i.flat)) for i in request.inputs],
        outputs=None if request.outputs is None else [replace(o, parameters=dict(o.parameters)) for o in request.outputs],
        parameters=dict(request.parameters),
        mutations=list(request.mutations),
        http_edits=list(request.http_edits),
    )
    kinds = ["shape", "shape_keeps_count", "shape_keeps_count", "datatype", "name", "raw", "bytes_prefix",
             "params", "outputs", "classify", "drop_input", "dup_input", "model", "version", "form", "values"]
    if http:
        kinds += ["field", "field", "binary_size", "header_length", "body_tail", "deep", "deep"]
    if only:
        kinds = [k for k in only if k in kinds]
    kind = draw(st.sampled_from(kinds))
    target = req.inputs[_pick(draw, req.inputs)] if req.inputs else None
    if kind == "shape" and target is not None:
        target.shape = draw(shapes(wide=http))
    elif kind == "shape_keeps_count" and target is not None:
        target.shape = draw(shapes_like(len(target.flat), wide=http))
        if math.prod(target.shape) == 0:
            target.flat, target.raw = [], b""
    elif kind == "datatype" and target is not None:
        target.datatype = draw(datatypes())
    elif kind == "name" and target is not None:
        target.name = draw(st.one_of(st.text(max_size=10), st.sampled_from(["", "INPUT0", "INPUT1", "OUTPUT0", "\x00"])))
    elif kind == "raw" and target is not None:
        target.form = "binary"
        how = draw(st.sampled_from(["random", "truncate", "extend", "empty"]))
        if how == "random":
            target.raw = draw(st.binary(max_size=64))
        elif how == "truncate":
            target.raw = target.raw[: draw(st.integers(0, max(0, len(target.raw) - 1)))]
        elif how == "extend":
            target.raw = target.raw + draw(st.binary(min_size=1, max_size=16))
        else:
            target.raw = b""
    elif kind == "bytes_prefix" and target is not None:
        # a BYTES buffer whose length prefixes lie (for any datatype: garbage where numbers go)
        count = draw(st.integers(0, 4))
        prefix = draw(st.sampled_from([0, 1, 3, 4, 5, 2**31 - 1, 2**31, 2**32 - 1]))
        body = draw(st.binary(max_size=8))
        target.form = "binary"
        target.raw = struct.pack("<I", prefix) * count + body
    elif kind == "params":
        where = draw(st.sampled_from(["request", "input", "output"]))
        params = draw(parameter_maps())
        if where == "request":
            req.parameters.update(params)
        elif where == "input" and target is not None:
            target.parameters.update(params)
        else:
            req.outputs = (req.outputs or []) + [Out(draw(st.sampled_from(["OUTPUT0", "OUTPUT", "x"])), params)]
    elif kind == "outputs":
        outs = draw(st.lists(st.tuples(st.one_of(st.text(max_size=8), st.sampled_from(["OUTPUT0", "OUTPUT1", "OUTPUT", "UPPER", "DOUBLED"])), parameter_maps()), max_size=4))
        req.outputs = [Out(n, {"classification": draw(parameter_values()), **p} if draw(st.booleans()) else p) for n, p in outs]
    elif kind == "classify":
        # top-k of an output: of every output, with k at the edges (the outputs may be empty)
        names = [o.name for o in req.outputs or []] or ["OUTPUT0", "OUTPUT", "UPPER", "DOUBLED", "OUTPUT1"]
        k = draw(st.sampled_from([0, 1, 2, 10, 11, 2**31, 2**63 - 1, -1]))
        req.outputs = [Out(name, {"classification": k}) for name in names]
    elif kind == "drop_input" and req.inputs:
        del req.inputs[_pick(draw, req.inputs)]
    elif kind == "dup_input" and target is not None:
        req.inputs.append(replace(target))
    elif kind == "model":
        req.model = draw(st.one_of(
            st.sampled_from(["broken", "victim", "acc", "pipeline", "add_one", "double", "identity_bf16", "classifier", "string_upper", "identity_2d_fp32"]),
            hostile_names(),
        ))
    elif kind == "deep":
        depth = draw(st.sampled_from(NESTING_DEPTHS))
        where = draw(st.sampled_from(["data", "request", "input", "output"]))
        value = nested(depth, draw(st.sampled_from(["list", "object", "mixed"])), draw(st.sampled_from([b'"x"', b"1", b"1.5", b"true"])))
        if where == "data" and target is not None:
            target.form, target.data = "json", value
        elif where == "input" and target is not None:
            target.parameters[draw(st.sampled_from(PARAMETER_KEYS))] = value
        elif where == "output":
            req.outputs = (req.outputs or []) + [Out("OUTPUT0", {draw(st.sampled_from(PARAMETER_KEYS)): value})]
        else:
            req.parameters[draw(st.sampled_from(PARAMETER_KEYS))] = value
    elif kind == "version":
        req.version = draw(versions())
    elif kind == "form" and target is not None:
        target.form = draw(st.sampled_from(["json", "binary", "contents"] if not http else ["json", "binary"]))
        if target.form == "binary" and not target.raw:
            target.raw = draw(st.binary(max_size=32))
    elif kind == "values" and target is not None:
        target.flat = draw(st.lists(json_leaves(), max_size=6)) if http else draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6))
    elif kind == "field":
        req.http_edits.append(("field", None))
    elif kind == "binary_size" and target is not None:
        target.form = "binary"
        req.http_edits.append(("binary_size", (req.inputs.index(target), draw(st.one_of(st.integers(-5, 5).map(lambda d: ("delta", d)), st.tuples(st.just("value"), json_leaves()))))))
    elif kind == "header_length":
        req.http_edits.append(("header_length", draw(st.one_of(
            st.integers(-5, 5).map(lambda d: ("delta", d)),
            st.sampled_from(["-1", "0", "", " ", "abc", "1e3", "+5", "0x10", "99999999999999999999", "١٢", "²", "-0", "5 5"]).map(lambda v: ("value", v)),
        ))))
    elif kind == "body_tail":
        req.http_edits.append(("body_tail", draw(st.one_of(st.integers(1, 8).map(lambda n: -n), st.binary(min_size=1, max_size=16)))))
    else:
        req.mutations.append("noop")
        return req
    req.mutations.append(kind)
    return req


@st.composite
def mutated_requests(
    draw: st.DrawFn, catalog: list[ModelSpec], *, http: bool = True, mutations: tuple[int, int] = (0, 3), only: tuple[str, ...] = ()
) -> Req:
    """A valid request with ``mutations`` (min, max) hostile mutations, of the kinds in
    ``only`` if given."""
    forms = ("json", "binary") if http else ("contents", "binary")
    req = draw(valid_requests(catalog, forms=forms))
    for _ in range(draw(st.integers(*mutations))):
        req = draw(mutate(req, http=http, only=only))
    return req


#: SageMaker's content type for a JSON header followed by binary tensors.
BINARY_JSON = "application/vnd.sagemaker-triton.binary+json"


# -- HTTP encoding of a request -------------------------------------------------------------


@dataclass
class HttpBody:
    """An inference body for HTTP: the JSON header, the binary chunks after it, the headers,
    and a cut (bytes dropped from the end) or extra bytes appended."""

    req: Req
    header: Any
    chunks: list[bytes]
    headers: dict[str, str]
    cut: int = 0

    def body(self) -> bytes:
        data = dumps(self.header) + b"".join(self.chunks)
        return data[: len(data) - self.cut] if self.cut else data


def _http_data(tensor: In) -> Any:
    if tensor.data is not None:
        return tensor.data
    flat = tensor.flat
    shape = tensor.shape
    if (
        isinstance(shape, list)
        and 1 < len(shape) <= 4
        and all(type(d) is int and d > 0 for d in shape)
        and math.prod(shape) == len(flat)
    ):
        array = np.empty(len(flat), dtype=object)
        array[:] = flat
        return array.reshape(shape).tolist()  # nested, as tritonclient sends it
    return flat


def _replace_somewhere(draw: st.DrawFn, node: Any) -> Any:
    """``node`` with one random sub-value replaced, deleted, or given a random extra key."""
    if isinstance(node, dict) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node, key=str)))
        action = draw(st.sampled_from(["descend", "replace", "delete", "add"]))
        copy = dict(node)
        if action == "descend":
            copy[key] = _replace_somewhere(draw, node[key])
        elif action == "replace":
            copy[key] = draw(json_values(max_leaves=6))
        elif action == "delete":
            del copy[key]
        else:
            copy[draw(json_keys())] = draw(json_values(max_leaves=6))
        return copy
    if isinstance(node, list) and node and draw(st.booleans()):
        index = draw(st.integers(0, len(node) - 1))
        copy = list(node)
        action = draw(st.sampled_from(["descend", "replace", "delete"]))
        if action == "descend":
            copy[index] = _replace_somewhere(draw, node[index])
        elif action == "replace":
            copy[index] = draw(json_values(max_leaves=6))
        else:
            del copy[index]
        return copy
    return draw(json_values(max_leaves=6))


def http_encode(req: Req, draw: st.DrawFn | None = None) -> HttpBody:
    """The v2 JSON body (the binary extension for binary inputs), with ``req``'s HTTP edits
    (``draw`` makes the random JSON-level ones)."""
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for tensor in req.inputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        params = dict(tensor.parameters)
        if tensor.form == "binary":
            params.setdefault("binary_data_size", len(tensor.raw))
            chunks.append(tensor.raw)
        else:
            entry["data"] = _http_data(tensor)
        if params:
            entry["parameters"] = params
        inputs.append(entry)
    header: Any = {"inputs": inputs}
    if req.id:
        header["id"] = req.id
    if req.outputs is not None:
        header["outputs"] = [
            {"name": o.name, **({"parameters": o.parameters} if o.parameters else {})} for o in req.outputs
        ]
    if req.parameters:
        header["parameters"] = req.parameters
    encoded = HttpBody(req, header, chunks, {"Content-Type": "application/json"})
    length_edit: tuple[str, Any] | None = None
    for kind, arg in req.http_edits:
        if kind == "field" and draw is not None:
            encoded.header = _replace_somewhere(draw, encoded.header)
        elif kind == "binary_size":
            index, (how, value) = arg
            try:
                params = encoded.header["inputs"][index].setdefault("parameters", {})
            except (KeyError, IndexError, TypeError, AttributeError):
                continue
            if not isinstance(params, dict):
                continue
            if how == "delta":
                current = params.get("binary_data_size")
                params["binary_data_size"] = (current if type(current) is int else 0) + value
            else:
                params["binary_data_size"] = value
        elif kind == "header_length":
            length_edit = arg
        elif kind == "body_tail":
            if isinstance(arg, int):
                encoded.cut = -arg
            else:
                encoded.chunks.append(arg)
    if chunks or length_edit is not None:
        json_length = len(dumps(encoded.header))
        value = str(json_length)
        if length_edit is not None:
            how, edit = length_edit
            value = str(json_length + edit) if how == "delta" else edit
        encoded.headers["Inference-Header-Content-Length"] = value
        encoded.headers["Content-Type"] = "application/octet-stream"
    return encoded


@st.composite
def http_bodies(
    draw: st.DrawFn, catalog: list[ModelSpec], *, mutations: tuple[int, int] = (0, 3), only: tuple[str, ...] = ()
) -> HttpBody:
    """A valid v2 inference body for a model of ``catalog`` with hostile mutations (see
    :func:`mutated_requests`), encoded for HTTP (JSON, or JSON plus binary tensors)."""
    return http_encode(draw(mutated_requests(catalog, http=True, mutations=mutations, only=only)), draw)


def example_request(
    model: str,
    inputs: list[In],
    *,
    mutations: list[str],
    version: str = "",
    outputs: list[Out] | None = None,
    parameters: dict[str, Any] | None = None,
) -> Req:
    """A request written out by hand, for ``@example``: the known holes, always tried first."""
    return Req(model, version, inputs, outputs, dict(parameters or {}), "", list(mutations))
