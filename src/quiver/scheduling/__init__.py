"""Schedulers: how requests reach a model's instances.

:func:`create_scheduler` picks Triton's scheduler for a configuration: the sequence batcher
for ``sequence_batching``, the dynamic batcher for ``dynamic_batching``, else the direct
scheduler (the next free instance).
"""

from __future__ import annotations

from pathlib import Path

from quiver.backends.base import ModelInstance
from quiver.clock import SYSTEM_CLOCK, Clock
from quiver.config import ModelConfig
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.base import Scheduler
from quiver.scheduling.direct import DirectScheduler
from quiver.scheduling.dynamic import DynamicBatcher, queue_from_config
from quiver.scheduling.sequence import SequenceBatcher, create_sequence_batcher


def create_scheduler(
    config: ModelConfig,
    instances: list[ModelInstance],
    stats: ModelStatistics,
    clock: Clock = SYSTEM_CLOCK,
    *,
    version_dir: Path | None = None,
) -> Scheduler:
    proto = config.proto
    if proto.HasField("sequence_batching"):
        return create_sequence_batcher(config, instances, stats, version_dir=version_dir, clock=clock)
    if proto.HasField("dynamic_batching"):
        batching = proto.dynamic_batching
        return DynamicBatcher(
            config.name,
            instances,
            stats,
            queue_from_config(batching, config.max_batch_size, config.name),
            priority_levels=int(batching.priority_levels),
            default_priority_level=int(batching.default_priority_level),
            preserve_ordering=bool(batching.preserve_ordering),
            clock=clock,
        )
    return DirectScheduler(
        config.name, instances, stats, batching=config.max_batch_size > 0, clock=clock
    )


__all__ = ["DirectScheduler", "DynamicBatcher", "Scheduler", "SequenceBatcher", "create_scheduler"]
