"""The server process's limits: the cores it may use (:func:`usable_cores`), and its
open-file limit.

The server raises its soft ``RLIMIT_NOFILE`` to the hard limit at start
(:func:`raise_open_file_limit`, as Go's runtime does), so thousands of connections, cached
model files and worker pipes are not cut off by the common soft limit of 1,024. What it
starts for models' own code (Python model workers) gets the soft limit the server was started
with back, as Go's ``os/exec`` restores it: a model's code that uses ``select()`` or sizes a
table by the limit sees what it would have seen outside the server. The original is carried in
the environment variable :data:`ORIGINAL_SOFT_ENV`, which the worker's bootstrap reads, applies
and removes before it imports anything else.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from pathlib import Path

logger = logging.getLogger(__name__)

#: The most open files :func:`raise_open_file_limit` asks for when the hard limit is unlimited.
OPEN_FILES_WANTED = 1 << 20
#: Set by :func:`raise_open_file_limit` when it raised the limit: the soft limit before.
ORIGINAL_SOFT_ENV = "QUIVER_NOFILE_SOFT"
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


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (at most
    :data:`OPEN_FILES_WANTED` when that is unlimited); the soft limit in force afterwards.
    When raised, the soft limit before goes to :data:`ORIGINAL_SOFT_ENV` for the processes
    that run models' code. A limit the system will not raise is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError) as exc:
        logger.debug("open file limit stays at %d: %s", soft, exc)
        return soft
    os.environ.setdefault(ORIGINAL_SOFT_ENV, str(soft))
    return wanted
