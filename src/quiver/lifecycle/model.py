"""A loaded model version and the states a version goes through."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from quiver.backends.base import ModelInstance
from quiver.config import ModelConfig
from quiver.errors import InvalidArgumentError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling import Scheduler

#: Triton keeps versions in an int64.
MAX_VERSION = (1 << 63) - 1


def parse_version(model: str, version: str) -> int | None:
    """A requested version: ``None`` for "" (the latest the policy serves), else an integer
    from 1 to 2^63-1 in ASCII digits (leading zeros allowed, as Triton's ``stol`` allows
    them). Anything else (``-1``, ``0``, ``abc``, ``1.5``, ``+1``, a NUL byte, a number past
    int64) is INVALID_ARG naming the version and the model."""
    if not version:
        return None
    negative = version[0] == "-"
    body = version[1:] if negative else version
    digits = body.lstrip("0")
    if not (body.isascii() and body.isdigit()):
        what = "not a number"
    elif negative or not digits:
        what = "not a positive integer"
    elif len(digits) > 19 or int(digits) > MAX_VERSION:  # 19 digits: no huge int() conversion
        what = "too large"
    else:
        return int(digits)
    shown = version if len(version) <= 64 else version[:64] + "..."
    shown = shown.encode("unicode_escape").decode("ascii").replace("'", "\\'")
    raise InvalidArgumentError(
        f"model '{model}': version '{shown}' is {what}; a version is an integer from 1 to "
        f"{MAX_VERSION}, or empty for the latest"
    )


class ModelState(enum.Enum):
    """Triton's model states, by the names the repository index reports."""

    UNKNOWN = "UNKNOWN"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


@dataclass(slots=True)
class Model:
    """One version of a model, READY to serve."""

    name: str
    version: int
    config: ModelConfig
    scheduler: Scheduler
    instances: list[ModelInstance]
    labels: dict[str, list[str]] = field(default_factory=dict)
    stats: ModelStatistics = field(default_factory=ModelStatistics)
    load_seconds: float = 0.0
    last_used: float = 0.0  # the lifecycle clock's seconds at the last lookup, for eviction
    loaded_at: float = 0.0  # the same clock's seconds when it was installed
    size_bytes: int = 0  # measured host footprint (0 when not measured)

    @property
    def version_str(self) -> str:
        return str(self.version)

    def process_memory_bytes(self) -> int | None:
        """Host memory of the processes this version's instances run in (a Python model's
        workers: their unique set size, read now), or None when they run in the server's."""
        sizes = [
            read() for instance in self.instances if (read := getattr(instance, "process_memory_bytes", None)) is not None
        ]
        return sum(sizes) if sizes else None


@dataclass(slots=True)
class VersionStatus:
    """What the repository index says of one version (or of a model with no loadable version)."""

    name: str
    version: str  # "" when the failure is the model's, not one version's
    state: ModelState
    reason: str = ""
