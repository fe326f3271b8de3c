"""The servers the benchmarks run, and the one harness that starts and stops them.

:class:`Server` is that harness: a server process in a session of its own with its output in a
log file, the addresses it reports there ("started HTTP service at HOST:PORT"), ready once a URL
answers 200, stopped with SIGTERM and then SIGKILL for its whole process group; a context
manager; and whatever is still running when the benchmark exits (Ctrl-C, SIGTERM, an error) is
stopped then. ``quiver serve`` is :class:`benchmarks.peers.quiver.QuiverServer`, a
:class:`Server` every benchmark that starts Quiver uses.

The peers are what the comparison benchmark (``benchmarks/compare.py``) runs side by side. Each
installs itself into a virtual environment of its own under ``benchmarks/.work/peers/`` (nothing
global, nothing committed), writes the workload's model in its own format, starts one server on
127.0.0.1 with ephemeral ports, and stops it afterwards. A peer that cannot be installed or
started raises :class:`PeerError`; the benchmark reports the message in its table and goes on
with the others.

The workload every peer serves is ``tiny`` (:mod:`benchmarks.peers.tiny`): ``OUTPUT0 =
INPUT0 * 2`` on FP32 [1, 16].
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "benchmarks" / ".work" / "peers"

class PeerError(RuntimeError):
    """A server could not be installed or started; the message says why, for the results table."""


@dataclass(frozen=True)
class Endpoints:
    """Where a started server listens, and its process (for CPU accounting)."""

    http: str | None  # "127.0.0.1:PORT", the KServe v2 REST API (None: not listening)
    grpc: str | None  # "127.0.0.1:PORT", the KServe v2 gRPC API, or None if the server has none
    pid: int  # the server's main process; its children count towards its CPU too
    metrics: str | None = None  # "127.0.0.1:PORT" serving GET /metrics, when the server reports it

    def address(self, encoding: str) -> tuple[str, int]:
        """(host, port) to drive with ``encoding``: the gRPC listener for ``grpc``, else HTTP."""
        where = self.grpc if encoding == "grpc" else self.http
        if where is None:
            raise PeerError(f"no {'gRPC' if encoding == 'grpc' else 'HTTP'} listener")
        host, port = where.rsplit(":", 1)
        return host, int(port)


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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def spawn(argv: Sequence[str], *, log: Path, cwd: Path | None = None, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own (so stopping it stops its children too), its
    output in ``log``. Until :func:`terminate` it is stopped at exit; and unless the benchmark
    handles SIGTERM itself, a SIGTERM then unwinds the benchmark as Ctrl-C does (exit 143), so
    that its servers are stopped on the way out."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _live.add(proc)
    return proc


def terminate(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0, *, group: bool = True) -> int | None:
    """SIGTERM the process group (``group``; else only the process, which then stops its own
    children), then SIGKILL the group for what is left after ``timeout`` seconds, until none is
    left (10 s at most). Returns the exit code it stopped with, or None if it had to be killed."""
    if proc is None:
        return None
    code: int | None = None
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        code = proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # children that outlived their parent (say, workers)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    _live.discard(proc)  # only now: a Ctrl-C while it stops still finds it in kill_all()
    return code


def kill_all() -> None:
    """Stop every server still running (at exit, on Ctrl-C)."""
    for proc in list(_live):
        terminate(proc, timeout=5.0)


atexit.register(kill_all)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def distinct_ports(count: int) -> list[int]:
    """``count`` free ports, all different."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


#: How a server names a listener in its log (Quiver: "started HTTP service at 127.0.0.1:8000").
STARTED = re.compile(r"started (\w+) service at (\S+):(\d+)")


