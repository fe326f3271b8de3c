"""A loaded model version and the states a version goes through."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from quiver.backends.base import ModelInstance
from quiver.config import ModelConfig
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling import Scheduler


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
    last_used: float = 0.0  # time.monotonic() of the last lookup, for eviction
    loaded_at: float = field(default_factory=time.monotonic)
    size_bytes: int = 0  # measured host footprint (0 when not measured)

    @property
    def version_str(self) -> str:
        return str(self.version)


@dataclass(slots=True)
class VersionStatus:
    """What the repository index says of one version (or of a model with no loadable version)."""

    name: str
    version: str  # "" when the failure is the model's, not one version's
    state: ModelState
    reason: str = ""
