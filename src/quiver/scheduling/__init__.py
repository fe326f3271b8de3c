"""Schedulers: how requests reach a model's instances."""

from quiver.scheduling.base import Scheduler
from quiver.scheduling.direct import DirectScheduler

__all__ = ["DirectScheduler", "Scheduler"]
