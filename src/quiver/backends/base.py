"""What every backend provides, and the registry that picks one by name.

A backend turns a model's files into :class:`ModelInstance` objects. An instance runs
``execute(requests) -> responses`` on its own executor thread, so an instance group with
``count: 2`` runs two executions at once. Framework modules are imported lazily, when a
model of theirs is loaded, so the server starts without frameworks it does not need.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import importlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.instance_thread import InstanceThread
from quiver.config import InstanceGroup, ModelConfig
from quiver.errors import QuiverError, UnsupportedError
from quiver.errors import (
    format_exception as format_exception,  # re-exported: backends import it from here
)
from quiver.streaming import Cancellation, StreamResponse
from quiver.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """Where a model version lives on local disk."""

    repository: Path  # the model repository folder
    model_dir: Path  # <repository>/<model>
    version: int

    @property
    def version_dir(self) -> Path:
        return self.model_dir / str(self.version)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One instance to create: which group it belongs to and where it runs."""

    group: InstanceGroup
    index: int  # index within the group
    device_id: int = 0

    @property
    def name(self) -> str:
        return f"{self.group.name}_{self.index}"


#: An execute() result: one response or one error per request, in request order.
ExecuteResult = list["InferenceResponse | QuiverError"]


@dataclass(slots=True)
class ExecutionTiming:
    """How the last execution split its time (Triton's compute_input/infer/output).

    A backend that cannot tell the phases apart leaves it zero and the scheduler counts the
    whole execution as compute_infer.
    """

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    #: When the execution began, on the scheduler's clock, if the instance held it queued
    #: first (a worker process's queue: that wait is queue time); 0: as it was handed over.
    #: Set as ``run()`` returns, read by the scheduler at once.
    started_ns: int = 0


class ModelInstance(Protocol):
    name: str
    timing: ExecutionTiming

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        """Execute ``requests`` (one batch) and return one result per request."""
        ...

    def unload(self) -> None:
        """Release the framework's resources; called once, on the instance's thread."""
        ...


