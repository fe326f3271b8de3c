"""cProfile of a server process, for measurement only: with ``QUIVER_PROFILE_DIR`` set, each
process that calls :func:`start` (the model side, each frontend worker, each Python model's
process) profiles itself from then on and writes ``<dir>/<name>-<pid>.prof`` when it ends
(:func:`dump`: at exit, or before the ``os._exit`` of a process that leaves that way).

Read them with ``python -m pstats FILE`` (or ``pstats.Stats(*files)`` to add up several
processes of one kind). Profiling roughly doubles what a request costs in Python code, so
the numbers are for where time goes, never for how fast the server is.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

ENV = "QUIVER_PROFILE_DIR"

_profile: Any = None
_path: Path | None = None


def start(name: str) -> None:
    """Profile this process from now on if ``QUIVER_PROFILE_DIR`` is set (else nothing)."""
    global _profile, _path
    folder = os.environ.get(ENV)
    if not folder or _profile is not None:
        return
    import cProfile

    _path = Path(folder) / f"{name}-{os.getpid()}.prof"
    _profile = cProfile.Profile()
    _profile.enable()
    atexit.register(dump)


def dump() -> None:
    """Write the profile taken so far (once; nothing when not profiling)."""
    global _profile
    profile, _profile = _profile, None
    if profile is None or _path is None:
        return
    profile.disable()
    _path.parent.mkdir(parents=True, exist_ok=True)
    partial = _path.with_suffix(".part")  # a process killed while writing leaves no torn profile
    profile.dump_stats(str(partial))
    partial.rename(_path)


__all__ = ["ENV", "dump", "start"]
