"""The caps on one extraction or copy of a model (:class:`ExtractLimits`) and what it
produced (:class:`ExtractResult`); shared by :mod:`quiver.repository.archive` and
:mod:`quiver.repository.folder_copy`, whose docstrings say how each cap is counted."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BYTES = 64 << 30  # the disk cache lowers it to its own size (see cache.py)
DEFAULT_MAX_FILES = 100_000
DEFAULT_MAX_RATIO = 100.0  # Apache POI's zip-bomb threshold (minimum inflate ratio 0.01)
DEFAULT_RATIO_FLOOR = 64 << 20  # the ratio applies once this many bytes are expanded


@dataclass(frozen=True, slots=True)
class ExtractLimits:
    """Caps on one extraction or copy; see the module docstring.

    ``max_bytes``: expanded bytes (the decompressed tar stream; a folder's file bytes).
    ``max_files``: members (folders and links included). ``max_ratio``: expanded bytes over
    the compressed archive's bytes, enforced once more than ``ratio_floor`` bytes are
    expanded; 0 turns it off.
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    max_files: int = DEFAULT_MAX_FILES
    max_ratio: float = DEFAULT_MAX_RATIO
    ratio_floor: int = DEFAULT_RATIO_FLOOR


@dataclass(frozen=True, slots=True)
class ExtractResult:
    """What an extraction or copy produced: files (all members, folders included) and bytes
    of file content written."""

    files: int
    bytes: int
