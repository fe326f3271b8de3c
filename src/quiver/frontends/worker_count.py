"""How many frontend worker processes ``--frontend-workers auto`` (the default) starts.

Measured on 2 cores (``benchmarks.http_workers``; README "HTTP frontend workers and CPU per
request"), the workers spend 56-98 us of CPU on an HTTP request at concurrency 8 and 32 and
300-370 us on a gRPC one, and the model side 44-83 us and 130-180 us: two or three workers keep
one model side busy, and more add only processes. With fewer than 4 cores the workers compete
with the model side, the Python models' processes and the clients for the same cores, and
each request wakes two more processes: the single process serves more except with the ONNX
model at concurrency 32 (same table; Triton's Python model measured in the same rounds), so
``auto`` is 0 there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Fewer usable cores than this: no frontend workers.
MIN_CORES = 4
#: The most workers ``auto`` starts.
MAX_AUTO = 3
_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = _CPU_MAX) -> int:
    """The cores this process may run on: its CPU affinity, lowered to the cgroup's CPU quota
    (``cpu.max``, as a container's ``--cpus`` sets it) when there is one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def auto_frontend_workers(cores: int) -> int:
    """``--frontend-workers auto`` on a machine with ``cores`` usable cores."""
    return 0 if cores < MIN_CORES else min(MAX_AUTO, cores - 2)


__all__ = ["MAX_AUTO", "MIN_CORES", "auto_frontend_workers", "usable_cores"]
