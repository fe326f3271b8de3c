"""The garbage collector's view of a long-running server: what lives for good is frozen.

CPython's cyclic collector walks every container object it tracks in a full collection: in
a server with onnxruntime, numpy, protobuf and the frontends imported that is tens of
thousands of module-level objects (classes, functions, descriptors) that never become garbage,
and a full collection stopped every thread for 26 ms (7 times per 2,000 requests of the
multi-model benchmark, whichever request it landed in). :func:`freeze_heap` moves everything
alive into the collector's permanent generation (:func:`gc.freeze`), which collections skip:
full collections then walk only what was made since (requests, the models loaded on demand).

It is called once the server has started (the models loaded at start included) and after a
framework's first model is loaded (its import and first session made what stays). A frozen
object is still freed when its last reference goes; only a reference cycle among frozen
objects would outlive its use (a model loaded at start and unloaded much later may leave a few
dozen objects), never anything made while serving.
"""

from __future__ import annotations

import gc
import logging
import threading

__all__ = ["freeze_heap"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()


def freeze_heap(why: str) -> None:
    """Collect what is garbage now, then freeze everything alive (``why``: for the log)."""
    with _lock:
        gc.collect()
        gc.freeze()
        logger.debug("garbage collector: %d objects frozen (%s)", gc.get_freeze_count(), why)
