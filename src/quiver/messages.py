"""Triton's error texts, in one place.

Client code and tests written against Triton match the wording of its common errors
("Request for unknown model", "JSON nesting depth exceeds maximum allowed limit (100)", ...).
Every such text Quiver answers with is built here, from Triton's own wording (its server's
``src/*.cc`` and core's ``src/*.cc``, and the texts its ``qa/`` tests assert), so the wording
lives in one module and the code that raises only says which error it is. Where Triton adds
context Quiver does not have (its request log prefix) the text starts at the words clients
match on; where Quiver knows more (the model, the tensor) it may add it after Triton's text.
"""

from __future__ import annotations

from collections.abc import Sequence


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


# -- raw binary requests (Inference-Header-Content-Length: 0) -----------------------------


def raw_input_count(given: int, configured: int, model: str) -> str:
    return (
        f"Raw request must only have 1 input (found {given}) to be deduced but got "
        f"{configured} inputs in '{model}' model configuration"
    )


def raw_input_variable_dims(name: str) -> str:
    return (
        f"The shape of the raw input '{name}' can not be deduced because there are more than "
        "one variable-sized dimension"
    )


def raw_input_bytes_shape(name: str) -> str:
    return f"For BYTE datatype raw input '{name}', the model must have input shape [1]"


def raw_input_too_large(size: int | str, limit: int) -> str:
    return (
        f"Raw input has a byte_size ({size} bytes) that exceeds the maximum allowed value of "
        f"{limit} bytes. Use --http-max-input-size to increase the limit."
    )


def input_byte_size_mismatch(name: str, model: str, expected: int, got: int) -> str:
    return (
        f"input byte size mismatch for input '{name}' for model '{model}'. Expected "
        f"{expected}, got {got}"
    )


# -- shared memory (server src/shared_memory_manager.cc, common.h/.cc) ---------------------

CLIENT_SHM_DISABLED = (
    "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to "
    "enable."
)


def shm_already_registered(name: str) -> str:
    return f"shared memory region '{name}' already in manager"


def shm_register_invalid(name: str) -> str:
    return f"failed to register shared memory region '{name}': invalid args"


def shm_register_failed(name: str, why: str) -> str:
    return f"failed to register shared memory region '{name}': {why}"


def shm_open_failed(key: str) -> str:
    return f"Unable to open shared memory region: '{key}'"


def shm_invalid_object(key: str) -> str:
    return f"Invalid shared memory region: '{key}'"


def shm_invalid_key(name: str, key: str) -> str:
    return f"cannot register shared memory region '{name}' - invalid shm key '{key}'"


def shm_reserved_key(name: str, key: str, prefix: str) -> str:
    return (
        f"cannot register shared memory region '{name}' with key '{key}' as the key contains "
        f"the reserved prefix '{prefix}'"
    )


def shm_not_found(name: str) -> str:
    return f"Unable to find shared memory region: '{name}'"


def shm_status_not_found(kind: str, name: str) -> str:
    return f"Unable to find {kind} shared memory region: '{name}'"


def shm_wrong_kind(name: str, registered: str, asked: str) -> str:
    return (
        f"The region named '{name}' is registered as {registered} shared memory, not {asked} "
        "shared memory"
    )


def shm_shrunk(name: str) -> str:
    return (
        f"shared memory region '{name}' is no longer its registered size: its object was made "
        "smaller after it was registered"
    )


def shm_invalid_offset(name: str) -> str:
    return f"Invalid offset for shared memory region: '{name}'"


def shm_invalid_extent(name: str) -> str:
    return f"Invalid offset + byte size for shared memory region: '{name}'"


def cuda_shm_unsupported(name: str) -> str:
    return f"failed to register CUDA shared memory region: '{name}', GPUs not supported"


def shm_output_too_small(name: str, given: int, needed: int) -> str:
    return (
        f"shared memory size specified with the request for output '{name}' ({given} bytes) "
        f"should be at least {needed} bytes to hold the results"
    )


def shm_with_classification(grpc: bool = False) -> str:
    return ("output" if grpc else "Output") + " can't set both 'shared_memory_region' and 'classification'"


SHM_WITH_BINARY_DATA = "Output can't set both 'shared_memory_region' and 'binary_data'"


def shm_param_type(param: str, tensor: str, expected: str) -> str:
    return (
        f"invalid value type for '{param}' parameter for tensor '{tensor}', expected {expected}."
    )