class Backend(Protocol):
    name: str

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Fill what the configuration leaves out (inputs, outputs, max_batch_size)."""
        ...

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> ModelInstance:
        """Load one instance; blocking, called on a load thread."""
        ...


#: Default for :attr:`ThreadedInstance.inline_threshold_ns` (``--inline-execution-threshold-us``).
INLINE_THRESHOLD_NS = 200_000
#: An instance's first call, before any is measured, is guessed to cost its creation time
#: divided by this (:meth:`ThreadedInstance.created_in`).
FIRST_CALL_DIVISOR = 8
#: ...and the guess is trusted only for a first call whose inputs hold at most this many bytes.
FIRST_CALL_MAX_INPUT_BYTES = 64 << 10


class ThreadedInstance(abc.ABC):
    """Base for instances whose ``execute`` blocks: one executor thread per instance.

    Handing a call to a thread and back costs two wake-ups, tens to hundreds of
    microseconds on a busy or virtualised machine. For an instance whose framework call is
    shorter than that (a small ONNX model), the hop is most of the request's cost. So each
    instance keeps a moving average of its execution time, and when it is below
    ``inline_threshold_ns`` and the framework may be called from any thread
    (``inline_safe``), the call runs on the event loop directly. One slow call (over 8x the
    average) resets the average at once, sending the next call back to the thread.

    Before the first call nothing is measured. An instance whose framework's first call is
    known to cost a small fraction of creating the instance (``first_call_guess``: ONNX
    Runtime's is 0.02-0.1x for models whose weights dominate, see the README's miss path)
    guesses it from its creation time (:meth:`created_in`, divided by
    :data:`FIRST_CALL_DIVISOR`; the loader gives the CPU time the creation took on its thread,
    not the wall time, which a busy machine stretches: a guess from that sent the first call
    to a thread just when starting one is slowest, 1-7 ms); a first call with at most :data:`FIRST_CALL_MAX_INPUT_BYTES`
    of inputs runs inline when that guess is under the threshold. A model just loaded on
    demand then answers its first request without starting its thread and handing the call
    over (0.3-0.6 ms on a busy 2-core machine); the call is timed like any other, so a first
    call that was slower sends the next ones to the thread.
    """

    #: Whether ``execute`` may run on a thread other than the instance's own.
    inline_safe = False
    #: Whether the first call's cost may be guessed from the creation time (:meth:`created_in`).
    first_call_guess = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.inline_threshold_ns = INLINE_THRESHOLD_NS
        self.timing = ExecutionTiming()
        self._executor = InstanceThread(f"quiver-{name}")
        self._cost_ns = -1  # moving average of execute(); -1 until measured
        self._guess_ns = -1  # the first call's guessed cost; -1: no guess

    def created_in(self, nanoseconds: int) -> None:
        """Creating this instance took ``nanoseconds`` of CPU: guess the first call's cost from
        it (when ``first_call_guess``)."""
        if self.first_call_guess and self.inline_safe:
            self._guess_ns = max(0, nanoseconds) // FIRST_CALL_DIVISOR

    @abc.abstractmethod
    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        """Run the framework on one batch; blocking, on the instance's thread."""

    def _timed(self, requests: list[InferenceRequest]) -> ExecuteResult:
        timing = self.timing
        timing.input_ns = timing.infer_ns = timing.output_ns = 0
        start = time.perf_counter_ns()
        try:
            return self.execute(requests)
        finally:
            spent = time.perf_counter_ns() - start
            cost = self._cost_ns
            self._cost_ns = spent if cost < 0 or spent > 8 * cost else (7 * cost + spent) >> 3

    @property
    def runs_inline(self) -> bool:
        return self.inline_safe and 0 <= self._cost_ns < self.inline_threshold_ns

    @property
    def answers_at_once(self) -> bool:
        """The next :meth:`run` is over before it returns (it runs inline, never waits): freed,
        the instance is lent to no one and every request waiting for it may take it in turn
        (:class:`quiver.scheduling.core.InstancePool`). Only an instance that keeps this class's
        :meth:`run` can promise it: one that overrides it may await even when inline."""
        return type(self).run is ThreadedInstance.run and self.runs_inline

    def _first_call_inline(self, requests: list[InferenceRequest]) -> bool:
        """Never run yet: whether the guess from the creation time lets ``requests`` run inline."""
        if self._cost_ns >= 0 or not 0 <= self._guess_ns < self.inline_threshold_ns:
            return False
        size = 0
        for request in requests:
            for tensor in request.inputs:
                size += tensor.data.nbytes if tensor.data.dtype != object else FIRST_CALL_MAX_INPUT_BYTES + 1
        return size <= FIRST_CALL_MAX_INPUT_BYTES

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        if self.runs_inline or (self._guess_ns >= 0 and self._first_call_inline(requests)):
            return self._timed(requests)
        running = self._executor.call(self._timed, requests)
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            # The thread cannot be stopped: the instance stays busy until the execution
            # ends, so the caller (and the scheduler that hands out instances) waits for it.
            # The model may stop early: its requests say they are cancelled now.
            for request in requests:
                request.cancellation = request.cancellation or Cancellation()
                request.cancellation.cancel()
            while not running.done():  # however often the caller is cancelled again
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((running,))
            if not running.cancelled():
                running.exception()  # retrieved: the caller hears of its cancellation only
            raise

    def release(self) -> None:  # noqa: B027 - optional hook, most instances need none
        """Framework clean-up; runs on the instance's own thread."""

    def unload(self) -> None:
        try:
            self._executor.submit(self.release).result()
        finally:
            self._executor.shutdown(wait=True)


