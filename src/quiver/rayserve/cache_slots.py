"""Disk-cache folders for replicas that share a node and a ``--model-cache-dir``.

A Quiver disk cache is owned by one process (it locks its folder). Replicas on one node each
claim a numbered slot under the configured folder, ``replica-0``, ``replica-1``, ..., by holding
an exclusive ``flock`` on ``replica-N.slot`` for their lifetime. The lock goes with the
process, so a replica that is restarted, or that replaces one that died, takes a free slot and
finds that cache's archives still there.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

MAX_SLOTS = 1024


class CacheSlot:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        for index in range(MAX_SLOTS):
            fd = os.open(root / f"replica-{index}.slot", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.index = index
            self.folder = root / f"replica-{index}"
            self._fd: int | None = fd
            return
        raise OSError(f"no free disk-cache slot under {root} ({MAX_SLOTS} replicas hold one)")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