def shm_param_without_region(param: str, tensor: str) -> str:
    return (
        f"'{param}' can not be specified without 'shared_memory_region' parameter for tensor "
        f"'{tensor}'"
    )


def shm_byte_size_missing(tensor: str) -> str:
    return (
        "'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
        f"parameter for tensor '{tensor}'"
    )


def shm_input_with_contents(tensor: str, model: str) -> str:
    return (
        "unexpected 'content' provided when using shared memory for input tensor "
        f"'{tensor}' for model '{model}'"
    )


def input_data_fields(data: bool, binary: bool, shm: bool) -> str:
    """HTTP: an input must give exactly one of 'data', binary data, a region."""
    text = (
        "Input must set only one of the following fields: 'data', 'binary_data_size' in "
        "'parameters', 'shared_memory_region' in 'parameters'. But"
    )
    if not (data or binary or shm):
        return text + " no field is set"
    text += " set"
    for given, field in ((data, "data"), (binary, "binary_data_size"), (shm, "shared_memory_region")):
        if given:
            text += f" '{field}'"
    return text


def grpc_contents_with_raw(tensor: str, model: str) -> str:
    return (
        "contents field must not be specified when using raw_input_contents for "
        f"'{tensor}' for model '{model}'"
    )


def grpc_input_data_missing(tensor: str, model: str) -> str:
    return f"unable to find data for input tensor '{tensor}' for model '{model}' in request."


# -- header forwarding -----------------------------------------------------------------------


def header_reserved(key: str) -> str:
    return f"Header '{key}' is reserved for Triton usage and cannot be forwarded."


# -- HTTP bodies -----------------------------------------------------------------------------


def too_many_chunks(limit: int) -> str:
    return (
        f"Chunked request body exceeds maximum of {limit} non-empty chunks. Send fewer or larger "
        "HTTP chunks."
    )


# -- requests against the model configuration (core src/infer_request.cc, model.cc) ----------


def unexpected_input(name: str, model: str, expected: Sequence[str]) -> str:
    return (
        f"unexpected inference input '{name}' for model '{model}'"
        + (f"; it expects: {', '.join(expected)}" if expected else "; it expects no inputs")
    )


def unexpected_output(name: str, model: str, produced: Sequence[str]) -> str:
    return f"unexpected inference output '{name}' for model '{model}'; it has: {', '.join(produced)}"


def input_datatype(name: str, given: str, model: str, expected: str) -> str:
    return (
        f"inference input '{name}' data-type is '{given}', but model '{model}' expects "
        f"'{expected}'"
    )


def batch_size(limit: int, model: str, given: int, tensor: str) -> str:
    return f"inference request batch-size must be <= {limit} for '{model}' (got {given}, input '{tensor}')"


_BATCH_NOTE = (
    " NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension "
    "to be prepended to each input shape. If you want to specify the full shape including the "
    "batch dim in your input dims config, try setting max_batch_size to zero. See the model "
    "configuration docs for more info on max_batch_size."
)


def input_shape(name: str, model: str, expected: Sequence[int], got: Sequence[int], batching: bool) -> str:
    return (
        f"unexpected shape for input '{name}' for model '{model}'. Expected {_dims(expected)}, "
        f"got {_dims(got)}." + (_BATCH_NOTE if batching else "")
    )


def input_twice(name: str) -> str:
    return f"input '{name}' already exists in request"


def output_twice(name: str) -> str:
    return f"output '{name}' already exists in request"


def missing_inputs(required: int, total: int, given: Sequence[str], missing: Sequence[str], model: str) -> str:
    got = "[" + ",".join(f"'{n}'" for n in given) + "]"
    lacking = "[" + ",".join(f"'{n}'" for n in missing) + "]"
    count = f"expected {total} inputs" if required == total else f"expected number of inputs between {required} and {total}"
    return (
        f"{count} but got {len(given)} inputs for model '{model}'. Got input(s) {got}, but "
        f"missing required input(s) {lacking}. Please provide all required input(s)."
    )


def unknown_model(name: str) -> str:
    return f"Request for unknown model: '{name}' is not found"


# -- the repository API and restricted APIs -------------------------------------------------

LOAD_UNLOAD_NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"


def restricted(header: str, *, grpc: bool = False) -> str:
    """HTTP says "API", gRPC "protocol", as in Triton."""
    return f"This {'protocol' if grpc else 'API'} is restricted, expecting header '{header}'"