@dataclass(slots=True)
class ServerContext:
    """The running server, for backends whose models call other models (Python BLS).

    Set by the model repository manager when the server starts: the inference entry
    (requests go through the normal path: checks, schedulers, statistics), the event
    loop it runs on and where instances report their health; by the runner: the backends'
    settings and cache folder. One per process, as Triton's Python backend has one server.
    """

    infer: Callable[[InferenceRequest], Awaitable[InferenceResponse]] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    #: The thread ``loop`` runs on (``threading.get_ident()``), set with it.
    thread: int = 0
    #: The streaming entry (``InferenceService.infer_stream``) and whether a model is
    #: decoupled, for BLS calls with ``decoupled=True``.
    infer_stream: Callable[[InferenceRequest], AsyncIterator[StreamResponse]] | None = None
    decoupled: Callable[[str, str], bool] | None = None
    #: ``--backend-config``: backend name ("" for global settings) -> key -> value.
    backend_config: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: Where backends keep what they make once (Python environments unpacked): the model cache.
    cache_dir: Path | None = None
    #: ``health(model, version, instance, reason)``: an instance cannot serve now (``reason``) or
    #: serves again (None); the manager shows a model whose instances all cannot as UNAVAILABLE.
    health: Callable[[str, int, str, str | None], None] | None = None
    #: Nanoseconds since a request last came or went (the manager's idle detector): work a
    #: backend does in the background waits for a lull. None before the manager starts.
    idle_ns: Callable[[], int] | None = None


SERVER = ServerContext()


def exit_cause(returncode: int | None) -> str:
    """How a child process ended, from its return code (``Popen.returncode``), for messages."""
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


#: Folders the backends keep under the model cache (:attr:`ServerContext.cache_dir`), which the
#: disk cache, in the same folder, leaves alone: packed Python environments unpacked
#: (:mod:`.python_env`), the Python worker's modules, ONNX Runtime's optimized graphs
#: (:mod:`.onnxruntime_optimized`).
CACHE_FOLDERS = frozenset({"python-envs", "python-worker", "onnxruntime-optimized"})


@dataclass(slots=True)
class _Registry:
    modules: dict[str, str] = field(
        default_factory=lambda: {
            "onnxruntime": "quiver.backends.onnxruntime",
            "python": "quiver.backends.python",
            "identity": "quiver.backends.identity",
            "pytorch": "quiver.backends.pytorch",
            "tensorflow": "quiver.backends.tensorflow",
            "dali": "quiver.backends.dali",
            "tensorrt": "quiver.backends.tensorrt",
        }
    )
    loaded: dict[str, Backend] = field(default_factory=dict)


_registry = _Registry()

#: Optional framework package -> the Quiver extra that installs it.
_EXTRAS = {"torch": "torch", "tensorflow": "tensorflow", "nvidia.dali": "dali", "nvidia": "dali"}


def imported_backend(name: str) -> Backend | None:
    """The backend called ``name`` if it has been imported already (nothing is imported)."""
    return _registry.loaded.get(name)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; raises UNSUPPORTED for one Quiver does not have."""
    known = _registry.loaded.get(name)
    if known is not None:
        return known
    module_name = _registry.modules.get(name)
    if module_name is None:
        raise UnsupportedError(
            f"backend '{name}' is not supported (available: {', '.join(sorted(_registry.modules))})"
        )
    rss_before, started = psutil.Process().memory_info().rss, time.monotonic()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = str(exc.name)
        extra = _EXTRAS.get(missing) or _EXTRAS.get(missing.partition(".")[0])
        hint = f"; install it with: pip install 'quiver[{extra}]'" if extra else ""
        raise UnsupportedError(
            f"backend '{name}' needs the Python package '{exc.name}', which is not installed{hint}"
        ) from None
    backend: Backend = module.BACKEND
    _registry.loaded[name] = backend
    # A framework's import is the process's, once, not a model's: it happens before the load
    # the memory budget measures, so say what it took (TensorFlow: seconds and ~0.6 GB).
    logger.info(
        "backend '%s' ready: its import took %.1f s and %d MB of host memory (not counted in "
        "--model-memory-limit)",
        name,
        time.monotonic() - started,
        max(0, psutil.Process().memory_info().rss - rss_before) >> 20,
    )
    return backend


def instance_specs(config: ModelConfig) -> list[InstanceSpec]:
    """Every instance the configuration's instance groups ask for."""
    specs: list[InstanceSpec] = []
    for group in config.instance_groups:
        gpus = group.gpus or (0,)
        for index in range(group.count):
            device = gpus[index % len(gpus)] if group.kind == "KIND_GPU" else 0
            specs.append(InstanceSpec(group=group, index=index, device_id=device))
    return specs


def model_path(config: ModelConfig, files: ModelFiles) -> Path:
    return files.version_dir / config.default_model_filename



