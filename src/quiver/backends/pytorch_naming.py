"""How the PyTorch backend binds configured tensor names to ``forward()``'s arguments and
to the results (Triton's rules, listed in :mod:`quiver.backends.pytorch`), read from the
TorchScript schema.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from quiver.errors import ConfigError

logger = logging.getLogger("quiver.backends.pytorch")  # the backend's logger, as before the split

_INDEXED = re.compile(r"__(\d+)$")

# --- tensor naming ------------------------------------------------------------------------


def tensor_index(name: str) -> int | None:
    """The index in a ``<name>__<index>`` tensor name (``INPUT__0`` -> 0), else None."""
    match = _INDEXED.search(name)
    if match is None or name.find("__") != match.start():
        return None
    return int(match.group(1))


@dataclass(frozen=True, slots=True)
class InputBinding:
    """How configured inputs reach ``forward``: by position, or all in one dict."""

    convention: str  # "forward_argument", "named_index", "config_order", "dict"
    positions: dict[str, int]  # input name -> argument position (ignored for "dict")
    arity: int  # number of forward arguments (1 for "dict")


def bind_inputs(
    names: list[str], arguments: list[tuple[str, str]], model: str, source: str
) -> InputBinding:
    """Map input names to forward() arguments by Triton's rules.

    ``arguments`` are forward's ``(name, kind)`` without ``self``; kind is the TorchScript type
    kind (``TensorType``, ``ListType``, ``DictType``, ...).
    """
    if not names:
        raise ConfigError(
            f"{source}: model '{model}' declares no input; the PyTorch backend cannot "
            "auto-complete inputs (TorchScript models carry no tensor types), so config.pbtxt "
            "must list them"
        )
    if len(arguments) == 1 and arguments[0][1] == "DictType":
        return InputBinding("dict", dict.fromkeys(names, 0), 1)
    for arg, kind in arguments:
        if kind == "DictType":
            raise ConfigError(
                f"{source}: model '{model}': forward() argument '{arg}' is a Dict; only a single "
                "Dict[str, Tensor] argument, or arguments of type Tensor and List[str], are "
                "supported"
            )
        if kind not in ("TensorType", "ListType"):
            raise ConfigError(
                f"{source}: model '{model}': forward() argument '{arg}' has type {kind}; only "
                "Tensor and List[str] arguments (or a single Dict[str, Tensor]) are supported"
            )
    if len(arguments) != len(names):
        raise ConfigError(
            f"{source}: model '{model}': the configuration declares {len(names)} input(s) "
            f"({', '.join(names)}) but forward() takes {len(arguments)} "
            f"({', '.join(a for a, _ in arguments)})"
        )
    arg_names = [a for a, _ in arguments]
    if all(n in arg_names for n in names):
        return InputBinding(
            "forward_argument", {n: arg_names.index(n) for n in names}, len(arguments)
        )
    indices = [tensor_index(n) for n in names]
    if all(i is not None for i in indices):
        positions = {n: i for n, i in zip(names, indices, strict=True) if i is not None}
        _check_indices(positions, len(arguments), "input", model, source)
        return InputBinding("named_index", positions, len(arguments))
    if any("__" in n for n in names):
        logger.warning(
            "model '%s': inputs are neither all forward() arguments (%s) nor all of the form "
            "<name>__<index>; feeding them in configuration order",
            model,
            ", ".join(arg_names),
        )
    return InputBinding("config_order", {n: i for i, n in enumerate(names)}, len(arguments))


def bind_outputs(names: list[str], model: str, source: str) -> tuple[str, dict[str, int]]:
    """Output name -> position in the model's result: ``<name>__<index>``, else config order."""
    if not names:
        raise ConfigError(
            f"{source}: model '{model}' declares no output; the PyTorch backend cannot "
            "auto-complete outputs, so config.pbtxt must list them"
        )
    indices = [tensor_index(n) for n in names]
    if all(i is not None for i in indices):
        positions = {n: i for n, i in zip(names, indices, strict=True) if i is not None}
        _check_indices(positions, None, "output", model, source)
        return "named_index", positions
    if any("__" in n for n in names):
        logger.warning(
            "model '%s': outputs are not all of the form <name>__<index>; taking them in "
            "configuration order",
            model,
        )
    return "config_order", {n: i for i, n in enumerate(names)}


def _check_indices(
    positions: dict[str, int], arity: int | None, kind: str, model: str, source: str
) -> None:
    seen: dict[int, str] = {}
    for name, index in positions.items():
        if index in seen:
            raise ConfigError(
                f"{source}: model '{model}': {kind}s '{seen[index]}' and '{name}' both name "
                f"position {index}"
            )
        if arity is not None and index >= arity:
            raise ConfigError(
                f"{source}: model '{model}': {kind} '{name}' names position {index} but "
                f"forward() takes {arity} argument(s)"
            )
        seen[index] = name


def _schema_arguments(module: Any) -> list[tuple[str, str, str]]:
    """forward()'s arguments without ``self``: (name, type kind, type as written)."""
    schema = module.forward.schema
    args = list(schema.arguments)
    if args and args[0].type.kind() == "ClassType":
        args = args[1:]
    return [(a.name, a.type.kind(), str(a.type)) for a in args]


def _result_types(module: Any) -> tuple[str, list[str]]:
    """forward()'s return type kind and, for tuples, the element types as written."""
    returns = module.forward.schema.returns
    if len(returns) != 1:
        return "TupleType", [str(r.type) for r in returns]
    rtype = returns[0].type
    kind = rtype.kind()
    if kind == "TupleType":
        return kind, [str(e) for e in rtype.elements()]
    return kind, [str(rtype)]
