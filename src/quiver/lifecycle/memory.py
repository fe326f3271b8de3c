"""Memory accounting for models: measure what a load really took, predict it before the next
load, and keep the sum of resident and loading models under a byte budget.

Three parts, each usable alone:

- :class:`MemoryMeter` measures one load: the growth of the C heap's bytes in use (glibc
  ``mallinfo2``) for frameworks that allocate from it alone, else the process RSS growth
  around it (psutil), and, when a GPU and NVML (or an already-imported torch with CUDA) are
  present, per-device GPU memory growth (:mod:`quiver.lifecycle.gpu_memory`, which also
  holds ``--model-load-gpu-limit``). No GPU, no NVML: the GPU figure is ``None``, silently.
- :class:`SizePredictor` remembers measured sizes per model identity (name, version, content
  fingerprint or ETag) and predicts a size before a load: the measurement of that exact
  identity, else from the model's files (``overhead + factor * file bytes``, see below),
  raised to any earlier measurement of the same model name.
- :class:`~quiver.lifecycle.budget.MemoryBudget` (in :mod:`quiver.lifecycle.budget`,
  re-exported here) is the ledger that keeps resident, retiring and reserved bytes under the
  limit at every step, and :class:`~quiver.lifecycle.budget.BudgetGate` is where loads wait
  for room.

**Why these deltas are trustworthy here, and when they are not.** RSS and the heap are per
process, so a delta measured around one load includes whatever other threads allocated or
freed meanwhile. The meter therefore serializes *measured* sections with a lock; loads that
need no measurement and unloads run through :meth:`MemoryMeter.shared`, alongside each other
but never alongside a measured load (an unload freeing 100 MB during a measured load would
make that load look 100 MB smaller). Inference in other threads still allocates while a load
is measured; it is the remaining noise, small next to model weights. Second, glibc keeps
freed memory in its heap: a load that parses a protobuf into temporary buffers shows those
buffers in RSS until ``malloc_trim`` returns them. Third, glibc's moving mmap threshold lets
a freed model's blocks stay in the heap and be reused by the next load (measured as 0, then
as 2 models): under a budget the manager fixes the threshold (:func:`fix_mmap_threshold`),
after which a load's large transient buffers are mapped and unmapped on their own and leave
nothing behind.

Two measurements follow. **By the heap** (``MemoryMeter.measure(load, heap=True)``, for the
frameworks in :data:`quiver.lifecycle.frameworks.HEAP_ALLOCATING`): the growth of
``uordblks + hblkhd`` of glibc's ``mallinfo2()`` (bytes handed out by every arena, plus blocks
mapped on their own), read in about a microsecond in a fresh process and in 60-150 us in one
whose arenas a thousand loads fragmented (:func:`limit_arenas`); freed temporaries are not in use, so no
trim is needed. It cannot see memory that does not come from ``malloc``: Python objects
(pymalloc maps its own arenas), files a framework maps instead of reading, shared libraries
paged in; hence it is used only for frameworks checked to allocate from the heap, and a model
never counts for less than its files (:class:`SizePredictor`'s floor, applied by the
admission). **By RSS** (everything else, and wherever ``mallinfo2`` is missing: not glibc, or
glibc before 2.33): RSS growth with ``malloc_trim`` before and after (glibc only; elsewhere a
no-op), which turns a noisy transient into the retained footprint (no full garbage
collection: see :func:`release_free_memory`). The two trims cost 0.1-0.3 ms per load on a
server with a hundred models loaded, a third of a small model's whole miss; the heap reading
costs a fraction of that.

Measured on this machine (2 cores, glibc 2.36, onnxruntime 1.32 CPU with the global thread
pools the server uses, torch 2.13 CPU; MatMul chains of 1024x1024 FP32 weights and
``torch.jit`` Linear stacks of the same sizes, several models loaded in one process, one
inference run each, mmap threshold fixed; the unfixed column is glibc's default moving
threshold):

====================  ==============  ==========  ==========================  =====================
model file            RSS+ (trimmed)  heap+       RSS+ untrimmed (fixed thr.)  RSS+ untrimmed (unfixed)
====================  ==============  ==========  ==========================  =====================
ONNX 0.3 KB           0.10 MB         1.10 MB     0.10 MB                     0.11 MB
ONNX 4 MB             4.18 MB         5.11 MB     4.18 MB                     12.1 MB
ONNX 24 MB            24.2 MB         25.2 MB     24.2 MB                     56.1 MB
ONNX 48 MB            48.2 MB         49.2 MB     48.2 MB                     104.1 MB
ONNX 100 MB           100.3 MB        101.3 MB    100.3 MB                    208.2 MB
ONNX 200 MB           200.5 MB        201.5 MB    200.5 MB                    332.2 MB
ONNX 100 MB reloaded  100.2 MB        101.3 MB    100.2 MB                    260.0 MB
TorchScript 4 MB      4.35 MB         4.06 MB     4.35 MB
TorchScript 24 MB     24.2 MB         24.2 MB     24.2 MB
TorchScript 48 MB     48.3 MB         48.3 MB     48.3 MB
TorchScript 100 MB    100.7 MB        100.7 MB    100.7 MB
TorchScript 200 MB    201.1 MB        201.3 MB    201.2 MB
====================  ==============  ==========  ==========================  =====================

The heap reads 1 MB more than RSS for every ONNX Runtime session: the first chunk of the
session's CPU memory arena, 1 MiB mapped at once and touched as inference needs it (0 with
``enable_mem_arena`` off); the heap counts it whole, as a larger batch will use it. The
first TorchScript model after the framework is primed reads 2.9 MB by the heap against 6.1 MB
by RSS: torch's first real forward pages in code and thread state, the framework's bytes,
not the model's. Retained memory is 1.00-1.05x the file size either way; hence
:data:`DEFAULT_FILE_FACTOR` = 1.1 (plus a margin) and :data:`DEFAULT_OVERHEAD_BYTES` = 2 MiB
per model. With glibc's moving threshold the *transient* peak of a load stays in RSS
(1.3-3x the file size) until trimmed; with the fixed threshold it is unmapped as it is freed,
and the budget counts retained bytes.

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
import math
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
from quiver.limits import usable_cores

__all__ = [
    "DEFAULT_FILE_FACTOR",
    "DEFAULT_OVERHEAD_BYTES",
    "DEFAULT_UNKNOWN_BYTES",
    "TRIM_AFTER_BYTES",
    "Admission",
    "Footprint",
    "GpuMemoryLimit",
    "MemoryBudget",
    "MemoryMeter",
    "ModelIdentity",
    "OutOfMemoryError",
    "Prediction",
    "SizePredictor",
    "TrimSchedule",
    "file_bytes",
    "fix_mmap_threshold",
    "gpu_memory_info",
    "gpu_memory_used",
    "heap_in_use",
    "limit_arenas",
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
_M_ARENA_MAX = -8


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): every field a ``size_t``."""

    _fields_ = [
        (field, ctypes.c_size_t)
        for field in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


def _load_mallinfo2() -> Callable[[], int] | None:
    function = _load_libc_function("mallinfo2")
    if function is None:
        return None  # glibc before 2.33, or not glibc
    function.restype = _MallInfo2  # type: ignore[attr-defined]
    function.argtypes = []  # type: ignore[attr-defined]

    def heap_in_use() -> int:
        info: _MallInfo2 = function()  # type: ignore[assignment]
        # bytes handed out from the arenas (all of them) + blocks mapped on their own
        return int(info.uordblks) + int(info.hblkhd)

    return heap_in_use


#: Bytes the C heap has handed out and not had back (glibc ``mallinfo2``: ``uordblks +
#: hblkhd``, every arena), or ``None`` where it cannot be read (not glibc, or older than 2.33).
heap_in_use: Callable[[], int] | None = _load_mallinfo2()

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


def limit_arenas(count: int | None = None) -> bool:
    """At most ``count`` glibc malloc arenas in this process (default: the cores it may use,
    :func:`~quiver.limits.usable_cores`),
    against glibc's default of 8 per core; unless ``MALLOC_ARENA_MAX`` or the
    ``glibc.malloc.arena_max`` tunable is set in the environment, which glibc applied already
    and which wins. Returns whether it was asked. glibc fixes its limit for good when a
    process makes its ninth arena, so this works only before that: the admission calls it as
    the server starts.

    Why, under a budget: reading the heap (:data:`heap_in_use`, ``mallinfo2``) locks every
    arena and walks its free lists, so it costs in proportion to the arenas and to how
    fragmented they are. In a server that has loaded and unloaded a thousand models, one
    reading took 150 us at the median on a model's first load (``benchmarks.miss_timeline
    --fine``, 2026-12-08), against 60 us with 2 arenas on this 2-core machine; a measured load
    reads it twice. Fewer arenas also keep fewer freed pages apart, the usual advice for
    long-running Python servers. The cost: threads share an arena when there are more threads
    than arenas and wait for its lock when they allocate at the same moment. ONNX Runtime
    allocates its tensors from its own arena; torch on the CPU calls ``malloc`` for each, so
    many torch instances running at once on a many-core machine may contend (set
    ``MALLOC_ARENA_MAX`` to choose); on this machine the multi-model benchmark showed none."""
    if _MALLOPT is None or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    if "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    count = usable_cores() if count is None else count
    return bool(_MALLOPT(_M_ARENA_MAX, max(1, int(count))))


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``, outside the GIL).
    No garbage collection: a full one stops every thread for tens of milliseconds (69 ms with
    onnxruntime and tritonclient imported); backends free their objects by reference count."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


