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


def input_byte_size_mismatch(name: str, model: str, expected: int, got: int) -> str:
    return (
        f"input byte size mismatch for input '{name}' for model '{model}'. Expected "
        f"{expected}, got {got}"
    )
