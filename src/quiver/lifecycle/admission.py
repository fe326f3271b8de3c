"""Admission: whether a model may load now, and what must go to make room for it.

:class:`AdmissionControl` owns the memory budget's ledger and gate
(:mod:`quiver.lifecycle.budget`), the eviction policy (:mod:`quiver.lifecycle.eviction`),
the memory meter and size predictor, frameworks' one-time cost, and the GPU load limit
(:mod:`quiver.lifecycle.memory`). It wraps a (non-ensemble) model's blocking load:

1. under ``--model-load-gpu-limit``, make room on the GPUs the load would grow (evicting
   models not in use that hold memory there, waiting for pinned ones, else refusing);
2. under ``--model-memory-limit``, reserve the predicted size (from free bytes, by claiming
   victims, waiting for pins), let the victims unload, run the load measured (or shared when
   its size is known), grow the reservation if it measured larger, commit the size.

Which models may be evicted is decided here (:meth:`candidates`): a model is *in use* while
it has an operation (a load or unload holds or waits for its lock), a pin (a request waiting
for its load, an ensemble load needing it) or a request in flight; the composing models of an
ensemble are in use while the ensemble, or anything it needs, has an operation or a request
in flight; an archive's namespace is in use as a whole while any of its models is.
Unloading is not done here: the life cycle that calls :meth:`load` passes itself as the
:class:`Unloader` that evicts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from tritonclient.grpc import model_config_pb2 as pb

from quiver.heap import freeze_heap
from quiver.lifecycle.ahead import AHEAD, AHEAD_LULL_S, RoomAhead
from quiver.lifecycle.budget import Admission, BudgetGate, MemoryBudget, OutOfMemoryError
from quiver.lifecycle.clock import Clock, seconds
from quiver.lifecycle.configs import ConfigCache
from quiver.lifecycle.dependencies import DependencyGraph, composing_of
from quiver.lifecycle.eviction import Candidate, EvictionPolicy, LRUPolicy
from quiver.lifecycle.frameworks import HEAP_ALLOCATING, prime
from quiver.lifecycle.idle import Activity
from quiver.lifecycle.loader import LoadOutcome, backend_name
from quiver.lifecycle.locks import ModelLocks
from quiver.lifecycle.memory import (
    GpuMemoryLimit,
    MemoryMeter,
    ModelIdentity,
    Prediction,
    SizePredictor,
    fix_mmap_threshold,
    limit_arenas,
)
from quiver.lifecycle.model import Model
from quiver.lifecycle.pins import Pins
from quiver.lifecycle.policies import DEFAULT_POLICY, make_policy
from quiver.lifecycle.pool import LoadPool
from quiver.lifecycle.sources import fingerprint_and_size
from quiver.lifecycle.table import ModelTable
from quiver.lifecycle.watch import FolderWatch
from quiver.repository.local import ModelSource

__all__ = ["AHEAD", "AdmissionControl", "Inspection", "Unloader"]

logger = logging.getLogger(__name__)

#: Inspections of archives' model folders kept (the least recently stored forgotten first).
ARCHIVED_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Inspection:
    """What a load needs to know of a model's files before it is admitted, read in one trip to
    a load thread (:meth:`AdmissionControl.inspect`): their fingerprint, the composing models
    when it is an ensemble, the backend its config names (``""`` when it cannot be read: the
    load says why) and the size predicted from the files (``None``: no files)."""

    fingerprint: str
    composing: list[str] | None
    backend: str
    from_files: int | None


class Unloader(Protocol):
    async def evict(self, victim: str, loading: str, *, claimed: bool) -> None:
        """Unload ``victim`` (and the ensembles that need it) to make room for ``loading``."""
        ...

    async def discard(self, models: list[Model]) -> None:
        """Unload models that were loaded but will not be served."""
        ...


class AdmissionControl:
    def __init__(
        self,
        *,
        table: ModelTable,
        graph: DependencyGraph,
        locks: ModelLocks,
        pins: Pins,
        pool: LoadPool,
        clock: Clock,
        memory_limit_bytes: int = 0,
        eviction_policy: str = DEFAULT_POLICY,
        load_wait_timeout: float = 60.0,
        strict: bool = False,
        gpu_limit: float = 0.0,
        gpu_reader: Callable[[], Mapping[int, tuple[int, int]] | None] | None = None,
        meter: MemoryMeter | None = None,
        predictor: SizePredictor | None = None,
        evict_ahead: bool = True,
    ) -> None:
        self._table = table
        self._graph = graph
        self._locks = locks
        self._pins = pins
        self._pool = pool
        self._clock = clock
        self._strict = strict
        self.load_wait_timeout = load_wait_timeout
        # Loads wait at the gate for room (host budget or GPU limit), woken when a pin is
        # released, a load or an unload finished.
        self.gate = BudgetGate(clock=clock)
        self.budget = MemoryBudget(memory_limit_bytes, listener=self.gate.notify) if memory_limit_bytes > 0 else None
        self.gate.budget = self.budget
        if self.budget is not None:
            fix_mmap_threshold()  # RSS deltas that belong to one load (lifecycle.memory)
            limit_arenas()  # cheaper heap readings (lifecycle.memory)
        self._frameworks: dict[str, int] = {}  # framework -> its one-time bytes, measured once
        #: Configurations read and prepared once per version of a model's files (the loads share it).
        self.configs = ConfigCache()
        #: Inspections of archives' model folders in the disk cache, by folder (see inspect).
        self._archived: OrderedDict[Path, Inspection] = OrderedDict()
        self._archived_lock = threading.Lock()
        #: Local model folders unchanged since their last walk (set in on_demand mode: watch.py).
        self.watch: FolderWatch | None = None
        self.evict_ahead = evict_ahead and eviction_policy != "none"  # none: nothing unloads
        #: When a request last came or went (told by the manager): evictions ahead wait for a lull.
        self.activity = Activity(clock)
        self.last_size = 0  # bytes of the last model loaded: what the next miss likely needs
        self.ahead = RoomAhead(self, pins, table)
        self._prime_lock = asyncio.Lock()
        #: ``none``: a load that does not fit fails at once (OutOfMemoryError; 507 on the
        #: SageMaker routes) instead of unloading other models: the platform decides.
        self.evicts = eviction_policy != "none"
        self.policy: EvictionPolicy = make_policy(eviction_policy if self.evicts else "lru")
        self._meter = meter or MemoryMeter(clock=clock)
        self._predictor = predictor or SizePredictor()
        # --model-load-gpu-limit: on only when a GPU can be read; loaded name -> GPU bytes per device.
        self._gpu: GpuMemoryLimit | None = None
        self._gpu_sizes: dict[str, dict[int, int]] = {}
        if gpu_limit > 0:
            gpu = GpuMemoryLimit(gpu_limit, **({"reader": gpu_reader} if gpu_reader else {}))
            if gpu.read() is None:
                logger.info(
                    "--model-load-gpu-limit %g has no effect: no GPU memory reading (no GPU, "
                    "or NVML / pynvml not available)",
                    gpu_limit,
                )
            else:
                self._gpu = gpu

    @property
    def meter(self) -> MemoryMeter:
        return self._meter

    @property
    def gpu(self) -> GpuMemoryLimit | None:
        return self._gpu

    @property
    def predictor(self) -> SizePredictor:
        return self._predictor

    @property
    def clock(self) -> Clock:
        return self._clock

    def by_heap(self, backend: str) -> bool:
        """Whether loads of ``backend`` are measured by the C heap's growth (not RSS)."""
        return backend in HEAP_ALLOCATING

    def primed(self, backend: str) -> bool:
        """Whether ``backend``'s one-time cost was measured (a load of it needs no priming)."""
        return backend in self._frameworks

    @property
    def framework_bytes(self) -> dict[str, int]:
        return dict(self._frameworks)

    def notify(self) -> None:
        """Something changed (a request finished, a pin was released): waiting loads look again."""
        self.gate.notify()

    @property
    def tracks_use(self) -> bool:
        """Whether the policy counts uses: only under a memory budget or GPU limit (without
        one nothing is ever evicted, and a count per request would cost every request for
        nothing), and not for LRU (which needs only the last use, which models keep)."""
        return (self.budget is not None or self._gpu is not None) and not isinstance(self.policy, LRUPolicy)

    def used(self, model: Model) -> None:
        """A request looked ``model`` up (the policy's use count)."""
        self.policy.touch(model.name, model.size_bytes, model.last_used)

    def released(self, name: str) -> None:
        """``name`` finished unloading (for any reason): its bytes come free now (to the load
        that claimed it, if any)."""
        self._gpu_sizes.pop(name, None)
        if self.budget is not None:
            self.budget.release(name)
            self.policy.forget(name)
        self.gate.notify()

    def retired(self, name: str) -> None:
        """The old versions of a reloaded ``name`` finished unloading."""
        if self.budget is not None:
            self.budget.retired(name)

    def claimant(self, victim: str) -> str | None:
        return self.budget.claimant(victim) if self.budget is not None else None

    # -- in use ------------------------------------------------------------------------

    def in_use(self, name: str) -> bool:
        """Being loaded or unloaded, pinned, or serving a request now."""
        return (
            self._locks.busy(name)
            or self._pins.pinned(name)
            or any(m.scheduler.inflight for m in self._table.loaded(name))
        )

    def candidates(self, loading: str) -> list[Candidate]:
        """Loaded models as eviction candidates, pinned when in use (see the module notes);
        none under ``--model-eviction-policy=none``."""
        if not self.evicts:
            return []
        busy_composing: set[str] = set()
        for ensemble, composing in self._graph.ensembles.items():
            if self.in_use(ensemble) or any(self._locks.busy(m) for m in self._graph.closure(ensemble)):
                busy_composing |= composing
        busy_namespaces = {
            ns.served for ns in self._graph.namespaces if any(self.in_use(n) for n in (ns.served, *ns.members))
        }
        candidates = []
        busy, pinned_now, namespace_of = self._locks.busy, self._pins.pinned, self._graph.namespace_of
        for name, versions in self._table.versions():  # one pass, no copies: hundreds loaded
            if name == loading or not versions:
                continue
            pinned = (
                busy(name)
                or pinned_now(name)
                or any(m.scheduler.inflight for m in versions)
                or name in busy_composing
                or (busy_namespaces and (name in busy_namespaces or namespace_of(name) in busy_namespaces))
            )
            if len(versions) == 1:
                (model,) = versions
                candidates.append(Candidate(name, model.size_bytes, model.last_used, bool(pinned)))
            else:
                size, last = sum(m.size_bytes for m in versions), max(m.last_used for m in versions)
                candidates.append(Candidate(name, size, last, bool(pinned)))
        return candidates

    # -- loading -----------------------------------------------------------------------

    def inspect(self, source: ModelSource, override: pb.ModelConfig | None) -> Inspection:
        """Blocking (a load thread): the :class:`Inspection` of ``source``'s files; the config
        is read once per fingerprint (:attr:`configs`). A model of an archive is inspected
        once per folder: the disk cache extracts each download into a folder of its own,
        whose files it checks against their manifest each time it hands it out (a file
        added, missing or changed: dropped, and fetched into a new folder), so what its
        files were they still are when it loads from it (a reload from the disk cache walks
        nothing again: 0.23 ms of a 4.5 ms reload, that code out of the CPU's caches)."""
        archived = bool(source.archive) and override is None
        if archived:
            with self._archived_lock:
                kept = self._archived.get(source.path)
            if kept is not None:
                return kept
        inspection = self._inspect(source, override)
        if archived:
            with self._archived_lock:
                self._archived[source.path] = inspection
                while len(self._archived) > ARCHIVED_KEPT:
                    self._archived.popitem(last=False)
        return inspection

    def _inspect(self, source: ModelSource, override: pb.ModelConfig | None) -> Inspection:
        watch = self.watch
        if watch is not None and override is None:
            fingerprint, size = watch.walk(source, fingerprint_and_size)
        else:
            fingerprint, size = fingerprint_and_size(source.path)
        strict, configs = self._strict, self.configs
        composing = composing_of(source, strict=strict, override=override, configs=configs, fingerprint=fingerprint)
        backend = ""
        if composing is None:
            backend = backend_name(source, strict=strict, override=override, configs=configs, fingerprint=fingerprint)
        from_files = self._predictor.from_bytes(size) if self.budget is not None else None
        return Inspection(fingerprint, composing, backend, from_files)

    def unchanged(self, name: str) -> tuple[ModelSource, Inspection] | None:
        """Blocking (a load thread): ``name``'s folder and its :class:`Inspection` without
        walking it, when its files are unchanged since their last walk (:attr:`watch`) and
        their configuration was prepared then (so not an ensemble): nothing is read."""
        watch = self.watch
        kept = watch.unchanged(name) if watch is not None else None
        if kept is None:
            return None
        source, fingerprint, size = kept
        prepared = self.configs.prepared(source, fingerprint, self._strict)
        if prepared is None:
            return None
        from_files = self._predictor.from_bytes(size) if self.budget is not None else None
        return source, Inspection(fingerprint, None, prepared.proto.backend, from_files)

    async def load(
        self,
        source: ModelSource,
        load: Callable[[], LoadOutcome],
        *,
        override: pb.ModelConfig | None,
        inspection: Inspection,
        unloader: Unloader,
    ) -> LoadOutcome:
        """Run ``load`` (a model's blocking load) once it is admitted (see the module notes);
        ``inspection`` is its files' (measured sizes belong to their fingerprint)."""
        name = source.name
        identity = ModelIdentity(name, "", inspection.fingerprint)
        gpu = self._gpu
        if gpu is None:
            return await self._load_host(source, identity, load, inspection, unloader)
        predicted = gpu.predict(identity)
        await self._admit_gpu(name, predicted, unloader)
        try:
            outcome = await self._load_host(source, identity, load, inspection, unloader)
        finally:
            gpu.settle(name)
            self.gate.notify()
        if outcome.models and name not in self._gpu_sizes and predicted is not None:
            self._gpu_sizes[name] = predicted  # loaded unmeasured: its known size
        return outcome

    async def _admit_gpu(self, name: str, predicted: Mapping[int, int] | None, unloader: Unloader) -> None:
        """Make room under the GPU load limit: evict models not in use that hold GPU memory
        on the devices the load would take past the limit (re-reading the devices after each
        eviction), wait for pinned ones within the load wait timeout (woken when a pin is
        released or an unload finishes), or refuse the load."""
        gpu = self._gpu
        assert gpu is not None
        deadline = seconds(self._clock) + self.load_wait_timeout
        while True:
            over = gpu.over(predicted, exclude=name)
            if not over:
                gpu.reserve(name, predicted)
                return
            offered = [
                replace(c, size_bytes=sum(self._gpu_sizes.get(c.name, {}).get(d, 0) for d in over))
                for c in self.candidates(name)
            ]
            offered = [c for c in offered if c.size_bytes > 0]
            victims = self.policy.victims(offered, sum(over.values()), 0)
            if not victims:  # not enough evictable: evict what there is, the readings decide
                victims = [c.name for c in offered if not c.pinned]
            claimed = self.budget.releasing if self.budget is not None else frozenset()
            victims = [v for v in victims if v not in claimed]  # another load unloads those
            if victims:
                for victim in victims:
                    await unloader.evict(victim, name, claimed=False)
                continue
            waiting_on = any(c.pinned or c.name in claimed for c in offered)
            if not waiting_on or not await self.gate.wait(deadline):
                raise OutOfMemoryError(gpu.describe(name, over))

    def _remember_gpu(self, identity: ModelIdentity, gpu_bytes: Mapping[int, int] | None) -> None:
        if self._gpu is not None and gpu_bytes is not None:
            self._gpu.record(identity, gpu_bytes)
            self._gpu_sizes[identity.name] = dict(gpu_bytes)

    async def _load_host(
        self,
        source: ModelSource,
        identity: ModelIdentity,
        load: Callable[[], LoadOutcome],
        inspection: Inspection,
        unloader: Unloader,
    ) -> LoadOutcome:
        """Load under the memory budget (see :mod:`quiver.lifecycle.budget` for the rules):
        reserve the predicted size (evicting models not in use, waiting for pinned ones),
        load once the victims are unloaded, then commit the measured size, growing the
        reservation first when the model measured larger than predicted."""
        name = source.name
        budget = self.budget

        async def discard(outcome: LoadOutcome) -> None:
            await unloader.discard(outcome.models)

        if budget is None:
            if self._gpu is None or self._gpu.predict(identity) is not None:
                return await self._pool.run(load, discard=discard)
            outcome, footprint = await self._pool.run(
                functools.partial(self._meter.measure, load), discard=lambda r: discard(r[0])
            )
            if outcome.models:
                self._remember_gpu(identity, footprint.gpu_bytes)
            return outcome
        await self._prime_framework(inspection.backend)
        prediction = self._predictor.predict(identity, estimate=inspection.from_files)
        timeout = self.load_wait_timeout
        admission = await self.gate.reserve(
            name,
            prediction.bytes,
            self.policy,
            functools.partial(self.candidates, name),
            timeout=timeout,
            wait=self.evicts,
        )
        try:
            await self.evict_claimed(admission, name, unloader)
            await self.gate.covered(name, seconds(self._clock) + timeout)
            started = seconds(self._clock)
            outcome, measured, how, gpu_bytes = await self._pool.run(
                functools.partial(self.measure, load, prediction, inspection.backend),
                discard=lambda r: discard(r[0]),
            )
            if outcome.models:
                self._remember_gpu(identity, gpu_bytes)
            load_seconds = seconds(self._clock) - started
        except BaseException:
            budget.cancel(name)
            raise
        return await self.settle(name, identity, inspection, prediction, outcome, measured, how, load_seconds, unloader)

    def measure(
        self, load: Callable[[], LoadOutcome], prediction: Prediction, backend: str
    ) -> tuple[LoadOutcome, int, str, Mapping[int, int] | None]:
        """Blocking (a load thread): ``load()`` under the budget's meter -> the outcome, its
        bytes (measured, or known), how they were found and its GPU bytes (None: not
        measured). A model measured
        before (same files) is not measured again: measuring serialises loads (and, by RSS,
        costs two heap trims); its size is known. A Python model's workers are processes of
        their own: their memory is not the server's growth but their own unique set size."""
        if prediction.source == "measured":
            return self._meter.shared(load), prediction.bytes, "known", None
        outcome, footprint = self._meter.measure(load, heap=self.by_heap(backend))
        measured = footprint.host_bytes + sum(m.process_memory_bytes() or 0 for m in outcome.models)
        return outcome, measured, f"measured by {footprint.by}", footprint.gpu_bytes

    async def settle(
        self,
        name: str,
        identity: ModelIdentity,
        inspection: Inspection,
        prediction: Prediction,
        outcome: LoadOutcome,
        measured: int,
        how: str,
        load_seconds: float,
        unloader: Unloader,
    ) -> LoadOutcome:
        """After a load under a reservation (here, or in a miss's one trip:
        :mod:`quiver.lifecycle.trip`): commit its size (``measured``, or the prediction when
        ``how`` is "known"), growing the reservation first if it measured larger; a load that
        gave no model gives its reservation back."""
        budget = self.budget
        assert budget is not None
        if not outcome.models:
            budget.cancel(name)
            return outcome
        size = self._size(identity, inspection, prediction, measured, how)
        try:
            if size > budget.reservation(name):
                await self._cover_overrun(name, size, unloader)
        except BaseException:
            budget.cancel(name)
            await unloader.discard(outcome.models)
            raise
        self._commit(name, outcome, size, prediction, measured, how, load_seconds)
        return outcome

    def settle_now(
        self,
        name: str,
        identity: ModelIdentity,
        inspection: Inspection,
        prediction: Prediction,
        outcome: LoadOutcome,
        measured: int,
        how: str,
        load_seconds: float,
    ) -> bool:
        """:meth:`settle` of a load that gave models, without awaiting, when its size is
        within its reservation (the usual: nothing to cover); whether it was settled (else
        nothing was done: :meth:`settle` covers the excess)."""
        budget = self.budget
        assert budget is not None and outcome.models
        size = self._size(identity, inspection, prediction, measured, how, record=False)
        if size > budget.reservation(name):
            return False
        if how != "known":
            self._predictor.record(identity, size)
        self._commit(name, outcome, size, prediction, measured, how, load_seconds)
        return True

    def _size(
        self,
        identity: ModelIdentity,
        inspection: Inspection,
        prediction: Prediction,
        measured: int,
        how: str,
        *,
        record: bool = True,
    ) -> int:
        """The bytes a loaded model counts for (recorded for its files when measured)."""
        if how == "known":
            return prediction.bytes
        size = self._predictor.counted(measured, inspection.from_files)  # never below its files
        if record:
            self._predictor.record(identity, size)
        return size

    def _commit(
        self,
        name: str,
        outcome: LoadOutcome,
        size: int,
        prediction: Prediction,
        measured: int,
        how: str,
        load_seconds: float,
    ) -> None:
        budget = self.budget
        assert budget is not None
        now = seconds(self._clock)
        for model in outcome.models:
            model.size_bytes = size
            model.last_used = now
        self.policy.touch(name, size, now, load_cost_s=load_seconds)
        budget.commit(name, size)
        self.last_size = size
        # Written AHEAD_LULL_S from now: the requests that waited for the load run and their
        # answers go out first (a log line costs 0.1 ms on a miss, its code cold by then, and on
        # a busy machine the core a client on the same machine needs to take its answer).
        announce = functools.partial(
            logger.info,
            "loaded model '%s' version(s) %s in %.3f s; it takes %d bytes of host memory (%s %d, "
            "predicted %d from %s); %d of %d bytes in use",
            name,
            ", ".join(m.version_str for m in outcome.models),
            outcome.models[0].load_seconds,
            size,
            how,
            measured,
            prediction.bytes,
            prediction.source,
            budget.used,
            budget.limit_bytes,
        )
        asyncio.get_running_loop().call_later(AHEAD_LULL_S, announce)

    async def _cover_overrun(self, name: str, size: int, unloader: Unloader) -> None:
        """The model measured ``size`` bytes, more than its reservation: reserve the
        excess as a load would (free bytes, evictions, waiting for pins) before it is READY;
        if that cannot be had, OutOfMemoryError (the caller unloads the model)."""
        budget = self.budget
        assert budget is not None
        granted = budget.reservation(name)
        logger.warning(
            "model '%s' measured %d bytes, %d more than its reservation; reserving the excess "
            "before it is served",
            name,
            size,
            size - granted,
        )
        try:
            admission = await self.gate.reserve(
                name,
                size - granted,
                self.policy,
                functools.partial(self.candidates, name),
                timeout=self.load_wait_timeout,
                grow=True,
                wait=self.evicts,
            )
            await self.evict_claimed(admission, name, unloader)
            await self.gate.covered(name, seconds(self._clock) + self.load_wait_timeout)
        except OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"model '{name}' measured {size} bytes when loaded, more than the {granted} "
                f"bytes predicted, and the excess does not fit: {exc.message}"
            ) from None

    def ahead_bytes(self) -> int:
        """The free bytes evictions ahead of need keep (:meth:`RoomAhead.bytes`)."""
        return self.ahead.bytes()

    def room_ahead_short(self) -> bool:
        """Whether evictions ahead of need have anything to do now (:meth:`RoomAhead.short`)."""
        return self.ahead.short()

    async def make_room_ahead(self, loaded: str, unloader: Unloader) -> None:
        """Evict ahead of need after ``loaded`` loaded (:meth:`RoomAhead.make`)."""
        await self.ahead.make(loaded, unloader)

    async def evict_claimed(self, admission: Admission, loading: str, unloader: Unloader) -> None:
        """Unload the models the admission claimed for ``loading`` (ensembles that need them
        first); their bytes come to its reservation as each unload finishes."""
        for victim in admission.victims:
            await unloader.evict(victim, loading, claimed=True)

    async def _prime_framework(self, backend: str) -> None:
        """Pay the model's framework's one-time process cost (import, first session) once, in
        a measured section of its own, so no model's measured size includes it. Reported,
        not counted in the budget (see :mod:`quiver.lifecycle.memory`)."""
        if not backend or backend in self._frameworks:
            return
        async with self._prime_lock:
            if backend in self._frameworks:
                return
            try:
                _, footprint = await self._pool.run(self._meter.measure, functools.partial(prime, backend))
            except Exception as exc:  # e.g. the package is missing: the load says so
                logger.debug("priming framework '%s' failed: %s", backend, exc)
                return
            self._frameworks[backend] = footprint.host_bytes
            await self._pool.run(freeze_heap, f"framework '{backend}' primed")  # what it made stays
            logger.info(
                "framework '%s' took %d bytes of host memory once for this process (import and "
                "first session); not charged to any model nor to the model memory limit",
                backend,
                footprint.host_bytes,
            )
