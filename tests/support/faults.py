"""Real storage faults for tests: a folder the kernel refuses to write into, a file size
limit that makes writes fail as a full disk does.

``read_only(folder)`` makes creating, deleting and renaming entries in ``folder`` fail:
``chmod 555`` for a normal user; as root, whom permission bits do not stop, the immutable
attribute (``chattr +i``, EPERM). Either way it checks by trying to create a file, and
skips the test, saying why, only when no way works on this machine (root on a filesystem
without the attribute).

``file_size_limit(pid, bytes)`` sets ``RLIMIT_FSIZE`` of a running process (``prlimit``):
its writes past ``bytes`` in any file fail with EFBIG (Python ignores SIGXFSZ), as a disk
that filled up mid-download does, without filling a disk.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _writable(folder: Path) -> bool:
    probe = folder / f".probe-{uuid.uuid4().hex}"
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return True


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[str]:
    """``folder`` unwritable for the duration; yields how (``chmod 555`` / ``chattr +i``)."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode & 0o7777
        folder.chmod(0o555)
        try:
            if _writable(folder):
                pytest.skip(f"chmod 555 does not stop writes into {folder} here")
            yield "chmod 555"
        finally:
            folder.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("running as root, where chmod does not stop writes, and chattr is not installed")
    done = subprocess.run([chattr, "+i", str(folder)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"running as root, where chmod does not stop writes, and chattr +i failed: {done.stderr.strip()}")
    try:
        if _writable(folder):
            pytest.skip(f"chattr +i does not stop writes into {folder} here")
        yield "chattr +i"
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=True)


@contextlib.contextmanager
def file_size_limit(pid: int, limit: int) -> Iterator[None]:
    """``RLIMIT_FSIZE`` of process ``pid`` set to ``limit`` bytes for the duration."""
    old = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, old)


__all__ = ["file_size_limit", "read_only"]
