"""ModelRepositoryManager: the control modes and the public API of the model life cycle.

Control modes, as Triton's:

- ``none``: every model in the repositories is loaded at start; the repository API may
  not load or unload.
- ``explicit``: only the ``--load-model`` models (``*`` for all) are loaded at start; the
  repository API loads and unloads.
- ``poll``: every model is loaded at start and the repositories are rescanned every
  ``--repository-poll-secs``: new models load, changed ones reload, removed ones unload.
- ``on_demand``: ``explicit`` plus loading on the first request, one load however many
  requests wait for it (single flight). A name that is not a local model folder is looked up
  as a key: an archive next to the model folders of a local repository, or an archive or
  folder in an ``s3://`` repository, fetched through the disk cache; each archive is its own
  namespace (:mod:`quiver.lifecycle.archives`).

The manager decides *what* loads and when; the parts it assembles (the README's "The
lifecycle package" maps them) decide *how*: :mod:`.table` (what is served, the index),
:mod:`.lifecycle` (loads, unloads, evictions, under the lock order of :mod:`.locks`),
:mod:`.dependencies` (ensembles, archive namespaces), :mod:`.admission` (budget, GPU limit,
eviction, what is in use), :mod:`.sources` (repositories, keys, URLs, the disk cache),
:mod:`.flights` (single flight), :mod:`.pins`, :mod:`.pool` and one injected :mod:`.clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as pb

from quiver import messages
from quiver.backends.base import INLINE_THRESHOLD_NS, SERVER
from quiver.backends.onnxruntime_optimized import stop as stop_optimizer
from quiver.config import parse_model_config_json
from quiver.ensemble.scheduler import InferFn
from quiver.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
    UnsupportedError,
)
from quiver.lifecycle.admission import AdmissionControl
from quiver.lifecycle.clock import SYSTEM_CLOCK, Clock, seconds
from quiver.lifecycle.dependencies import DependencyGraph, composing_of
from quiver.lifecycle.flights import SingleFlight
from quiver.lifecycle.lifecycle import ModelLifeCycle
from quiver.lifecycle.locks import ModelLocks
from quiver.lifecycle.memory import MemoryMeter, SizePredictor
from quiver.lifecycle.model import Model, ModelState, VersionStatus
from quiver.lifecycle.pins import Pins
from quiver.lifecycle.policies import DEFAULT_POLICY
from quiver.lifecycle.pool import LoadPool
from quiver.lifecycle.read_ahead import ReadAhead
from quiver.lifecycle.sources import DEFAULT_CACHE_BYTES, ModelSources
from quiver.lifecycle.table import ModelTable
from quiver.lifecycle.watch import FolderWatch
from quiver.metrics.statistics import MultiModelStatistics
from quiver.repository.archive import ExtractLimits
from quiver.repository.cache import CACHE_REVALIDATE, DEFAULT_REVALIDATE_TIMEOUT, CacheStats
from quiver.repository.names import (
    check_file_paths,
    check_key_name,
    check_local_path,
    check_model_name,
)

__all__ = ["CONTROL_MODES", "DEFAULT_CACHE_BYTES", "ModelRepositoryManager"]

logger = logging.getLogger(__name__)

CONTROL_MODES = ("none", "explicit", "poll", "on_demand")
#: Modes in which the repository API may load and unload models.
_API_MODES = ("explicit", "on_demand")


def _index_order(status: VersionStatus) -> tuple[str, int]:
    return status.name, int(status.version) if status.version else -1


class ModelRepositoryManager:
    def __init__(
        self,
        repositories: list[Path],
        *,
        control_mode: str = "none",
        startup_models: Iterable[str] = (),
        strict_config: bool = False,
        load_threads: int = 4,
        load_retries: int = 0,
        inline_threshold_ns: int = INLINE_THRESHOLD_NS,
        memory_limit_bytes: int = 0,
        eviction_policy: str = DEFAULT_POLICY,
        load_wait_timeout: float = 60.0,
        remote_repositories: Iterable[str] = (),
        s3_options: dict[str, Any] | None = None,
        cache_dir: Path | None = None,
        cache_size: int = DEFAULT_CACHE_BYTES,
        archive_limits: ExtractLimits | None = None,
        cache_revalidate_timeout: float = DEFAULT_REVALIDATE_TIMEOUT,
        cache_revalidate: str = "background",
        gpu_limit: float = 0.0,
        gpu_reader: Callable[[], Mapping[int, tuple[int, int]] | None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        meter: MemoryMeter | None = None,
        predictor: SizePredictor | None = None,
        namespacing: bool = True,
        evict_ahead: bool = True,
        read_ahead: bool = True,
        watch_folders: bool = True,
    ) -> None:
        if control_mode not in CONTROL_MODES:
            raise InvalidArgumentError(f"unknown model control mode '{control_mode}'")
        self.control_mode = control_mode
        if cache_revalidate not in CACHE_REVALIDATE:
            raise InvalidArgumentError(f"unknown model cache revalidation '{cache_revalidate}'")
        #: On-demand loads of a key whose cached copy is confirmed current ask the store in
        #: the background ("background") or first ("always").
        self._check_later = cache_revalidate == "background"
        self._startup_models = list(startup_models)
        self._local_roots = list(repositories)
        #: on_demand: local model folders watched for changes after a walk (watch.py)
        self._watch_folders = watch_folders
        self._strict = strict_config
        self._load_wait_timeout = load_wait_timeout
        self._clock = clock
        self.multi_model = MultiModelStatistics()
        self._pool = LoadPool(load_threads)
        self._graph = DependencyGraph()
        self._table = ModelTable(clock)
        self._locks = ModelLocks(self._graph)
        self._pins = Pins()
        self._sources = ModelSources(
            repositories,
            pool=self._pool,
            stats=self.multi_model,
            remote_repositories=list(remote_repositories),
            s3_options=s3_options,
            cache_dir=cache_dir,
            cache_size=cache_size,
            archive_limits=archive_limits,
            cache_revalidate_timeout=cache_revalidate_timeout,
        )
        #: The memory budget, GPU limit and eviction policy (read by metrics and tests).
        self.admission = AdmissionControl(
            table=self._table,
            graph=self._graph,
            locks=self._locks,
            pins=self._pins,
            pool=self._pool,
            clock=clock,
            memory_limit_bytes=memory_limit_bytes,
            eviction_policy=eviction_policy,
            load_wait_timeout=load_wait_timeout,
            strict=strict_config,
            gpu_limit=gpu_limit,
            gpu_reader=gpu_reader,
            meter=meter,
            predictor=predictor,
            evict_ahead=evict_ahead,
        )
        # A model no longer pinned, or no longer loading or unloading: loads waiting for room look again.
        self._locks.on_release = self._pins.on_release = self.admission.notify
        if self.admission.tracks_use:
            self._table.on_use = self.admission.used
        self._lifecycle = ModelLifeCycle(
            table=self._table,
            graph=self._graph,
            locks=self._locks,
            pins=self._pins,
            sources=self._sources,
            admission=self.admission,
            pool=self._pool,
            clock=clock,
            stats=self.multi_model,
            strict=strict_config,
            inline_threshold_ns=inline_threshold_ns,
            reload_failed_composing=control_mode in _API_MODES,
            namespacing=namespacing,
            load_retries=load_retries,
        )
        self._flights = SingleFlight(self._lifecycle.spawn, clock)
        # the requests waiting for a load go on as soon as its model is READY (flights.land)
        self._table.add_listener(self._landed)
        self._poll_task: asyncio.Task[None] | None = None
        self._idle_ns: Callable[[], int] | None = None  # what start gave SERVER.idle_ns
        #: on_demand: the local model folders' configurations read while idle (read_ahead.py)
        self._read_ahead = (
            ReadAhead(
                configs=self.admission.configs,
                pool=self._pool,
                meter=self.admission.meter,
                clock=clock,
                strict=strict_config,
                activity=self.admission.activity,
            )
            if read_ahead and control_mode == "on_demand"
            else None
        )
        self._read_ahead_task: asyncio.Task[None] | None = None
        #: Who waits for a lull between requests: configurations read ahead, evictions ahead.
        self._tells_activity = self._read_ahead is not None or self.admission.budget is not None
        #: A request came (any: the frontends call it as each arrives; one clock read and one
        #: store, the method bound once here): work that waits for a lull waits again.
        self.request_came: Callable[[], None] = self.admission.activity.busy

    def _landed(self, name: str, resident: bool) -> None:
        if resident:
            self._flights.land(name)

    def add_residency_listener(self, listener: Callable[[str, bool], None]) -> None:
        """Call ``listener(name, resident)`` whenever a model becomes READY (True) or stops
        being served (False): loads, reloads, failed loads, unloads and evictions alike. A
        cluster router (Ray Serve's model multiplexing) keeps its view of this process in
        step through it."""
        self._table.add_listener(listener)

    def bind(self, infer: InferFn) -> None:
        """The server's inference entry, which ensembles send their steps through (and
        Python models their BLS requests)."""
        self._lifecycle.bind(infer)
        SERVER.infer = infer

    @property
    def on_demand(self) -> bool:
        return self.control_mode == "on_demand"

    # -- start and poll ----------------------------------------------------------------

    async def start(self, poll_seconds: float = 0.0) -> dict[str, str]:
        """Load what the control mode loads at start; returns name -> reason for failures."""
        SERVER.loop = asyncio.get_running_loop()
        SERVER.thread = threading.get_ident()
        SERVER.health = self._table.set_health
        activity, clock = self.admission.activity, self._clock
        self._idle_ns = SERVER.idle_ns = lambda: clock.now() - activity.last
        if self.on_demand and self._watch_folders and self.admission.watch is None:
            # misses of local folders unchanged since their last walk walk nothing (watch.py)
            self.admission.watch = FolderWatch(self._local_roots)
            if self._read_ahead is not None:
                self._read_ahead.watch = self.admission.watch
        sources, clashes = await self._sources.scan()
        failures = dict(clashes)
        for name, reason in clashes.items():
            logger.error("%s", reason)
            self._table.mark(name, ModelState.UNAVAILABLE, reason)
        if self.control_mode in _API_MODES and "*" not in self._startup_models:
            wanted = []
            for name in self._startup_models:
                if name in sources:
                    wanted.append(name)
                else:
                    failures[name] = f"--load-model '{name}': no such model in the model repository"
                    logger.error("%s", failures[name])
        else:
            wanted = list(sources)
        # Composing models first, then ensembles (which load what they still miss).
        kinds = await asyncio.gather(
            *(self._pool.run(functools.partial(composing_of, sources[n], strict=self._strict)) for n in wanted)
        )
        plain = [n for n, composing in zip(wanted, kinds, strict=True) if composing is None]
        ensembles = [n for n, composing in zip(wanted, kinds, strict=True) if composing is not None]
        for group in (plain, ensembles):
            results = await asyncio.gather(
                *(self._lifecycle.spawn(self._lifecycle.load(sources[name])) for name in group),
                return_exceptions=True,
            )
            for name, result in zip(group, results, strict=True):
                if isinstance(result, BaseException):
                    failures[name] = str(result)
                else:
                    failures.update(result)
        if self.control_mode == "poll" and poll_seconds > 0:
            self._poll_task = asyncio.create_task(self._poll_forever(poll_seconds), name="quiver-poll")
        if self._read_ahead is not None:
            ahead = [source for name, source in sorted(sources.items()) if not self._table.known(name)]
            self._read_ahead_task = asyncio.create_task(self._read_ahead.run(ahead), name="quiver-read-ahead")
        return failures

    async def _poll_forever(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.poll()
            except Exception:
                logger.exception("polling the model repository failed")

    async def poll(self) -> None:
        """Rescan the repositories: load new models, reload changed ones, unload removed ones."""
        sources, clashes = await self._sources.scan()
        work: list[Coroutine[Any, Any, object]] = []
        for name, source in sources.items():
            if self._locks.busy(name):
                continue  # a load or unload of it is under way; look again next time
            if await self._sources.changed(source):
                logger.info("model '%s' is new or changed in the repository; loading it", name)
                work.append(self._lifecycle.load(source))
        for name in self._sources.fingerprinted:
            if name not in sources and not self._sources.overridden(name):
                logger.info("model '%s' was removed from the repository; unloading it", name)
                self._sources.forget_fingerprint(name)
                work.append(self._lifecycle.unload(name, "removed from the model repository"))
        for name, reason in clashes.items():
            self._table.mark(name, ModelState.UNAVAILABLE, reason)
        results = await asyncio.gather(*(self._lifecycle.spawn(w) for w in work), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, QuiverError):
                logger.error("repository poll: %s", result)

    # -- the repository API ------------------------------------------------------------

    def _check_api(self, what: str, name: str) -> None:
        if self.control_mode not in _API_MODES:
            raise UnavailableError(  # Triton's code and text (in 'none' mode too)
                messages.LOAD_UNLOAD_NOT_ALLOWED
                + f" (failed to {what} '{name}': model control mode '{self.control_mode}'; start "
                "with --model-control-mode=explicit)"
            )
        check_model_name(name)

    async def load(
        self,
        name: str,
        *,
        config_json: str | None = None,
        files: dict[str, bytes] | None = None,
    ) -> None:
        """The repository API's load: (re)load ``name``, optionally with a config and files
        given in the request instead of the repository's. Raises if nothing could load."""
        self._check_api("load", name)
        if files:
            check_file_paths(list(files), name)
        override = (
            parse_model_config_json(config_json, f"config parameter of the load request for '{name}'", name)
            if config_json
            else None
        )
        if self.on_demand and not files and await self._is_key(name):
            # An archive (or S3) key: the same path as an on-demand request, sharing its
            # single flight; a loaded key is fetched and loaded again (a new upload is served).
            if override is not None:
                raise InvalidArgumentError(
                    f"failed to load '{name}': the 'config' parameter is not supported for "
                    "archive and S3 keys (the archive holds the configuration)"
                )
            stores = self._sources.key_stores(name)
            await self._flights.follow(name, functools.partial(self._lifecycle.load_archive, name, name, stores))
            return
        await self._lifecycle.run(self._load_folder(name, override, files))

    async def _load_folder(
        self, name: str, override: pb.ModelConfig | None, files: dict[str, bytes] | None
    ) -> None:
        failures = await self._lifecycle.load_folder(name, override, files)
        # Judged right after the lock was released, before an unload waiting for it runs.
        if name in failures or not self._table.serving(name):
            reason = failures.get(name) or next(iter(failures.values()), "no version loaded")
            kept = " (the loaded versions keep serving)" if self._table.serving(name) else ""
            raise InvalidArgumentError(f"failed to load '{name}': {reason}{kept}")
        if failures:
            logger.warning("model '%s' loaded, some versions failed: %s", name, failures)

    async def _is_key(self, name: str) -> bool:
        """Whether ``name`` is served from a storage key (archive, S3 folder) rather than a
        local model folder: loaded from one, or no local model folder has that name."""
        return self._graph.has_namespace(name) or await self._sources.is_key(name)

    async def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """The repository API's unload. Loaded ensembles that need ``name`` are unloaded
        first (an ensemble never runs without its composing models); with
        ``unload_dependents``, an ensemble's composing models that no other loaded ensemble
        needs are unloaded after it."""
        self._check_api("unload", name)
        if not self._table.known(name) and not self._table.serving(name):
            sources, _ = await self._sources.scan()
            if name not in sources:
                raise NotFoundError(f"failed to unload '{name}': unknown model")
        await self._lifecycle.unload_model(name, with_composing=unload_dependents)
        self._sources.expire(name)  # unloaded on purpose: its next load asks the store first

    async def load_url(self, name: str, url: str) -> str:
        """Load the model at ``url`` (``s3://bucket/prefix/key.tar.gz``, an S3 folder, a
        local archive or folder) as ``name``, in its own namespace: SageMaker's ``POST
        /models``, in the modes that let the repository API load (explicit, as Triton's
        SageMaker image runs, and on_demand). Returns the name it is served under.
        AlreadyExistsError when ``name`` is loaded."""
        if self.control_mode not in _API_MODES:
            raise UnsupportedError(
                f"cannot load '{name}' from '{url}': loading by url is not allowed in model "
                f"control mode '{self.control_mode}' (start with --model-control-mode=explicit "
                "or on_demand)"
            )
        check_key_name(name)
        if not url.startswith("s3://"):
            check_local_path(url.removeprefix("file://"), "url")
        if self._table.serving(name):
            raise AlreadyExistsError(f"model '{name}' is already loaded")
        store, key = await self._sources.store_for_url(url)
        await self._flights.follow(name, functools.partial(self._lifecycle.load_archive, name, key, [store]))
        return name

    # -- on demand -----------------------------------------------------------------------

    async def acquire(self, name: str, version: str = "", *, use: bool = True, missed: bool = False) -> Model:
        """The READY model for ``name``, loading it first in on-demand mode. Concurrent
        requests for a model that is not loaded wait for one load (single flight); a request
        gives up after the load wait timeout with UNAVAILABLE while the load goes on; a failed
        load is reported to every waiting request, and the next request tries again. ``use``:
        the caller runs a request on it (see :meth:`get`). ``missed``: the caller's own
        :meth:`get` just found it not READY, in on-demand mode, with no await since."""
        if not missed:
            try:
                return self._table.get(name, version, use=use)
            except (NotFoundError, UnavailableError):
                if not self.on_demand:
                    raise
        check_model_name(name)
        self.multi_model.cache_misses += 1
        self.admission.activity.busy()
        waited_from = seconds(self._clock)
        try:
            # A request waiting for its model's load pins it: once loaded, the model is not
            # evicted before the waiting requests reach it (they enqueue without yielding
            # after get(), which makes them in flight).
            with self._pins.holding(name):
                return await self._acquire_loading(name, version, waited_from + self._load_wait_timeout, use)
        finally:
            self.multi_model.loading_wait_time_us.observe((seconds(self._clock) - waited_from) * 1e6)

    async def _acquire_loading(self, name: str, version: str, deadline: float, use: bool) -> Model:
        while True:
            task = self._flights.join(name, functools.partial(self._load_on_demand, name))
            try:
                await self._flights.wait(task, deadline)
            except TimeoutError:
                raise UnavailableError(
                    f"model '{name}' is still loading after {self._load_wait_timeout:g} s "
                    "(--model-load-wait-timeout); the load goes on: try again"
                ) from None
            try:
                return self._table.get(name, version, use=use)
            except (NotFoundError, UnavailableError):
                # Evicted again before this request got to it (every other model was in
                # use): load it again while the wait allows.
                if seconds(self._clock) >= deadline or self._table.serving(name):
                    raise

    async def _load_on_demand(self, name: str) -> None:
        # The folder found, its files inspected (fingerprint, config, size) and the model
        # often loaded too, in one trip to a load thread; neither found nor inspected when
        # its files did not change since they were (watch.py: the changes read here first).
        if self.admission.watch is not None:
            self.admission.watch.read_changes()
        failures = None
        if self._local_roots:  # only S3 repositories: a key, no trip to look for a folder
            failures = await self._lifecycle.load_on_demand(name, functools.partial(self._sources.find, name))
        if failures is None:  # no folder found by a direct look: a scan, then a key
            source = (await self._sources.scan())[0].get(name) if self._local_roots else None
            if source is None:
                stores = self._sources.key_stores(name)
                await self._lifecycle.load_archive(name, name, stores, check_later=self._check_later)
                return
            failures = await self._lifecycle.load_missing(source)
        if not self._table.serving(name):
            reason = failures.get(name) or next(iter(failures.values()), "no version loaded")
            raise UnavailableError(f"model '{name}' failed to load: {reason}")

    # -- lookup (hot path) and the index -------------------------------------------------

    def get(self, name: str, version: str = "", *, use: bool = False) -> Model:
        """The READY model serving ``name`` (latest loaded version when ``version`` is empty);
        a version that is not a positive integer is INVALID_ARG. ``use``: a request will run
        on it (counted for eviction); a look that runs nothing is not a use."""
        return self._table.get(name, version, use=use)

    def is_ready(self, name: str, version: str = "") -> bool:
        """Whether ``name`` (``version``) is READY; a version that is not a positive integer
        is INVALID_ARG, as in Triton's ModelReady."""
        return self._table.is_ready(name, version)

    def versions(self, name: str) -> list[Model]:
        return self._table.loaded(name)

    @property
    def ready_models(self) -> list[Model]:
        return self._table.models

    def index(self) -> list[VersionStatus]:
        """Every model version the manager knows of, with its state and reason."""
        return self._table.index()

    async def repository_index(self) -> list[VersionStatus]:
        """Like :meth:`index`, plus models in the repositories never loaded (no state): model
        folders and, in on-demand mode, the keys it would load: archives in the local
        repositories, archives and folders in the S3 ones (an S3 repository that cannot be
        listed is left out, with a warning). The listings are incremental
        (:meth:`ModelSources.index_names`): with nothing changed, the index of 10,000 models
        lists nothing."""
        names = await self._sources.index_names(keys=self.on_demand)
        known = sorted(self.index(), key=_index_order)  # nearly sorted already: cheap
        seen = {s.name for s in known}
        unknown = (VersionStatus(name, "", ModelState.UNKNOWN) for name in names if name not in seen)
        return list(heapq.merge(known, unknown, key=_index_order))

    def request_done(self, model: Model) -> None:
        """A request on ``model`` finished (its pin may be released): loads waiting for room
        look again."""
        admission = self.admission
        admission.notify()
        if self._tells_activity:
            admission.activity.busy()

    # -- statistics ----------------------------------------------------------------------

    @property
    def memory(self) -> tuple[int, int]:
        """Bytes of the memory budget in use (resident, retiring and reserved: never above
        the limit) and its limit (0, 0 without a budget)."""
        budget = self.admission.budget
        return (0, 0) if budget is None else (budget.used, budget.limit_bytes)

    @property
    def memory_reserved(self) -> int:
        """Bytes of the budget reserved by loads under way (part of :attr:`memory`'s used)."""
        budget = self.admission.budget
        return 0 if budget is None else budget.reserved_bytes

    @property
    def framework_bytes(self) -> dict[str, int]:
        """Each framework's one-time host memory, measured once (outside the budget)."""
        return self.admission.framework_bytes

    @property
    def disk_cache_stats(self) -> CacheStats | None:
        """The disk cache's counters (None until a model was fetched through it)."""
        return self._sources.disk_cache_stats

    @property
    def disk_cache_usage(self) -> tuple[int, int]:
        """Bytes of the disk cache in use and its size (0, 0 before it is used)."""
        return self._sources.disk_cache_usage

    # -- stopping ----------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop polling, cancel and await the loads in flight, drain every model's scheduler
        and unload the instances (``finalize`` runs), close the disk cache."""
        for task in (self._poll_task, self._read_ahead_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._lifecycle.stop(timeout=self._load_wait_timeout)
        if self.admission.watch is not None:
            self.admission.watch.close()
        await self._sources.close()
        self._pool.shutdown()
        if SERVER.idle_ns is self._idle_ns:
            SERVER.idle_ns = None
        stop_optimizer()