#: Unloads under a budget hand the C heap's free pages back once models of this many bytes
#: were freed since the last time (:class:`TrimSchedule`).
TRIM_AFTER_BYTES = 4 << 20


class TrimSchedule:
    """When unloads give the C heap's free pages back to the OS (:func:`release_free_memory`:
    0.1-0.3 ms on a server with a hundred models loaded, a good part of a small model's
    unload): once models of ``after_bytes`` were freed since the last time. A model's blocks
    of 1 MiB or more are unmapped as they are freed (:func:`fix_mmap_threshold`), so what
    waits meanwhile is smaller blocks, which the next loads reuse."""

    def __init__(self, after_bytes: int = TRIM_AFTER_BYTES) -> None:
        self._after = after_bytes
        self._freed = 0

    def freed(self, size: int) -> bool:
        """Models of ``size`` bytes were freed: whether to trim now."""
        self._freed += size
        if self._freed < self._after:
            return False
        self._freed = 0
        return True


_PROCESS: list[psutil.Process] = []  # this process, kept (psutil.Process() reads /proc)


def _process_rss() -> int:
    if not _PROCESS or _PROCESS[0].pid != os.getpid():
        _PROCESS[:] = [psutil.Process()]
    return int(_PROCESS[0].memory_info().rss)


# -- MemoryMeter -------------------------------------------------------------------------------


