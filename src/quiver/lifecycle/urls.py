"""What a SageMaker ``POST /models`` url names, and what a failed load from it answers.

:func:`url_folder` checks a local url (no NUL, not under /dev, /proc or /sys, an existing
folder) and finds the model folder it serves; :func:`load_failure` sorts a failed load as
Triton's SageMaker frontend does: out of memory (the budget's, the disk cache's, or a
framework's message) is a capacity error (507: the platform unloads models and retries), a
model that failed to load is the folder's fault (400).
"""

from __future__ import annotations

import os
from pathlib import Path

from quiver.errors import InvalidArgumentError, NotFoundError, QuiverError, UnavailableError
from quiver.lifecycle.budget import OutOfMemoryError
from quiver.lifecycle.dependencies import is_model_folder, served_folder
from quiver.repository.cache import CacheFullError
from quiver.repository.names import check_local_path

#: Errors that mean "no room (memory or disk); unload something and try again".
CAPACITY_ERRORS: tuple[type[QuiverError], ...] = (OutOfMemoryError, CacheFullError)
#: Where Triton's SageMaker frontend refuses to look for models.
_FORBIDDEN_ROOTS = ("/dev/", "/proc/", "/sys/")
#: What a framework says when it runs out of memory (the strings Triton's SageMaker frontend
#: looks for to answer 507 rather than 400).
_OOM_MESSAGES = (
    "CUDA out of memory", "CUDA_OUT_OF_MEMORY", "Out of memory", "Out Of Memory", "out of memory",
    "MemoryError", "OutOfMemory", "OOM", "Failed to allocate memory", "failed to allocate memory",
    "No space left on device",
)  # fmt: skip


def url_folder(local: str, url: str) -> Path:
    """The model folder the local path ``local`` (of ``url``) serves: itself when it is a
    model folder (a config.pbtxt is not required: Triton completes configs), else the
    repository's model by :func:`~quiver.lifecycle.dependencies.served_folder`, as for
    archives. Blocking (it reads the folder)."""
    check_local_path(local, "url")
    path = Path(os.path.abspath(os.path.normpath(local)))
    if str(path).startswith(_FORBIDDEN_ROOTS) or str(path) in ("/dev", "/proc", "/sys"):
        raise InvalidArgumentError(f"url '{url}' may not be under /dev, /proc or /sys")
    if not path.is_dir():
        if path.exists() or path.is_symlink():
            raise InvalidArgumentError(f"url '{url}' is not a folder (a model folder or repository)")
        raise NotFoundError(f"url '{url}' does not exist")
    if is_model_folder(path):
        return path
    return served_folder(path, f"url '{url}'")


def load_failure(exc: QuiverError) -> QuiverError:
    """The error a SageMaker load answers with (see the module notes); other errors stay."""
    if isinstance(exc, CAPACITY_ERRORS):
        return exc
    message = exc.message
    if any(text in message for text in _OOM_MESSAGES):
        return OutOfMemoryError(message)
    if isinstance(exc, UnavailableError) and "failed to load" in message:
        return InvalidArgumentError(message)
    return exc


__all__ = ["CAPACITY_ERRORS", "load_failure", "url_folder"]
