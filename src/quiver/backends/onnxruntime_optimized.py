"""Optimized graphs kept: ONNX Runtime's graph optimizations done once per model file, not at
every load.

Every ``InferenceSession`` runs ONNX Runtime's graph transformers over its model before it
serves (constant folding, fusions, layout changes), and that is most of what creating a
session costs: ResNet-50 200 ms of its 250, and a quarter of a tiny model's cold-start. A
multi-model endpoint loads the same files again and again as models are evicted and asked
for. So, after a model file's first load, a separate process (:mod:`.onnxruntime_optimizer`,
one model at a time, in a lull between requests and at the CPU's idle priority) writes the
optimized graph, as ONNX Runtime's
``optimized_model_filepath`` saves it, into the model cache (``<cache>/onnxruntime-optimized``);
later loads of the same file open that copy with optimizations off. The copy is what ONNX
Runtime itself would have built at that load, so outputs do not change.

What a copy is kept for, the key of its file name: the model file (its path, device, inode,
size, modification and change times: a file rewritten is another file), the optimization
level, and the machine (ONNX Runtime's version, the CPU's architecture and flags: the
``all`` level may choose kernels and layouts for this CPU). Only CPU sessions use copies, and
only of model files up to :data:`MAX_SOURCE_BYTES`. A copy that fails to open is deleted and
the model opened from its own file; a file the optimizer fails on (or crashes on) is not tried
again by this server. The copies' bytes are bounded (least recently used go first).

Settings (``--backend-config=onnxruntime,<key>=<value>``, Quiver's own keys):

- ``optimized-model-cache=<0|1>``: keep optimized graphs. Unset: on in the ``on_demand``
  model control mode (the multi-model endpoint, :mod:`quiver.settings`), off otherwise.
- ``optimized-model-cache-size=<bytes>``: most bytes the copies take (default 4 GiB).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import platform
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quiver.backends.base import SERVER, exit_cause

__all__ = [
    "CACHE",
    "CACHE_SIZE",
    "KEYS",
    "OptimizedModels",
    "check_settings",
    "optimized_models",
    "stop",
]

logger = logging.getLogger(__name__)

CACHE = "optimized-model-cache"
CACHE_SIZE = "optimized-model-cache-size"
KEYS = frozenset({CACHE, CACHE_SIZE})

DEFAULT_CACHE_BYTES = 4 << 30
#: Larger model files are opened from their own file every time (protobuf's 2 GiB limit on
#: the copy's one file, and the cache's bytes).
MAX_SOURCE_BYTES = 1 << 30
#: The optimizer process ends after this long without a job (its memory goes back).
IDLE_SECONDS = 30.0
#: One model's optimization that takes longer ends the optimizer (the model is not tried again).
JOB_TIMEOUT_SECONDS = 600.0
#: Jobs waiting at most; more are dropped (asked again at the file's next load).
MAX_PENDING = 1024
#: A job waits for this long without requests (the server's idle detector), so that it runs
#: between requests rather than beside them...
LULL_SECONDS = 0.02
#: ... but no longer than this: then it runs anyway, at the CPU's idle priority.
MAX_LULL_WAIT_SECONDS = 10.0
#: How often the optimizer's thread looks for jobs and a lull (it is never woken).
POLL_SECONDS = 0.05
#: Folders of copies for another machine key left this long untouched are deleted.
STALE_SECONDS = 7 * 24 * 3600

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
_SUFFIX = ".onnx"
_TEMPORARY = ".tmp-"
_OPTIMIZER = Path(__file__).with_name("onnxruntime_optimizer.py")


def check_settings(settings: Mapping[str, str]) -> None:
    """The optimized-graph settings, checked: ValueError names the key and the value."""
    flag = settings.get(CACHE)
    if flag is not None and flag.strip().lower() not in _TRUE + _FALSE:
        raise ValueError(f"onnxruntime,{CACHE}={flag}: use 1 (keep optimized graphs) or 0")
    size = settings.get(CACHE_SIZE)
    if size is not None and not size.strip().isdecimal():
        raise ValueError(f"onnxruntime,{CACHE_SIZE}={size}: a number of bytes, 0 or more")


def machine_key() -> str:
    """What an ``all``-level graph may depend on besides its file: ONNX Runtime's version and
    the CPU (architecture and feature flags)."""
    import onnxruntime as ort

    flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as file:
        for line in file:
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[-1].strip()
                break
    text = "\0".join((ort.__version__, platform.machine(), flags))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class _Entry:
    bytes: int
    used: float  # time.time() of its last use


class OptimizedModels:
    """Optimized copies of model files under ``root`` (one folder per :func:`machine_key`),
    at most ``budget`` bytes, made by one optimizer process at a time on a thread of its own.
    Thread-safe: :meth:`find` and :meth:`submit` are called from load threads."""

    def __init__(
        self,
        root: Path,
        budget: int = DEFAULT_CACHE_BYTES,
        *,
        python: str = sys.executable,
        idle_seconds: float = IDLE_SECONDS,
        timeout_seconds: float = JOB_TIMEOUT_SECONDS,
        idle_ns: Callable[[], int] | None = None,
    ) -> None:
        self.root = root
        self.budget = budget
        self._python = python
        self._idle = idle_seconds
        self._timeout = timeout_seconds
        self._idle_ns = idle_ns  # None: the server's (SERVER.idle_ns)
        self._lock = threading.Lock()
        self._jobs: deque[tuple[str, str, str]] = deque()
        self._stopping = False
        self._pending: set[str] = set()
        self._failed: set[str] = set()
        self._timeouts: dict[str, int] = {}  # key -> optimizations of it that timed out
        self._entries: dict[str, _Entry] = {}
        self._scanned = False
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._idle_event = threading.Event()
        self._idle_event.set()
        self.made = 0  # copies written by this server
        self.failures = 0  # files the optimizer failed on

    # -- the load threads' side ---------------------------------------------------------------

    def key(self, source: str, level: str) -> str | None:
        """The key of ``source``'s copy at ``level``, or None when the file is not one to
        keep a copy of (missing, not a regular file, or over :data:`MAX_SOURCE_BYTES`)."""
        try:
            st = os.stat(source)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
            return None
        text = f"{source}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{level}"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}{_SUFFIX}"

    def find(self, key: str) -> str | None:
        """The copy kept under ``key`` (a regular file; never a link), or None. Once the folder
        was read (:meth:`_scan`), a key neither found there nor made since is not looked for on
        disk: a model's first load, which has no copy, makes no system call for it (a copy
        another server made meanwhile is learnt when the optimizer meets it; a key that failed
        here is still looked for, since only another server can make its copy)."""
        with self._lock:
            if self._scanned and key not in self._entries and key not in self._failed:
                return None
        target = self.path(key)
        try:
            st = os.lstat(target)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            self.discard(key)
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(st.st_size, time.time())
            else:
                entry.used = time.time()
        return str(target)

    def discard(self, key: str) -> None:
        """Delete ``key``'s copy (it failed to open); its file is not optimized again here."""
        with contextlib.suppress(OSError):
            os.unlink(self.path(key))
        with self._lock:
            self._entries.pop(key, None)
            self._failed.add(key)

    def submit(self, source: str, level: str, key: str) -> None:
        """Have ``source`` optimized at ``level`` into ``key``'s copy, in the background (at
        most once at a time per key; never again after it failed). Nothing is woken: the
        optimizer's thread looks for jobs every :data:`POLL_SECONDS` (a thread woken here would
        take the GIL from the load that called and from the request it serves)."""
        with self._lock:
            if key in self._pending or key in self._failed or self.budget <= 0:
                return
            if len(self._pending) >= MAX_PENDING:
                return
            self._pending.add(key)
            self._jobs.append((source, level, key))
            self._idle_event.clear()
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(
                    target=self._run, name="quiver-onnxruntime-optimizer", daemon=True
                )
                self._thread.start()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every job submitted was done within ``timeout`` seconds (tests, benchmarks)."""
        return self._idle_event.wait(timeout)

    def stop(self) -> None:
        """End the optimizer process and its thread (jobs waiting are dropped; one running
        is cut short: its process is killed)."""
        with self._lock:
            thread = self._thread
            self._stopping = True
            process = self._process
        if process is not None:
            with contextlib.suppress(OSError):
                process.kill()  # an answer awaited ends now (the thread sees the pipe close)
        if thread is not None:
            thread.join(timeout=10)
        if thread is None or not thread.is_alive():
            self._end_process()

    # -- the optimizer's thread ---------------------------------------------------------------

    def _run(self) -> None:
        if not self._scanned:
            try:
                self._scan()
            except Exception:
                logger.exception("onnxruntime optimized graphs: could not read %s", self.root)
        last_work = time.monotonic()
        head_since = 0.0  # when the job first in line was first seen waiting for a lull
        while True:
            time.sleep(POLL_SECONDS)
            now = time.monotonic()
            with self._lock:
                stopping = self._stopping
                if stopping:
                    self._jobs.clear()
                    self._pending.clear()
                    self._idle_event.set()
                job = self._jobs[0] if self._jobs else None
                done = stopping or (job is None and self._process is None and now - last_work > self._idle)
                if done:
                    self._thread = None  # a later submit starts another
            if done:
                self._end_process()
                return
            if job is None:
                if self._process is not None and now - last_work > self._idle:
                    self._end_process()
                continue
            if not head_since:
                head_since = now
            if not self._quiet() and now - head_since < MAX_LULL_WAIT_SECONDS:
                continue  # requests come and go: look again later
            with self._lock:
                self._jobs.popleft()
            head_since = 0.0
            source, level, key = job
            try:
                self._optimize(source, level, key)
            except Exception:
                logger.exception("onnxruntime optimized graphs: optimizing %s failed", source)
                with self._lock:
                    self._failed.add(key)
            finally:
                last_work = time.monotonic()
                with self._lock:
                    self._pending.discard(key)
                    if not self._pending:
                        self._idle_event.set()

    def _quiet(self) -> bool:
        """Whether no request came or went for :data:`LULL_SECONDS` (the server's idle
        detector; True when nothing tells this server's activity)."""
        idle_ns = self._idle_ns if self._idle_ns is not None else SERVER.idle_ns
        return idle_ns is None or idle_ns() >= int(LULL_SECONDS * 1e9)

    def _scan(self) -> None:
        """The copies already there (made by earlier servers); temporary files left by a
        server that was killed are removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        found: dict[str, _Entry] = {}
        for item in os.scandir(self.root):
            with contextlib.suppress(OSError):
                st = item.stat(follow_symlinks=False)
                if item.name.startswith(_TEMPORARY):
                    if time.time() - st.st_mtime > 3600:  # left by a server that was killed
                        shutil.rmtree(item.path) if stat.S_ISDIR(st.st_mode) else os.unlink(item.path)
                elif item.name.endswith(_SUFFIX) and stat.S_ISREG(st.st_mode):
                    found[item.name[: -len(_SUFFIX)]] = _Entry(st.st_size, st.st_mtime)
        with self._lock:
            for key, entry in found.items():
                self._entries.setdefault(key, entry)
            self._scanned = True
        self._trim(keep="")
        # Copies for another ONNX Runtime or CPU (an upgrade, a moved cache), unused for a week.
        with contextlib.suppress(OSError):
            for item in os.scandir(self.root.parent):
                st = item.stat(follow_symlinks=False)
                if item.path != str(self.root) and stat.S_ISDIR(st.st_mode) and time.time() - st.st_mtime > STALE_SECONDS:
                    logger.info("onnxruntime: deleting optimized graphs of another machine or version, %s", item.path)
                    shutil.rmtree(item.path, ignore_errors=True)

    def _optimize(self, source: str, level: str, key: str) -> None:
        target = self.path(key)
        try:
            there = os.lstat(target)
        except OSError:
            there = None
        if there is not None:  # another server made it meanwhile: known from now on
            if not stat.S_ISREG(there.st_mode):
                self.discard(key)  # a link or a folder in its place: removed, never followed
                return
            with self._lock:
                self._entries.setdefault(key, _Entry(there.st_size, time.time()))
            self._trim(keep=key)
            return
        # A private, empty folder of its own (so two servers on one cache never share it): the
        # copy is written and opened there first, where a graph that names external data files
        # (resolved beside it) finds none, rather than in the cache folder among other files.
        work = Path(tempfile.mkdtemp(prefix=_TEMPORARY, dir=self.root))
        started = time.monotonic()
        try:
            job = {"source": source, "target": str(target), "temporary": str(work / f"copy{_SUFFIX}"), "level": level}
            answer = self._ask(job)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if answer is None or not answer.get("ok"):
            if answer is None:
                reason = f"no answer in {self._timeout:.0f} s"
                with self._lock:
                    self._timeouts[key] = self._timeouts.get(key, 0) + 1
                    given_up = self._timeouts[key] >= 2 and not self._stopping  # (once may be a starved CPU)
            else:
                reason, given_up = str(answer.get("error")), True
            if given_up:
                self._fail(key, source, reason)
            return
        try:
            size = os.lstat(target).st_size
        except OSError:
            return
        if size > self.budget:  # kept, it would be trimmed at once and made again at each load
            with contextlib.suppress(OSError):
                os.unlink(target)
            self._fail(key, source, f"its {size} bytes are more than {CACHE_SIZE}={self.budget}")
            return
        with self._lock:
            self._entries[key] = _Entry(size, time.time())
        self.made += 1
        logger.debug("onnxruntime: optimized graph of %s kept (%d bytes, %.0f ms)", source, size, (time.monotonic() - started) * 1e3)
        self._trim(keep=key)

    def _fail(self, key: str, source: str, reason: str) -> None:
        with self._lock:
            self._failed.add(key)
        self.failures += 1
        logger.warning(
            "onnxruntime: the optimized graph of %s could not be kept (%s); its loads optimize it each time",
            source, reason,
        )  # fmt: skip

    def _trim(self, keep: str) -> None:
        """Delete the least recently used copies until they fit the budget (``keep`` last)."""
        while True:
            with self._lock:
                total = sum(e.bytes for e in self._entries.values())
                if total <= self.budget or not self._entries:
                    return
                victim = min(self._entries, key=lambda k: (k == keep, self._entries[k].used))
                self._entries.pop(victim)
            with contextlib.suppress(OSError):
                os.unlink(self.path(victim))

    def _ask(self, job: dict[str, str]) -> dict[str, object] | None:
        """Send ``job`` to the optimizer process (started if need be) and read its answer: a
        failed one when the process ended (a crash on that model); None when it took longer
        than the timeout (it is then ended) or the server is stopping."""
        process = self._process
        if process is not None and process.poll() is not None:
            self._end_process()  # (its pipes closed)
            process = None
        if process is None:
            with self._lock:
                if self._stopping:
                    return None
                process = self._start()
        assert process.stdin is not None and process.stdout is not None
        ready: list[Any] = []
        try:
            process.stdin.write((json.dumps(job) + "\n").encode())
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], self._timeout)
            line = process.stdout.readline() if ready else b""
        except OSError:
            line = b""
        if not line:
            self._end_process()
            if ready and not self._stopping:  # it ended on this job (exited, or crashed)
                return {"ok": False, "error": f"the optimizer process {exit_cause(process.returncode)}"}
            return None
        try:
            answer = json.loads(line)
        except ValueError:
            self._end_process()
            return None
        return answer if isinstance(answer, dict) else None

    def _start(self) -> subprocess.Popen[bytes]:
        environ = dict(os.environ, QUIVER_OPTIMIZER_PARENT=str(os.getpid()))
        process = subprocess.Popen(
            [self._python, "-P", str(_OPTIMIZER)],  # -P: not its own folder first (quiver.backends.onnxruntime)
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=environ,
            cwd=str(self.root),
        )
        self._process = process
        _live.add(process)
        return process

    def _end_process(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        _live.discard(process)


_live: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _stop_all() -> None:
    for process in list(_live):
        with contextlib.suppress(OSError):
            process.kill()


_decided: list[OptimizedModels | None] = []
_decide_lock = threading.Lock()


def optimized_models() -> OptimizedModels | None:
    """This process's optimized copies, or None when they are off (decided at the first call,
    from the server's backend settings and cache folder)."""
    if _decided:
        return _decided[0]
    with _decide_lock:
        if not _decided:
            _decided.append(_start())
    return _decided[0]


def _start() -> OptimizedModels | None:
    settings = SERVER.backend_config.get("onnxruntime", {})
    try:
        check_settings(settings)
    except ValueError as exc:  # checked at start; a server built in code may not be
        logger.warning("%s; no optimized graphs kept", exc)
        return None
    if settings.get(CACHE, "0").strip().lower() not in _TRUE or SERVER.cache_dir is None:
        return None
    budget = int(settings.get(CACHE_SIZE, str(DEFAULT_CACHE_BYTES)) or 0)
    if budget <= 0:
        return None
    root = SERVER.cache_dir / "onnxruntime-optimized" / machine_key()
    logger.info(
        "onnxruntime: optimized graphs kept in %s (at most %d bytes; "
        "--backend-config=onnxruntime,%s=0 turns this off)",
        root, budget, CACHE,
    )  # fmt: skip
    return OptimizedModels(root, budget)


def stop() -> None:
    """End this process's optimizer, if it has one (the server stopping)."""
    if _decided and _decided[0] is not None:
        _decided[0].stop()
