"""Long decodes and encodes on worker threads, so the event loop keeps serving meanwhile.

A 60 MB body of 15 million BYTES elements takes seconds to become an array; done on the
event loop it held every health check and every other request for as long. The protocol
modules estimate how long a decode or an encode will take (``decode_cost``,
``encode_cost``: JSON is parsed, BYTES elements are walked, fixed-size binary tensors are
views); from :data:`OFFLOAD_NS` on, the work runs on a small pool of threads of its own
(not the loop's default executor, which disk and S3 work share: a stalled store must not
hold decodes). Shorter work stays inline, where the thread hop (about 50-100 us) would
cost more than it saves: a small request, or a large binary tensor of a fixed-size type,
is decoded as fast as before.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

#: Decodes and encodes estimated at this many nanoseconds or more run on a codec thread.
OFFLOAD_NS = 500_000
#: gRPC messages of this many bytes or more are parsed on a codec thread (their buffers
#: are copied: about half a millisecond per MiB).
PARSE_INLINE_BYTES = 1 << 20
#: Deflate expands at most about 1032:1: smaller compressed bodies inflate inline (to at
#: most 256 KiB, well under OFFLOAD_NS); larger ones on a codec thread.
INFLATE_INLINE_BYTES = 256

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


def set_codec_threads(count: int) -> None:
    """Use ``count`` codec threads (``--sagemaker-thread-count``); call before serving."""
    global _pool
    if count < 1:
        raise ValueError(f"codec threads must be at least 1, got {count}")
    with _pool_lock:
        previous, _pool = _pool, ThreadPoolExecutor(max_workers=count, thread_name_prefix="quiver-codec")
    if previous is not None:
        previous.shutdown(wait=False)


def codec_threads() -> int:
    """How many codec threads decode and encode large bodies."""
    return _executor()._max_workers


async def in_worker(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` on a codec thread; its exceptions come back here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


__all__ = [
    "INFLATE_INLINE_BYTES",
    "OFFLOAD_NS",
    "PARSE_INLINE_BYTES",
    "codec_threads",
    "in_worker",
    "set_codec_threads",
]