MeasuredBy = Literal["heap", "rss"]


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one measured load took: host bytes (growth of the C heap's bytes in use, or of the
    RSS: ``by``; never negative), GPU bytes per device (``None`` without a GPU), and how long
    it ran in seconds (the load cost)."""

    host_bytes: int
    gpu_bytes: Mapping[int, int] | None
    seconds: float
    by: MeasuredBy = "rss"

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
    """Measures the memory a load takes, as C heap or RSS growth (and GPU growth when present).

    Call :meth:`measure` *in the load thread*, around the blocking backend load (and its
    warmup): ``model, footprint = meter.measure(load, heap=...)``. Measured sections never
    overlap each other or a :meth:`shared` section, so each delta belongs to one load;
    downloads and extraction should stay outside (they do not grow the heap, and they would
    hold the lock). Loads of models whose size is already known may use :meth:`shared`, which
    lets them run in parallel with each other while still keeping them out of measured
    sections.

    Two ways to measure host memory (see the module notes for why they agree):

    - ``heap=True``, for frameworks whose models take all their memory from ``malloc``
      (ONNX Runtime, torch): the growth of the C heap's bytes in use (glibc ``mallinfo2``,
      about a microsecond), no trim, no RSS read;
    - otherwise, or where ``mallinfo2`` is missing (not glibc, glibc before 2.33): the RSS
      growth, with ``malloc_trim`` before and after (``trim``, default on) so the delta is
      retained memory, not the allocator's leftovers from parsing.

    ``rss``, ``heap``, ``gpu`` and ``clock`` are injectable for tests (``heap=None``: always
    RSS).
    """

    def __init__(
        self,
        *,
        rss: Callable[[], int] = _process_rss,
        heap: Callable[[], int] | None = heap_in_use,
        gpu: Callable[[], Mapping[int, int] | None] | None = gpu_memory_used,
        clock: Clock = SYSTEM_CLOCK,
        trim: bool = True,
    ) -> None:
        self._rss = rss
        self._heap = heap
        self._gpu = gpu
        self._clock = clock
        self._trim = trim
        self._lock = _SharedExclusiveLock()

    @property
    def reads_heap(self) -> bool:
        """Whether :meth:`measure` can measure by the C heap (``heap=True``) here."""
        return self._heap is not None

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

    def measure(self, load: Callable[[], T], *, heap: bool = False) -> tuple[T, Footprint]:
        """Run ``load`` alone (no other measured or shared section at the same time) and
        return its result with its footprint; ``heap``: its memory all comes from ``malloc``
        (measured by the heap when it can be read, else by RSS). Exceptions from ``load``
        propagate."""
        by: MeasuredBy = "heap" if heap and self._heap is not None else "rss"
        read = self._heap if by == "heap" and self._heap is not None else self._rss
        with self._lock.exclusive():
            if by == "rss":
                self._settle()
            before = read()
            gpu_before = self._gpu_now()
            started = seconds(self._clock)
            result = load()
            duration = seconds(self._clock) - started
            if by == "rss":
                self._settle()
            host = max(0, read() - before)
            gpu_after = self._gpu_now() if gpu_before is not None else None
        gpu: dict[int, int] | None = None
        if gpu_before is not None and gpu_after is not None:
            gpu = {d: max(0, gpu_after.get(d, 0) - gpu_before.get(d, 0)) for d in gpu_after}
        footprint = Footprint(host, gpu, duration, by)
        logger.debug("measured load: %d host bytes (%s), gpu %s, %.3f s", host, by, gpu, duration)
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
        return self.from_bytes(file_bytes(paths))

    def from_bytes(self, total: int) -> int | None:
        """:meth:`from_files` for files of ``total`` bytes, counted already."""
        if total <= 0:
            return None
        return self.overhead_bytes + int(total * self.file_factor)

    def counted(self, measured: int, estimate: int | None) -> int:
        """What a model that measured ``measured`` bytes counts for: never less than the
        per-model overhead plus its file bytes (``estimate``, :meth:`from_bytes` of them; the
        overhead alone when ``None``). RSS growth undercounts when the load reuses memory an
        eviction just freed (the heap does not always shrink), and the heap's growth leaves out
        files a framework maps instead of reading. The floor is at least :meth:`predict`'s for
        a measured model (the overhead), so a model counts the same bytes when it is measured
        and when it reloads at its known size."""
        files = 0
        if estimate is not None and estimate > self.overhead_bytes:
            files = math.ceil((estimate - self.overhead_bytes) / self.file_factor)
        return max(int(measured), self.overhead_bytes + files)

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
