"""The servers the comparison benchmark (``benchmarks/compare.py``) runs side by side.

Each peer installs itself into a virtual environment of its own under ``benchmarks/.work/peers/``
(nothing global, nothing committed), writes the workload's model in its own format, starts one
server process on 127.0.0.1 with ephemeral ports, and stops it afterwards. A peer that cannot be
installed or started raises :class:`PeerError`; the benchmark reports the message in its table and
goes on with the others.

The workload every peer serves is ``tiny``: model ``tiny``, input ``INPUT0`` FP32 [1, 16], output
``OUTPUT0`` FP32 [1, 16] equal to ``INPUT0 * 2``, no batching (Triton ``max_batch_size: 0``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work" / "peers"

TINY_MODEL = "tiny"
TINY_INPUT = "INPUT0"
TINY_OUTPUT = "OUTPUT0"
TINY_SHAPE = (1, 16)


class PeerError(Exception):
    """A peer could not be installed or started; the message says why, for the results table."""


@dataclass(frozen=True)
class Endpoints:
    """Where a started peer listens, and its server process (for CPU accounting)."""

    http: str  # "127.0.0.1:PORT", the KServe v2 REST API
    grpc: str | None  # "127.0.0.1:PORT", the KServe v2 gRPC API, or None if the peer has none
    pid: int  # the server's main process; its children count towards its CPU too
    metrics: str | None = None  # "127.0.0.1:PORT" serving GET /metrics, when the peer reports it


class Peer(ABC):
    """One server under test. ``setup`` is idempotent and quick once done."""

    name: str  # as it appears in the tables, e.g. "triton", "mlserver (parallel_workers 0)"

    @abstractmethod
    def setup(self) -> None:
        """Install the server into its own virtual environment (raise PeerError on failure)."""

    @abstractmethod
    def start(self, workload: str) -> Endpoints:
        """Write ``workload``'s model, start the server, wait until the model is ready."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the server and every process it started; safe to call twice."""


# -- processes ----------------------------------------------------------------------------

_live: set[subprocess.Popen[bytes]] = set()


def spawn(argv: list[str], *, log: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own (so stopping it stops its children too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _live.add(proc)
    return proc


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``timeout`` seconds."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    _live.discard(proc)  # only now: a Ctrl-C while it stops still finds it in kill_all()


def kill_all() -> None:
    """Stop every server still running (at exit, on Ctrl-C)."""
    for proc in list(_live):
        terminate(proc, timeout=5.0)


atexit.register(kill_all)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200; PeerError with the log's tail if the server dies or
    does not get there in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"exited with code {proc.returncode}: {tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.2)
    raise PeerError(f"not ready after {timeout:.0f} s ({url}): {tail(log)}")


def tail(log: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        text = log.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])
    return "(no log)"


def make_venv(path: Path, packages: list[str], log: Path) -> Path:
    """Create ``path`` as a virtual environment holding ``packages``; returns its python.
    A marker file records what was installed, so a second call with the same list is free."""
    python = path / "bin" / "python"
    marker = path / ".installed"
    wanted = "\n".join(packages)
    if marker.exists() and marker.read_text() == wanted:
        return python
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        for argv in (
            [sys.executable, "-m", "venv", "--clear", str(path)],
            [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
            [str(python), "-m", "pip", "install", "--quiet", *packages],
        ):
            if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise PeerError(f"{' '.join(argv[2:4])} failed in {path}: {tail(log)}")
    marker.write_text(wanted)
    return python
