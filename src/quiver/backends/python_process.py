"""A Python model's worker process, as the server starts and stops it: the command (the model's
Python, a bootstrap that puts the worker's modules first and reports a missing numpy), the
``init``/``ready`` handshake within ``stub-timeout-seconds``, its shared-memory pools, its
batches in flight (:class:`Batch`), its exit cause, its memory (USS), and the guarantees that
it never outlives the server (``PR_SET_PDEATHSIG`` from a spawning thread that lives as long as
the process, an exit hook, and at start the removal of pools left by servers that were killed). Used by
:mod:`quiver.backends.python_worker` (serving) and :mod:`quiver.backends.python` (auto-complete).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import subprocess
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from quiver.backends.base import ModelFiles, exit_cause
from quiver.backends.python_env import PythonEnv
from quiver.backends.python_settings import PythonSettings
from quiver.config import ModelConfig
from quiver.errors import ErrorCode, InternalError, UnavailableError, error_for_code
from quiver.ipc import messages as msg
from quiver.ipc.channel import AsyncChannel, Channel, ChannelError, pipe_pair
from quiver.ipc.shm import SHM_DIR, Arena, Mapper, unlink, unlink_prefixed
from quiver.limits import ORIGINAL_SOFT_ENV

logger = logging.getLogger("quiver.backends.python_worker")

_model_logger = logging.getLogger("quiver.python_model")

#: Workers are started from this one thread, which lives as long as the process: the kernel
#: sends PR_SET_PDEATHSIG when the *thread* that forked a worker ends, not only the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quiver-python-spawner")
_worker_ids = itertools.count(1)
_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()
#: Blocks of a worker's pool the server has read are given back with the next batch, or in a
#: message of their own once this many wait.
_RELEASE_BATCH = 64

_BOOTSTRAP = """\
import os, sys
_soft = os.environ.pop({soft_env!r}, None)
if _soft:  # the model's code gets the open-file limit the server was started with
    import resource
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(_soft), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    except (ValueError, OSError):
        pass
sys.path.insert(0, {tree!r})
try:
    import numpy
except ImportError as exc:
    from quiver.ipc.channel import Channel
    fds = tuple(int(fd) for fd in os.environ["QUIVER_WORKER_FDS"].split(","))
    Channel(fds).send({{"op": "init_error", "code": "NUMPY", "message": str(exc)}})
    raise SystemExit(3)
