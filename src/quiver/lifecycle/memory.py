"""Memory accounting for models: measure what a load really took, predict it before the next
load, and keep the sum of resident and loading models under a byte budget.

Three parts, each usable alone:

- :class:`MemoryMeter` measures one load: process RSS growth around it (psutil) and, when a
  GPU and NVML (or an already-imported torch with CUDA) are present, per-device GPU memory
  growth (:mod:`quiver.lifecycle.gpu_memory`, which also holds ``--model-load-gpu-limit``).
  No GPU, no NVML: the GPU figure is ``None``, silently.
- :class:`SizePredictor` remembers measured sizes per model identity (name, version, content
  fingerprint or ETag) and predicts a size before a load: the measurement of that exact
  identity, else from the model's files (``overhead + factor * file bytes``, see below),
  raised to any earlier measurement of the same model name.
- :class:`~quiver.lifecycle.budget.MemoryBudget` (in :mod:`quiver.lifecycle.budget`,
  re-exported here) is the ledger that keeps resident, retiring and reserved bytes under the
  limit at every step, and :class:`~quiver.lifecycle.budget.BudgetGate` is where loads wait
  for room.

**Why RSS deltas are trustworthy here, and when they are not.** RSS is per process, so a
delta measured around one load includes whatever other threads allocated or freed meanwhile.
The meter therefore serializes *measured* sections with a lock; loads that need no
measurement and unloads run through :meth:`MemoryMeter.shared`, alongside each other but
never alongside a measured load (an unload freeing 100 MB during a measured load would make
that load look 100 MB smaller). Inference in other threads still allocates while a load is
measured; it is the remaining noise, small next to model weights. Second, glibc keeps freed
memory in its heap: a load that parses a protobuf into temporary buffers shows those buffers
in RSS until ``malloc_trim`` returns them. The meter trims (glibc only; elsewhere a no-op)
before and after each measured load, which turns a noisy transient into the retained
footprint (no full garbage collection: see :func:`release_free_memory`). Third, glibc's
moving mmap threshold lets a freed model's blocks stay
in the heap and be reused by the next load (measured as 0, then as 2 models): under a budget
the manager fixes the threshold (:func:`fix_mmap_threshold`). Measured on this machine (2
cores, onnxruntime 1.31 CPU, MatMul chains of 1024x1024 FP32 weights, several models loaded
in one process, one inference run each):

=========  ==============  ==================  ==========================
file size  RSS+ (trimmed)  RSS+ (not trimmed)  ratio trimmed / file size
=========  ==============  ==================  ==========================
4 MB       4.2 MB          16.2 MB             1.05
24 MB      24.3 MB         60.2 MB             1.01
48 MB      49.2 MB         132.2 MB            1.03
100 MB     100.4 MB        156.4 MB            1.00
200 MB     200.5 MB        312.4 MB            1.00
(reload)   100.2 / 200.5   200.1 / 360.4       1.00
=========  ==============  ==================  ==========================

TorchScript (``torch.jit.load`` of Linear stacks) retained 1.01x as well. Hence
:data:`DEFAULT_FILE_FACTOR` = 1.1 (the measured 1.00-1.05 plus a margin) and :data:`DEFAULT_OVERHEAD_BYTES` = 2 MiB per model. Untrimmed, the *transient*
peak during a load is 1.3-3x the file size; the budget counts retained bytes, so keep some
headroom below the machine's memory for one load's transient (measured loads are serialized,
so there is at most one such peak at a time).

**A framework's one-time cost is not a model's.** The first model of a framework in a process
also pays for the framework itself. Measured here (RSS, trimmed): importing onnxruntime
20.3 MB and its first session 10.4 MB (a second one 0.2 MB); importing torch 196 MB and its
first TorchScript module 11.2 MB (a second one 0.1 MB). Charged to the first model, that
cost would stick to it (its remembered size, hence every later prediction) and could make a
10 MB model look larger than a 30 MB budget. So the manager *primes* each framework once
(:func:`quiver.lifecycle.frameworks.prime`: import it and open a tiny session) in a measured
section of its own before the first model of that framework loads; models are measured
after it, and their sizes hold only their own bytes. The framework's bytes are reported
(``quiver_model_framework_bytes{framework}`` and a log line) and are **not** counted in the
model memory budget, like the interpreter and the server's own libraries: the budget is for
models, and the machine needs room for the frameworks in use besides it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import psutil

from quiver.lifecycle.budget import Admission, MemoryBudget, OutOfMemoryError
from quiver.lifecycle.clock import SYSTEM_CLOCK, Clock, seconds
from quiver.lifecycle.gpu_memory import GpuMemoryLimit, gpu_memory_info, gpu_memory_used

__all__ = [
    "DEFAULT_FILE_FACTOR",
    "DEFAULT_OVERHEAD_BYTES",
    "DEFAULT_UNKNOWN_BYTES",
    "Admission",
    "Footprint",
    "GpuMemoryLimit",
    "MemoryBudget",
    "MemoryMeter",
    "ModelIdentity",
    "OutOfMemoryError",
    "Prediction",
    "SizePredictor",
    "file_bytes",
    "fix_mmap_threshold",
    "gpu_memory_info",
    "gpu_memory_used",
    "release_free_memory",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20

#: Predicted bytes per byte of model files (ONNX Runtime / TorchScript retained 1.00-1.05x; see above).
DEFAULT_FILE_FACTOR = 1.1
#: Predicted bytes per model on top of its files (sessions, kernels, small buffers).
DEFAULT_OVERHEAD_BYTES = 2 * MiB
#: Prediction when nothing is known: no measurement and no files to look at.
DEFAULT_UNKNOWN_BYTES = 64 * MiB


# -- process memory ----------------------------------------------------------------------------


def _load_libc_function(name: str) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function: Callable[..., int] = getattr(libc, name)
    except (OSError, AttributeError):
        return None  # not glibc (musl has no malloc_trim)
    return function


_MALLOC_TRIM = _load_libc_function("malloc_trim")
_MALLOPT = _load_libc_function("mallopt")
_M_MMAP_THRESHOLD = -3

#: Allocations from this size up are mapped on their own and unmapped when freed (see
#: :func:`fix_mmap_threshold`).
MMAP_THRESHOLD_BYTES = 1 << 20


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc map every allocation of ``threshold`` bytes or more on its own, for good.

    By default glibc raises its mmap threshold each time a large mapped block is freed (up to
    32 MiB), after which blocks of that size come from the heap and may stay in RSS when freed:
    unloading one model then loading another measured one model's growth as 0 and the next as
    2 models (10 MB ONNX models, loaded and unloaded in turn: 10.6, 21.1, 0.1 MB). Setting the
    threshold fixes it (and turns the adjustment off): the same sequence measures 10.6, 10.6,
    10.6 MB. The cost is a map and unmap per large block (request tensors of a MiB or more),
    as glibc does anyway before it first moves its threshold (which starts at 128 KiB). The
    manager sets it when a memory budget is configured. Returns whether it was set (glibc
    only)."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, int(threshold)))


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``, outside the GIL).
    No garbage collection: a full one stops every thread for tens of milliseconds (69 ms with
    onnxruntime and tritonclient imported); backends free their objects by reference count."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_PROCESS: list[psutil.Process] = []  # this process, kept (psutil.Process() reads /proc)


def _process_rss() -> int:
    if not _PROCESS or _PROCESS[0].pid != os.getpid():
        _PROCESS[:] = [psutil.Process()]
    return int(_PROCESS[0].memory_info().rss)


# -- MemoryMeter -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one measured load took: host bytes (RSS growth, never negative), GPU bytes per
    device (``None`` without a GPU), and how long it ran in seconds (the load cost)."""

    host_bytes: int
    gpu_bytes: Mapping[int, int] | None
    seconds: float

    @property
    def gpu_total(self) -> int | None:
        return None if self.gpu_bytes is None else sum(self.gpu_bytes.values())


