"""quiver.backends.python_process: exit causes, a process's USS, and the removal of pools that
killed servers left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from quiver.backends import python_process
from quiver.backends.base import exit_cause
from quiver.ipc.shm import SHM_DIR


def test_exit_causes_name_the_code_or_the_signal() -> None:
    assert exit_cause(1) == "exited with code 1"
    assert exit_cause(-11) == "was killed by SIGSEGV"
    assert exit_cause(-9) == "was killed by SIGKILL"


def test_uss_counts_a_process_private_memory() -> None:
    code = "import sys; b = bytearray(64 << 20); sys.stdout.write('x'); sys.stdout.flush(); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.read(1) == b"x"
        assert python_process.uss_bytes(child.pid) >= 64 << 20
    finally:
        child.kill()
        child.communicate()
    assert python_process.uss_bytes(child.pid) == 0  # gone


def test_pools_of_servers_that_are_gone_are_removed_once() -> None:
    prefix = f"quiver_sweep_{uuid.uuid4().hex[:8]}_"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone, mine = f"{prefix}{int(dead.stdout)}_1_s_0", f"{prefix}{os.getpid()}_1_s_0"
    for name in (gone, mine):
        with open(os.path.join(SHM_DIR, name), "wb"):
            pass
    try:
        python_process._sweep(prefix)
        names = os.listdir(SHM_DIR)
        assert gone not in names and mine in names
    finally:
        for name in (gone, mine):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))


def test_the_stub_starts_under_a_python_without_ctypes() -> None:
    """An environment's Python built without libffi has no ctypes: the worker still imports and
    arms its parent-death watch (the EOF watchdog then stands alone) and names no CPU."""
    script = (
        "import os, sys\n"
        "sys.modules['ctypes'] = None\n"
        "sys.modules['_ctypes'] = None\n"
        "import quiver.backends.python_stub as stub\n"
        "from quiver.ipc.inbox import current_cpu\n"
        "assert current_cpu() is None\n"
        "stub._die_with_parent(os.getppid())\n"
        "print('started')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "started"
