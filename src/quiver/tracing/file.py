"""Trace files, written as Triton writes them, off the event loop.

``PATH`` holds a JSON array of every trace written to it since the server started (the first
write truncates it, as Triton's does); Quiver keeps the array closed after each write, so the
file is valid JSON at any moment, not only after shutdown. ``PATH.<index>`` files (log
frequency, trace count reached) each hold one array. One writer thread does every write in
order; :meth:`TraceFiles.close` waits for it.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


class TraceFiles:
    """The trace files of one server: each path's next index and whether it was started."""

    def __init__(self) -> None:
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quiver-trace-writer")
        self._started: set[str] = set()
        self._indexes: dict[str, int] = {}

    def append(self, path: str, traces: bytes) -> None:
        """Add ``traces`` (comma-separated trace objects) to the array in ``path``."""
        if traces:
            self._writer.submit(self._append, path, traces)

    def write_indexed(self, path: str, traces: bytes) -> None:
        """Write ``traces`` as one array to ``path.<next index>``."""
        index = self._indexes.get(path, 0)
        self._indexes[path] = index + 1
        self._writer.submit(self._write, f"{path}.{index}", b"[" + traces + b"]")

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    # -- on the writer thread --------------------------------------------------------------

    def _append(self, path: str, traces: bytes) -> None:
        try:
            if path not in self._started:
                self._started.add(path)
                with open(path, "wb") as out:
                    out.write(b"[" + traces + b"]")
                return
            with open(path, "r+b") as out:
                out.seek(-1, os.SEEK_END)  # over the closing bracket
                out.write(b"," + traces + b"]")
        except OSError as exc:
            logger.error("failed writing trace file %s: %s", path, exc)

    def _write(self, path: str, content: bytes) -> None:
        try:
            with open(path, "wb") as out:
                out.write(content)
        except OSError as exc:
            logger.error("failed creating trace file %s: %s", path, exc)