from quiver.backends.python_stub import main
main()
"""


@atexit.register
def _stop_all() -> None:
    """No worker outlives a server that exits normally (SIGKILL is PR_SET_PDEATHSIG's)."""
    with _live_lock:
        processes = list(_live)
    for process in processes:
        with contextlib.suppress(OSError):
            process.kill()


def uss_bytes(pid: int) -> int:
    """The unique set size of ``pid`` (its private pages; ``/proc/<pid>/smaps_rollup``),
    else its RSS; 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            total = 0
            for line in file:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
            return total
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Batch:
    """A batch sent to the worker: its request ids, each request's result as it comes
    (``results``, None until then; ``missing`` counts those still to come), the future its
    task waits on, whether the worker is done with it (answered ``done``, or died), and
    whether it died before starting it (then the batch is sent again). ``limit``: the shortest
    ``timeout`` of its requests (microseconds, 0: none), whose ``timer`` runs from when the
    worker starts it; ``queued``: sent while the worker held another batch, so it waits there
    first; ``start``: then, when the worker started it (its report; else 0); ``sent``: when it
    was sent."""

    __slots__ = (
        "finished", "ids", "limit", "missing", "queued", "results", "sent", "start", "timer", "unstarted", "waiter",
    )

    def __init__(self, ids: list[str], waiter: asyncio.Future[None], results: list[Any] | None = None) -> None:
        self.ids = ids
        self.waiter = waiter
        self.results: list[Any] = [] if results is None else results
        self.missing = 0
        self.finished = False
        self.unstarted = False
        self.limit = 0
        self.queued = False
        self.sent = 0  # when it was sent (``time.monotonic_ns()``)
        self.start = 0
        self.timer: asyncio.TimerHandle | None = None

    def finish(self) -> None:
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.waiter.done():
            self.waiter.set_result(None)

    def answer(self, index: int, result: Any) -> None:
        """Request ``index``'s result (the first one counts); the waiter wakes when the batch
        is finished and every request has its result."""
        if self.results[index] is None:
            self.results[index] = result
            self.missing -= 1
            if not self.missing and self.finished and not self.waiter.done():
                self.waiter.set_result(None)


class Worker:
    """One started worker process: its channel, the pool the server writes into, the worker's."""

    def __init__(
        self, process: subprocess.Popen[bytes], channel: Channel, arena: Arena, mapper: Mapper, tag: str,
        started: memoryview | None = None,
    ) -> None:
        self.process = process
        self.channel = channel
        self.arena = arena
        self.mapper = mapper
        self.tag = tag
        self.achannel: AsyncChannel | None = None
        #: joining its pipes to the loop, once (two batches in flight may both find them not
        #: joined yet, and a second registration of a pipe fails: EEXIST)
        self.joining: asyncio.Future[None] | None = None
        self.finalized = False  # it answered ``finalize``: its channel's end is expected
        #: batches sent and not answered ``done``, in the order the worker runs them
        self.inflight: deque[int] = deque()
        #: blocks of the worker's pool read and not yet given back (sent with the next batch)
        self.releases: list[list[Any]] = []
        #: batches whose inputs are in the server's pool (sent, and the worker not done with them)
        self.holding = 0
        #: resolved when a batch's inputs leave the server's pool (one waits for room there)
        self.freed: asyncio.Future[None] | None = None
        #: A word of the server's pool where the worker writes the number of each batch as it
        #: starts it: once it died, the batches it held and had not started are known.
        self.started = started

    def started_batch(self) -> int:
        """The number of the batch the worker started last (0: none yet)."""
        return int(self.started[0]) if self.started is not None else 0

    def inputs_freed(self, batches: int = 0) -> None:
        """``batches`` batches' inputs left the server's pool (or the pool is gone with the
        process): a batch waiting for room looks again."""
        self.holding -= batches
        freed = self.freed
        if freed is not None:
            self.freed = None
            if not freed.done():
                freed.set_result(None)

    def release(self, descriptors: Any) -> None:
        """The blocks of the worker's pool that ``descriptors`` (tensors read) name are given
        back with the next batch (or now, once many wait)."""
        releases = self.releases
        for descriptor in descriptors:
            try:
                if descriptor[3]:  # an empty tensor has no block
                    releases.append([descriptor[3], descriptor[4]])
            except (IndexError, KeyError, TypeError):  # not a descriptor (read() said so)
                pass
        if len(releases) >= _RELEASE_BATCH and self.achannel is not None:
            self.achannel.send({"op": msg.RELEASE, "blocks": releases})
            self.releases = []

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()

    def close(self) -> None:
        """After the process ended: unmap and unlink both pools."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        with _live_lock:
            _live.discard(self.process)
        if self.achannel is not None:
            self.achannel.close()
        else:
            self.channel.close()
        if self.started is not None:
            self.started.release()
        self.mapper.close()
        self.arena.close()
        unlink_prefixed(self.tag)


def start_worker(
    config: ModelConfig, files: ModelFiles, env: PythonEnv, tree: str, settings: PythonSettings,
    init_args: dict[str, str] | None, auto_complete: dict[str, Any] | None = None,
) -> tuple[Worker, dict[str, Any]]:
    """Start a worker and wait (blocking) for its ``ready``; the worker and that message.
    QuiverError names the model and what went wrong."""
    where = f"model '{config.name}' version {files.version}"
    _sweep(settings.shm_region_prefix_name)
    tag = f"{settings.shm_region_prefix_name}{os.getpid()}_{next(_worker_ids)}_"
    ours, theirs = pipe_pair()
    environ = env.environ(dict(os.environ))
    environ["QUIVER_WORKER_FDS"] = f"{theirs[0]},{theirs[1]}"
    environ["QUIVER_WORKER_PARENT"] = str(os.getpid())
    command = [env.python, *(["-I"] if env.isolated else []), "-c", _BOOTSTRAP.format(tree=tree, soft_env=ORIGINAL_SOFT_ENV)]

    def spawn() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(command, pass_fds=theirs, env=environ, cwd=str(files.version_dir))
        with _live_lock:
            _live.add(process)
        return process

    try:
        process = _SPAWNER.submit(spawn).result()
    except OSError as exc:
        for fd in ours:
            os.close(fd)
        raise UnavailableError(f"{where}: starting its Python worker ({env.python}) failed: {exc}") from None
    finally:
        for fd in theirs:
            os.close(fd)
    channel = Channel(ours)
    arena = Arena(tag + "s", settings.shm_default_byte_size, settings.shm_growth_byte_size, settings.shm_max_byte_size)
    marker, view = arena.alloc(8)
    started = view.cast("q")
    started[0] = 0
    worker = Worker(process, channel, arena, Mapper(tag + "w"), tag, started)
    try:
        channel.send(
            {
                "op": msg.INIT,
                "args": init_args or {},
                "auto_complete": auto_complete,
                "model_name": config.name,
                "model_version": files.version,
                "model_dir": str(files.model_dir),
                "filename": config.default_model_filename,
                "outputs": [tensor.name for tensor in config.outputs],
                "spin_us": settings.spin_microseconds,
                "report_cpu": settings.answer_spin_microseconds > 0,
                "shm": {
                    "started": [marker.segment, marker.offset],
                    "prefix": tag + "w",
                    "server_prefix": tag + "s",
                    "default": settings.shm_default_byte_size,
                    "growth": settings.shm_growth_byte_size,
                    "max": settings.shm_max_byte_size,
                },
            }
        )
        while True:
            try:
                answer = channel.recv(settings.stub_timeout_seconds)
            except TimeoutError:
                raise UnavailableError(
                    f"{where}: its Python worker did not finish loading and initialize() within "
                    f"{settings.stub_timeout_seconds:g} s (--backend-config=python,stub-timeout-seconds)"
                ) from None
            if answer is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(5)
                raise UnavailableError(f"{where}: its Python worker {exit_cause(process.poll())} while loading")
            if answer["op"] == msg.LOG:
                log_message(answer)
                continue
            break
        if answer["op"] == msg.INIT_ERROR:
            code, message = str(answer.get("code")), str(answer.get("message"))
            if code == "NUMPY":
                raise UnavailableError(
                    f"{where}: the Python environment '{env.root}' ({env.python}) has no numpy "
                    f"({message}); Triton's Python backend needs numpy in EXECUTION_ENV_PATH's "
                    "environment: install it there before packing it"
                )
            raise error_for_code(ErrorCode[code] if code in ErrorCode.__members__ else ErrorCode.INTERNAL, message)
        if answer["op"] != msg.READY:
            raise InternalError(f"{where}: its Python worker answered '{answer['op']}' instead of 'ready'")
        return worker, answer
    except (OSError, ChannelError) as exc:
        worker.kill()
        worker.close()
        raise UnavailableError(f"{where}: talking to its Python worker failed: {exc}") from None
    except BaseException:
        worker.kill()
        worker.close()
        raise


def log_message(message: dict[str, Any]) -> None:
    """A ``log`` message of a worker, into the server's log."""
    level = message.get("level", logging.INFO)
    _model_logger.log(level if isinstance(level, int) else logging.INFO, "%s", message.get("message", ""))


def wait(process: subprocess.Popen[bytes]) -> int | None:
    try:
        return process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()

_swept: set[str] = set()


def _sweep(prefix: str) -> None:
    """Remove the pools (``<prefix><pid>_...``) of servers that are gone (killed: nobody unlinked
    them), once per prefix and process."""
    if prefix in _swept:
        return
    _swept.add(prefix)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].partition("_")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            unlink(name)
        except PermissionError:  # another user's server, alive
            pass