def wait_listeners(proc: subprocess.Popen[bytes], log: Path, names: Sequence[str], timeout: float) -> dict[str, str]:
    """``{NAME: "HOST:PORT"}`` once ``log`` has a "started NAME service at HOST:PORT" line for
    each of ``names``; PeerError with the log's tail if the server dies or does not get there
    in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text(errors="replace")
        found = {m.group(1): f"{m.group(2)}:{m.group(3)}" for m in STARTED.finditer(text)}
        if all(name in found for name in names):
            return found
        if proc.poll() is not None:
            raise PeerError(f"exited with code {proc.returncode}: {tail(log)}")
        if time.monotonic() > deadline:
            raise PeerError(f"no {'/'.join(names)} listener lines in its log after {timeout:.0f} s: {tail(log)}")
        time.sleep(0.1)


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


class Server:
    """One server process, started by :meth:`start` (or ``with``) and stopped by :meth:`stop`.

    ``listeners``: the names whose "started NAME service at HOST:PORT" lines to wait for in
    the log (``HTTP``, ``GRPC``, ``Metrics``); ``addresses``: listeners known in advance (a
    server given fixed ports). ``ready_path``: once the listeners are up, poll this path on the
    HTTP listener until it answers 200 (None: do not). ``timeout``: seconds for all of that.
    ``stop_timeout``: seconds between SIGTERM and SIGKILL; ``signal_group``: SIGTERM the whole
    process group (else the server alone, which stops its children itself). Failing to start
    raises :class:`PeerError` (the log's tail in its message), the process stopped.
    """

    def __init__(
        self, name: str, argv: Sequence[str], *, log: Path, listeners: Sequence[str] = ("HTTP",),
        addresses: Mapping[str, str] | None = None, ready_path: str | None = "/v2/health/ready",
        timeout: float = 120.0, stop_timeout: float = 15.0, signal_group: bool = True,
        cwd: Path | None = None, env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(arg) for arg in argv]
        self.log = log
        self.listeners = tuple(listeners)
        self.addresses: dict[str, str] = dict(addresses or {})
        self.ready_path = ready_path
        self.timeout = timeout
        self.stop_timeout = stop_timeout
        self.signal_group = signal_group
        self.cwd = cwd
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None  # what it stopped with; None: killed, or not stopped

    def start(self) -> Endpoints:
        if self.proc is not None:
            raise PeerError(f"{self.name}: already started")
        try:
            self.proc = spawn(self.argv, log=self.log, cwd=self.cwd, env=self.env)
        except OSError as exc:
            raise PeerError(f"{self.name}: cannot run {self.argv[0]}: {exc}") from None
        try:
            self.addresses.update(wait_listeners(self.proc, self.log, self.listeners, self.timeout))
            if self.ready_path is not None and "HTTP" in self.addresses:
                wait_ready(self.proc, f"http://{self.addresses['HTTP']}{self.ready_path}", self.log, self.timeout)
        except PeerError as exc:
            self.stop()
            raise PeerError(f"{self.name}: {exc}") from None
        return self.endpoints

    @property
    def endpoints(self) -> Endpoints:
        assert self.proc is not None, "not started"
        get = self.addresses.get
        return Endpoints(http=get("HTTP"), grpc=get("GRPC"), pid=self.proc.pid, metrics=get("Metrics"))

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def stop(self) -> int | None:
        """Stop it (safe twice); the exit code it stopped with, None if it had to be killed."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self.exit_code = terminate(proc, self.stop_timeout, group=self.signal_group)
        return self.exit_code

    def tail(self, lines: int = 30) -> str:
        """The log's last lines, for an error message."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None) -> None:
        self.stop()


def smoke(candidates: Iterable[Peer], check: Callable[[Peer], None]) -> int:
    """A peer module's smoke check: ``check(peer)`` for each peer, which is stopped afterwards;
    one that raises is reported as FAILED. The exit status: 1 if any failed."""
    failed = 0
    for peer in candidates:
        try:
            check(peer)
        except (RuntimeError, AssertionError) as exc:  # PeerError too
            print(f"[{peer.name}] FAILED: {exc}")
            failed += 1
        finally:
            peer.stop()
    return 1 if failed else 0


# -- installing ---------------------------------------------------------------------------


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
