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

from quiver.limits import usable_cores

__all__ = ["MAX_AUTO", "MIN_CORES", "auto_frontend_workers", "usable_cores"]

#: Fewer usable cores than this: no frontend workers.
MIN_CORES = 4
#: The most workers ``auto`` starts.
MAX_AUTO = 3


def auto_frontend_workers(cores: int) -> int:
    """``--frontend-workers auto`` on a machine with ``cores`` usable cores."""
    return 0 if cores < MIN_CORES else min(MAX_AUTO, cores - 2)


__all__ = ["MAX_AUTO", "MIN_CORES", "auto_frontend_workers", "usable_cores"]
