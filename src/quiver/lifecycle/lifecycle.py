"""ModelLifeCycle: how a model's versions load, reload, unload and get evicted.

It is the only code that changes the served-model table (:mod:`quiver.lifecycle.table`).
Every load and unload runs under the model's lock (:mod:`quiver.lifecycle.locks`, where the
lock order is written down), in a task the life cycle owns, and every blocking step on the
load pool (:mod:`quiver.lifecycle.pool`):

- **load**: the index shows LOADING (unless older versions serve), the files are
  fingerprinted, an ensemble first pins and loads its composing models; any other model
  loads through admission (:mod:`quiver.lifecycle.admission`: room in the memory budget and
  under the GPU limit, evicting what is not in use). What loaded is installed; a reload
  keeps the old versions serving until the new ones are READY, then drains and unloads them;
  a failed reload leaves them serving.
- **unload**: the ensembles that need the model go first (an ensemble never runs without its
  composing models); the model leaves service at once, its scheduler drains (in-flight
  requests finish), its instances unload (``finalize`` runs), and only then are its bytes
  released. An archive's served model takes its namespace and disk-cache lease with it.
- **stop**: owned loads in flight are cancelled and awaited (a load in a thread finishes and
  is unloaded), then everything loaded is unloaded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import INLINE_THRESHOLD_NS
from quiver.config import ModelConfig
from quiver.ensemble.scheduler import InferFn
from quiver.errors import (
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
)
from quiver.lifecycle.admission import AHEAD, AdmissionControl, Inspection
from quiver.lifecycle.archives import ArchiveLayouts, check_members_free, is_namespaced
from quiver.lifecycle.clock import Clock, seconds
from quiver.lifecycle.dependencies import DependencyGraph, Namespace
from quiver.lifecycle.loader import LoadOutcome, load_ensemble, load_model, unload_instances
from quiver.lifecycle.locks import ModelLocks
from quiver.lifecycle.memory import TrimSchedule, release_free_memory
from quiver.lifecycle.model import Model, ModelState
from quiver.lifecycle.pins import Pins
from quiver.lifecycle.pool import LoadPool, settle
from quiver.lifecycle.sources import ModelSources
from quiver.lifecycle.table import ModelTable
from quiver.lifecycle.trip import Trip, find_and_load, settle_trip, settle_trip_now
from quiver.metrics.statistics import MultiModelStatistics
from quiver.repository.local import ModelSource
from quiver.repository.storage import Storage

__all__ = ["ModelLifeCycle"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long the rest of a miss's load waits, at most, for its requests' answers and a lull
#: (:meth:`ModelLifeCycle._after_answers`): it holds the model's lock meanwhile.
LANDED_TAIL_S = 0.01


class ModelLifeCycle:
    def __init__(
        self,
        *,
        table: ModelTable,
        graph: DependencyGraph,
        locks: ModelLocks,
        pins: Pins,
        sources: ModelSources,
        admission: AdmissionControl,
        pool: LoadPool,
        clock: Clock,
        stats: MultiModelStatistics,
        strict: bool = False,
        inline_threshold_ns: int = INLINE_THRESHOLD_NS,
        reload_failed_composing: bool = False,
        namespacing: bool = True,
        load_retries: int = 0,
    ) -> None:
        self._table = table
        #: --model-load-retry-count: a model whose load failed is tried this many times more.
        self._load_retries = max(0, load_retries)
        self._graph = graph
        self._locks = locks
        self._pins = pins
        self._sources = sources
        self._admission = admission
        self._pool = pool
        self._clock = clock
        self._stats = stats
        self._strict = strict
        self._inline_threshold_ns = inline_threshold_ns
        # explicit and on_demand modes load a composing model again when an earlier load of
        # it failed; none and poll modes report the earlier failure.
        self._reload_failed_composing = reload_failed_composing
        self._namespacing = namespacing
        self._layouts = ArchiveLayouts(namespacing=namespacing)  # of the disk cache's folders
        self._infer: InferFn | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closed = False
        self._trims = TrimSchedule()

    def bind(self, infer: InferFn) -> None:
        self._infer = infer

    # -- owned tasks -------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, T], name: str = "quiver-load") -> asyncio.Task[T]:
        """Run ``coro`` (a load or unload) as a task :meth:`stop` cancels and awaits; once
        stopped, UnavailableError."""
        if self.closed:
            coro.close()
            raise UnavailableError("the server is stopping: no more models are loaded")
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """:meth:`spawn` ``coro`` and wait for it; cancelling the caller cancels it. Cancelled
        by :meth:`stop`: UnavailableError."""
        task = self.spawn(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                raise UnavailableError("the server is stopping: the load was cancelled") from None
            task.cancel()
            await settle(task)
            raise

    # -- loading -----------------------------------------------------------------------

    async def load(
        self,
        source: ModelSource,
        override: pb.ModelConfig | None = None,
        visiting: frozenset[str] = frozenset(),
    ) -> dict[str, str]:
        """Load (or reload) one model under its lock; returns its failures."""
        async with self._locks.hold(source.name):
            return await self.load_locked(source, override, visiting)

    async def load_missing(
        self, source: ModelSource, visiting: frozenset[str] = frozenset(), *, inspection: Inspection | None = None
    ) -> dict[str, str]:
        """Load a model on demand (a request's, or an ensemble's composing model) unless a
        load that held its lock meanwhile loaded it: loading it again would be a reload,
        wasted, and under a full budget one that needs room for a second copy while its
        first is pinned (two such reloads would wait for each other). ``inspection``: its
        files inspected already (:meth:`AdmissionControl.inspect`). Returns failures."""
        async with self._locks.hold(source.name):
            if self._table.serving(source.name):
                return {}
            return await self.load_locked(source, None, visiting, inspection=inspection)

    async def load_on_demand(self, name: str, find: Callable[[], ModelSource | None]) -> dict[str, str] | None:
        """:meth:`load_missing` of the folder ``find()`` (blocking) finds, found, inspected and
        often loaded in one trip to a load thread (:mod:`quiver.lifecycle.trip`); its failures,
        or ``None`` (the lock released) when there is no such folder."""
        async with self._locks.hold(name):
            if self._table.serving(name):
                return {}  # loaded while this waited for the lock
            trip = Trip(name)
            # The index shows LOADING for the whole trip: set here, not from the load thread
            # once the config is ready (that woke the event loop mid-load: a wake-up and a
            # hand-off of the GIL on the load's path). What it showed before comes back when
            # the trip finds no folder or fails before loading.
            before = self._table.mark_loading(name)

            def discard(done: Trip) -> Coroutine[Any, Any, None]:  # cancelled: what loaded goes
                return self.discard(done.outcome.models if done.outcome is not None else [])

            try:
                await self._pool.run(
                    find_and_load, self._admission, trip, find, self._loader, discard=discard, arrived=self._land
                )
            except BaseException as exc:
                if trip.landed is not None:
                    raise  # cancelled once installed (_land): it serves, settled; stop() unloads it
                if trip.reserved and self._admission.budget is not None:
                    self._admission.budget.cancel(name)
                if not trip.loads or not isinstance(exc, Exception):
                    self._table.restore(name, before)
                    raise  # not the load's error (or cancelled): as before any load
                trip.error = exc  # the load's: reported as any load's failure is
            if trip.source is None:
                self._table.restore(name, before)
                return None
            if trip.landed is not None:
                await self._after_answers(name)
            return await self.load_locked(trip.source, None, inspection=trip.inspection, trip=trip)

    async def _after_answers(self, name: str) -> None:
        """The rest of a load whose requests were woken as it was installed (:meth:`_land`)
        waits until they are answered and a lull follows (:meth:`RoomAhead.answered`; at most
        :data:`LANDED_TAIL_S`), then sets off evictions ahead of need: its bookkeeping (its
        statistics, its lock and the flight's end: 0.1-0.2 ms) does not take the core a client
        on the same machine needs to read its answer."""
        try:
            await self._admission.ahead.answered(name, seconds(self._clock) + LANDED_TAIL_S)
            if self._admission.room_ahead_short():
                self._evict_ahead(name)
        except UnavailableError:
            return  # the server stops
        except Exception:  # a bug here must not hide: the load itself is done and serving
            logger.exception("the bookkeeping after loading model '%s' failed", name)

    def _land(self, trip: Trip) -> None:
        """On the event loop as a miss's trip arrives, before its task resumes (a round of the
        loop later): a model it loaded within its reservation is settled and installed now, so
        the requests waiting for it run in the loop's next round, ahead of the rest of the
        load's bookkeeping (:meth:`load_locked` then finds ``trip.landed``). Anything else (a
        failure, a model that measured above its reservation, the server stopping) is left to
        the task, as before."""
        source, inspection, outcome = trip.source, trip.inspection, trip.outcome
        if not trip.loads or self.closed or source is None or inspection is None or outcome is None:
            return
        if not outcome.models or self._table.serving(source.name):
            return
        self._sources.remember_fingerprint(source.name, inspection.fingerprint)
        if not settle_trip_now(self._admission, trip):
            return
        trip.settled = True  # committed: should the install fail, the task must not settle again
        trip.landed = self._install(source.name, outcome, None, ahead=False)  # after the answers
        trip.landed_at = seconds(self._clock)

    def _loader(
        self, source: ModelSource, inspection: Inspection, override: pb.ModelConfig | None = None
    ) -> Callable[[], LoadOutcome]:  # the blocking load of the files ``inspection`` saw
        return functools.partial(
            load_model,
            source,
            strict=self._strict,
            config_override=override,
            inline_threshold_ns=self._inline_threshold_ns,
            clock=self._clock,
            configs=self._admission.configs,
            fingerprint=inspection.fingerprint,
            announce=self._admission.budget is None,  # else once its size is known
        )

    async def load_locked(
        self,
        source: ModelSource,
        override: pb.ModelConfig | None,
        visiting: frozenset[str] = frozenset(),
        *,
        inspection: Inspection | None = None,
        trip: Trip | None = None,
    ) -> dict[str, str]:
        """:meth:`load` for a caller that holds the model's lock (``inspection``: its files'
        without ``override``, taken already, for the first attempt; ``trip``: a miss's trip
        that may have loaded it already)."""
        name = source.name
        trip = trip if trip is not None and trip.loads else None
        started = trip.started if trip is not None else seconds(self._clock)
        try:
            failures = await self._load_inner(source, override, visiting, inspection, trip)
            for attempt in range(1, self._load_retries + 1):
                if not failures or self.closed:
                    break
                logger.warning(
                    "loading model '%s' failed (%s); retry %d of %d (--model-load-retry-count)",
                    name, "; ".join(failures.values()), attempt, self._load_retries,
                )  # fmt: skip
                failures = await self._load_inner(source, override, visiting)
            if self._table.serving(name) and name not in failures:
                ended = trip.landed_at if trip is not None and trip.landed is not None else seconds(self._clock)
                self._stats.loading_time_us.observe((ended - started) * 1e6)
                # The requests that waited for the load were woken as it was installed
                # (flights.land): they run (a model's first call often inline) and answer
                # before the rest of this load's bookkeeping (its lock and pins released).
                await asyncio.sleep(0)
            else:
                self._stats.load_failures += 1
            return failures
        except QuiverError as exc:
            self._stats.load_failures += 1  # e.g. out of memory: recorded, and the caller learns why
            if not self._table.serving(name):
                self._table.mark(name, ModelState.UNAVAILABLE, exc.message)
            raise
        except Exception as exc:  # a bug or an OS error must cost this load, not leave it LOADING
            logger.exception("loading model '%s' failed unexpectedly", name)
            reason = f"model '{name}': {type(exc).__name__}: {exc}"
            if not self._table.serving(name):
                self._table.mark(name, ModelState.UNAVAILABLE, reason)
            return {name: reason}

    async def _load_inner(
        self,
        source: ModelSource,
        override: pb.ModelConfig | None,
        visiting: frozenset[str],
        inspection: Inspection | None = None,
        trip: Trip | None = None,
    ) -> dict[str, str]:
        if trip is not None and trip.landed is not None:
            return trip.landed  # installed as it arrived (_land)
        name = source.name
        serving = self._table.serving(name)
        if not serving and trip is None:  # a trip showed LOADING from its start
            self._table.mark(name, ModelState.LOADING)
        if trip is not None:
            inspection = trip.inspection
        if inspection is None or override is not None:
            # One trip to a load thread: the files' fingerprint, the config (an ensemble? which
            # framework?) and their size, read once per version of the files.
            inspection = await self._pool.run(self._admission.inspect, source, override)
        composing = inspection.composing
        self._sources.remember_fingerprint(name, inspection.fingerprint)
        if composing is not None:
            outcome = await self._load_ensemble(source, composing, override, visiting | {name})
        elif trip is not None:  # loaded in the trip that found it
            if trip.error is not None:
                raise trip.error
            if trip.settled and trip.outcome is not None:  # committed as it arrived (_land)
                outcome = trip.outcome
            else:
                outcome = await settle_trip(self._admission, trip, self)
        else:
            load = self._loader(source, inspection, override)
            outcome = await self._admission.load(source, load, override=override, inspection=inspection, unloader=self)
        if self.closed:  # the server stopped while this loaded
            await self.discard(outcome.models)
            return _failures(name, outcome)
        if not outcome.models and serving:
            logger.error("reload of model '%s' failed; the loaded versions keep serving", name)
            return _failures(name, outcome)
        old = self._table.loaded(name)
        failures = self._install(name, outcome, composing)
        if old:
            try:
                await self.discard(old)
            finally:
                self._admission.retired(name)  # the old versions' bytes, counted until now
        return failures

    def _install(
        self, name: str, outcome: LoadOutcome, composing: list[str] | None, *, ahead: bool = True
    ) -> dict[str, str]:
        """Serve what a load gave (the requests waiting for it are woken); its failures.
        ``ahead``: set off evictions ahead of need now (else the caller does, later)."""
        self._table.install(name, outcome)
        if outcome.models and composing is not None:
            self._graph.set_composing(name, composing)
        if ahead and outcome.models and self._admission.room_ahead_short():
            # in the loop's next round, after the requests that waited for the load (woken by
            # the install): evictions ahead wait for them to be answered
            asyncio.get_running_loop().call_soon(self._evict_ahead, name)
        return _failures(name, outcome)

    def _evict_ahead(self, loaded: str) -> None:
        if not self.closed:
            self.spawn(self._admission.make_room_ahead(loaded, self), name="quiver-evict-ahead")

    async def _load_ensemble(
        self,
        source: ModelSource,
        composing: list[str],
        override: pb.ModelConfig | None,
        visiting: frozenset[str],
    ) -> LoadOutcome:
        name = source.name
        with self._graph.loading(name, composing), self._pins.holding(*composing):
            configs, problem = await self._ensure_composing(name, composing, visiting)
        if problem:
            logger.error("failed to load ensemble '%s': %s", name, problem)
            return LoadOutcome(None, [], {}, problem)
        assert self._infer is not None, "bind() the inference entry before loading ensembles"
        return await self._pool.run(
            functools.partial(
                load_ensemble,
                source,
                strict=self._strict,
                composing=configs,
                infer=self._infer,
                config_override=override,
                clock=self._clock,
            ),
            discard=lambda outcome: self.discard(outcome.models),
        )

    async def _ensure_composing(
        self, ensemble: str, names: list[str], visiting: frozenset[str]
    ) -> tuple[dict[str, ModelConfig], str]:
        """The READY configs of an ensemble's composing models, loading those that never
        loaded (or failed, in explicit and on-demand modes); or why one is not available."""
        configs: dict[str, ModelConfig] = {}
        sources: dict[str, ModelSource] | None = None
        for dep in names:
            if dep in visiting:
                return {}, f"ensemble '{ensemble}' and model '{dep}' contain each other"
            failed_before = self._table.known(dep) and not self._reload_failed_composing
            if not self._table.serving(dep) and not failed_before:
                source = self._graph.member(dep)  # a model of the same archive
                if source is None:
                    if sources is None:
                        sources, _ = await self._sources.scan()
                    source = sources.get(dep)
                if source is None:
                    return {}, (
                        f"ensemble '{ensemble}': composing model '{dep}' is not in the "
                        "model repository"
                    )
                await self.load_missing(source, visiting)
            model = self._table.latest(dep)
            if model is None:
                return {}, (
                    f"ensemble '{ensemble}': composing model '{dep}' is not available: "
                    f"{self._table.reason(dep)}"
                )
            configs[dep] = model.config
        return configs, ""

    async def load_folder(
        self, name: str, override: pb.ModelConfig | None, files: dict[str, bytes] | None
    ) -> dict[str, str]:
        """The repository API's load of a model folder (or of ``files`` from the request, in a
        private folder); returns its failures."""
        async with self._locks.hold(name):
            new_root: Path | None = None
            if files:
                if override is None:
                    raise InvalidArgumentError(
                        f"failed to load '{name}': 'file:' parameters need the 'config' parameter too"
                    )
                source = await self._sources.write_override(name, files)
                new_root = source.repository
            else:
                sources, _ = await self._sources.scan()
                found = sources.get(name)
                if found is None:
                    raise NotFoundError(
                        f"failed to load '{name}': no model named '{name}' in the model repository"
                    )
                source = found
            loaded = False
            try:
                failures = await self.load_locked(source, override)
                loaded = name not in failures and self._table.serving(name)
            finally:
                # The files of the versions that serve stay until a load replaced them.
                await self._sources.settle_override(name, new_root, loaded)
        return failures

    # -- archives ----------------------------------------------------------------------

    async def load_archive(self, served: str, key: str, stores: list[Storage], *, check_later: bool = False) -> None:
        """Fetch ``key`` through the disk cache and load the model it holds as ``served``,
        with the archive's other models in its namespace; the cache lease is kept until
        ``served`` is unloaded. ``check_later``: a copy already confirmed current may be used
        while the store is asked in the background (:meth:`DiskCache.acquire`)."""
        if self._graph.has_namespace(served):
            await self._drop_namespace(served, f"archive model '{served}' is loaded again")
        lease = await self._sources.fetch(served, key, stores, check_later=check_later)
        try:
            layout = self._layouts.kept(served, key, lease.path)  # a reload from the disk cache
            if layout is None:
                layout = await self._pool.run(self._layouts.read, served, key, lease.path)
            source, members = layout
            if not self._namespacing:
                check_members_free(served, key, members, self._graph, self._table.serving, self._locks.busy)
        except BaseException:
            lease.release()
            raise
        self._graph.add_namespace(Namespace(served, key, {m.name: m for m in members}, lease.release))
        try:
            try:
                if self._table.serving(served):
                    failures = await self.load(source)  # loaded again (a new upload is served)
                else:  # inspected and often loaded in one trip to a load thread, as a folder's miss
                    failures = await self.load_on_demand(served, lambda: source) or {}
            finally:
                lease.loaded()  # a background check of the copy may start now
        except BaseException:
            if not self._table.serving(served):
                await self._drop_namespace(served, f"archive '{key}' failed to load")
            raise
        if not self._table.serving(served):
            await self._drop_namespace(served, f"archive '{key}' failed to load")
            reason = failures.get(served) or next(iter(failures.values()), "no version loaded")
            raise UnavailableError(f"model '{served}' failed to load: {reason}")
        logger.info(
            "model '%s' served from '%s' (%s)%s",
            served,
            key,
            lease.path,
            f" with {', '.join(sorted(m.name for m in members))}" if members else "",
        )

    async def _drop_namespace(self, served: str, reason: str) -> None:
        """Unload the composing models of the archive served as ``served``, forget them,
        and release the archive's cache lease (the cache may then evict its files)."""
        namespace = self._graph.namespace(served)
        if namespace is None:
            return
        try:
            for member in sorted(namespace.members):
                if self._table.serving(member):
                    await self.unload(member, reason)
        finally:
            self._graph.pop_namespace(served)
            for member in namespace.members:
                if not self._table.serving(member):
                    self._table.forget(member)
                    self._sources.forget_fingerprint(member)
            if namespace.release is not None:
                namespace.release()

    # -- unloading ---------------------------------------------------------------------

    def dependents(self, name: str) -> list[str]:
        """Loaded ensembles that have ``name`` among their composing models."""
        return self._graph.dependents(name, self._table.serving)

    async def unload(self, name: str, reason: str) -> None:
        """Unload ``name`` and, first, every loaded ensemble that needs it."""
        for dependent in self.dependents(name):
            await self.unload(dependent, f"composing model '{name}' was unloaded")
        async with self._locks.hold(name):
            await self.unload_locked(name, reason)

    async def unload_model(self, name: str, *, with_composing: bool = False) -> None:
        """The repository API's unload: :meth:`unload`, and the model's request-supplied files
        go; ``with_composing``: then an ensemble's composing models that no other loaded
        ensemble needs."""
        composing = self._graph.composing(name)
        for dependent in self.dependents(name):
            await self.unload(dependent, f"composing model '{name}' was unloaded")
        async with self._locks.hold(name):
            await self.unload_locked(name, "unloaded")
            await self._sources.drop_override(name)
        if with_composing:
            for dep in sorted(composing):
                if not self.dependents(dep):
                    await self.unload(dep, f"unloaded with ensemble '{name}'")

    async def unload_locked(self, name: str, reason: str) -> None:
        """Unload ``name`` (its lock held); its bytes are released once it has unloaded."""
        try:
            await self._unload_and_record(name, reason)
        finally:
            # Released only now that the unload has finished (for an eviction, to the load
            # that claimed it); an unload through the repository API counts the same.
            self._admission.released(name)
            if self._graph.has_namespace(name):
                await self._drop_namespace(name, f"archive model '{name}' was unloaded")

    async def _unload_and_record(self, name: str, reason: str) -> None:
        self._graph.forget_ensemble(name)
        models = self._table.take(name)
        if not models:
            if is_namespaced(name) and self._graph.namespace_of(name) is None:
                self._table.forget(name)  # a forgotten archive's model: nothing to show
                return
            if self._table.known(name) and not self._table.was_ready(name):
                return
            self._table.mark(name, ModelState.UNAVAILABLE, reason)
            return
        self._table.mark_versions(name, models, ModelState.UNLOADING)
        started = seconds(self._clock)
        await self.discard(models)
        self._stats.unloading_time_us.observe((seconds(self._clock) - started) * 1e6)
        self._table.mark_versions(name, models, ModelState.UNAVAILABLE, reason)
        logger.info("unloaded model '%s' (%s)", name, reason)

    async def discard(self, models: list[Model]) -> None:
        """Drain the models' schedulers (in-flight requests finish), then free the instances
        (never during a measured load, whose RSS delta the freed memory would shrink) and,
        under a budget, give the freed heap back to the OS before the bytes count as free
        (:class:`TrimSchedule`: once enough was freed since it was last done)."""
        if len(models) == 1:
            await models[0].scheduler.stop()  # no task of its own to gather
        else:
            await asyncio.gather(*(m.scheduler.stop() for m in models))
        meter = self._admission.meter
        instances = [(m.name, instance) for m in models for instance in m.instances]
        if not instances:
            return
        trim = self._admission.budget is not None and self._trims.freed(sum(m.size_bytes for m in models))
        if len(instances) == 1:  # the usual: one trip to a load thread frees it and trims
            await self._pool.run(meter.shared, functools.partial(unload_instances, instances, trim=trim))
            return
        await asyncio.gather(
            *(self._pool.run(meter.shared, functools.partial(unload_instances, [one], trim=False)) for one in instances)
        )
        if trim:
            await self._pool.run(meter.shared, release_free_memory)

    async def evict(self, victim: str, loading: str, *, claimed: bool) -> None:
        """Unload ``victim`` to make room for ``loading``. A claimed victim is unloaded only
        while still claimed for ``loading``: one unloaded meanwhile (the repository API, a
        cascade) already gave its bytes, and a model loaded again since is not the victim."""

        def still_victim() -> bool:
            if claimed:
                return self._admission.claimant(victim) == loading
            return self._table.serving(victim)

        if not still_victim():
            return
        for dependent in self.dependents(victim):
            await self.unload(dependent, f"composing model '{victim}' was unloaded")
        async with self._locks.hold(victim):
            if not still_victim():
                return
            loaded = self._table.latest(victim)
            if loaded is not None:
                self._stats.evictions += 1
                self._stats.eviction_age_s.observe(max(0.0, seconds(self._clock) - loaded.loaded_at))
            reason = (
                "evicted to make room for the next load"
                if loading == AHEAD
                else f"evicted to make room for model '{loading}'"
            )
            await self.unload_locked(victim, reason)

    # -- stopping ----------------------------------------------------------------------

    async def stop(self, timeout: float) -> None:
        """Cancel the loads in flight and wait for them (at most ``timeout`` seconds: a load
        thread cannot be interrupted), then unload everything."""
        self.closed = True
        self._admission.gate.close()  # loads waiting for room give up now
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                logger.warning(
                    "%d model load(s) still running after %g s; stopping without them",
                    len(pending),
                    timeout,
                )
        await self.discard(self._table.take_all())
        for namespace in self._graph.pop_namespaces():
            if namespace.release is not None:
                namespace.release()


def _failures(name: str, outcome: LoadOutcome) -> dict[str, str]:
    """A load's failures by name (``name``, ``name:version``)."""
    failures: dict[str, str] = {}
    if outcome.error:
        failures[name] = outcome.error
    for version, reason in outcome.failures.items():
        failures[f"{name}:{version}"] = reason
    return failures
