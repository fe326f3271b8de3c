"""Trace files, written as Triton writes them, off the event loop.

``PATH`` holds a JSON array of every trace written to it since the server started (the first
write truncates it, as Triton's does); Quiver keeps the array closed after each write, so the
file is valid JSON at any moment, not only after shutdown. ``PATH.<index>`` files (log
frequency, trace count reached) each hold one array. One writer thread does every write in
order, each a batch of the traces that finished meanwhile, into a file it keeps open;
:meth:`TraceFiles.close` waits for it.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

logger = logging.getLogger(__name__)


class TraceFiles:
    """The trace files of one server: each path's next index, its open handle, and the traces
    waiting for the writer (taken in one write, however many finished meanwhile)."""

    def __init__(self) -> None:
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quiver-trace-writer")
        self._lock = threading.Lock()
        self._pending: dict[str, list[bytes]] = {}
        self._scheduled = False
        self._handles: dict[str, BinaryIO] = {}  # the writer thread's alone
        self._indexes: dict[str, int] = {}
        self._failed: set[str] = set()  # paths whose failure was logged (once each)

    def append(self, path: str, traces: bytes) -> None:
        """Add ``traces`` (comma-separated trace objects) to the array in ``path``."""
        if not traces:
            return
        with self._lock:
            self._pending.setdefault(path, []).append(traces)
            if self._scheduled:
                return
            self._scheduled = True
        self._writer.submit(self._flush)

    def write_indexed(self, path: str, traces: bytes) -> None:
        """Write ``traces`` as one array to ``path.<next index>``."""
        index = self._indexes.get(path, 0)
        self._indexes[path] = index + 1
        self._writer.submit(self._write, f"{path}.{index}", b"[" + traces + b"]")

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    # -- on the writer thread --------------------------------------------------------------

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._scheduled = False
        for path, chunks in pending.items():
            self._append(path, b",".join(chunks))

    def _append(self, path: str, traces: bytes) -> None:
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = open(path, "w+b")  # noqa: SIM115 - kept open
                handle.write(b"[" + traces + b"]")
            else:
                handle.seek(-1, os.SEEK_END)  # over the closing bracket
                handle.write(b"," + traces + b"]")
            handle.flush()
        except OSError as exc:
            self._fail(path, exc)

    def _write(self, path: str, content: bytes) -> None:
        try:
            with open(path, "wb") as out:
                out.write(content)
        except OSError as exc:
            self._fail(path, exc)

    def _fail(self, path: str, exc: OSError) -> None:
        if path not in self._failed:
            self._failed.add(path)
            logger.error("failed writing trace file %s: %s (traces for it are lost)", path, exc)
