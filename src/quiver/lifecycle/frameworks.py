"""A framework's one-time process cost, paid once on its own so no model is charged with it.

The first model of a framework in a process pays for the framework too: importing it (shared
libraries mapped and touched, module state) and its first session or module (runtime
environment, kernel registries, allocators). Measured on the dev machine, RSS after
``malloc_trim``: onnxruntime 20.3 MB to import and 10.4 MB for its first session (the second
costs 0.2 MB); torch 196 MB to import and 11.2 MB for its first TorchScript module (the
second 0.1 MB). :func:`prime` pays that cost with a tiny model, so the manager can measure it
in a section of its own (:class:`~quiver.lifecycle.memory.MemoryMeter`) before the first real
model of the framework loads; see :mod:`quiver.lifecycle.memory` for how it is accounted.
"""

from __future__ import annotations

import io
import logging
import warnings

from quiver.backends.base import get_backend

__all__ = ["HEAP_ALLOCATING", "prime"]

logger = logging.getLogger(__name__)


def _prime_onnxruntime() -> None:
    from quiver.backends.onnxruntime import prime as prime_onnxruntime

    prime_onnxruntime()


def _prime_pytorch() -> None:
    import torch

    with warnings.catch_warnings():
        # torch 2.x deprecates TorchScript (as the backend, served all the same).
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
        buffer = io.BytesIO()
        torch.jit.save(torch.jit.script(torch.nn.Identity()), buffer)
        buffer.seek(0)
        module = torch.jit.load(buffer, map_location="cpu")  # type: ignore[no-untyped-call]
        with torch.inference_mode():
            module(torch.ones(1))


_FIRST_USE = {"onnxruntime": _prime_onnxruntime, "pytorch": _prime_pytorch}

#: Backends whose models take their host memory from ``malloc`` alone (weights, sessions,
#: kernels' buffers), so a load is measured by the C heap's growth instead of trimmed RSS:
#: checked against trimmed RSS for ONNX Runtime and TorchScript models of 0.3 KB to 200 MB
#: (:mod:`quiver.lifecycle.memory`). Python models (objects in pymalloc's own mappings), DALI
#: and TensorFlow are measured by RSS.
HEAP_ALLOCATING = frozenset({"onnxruntime", "pytorch"})


def prime(backend: str) -> None:
    """Import ``backend`` (a backend name: ``onnxruntime``, ``pytorch``, ``python``...) and
    open its first tiny session where it has sessions. Blocking; raises what importing the
    backend raises (UNSUPPORTED when its package is missing)."""
    get_backend(backend)
    first_use = _FIRST_USE.get(backend)
    if first_use is not None:
        first_use()
    logger.debug("framework '%s' primed", backend)