class _SharedExclusiveLock:
    """Many shared holders or one exclusive holder; a waiting exclusive holder blocks new shared ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting_exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting_exclusive += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class MemoryMeter:
    """Measures the memory a load takes, as process RSS growth (and GPU growth when present).

    Call :meth:`measure` *in the load thread*, around the blocking backend load (and its
    warmup): ``model, footprint = meter.measure(load)``. Measured sections never overlap each
    other or a :meth:`shared` section, so each delta belongs to one load; downloads and
    extraction should stay outside (they do not grow the heap, and they would hold the lock).
    Loads of models whose size is already known may use :meth:`shared`, which lets them run
    in parallel with each other while still keeping them out of measured sections.

    ``rss``, ``gpu`` and ``clock`` are injectable for tests; ``trim`` (default on) calls
    ``malloc_trim`` before and after, so the delta is retained memory, not
    the allocator's leftovers from parsing (see the module notes for measurements).
    """

    def __init__(
        self,
        *,
        rss: Callable[[], int] = _process_rss,
        gpu: Callable[[], Mapping[int, int] | None] | None = gpu_memory_used,
        clock: Clock = SYSTEM_CLOCK,
        trim: bool = True,
    ) -> None:
        self._rss = rss
        self._gpu = gpu
        self._clock = clock
        self._trim = trim
        self._lock = _SharedExclusiveLock()

    def _settle(self) -> None:
        if self._trim:
            release_free_memory()

    def _gpu_now(self) -> Mapping[int, int] | None:
        if self._gpu is None:
            return None
        try:
            return self._gpu()
        except Exception:
            return None

    def measure(self, load: Callable[[], T]) -> tuple[T, Footprint]:
        """Run ``load`` alone (no other measured or shared section at the same time) and
        return its result with its footprint. Exceptions from ``load`` propagate."""
        with self._lock.exclusive():
            self._settle()
            rss_before = self._rss()
            gpu_before = self._gpu_now()
            started = seconds(self._clock)
            result = load()
            duration = seconds(self._clock) - started
            self._settle()
            host = max(0, self._rss() - rss_before)
            gpu_after = self._gpu_now() if gpu_before is not None else None
        gpu: dict[int, int] | None = None
        if gpu_before is not None and gpu_after is not None:
            gpu = {d: max(0, gpu_after.get(d, 0) - gpu_before.get(d, 0)) for d in gpu_after}
        footprint = Footprint(host, gpu, duration)
        logger.debug("measured load: %d host bytes, gpu %s, %.3f s", host, gpu, duration)
        return result, footprint

    def shared(self, load: Callable[[], T]) -> T:
        """Run ``load`` unmeasured: in parallel with other shared loads, never during a measured one."""
        with self._lock.shared():
            return load()


# -- SizePredictor -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """What a measured size belongs to: a model's name, version and a fingerprint of its
    content (the manager's file fingerprint, or the archive's ETag)."""

    name: str
    version: str
    fingerprint: str


PredictionSource = Literal["measured", "previous", "files", "default"]


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted size in bytes and where it came from: ``measured`` (this exact identity
    loaded before), ``previous`` (an earlier measurement of the same model name, another
    version or content, which was larger than the file estimate), ``files`` (overhead +
    factor x file bytes) or ``default`` (nothing known)."""

    bytes: int
    source: PredictionSource


