"""The value types of ``quiver serve``'s flags (argparse ``type=`` callables): booleans in
Triton's spellings, byte sizes with suffixes, fractions, ratios, seconds and counts, each with
an error naming what it expected."""

from __future__ import annotations

import argparse

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


def _fraction(value: str) -> float:
    """A fraction in (0, 1], for --model-load-gpu-limit (Triton's DEVICE:FRACTION form too:
    Quiver's limit holds for every GPU)."""
    from quiver.settings import parse_fraction

    value = value.rpartition(":")[2]
    try:
        return parse_fraction(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(value: str) -> float:
    """A positive number of seconds."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number") from None
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got '{value}'")
    return number


def _size(value: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = value.strip().lower().removesuffix("b")
    factor = units.get(text[-1:], 1)
    if factor != 1:
        text = text[:-1]
    try:
        number = int(text) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 64M, got '{value}'") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got '{value}'")
    return number


def _ratio(value: str) -> float:
    """An expansion ratio, for --model-archive-max-ratio: 0 (no limit) or at least 1."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number") from None
    if not (number == 0 or 1 <= number < float("inf")):
        raise argparse.ArgumentTypeError(f"{value} is neither 0 (no limit) nor a ratio of at least 1")
    return number


def _workers(value: str) -> int | None:
    """--frontend-workers: a number (checked by the settings), or ``auto`` (None)."""
    if value.strip().lower() == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is neither a number nor 'auto'") from None


def _count(value: str) -> int:
    """A positive integer."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not an integer") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got '{value}'")
    return number


def _flag(parser: argparse._ActionsContainer, name: str, default: bool, help: str) -> None:
    parser.add_argument(
        name,
        type=_bool,
        nargs="?",
        const=True,
        default=default,
        metavar="true|false",
        help=f"{help} (default: {str(default).lower()})",
    )
