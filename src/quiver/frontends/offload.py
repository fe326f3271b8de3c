"""Large decodes and encodes on worker threads, so the event loop keeps serving meanwhile.

A 60 MB body of 15 million BYTES elements takes seconds to become an array; done on the
event loop it would hold every health check and every small request for as long. Bodies and
responses from :data:`OFFLOAD_BYTES` on are decoded and encoded on a small pool of threads
of their own (not the loop's default executor, which disk and S3 work share: a stalled store
must not hold decodes). Smaller ones stay inline, where a thread hop would cost more than the
work (see the README's Protocol section for the measurements).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import numpy as np

from quiver.types import InferenceResponse

#: Bodies (and responses) of at least this many bytes are decoded (encoded) on a thread.
OFFLOAD_BYTES = 1 << 20
#: Deflate expands at most about 1032:1: smaller compressed bodies inflate inline.
INFLATE_INLINE_BYTES = OFFLOAD_BYTES // 1032

_P = ParamSpec("_P")
_T = TypeVar("_T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(
                    max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="quiver-codec"
                )
    return _pool


async def in_worker(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on a codec thread; its exceptions come back here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


def response_size(response: InferenceResponse) -> int:
    """About the bytes an encoded response will take: its arrays' sizes (a BYTES element
    counts as its pointer, so a response of many elements counts as large)."""
    total = 0
    for tensor in response.outputs:
        data: Any = tensor.data
        total += data.nbytes if isinstance(data, np.ndarray) else 0
    return total


__all__ = ["INFLATE_INLINE_BYTES", "OFFLOAD_BYTES", "in_worker", "response_size"]