def file_bytes(paths: Path | Iterable[Path]) -> int:
    """Total size of the regular files at or under ``paths`` (symlinks not followed)."""
    roots = [paths] if isinstance(paths, Path) else list(paths)
    total = 0
    for root in roots:
        try:
            if root.is_file():
                total += root.stat().st_size
                continue
        except OSError:
            continue
        for folder, _dirs, files in os.walk(root):
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(folder, name))
                    if not os.path.islink(os.path.join(folder, name)):
                        total += st.st_size
    return total


class SizePredictor:
    """Remembers measured sizes per :class:`ModelIdentity` and predicts sizes before loads.

    :meth:`predict` answers, in order: the last measurement of this exact identity; else
    ``overhead_bytes + file_factor * (bytes of the model's files)``, raised to the last
    measurement of the same model name under another version or content if that is larger
    (under-predicting overshoots the budget, over-predicting only evicts one model early);
    else that earlier measurement alone; else ``default_bytes``. Predictions are never below
    ``overhead_bytes``. Thread-safe.
    """

    def __init__(
        self,
        *,
        file_factor: float = DEFAULT_FILE_FACTOR,
        overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
        default_bytes: int = DEFAULT_UNKNOWN_BYTES,
    ) -> None:
        if file_factor <= 0:
            raise ValueError("file_factor must be positive")
        if overhead_bytes < 0 or default_bytes < 0:
            raise ValueError("overhead_bytes and default_bytes must not be negative")
        self.file_factor = file_factor
        self.overhead_bytes = overhead_bytes
        self.default_bytes = default_bytes
        self._measured: dict[ModelIdentity, int] = {}
        self._by_name: dict[str, int] = {}  # last measurement of any identity with that name
        self._lock = threading.Lock()

    def record(self, identity: ModelIdentity, measured_bytes: int) -> None:
        """Remember a load's measured footprint (the latest measurement wins)."""
        value = max(0, int(measured_bytes))
        with self._lock:
            self._measured[identity] = value
            self._by_name[identity.name] = value

    def measured(self, identity: ModelIdentity) -> int | None:
        with self._lock:
            return self._measured.get(identity)

    def forget(self, identity: ModelIdentity) -> None:
        """Drop the measurement of one identity (e.g. its content was deleted from the store)."""
        with self._lock:
            self._measured.pop(identity, None)

    def from_files(self, paths: Path | Iterable[Path]) -> int | None:
        """``overhead + factor * file bytes``, or ``None`` when there are no files."""
        total = file_bytes(paths)
        if total <= 0:
            return None
        return self.overhead_bytes + int(total * self.file_factor)

    def predict(
        self, identity: ModelIdentity, paths: Path | Iterable[Path] = (), *, estimate: int | None = None
    ) -> Prediction:
        """Predicted footprint of ``identity``; ``paths`` are its files on disk (the model folder
        or version folders), looked at only when no measurement of this identity exists and
        no ``estimate`` (:meth:`from_files` of them, taken already) is given."""
        with self._lock:
            exact = self._measured.get(identity)
            previous = self._by_name.get(identity.name)
        if exact is not None:
            return Prediction(max(exact, self.overhead_bytes), "measured")
        if estimate is None:
            estimate = self.from_files(paths)
        if estimate is not None:
            if previous is not None and previous > estimate:
                return Prediction(previous, "previous")
            return Prediction(estimate, "files")
        if previous is not None:
            return Prediction(max(previous, self.overhead_bytes), "previous")
        return Prediction(max(self.default_bytes, self.overhead_bytes), "default")
