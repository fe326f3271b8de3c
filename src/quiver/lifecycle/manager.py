"""ModelRepositoryManager: decides what is loaded and answers "which model serves this?".

Control modes, as Triton's:

- ``none``: every model in the repositories is loaded at start; the repository API may
  not load or unload.
- ``explicit``: only the ``--load-model`` models (``*`` for all) are loaded at start; the
  repository API loads and unloads.
- ``poll``: every model is loaded at start and the repositories are rescanned every
  ``--repository-poll-secs``: new models load, changed ones reload, removed ones unload.

Loads run on a bounded thread pool (``--model-load-thread-count``). Each model has its own
lock, so loads and unloads of one model happen one after another while other models load in
parallel. A reload keeps the old versions serving until the new ones are READY; a failed
reload leaves the old ones serving. An unload lets in-flight requests finish; new ones get
UNAVAILABLE.

``on_demand`` is ``explicit`` plus loading on the first request. A name that is not a local
model folder is looked up as a key: an archive (``resnet_v0.tar.gz``) next to the model
folders of a local repository, or an archive or folder in an ``s3://`` repository. It is
fetched through the :class:`~quiver.repository.cache.DiskCache` the manager owns, whose
lease is held while the model is loaded; each archive is its own namespace (see
:mod:`quiver.lifecycle.archives`), loaded, pinned, evicted and unloaded as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import INLINE_THRESHOLD_NS, SERVER
from quiver.config import ModelConfig, parse_model_config_json
from quiver.ensemble.scheduler import InferFn
from quiver.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
    UnsupportedError,
)
from quiver.lifecycle.archives import archive_layout, is_namespaced
from quiver.lifecycle.budget import Admission, BudgetGate, MemoryBudget, OutOfMemoryError
from quiver.lifecycle.eviction import Candidate, EvictionPolicy, GreedyDualSizePolicy, LRUPolicy
from quiver.lifecycle.frameworks import prime
from quiver.lifecycle.loader import (
    LoadOutcome,
    backend_name,
    is_ensemble,
    load_ensemble,
    load_model,
    unload_instance,
)
from quiver.lifecycle.memory import (
    GpuMemoryLimit,
    MemoryMeter,
    ModelIdentity,
    SizePredictor,
    fix_mmap_threshold,
    release_free_memory,
)
from quiver.lifecycle.model import Model, ModelState, VersionStatus, parse_version
from quiver.metrics.statistics import MultiModelStatistics
from quiver.repository.archive import ExtractLimits
from quiver.repository.cache import DEFAULT_REVALIDATE_TIMEOUT, CacheLease, CacheStats, DiskCache
from quiver.repository.local import CONFIG_FILENAME, LocalRepository, ModelSource
from quiver.repository.names import (
    check_file_paths,
    check_key_name,
    check_local_path,
    check_model_name,
)
from quiver.repository.storage import (
    LocalStorage,
    S3Storage,
    Storage,
    is_archive_key,
    model_keys,
    parse_s3_url,
    storage_for,
)

logger = logging.getLogger(__name__)

CONTROL_MODES = ("none", "explicit", "poll", "on_demand")
#: Modes in which the repository API may load and unload models.
_API_MODES = ("explicit", "on_demand")


_monotonic = time.monotonic

#: ``--model-cache-size`` when none is given.
DEFAULT_CACHE_BYTES = 20 << 30


def default_cache_dir() -> Path:
    """``$QUIVER_CACHE_DIR``, else ``quiver-model-cache-<uid>`` under the system temp folder."""
    configured = os.environ.get("QUIVER_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"quiver-model-cache-{os.getuid()}"


def fingerprint(path: Path) -> str:
    """Changes when any file under ``path`` is added, removed, resized or rewritten."""
    digest = hashlib.blake2b(digest_size=16)
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            digest.update(f"{os.path.relpath(full, path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class ModelRepositoryManager:
    def __init__(
        self,
        repositories: list[Path],
        *,
        control_mode: str = "none",
        startup_models: Iterable[str] = (),
        strict_config: bool = False,
        load_threads: int = 4,
        inline_threshold_ns: int = INLINE_THRESHOLD_NS,
        memory_limit_bytes: int = 0,
        eviction_policy: str = "lru",
        load_wait_timeout: float = 60.0,
        remote_repositories: Iterable[str] = (),
        s3_options: dict[str, Any] | None = None,
        cache_dir: Path | None = None,
        cache_size: int = DEFAULT_CACHE_BYTES,
        archive_limits: ExtractLimits | None = None,
        cache_revalidate_timeout: float = DEFAULT_REVALIDATE_TIMEOUT,
        gpu_limit: float = 0.0,
        gpu_reader: Callable[[], Mapping[int, tuple[int, int]] | None] | None = None,
    ) -> None:
        if control_mode not in CONTROL_MODES:
            raise InvalidArgumentError(f"unknown model control mode '{control_mode}'")
        self._repository = LocalRepository(repositories)
        # Where keys (archives, S3 folders) are looked up, in order: local folders, then S3.
        self._s3_options = dict(s3_options or {})
        self._stores: list[Storage] = [LocalStorage(root) for root in repositories]
        self._stores += [storage_for(url, **self._s3_options) for url in remote_repositories]
        self._url_stores: dict[str, Storage] = {}
        self._cache_dir = cache_dir
        self._cache_size = cache_size
        self._archive_limits = archive_limits  # None: the defaults, bytes capped at the cache size
        self._cache_revalidate_timeout = cache_revalidate_timeout
        self._cache: DiskCache | None = None
        self._cache_private: Path | None = None  # a fallback folder of our own, deleted at stop
        self._cache_lock = asyncio.Lock()
        # Archives: served name -> the cache lease held while it is loaded; its namespace's
        # composing models (namespaced names); namespaced name -> served name and source.
        self._leases: dict[str, CacheLease] = {}
        self._namespace: dict[str, set[str]] = {}
        self._namespace_of: dict[str, str] = {}
        self._members: dict[str, ModelSource] = {}
        self.control_mode = control_mode
        self._startup_models = list(startup_models)
        self._strict = strict_config
        self._inline_threshold_ns = inline_threshold_ns
        self._pool = ThreadPoolExecutor(max_workers=max(1, load_threads), thread_name_prefix="quiver-load")
        self._ready: dict[str, dict[int, Model]] = {}
        self._latest: dict[str, Model] = {}
        self._status: dict[str, list[VersionStatus]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._fingerprints: dict[str, str] = {}
        self._overrides: dict[str, Path] = {}  # models loaded from request-supplied files
        self._poll_task: asyncio.Task[None] | None = None
        self._infer: InferFn | None = None
        # The multi-model parts: loads on demand, a byte budget, eviction.
        self._load_wait_timeout = load_wait_timeout
        self._loading: dict[str, asyncio.Task[None]] = {}  # single flight of on-demand loads
        # Loads wait at the gate for room (host budget or GPU limit), woken when a pin is
        # released, a load or an unload finished.
        self._gate = BudgetGate()
        self._budget = (
            MemoryBudget(memory_limit_bytes, listener=self._gate.notify) if memory_limit_bytes > 0 else None
        )
        self._gate.budget = self._budget
        if self._budget is not None:
            fix_mmap_threshold()  # RSS deltas that belong to one load (lifecycle.memory)
        self._frameworks: dict[str, int] = {}  # framework -> its one-time bytes, measured once
        self._prime_lock = asyncio.Lock()
        self._policy: EvictionPolicy = (
            GreedyDualSizePolicy() if eviction_policy in ("gds", "greedy-dual-size") else LRUPolicy()
        )
        self._touch_policy = not isinstance(self._policy, LRUPolicy)
        self._meter = MemoryMeter()
        self._predictor = SizePredictor()
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
        self.multi_model = MultiModelStatistics()
        self._composing: dict[str, set[str]] = {}  # loaded ensemble -> its composing models
        self._composing_loading: dict[str, set[str]] = {}  # ensemble loading -> the same, pinned
        self._awaiting: dict[str, int] = {}  # model -> requests waiting for its load (pins)
        self._residency_listeners: list[Callable[[str, bool], None]] = []
        self._closed = False

    def add_residency_listener(self, listener: Callable[[str, bool], None]) -> None:
        """Call ``listener(name, resident)`` whenever a model becomes READY (True) or stops
        being served (False): loads, reloads, failed loads, unloads and evictions alike. A
        cluster router (Ray Serve's model multiplexing) keeps its view of this process in
        step through it."""
        self._residency_listeners.append(listener)

    def _tell_residency(self, name: str, resident: bool) -> None:
        for listener in self._residency_listeners:
            try:
                listener(name, resident)
            except Exception:
                logger.exception("residency listener failed for model '%s'", name)

    # -- start -------------------------------------------------------------------------

    async def start(self, poll_seconds: float = 0.0) -> dict[str, str]:
        """Load what the control mode loads at start; returns name -> reason for failures."""
        SERVER.loop = asyncio.get_running_loop()
        sources, clashes = await self._scan()
        failures = dict(clashes)
        for name, reason in clashes.items():
            logger.error("%s", reason)
            self._status[name] = [VersionStatus(name, "", ModelState.UNAVAILABLE, reason)]
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
        loop = asyncio.get_running_loop()
        kinds = await asyncio.gather(
            *(
                loop.run_in_executor(self._pool, functools.partial(is_ensemble, sources[n], strict=self._strict))
                for n in wanted
            )
        )
        plain = [n for n, (ensemble, _) in zip(wanted, kinds, strict=True) if not ensemble]
        ensembles = [n for n, (ensemble, _) in zip(wanted, kinds, strict=True) if ensemble]
        for group in (plain, ensembles):
            results = await asyncio.gather(
                *(self._load_source(sources[name]) for name in group), return_exceptions=True
            )
            for name, result in zip(group, results, strict=True):
                if isinstance(result, BaseException):
                    failures[name] = str(result)
                else:
                    failures.update(result)
        if self.control_mode == "poll" and poll_seconds > 0:
            self._poll_task = asyncio.create_task(self._poll_forever(poll_seconds), name="quiver-poll")
        return failures

    async def _scan(self) -> tuple[dict[str, ModelSource], dict[str, str]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._repository.scan)

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    # -- load --------------------------------------------------------------------------

    def bind(self, infer: InferFn) -> None:
        """The server's inference entry, which ensembles send their steps through (and
        Python models their BLS requests)."""
        self._infer = infer
        SERVER.infer = infer

    async def _load_source(
        self,
        source: ModelSource,
        config_override: pb.ModelConfig | None = None,
        visiting: frozenset[str] = frozenset(),
    ) -> dict[str, str]:
        """Load (or reload) one model under its lock; returns its failures."""
        try:
            async with self._lock(source.name):
                return await self._load_locked(source, config_override, visiting)
        finally:
            self._gate.notify()  # no longer pinned by its load

    async def _load_locked(
        self,
        source: ModelSource,
        config_override: pb.ModelConfig | None,
        visiting: frozenset[str] = frozenset(),
    ) -> dict[str, str]:
        started = time.monotonic()
        try:
            failures = await self._load_inner(source, config_override, visiting)
            if source.name in self._ready and source.name not in failures:
                self.multi_model.loading_time_us.observe((time.monotonic() - started) * 1e6)
            else:
                self.multi_model.load_failures += 1
            return failures
        except QuiverError as exc:
            self.multi_model.load_failures += 1  # e.g. out of memory: recorded, and the caller learns why
            if source.name not in self._ready:
                self._status[source.name] = [
                    VersionStatus(source.name, "", ModelState.UNAVAILABLE, exc.message)
                ]
            raise
        except Exception as exc:  # a bug or an OS error must cost this load, not leave it LOADING
            name = source.name
            logger.exception("loading model '%s' failed unexpectedly", name)
            reason = f"model '{name}': {type(exc).__name__}: {exc}"
            if name not in self._ready:
                self._status[name] = [VersionStatus(name, "", ModelState.UNAVAILABLE, reason)]
            return {name: reason}

    async def _load_inner(
        self,
        source: ModelSource,
        config_override: pb.ModelConfig | None,
        visiting: frozenset[str],
    ) -> dict[str, str]:
        name = source.name
        loop = asyncio.get_running_loop()
        serving = name in self._ready
        if not serving:
            self._status[name] = [VersionStatus(name, "", ModelState.LOADING)]
        self._fingerprints[name] = await loop.run_in_executor(self._pool, fingerprint, source.path)
        ensemble, composing = await loop.run_in_executor(
            self._pool,
            functools.partial(is_ensemble, source, strict=self._strict, override=config_override),
        )
        if ensemble:
            self._composing_loading[name] = set(composing)
            try:
                configs, problem = await self._ensure_composing(name, composing, visiting | {name})
            finally:
                self._composing_loading.pop(name, None)
            if problem:
                outcome = LoadOutcome(None, [], {}, problem)
                logger.error("failed to load ensemble '%s': %s", name, problem)
            else:
                assert self._infer is not None, "bind() the inference entry before loading ensembles"
                outcome = await loop.run_in_executor(
                    self._pool,
                    functools.partial(
                        load_ensemble,
                        source,
                        strict=self._strict,
                        composing=configs,
                        infer=self._infer,
                        config_override=config_override,
                    ),
                )
                if outcome.models:
                    self._composing[name] = set(composing)
        else:
            outcome = await self._load_within_budget(source, config_override, serving)
        failures: dict[str, str] = {}
        if outcome.error:
            failures[name] = outcome.error
        for version, reason in outcome.failures.items():
            failures[f"{name}:{version}"] = reason
        if self._closed:  # the server stopped while this loaded
            await self._unload_models(outcome.models)
            return failures
        if not outcome.models and serving:
            logger.error("reload of model '%s' failed; the loaded versions keep serving", name)
            return failures
        old = list(self._ready.get(name, {}).values())
        self._install(name, outcome)
        if old:
            try:
                await self._unload_models(old)
            finally:
                if self._budget is not None:
                    self._budget.retired(name)  # the old versions' bytes, counted until now
        return failures

    async def _load_within_budget(
        self, source: ModelSource, config_override: pb.ModelConfig | None, serving: bool
    ) -> LoadOutcome:
        """Load a (non-ensemble) model; under a memory budget, first make room for its
        predicted size by evicting the least valuable models not in use, then measure what
        it really took. Under a GPU load limit, first make room on the GPUs it would grow."""
        name = source.name
        load = functools.partial(
            load_model,
            source,
            strict=self._strict,
            inline_threshold_ns=self._inline_threshold_ns,
            config_override=config_override,
        )
        gpu = self._gpu
        if gpu is None:
            return await self._load_host_budget(source, load, serving, config_override)
        identity = ModelIdentity(name, "", self._fingerprints.get(name, ""))
        predicted = gpu.predict(identity)
        await self._admit_gpu(name, predicted)
        try:
            outcome = await self._load_host_budget(source, load, serving, config_override)
        finally:
            gpu.settle(name)
            self._gate.notify()
        if outcome.models and name not in self._gpu_sizes and predicted is not None:
            self._gpu_sizes[name] = predicted  # loaded unmeasured: its known size
        return outcome

    async def _admit_gpu(self, name: str, predicted: Mapping[int, int] | None) -> None:
        """Make room under the GPU load limit: evict models not in use that hold GPU memory
        on the devices the load would take past the limit (re-reading the devices after each
        eviction), wait for pinned ones within the load wait timeout (woken when a pin is
        released or an unload finishes), or refuse the load."""
        gpu = self._gpu
        assert gpu is not None
        deadline = self._gate.clock() + self._load_wait_timeout
        while True:
            over = gpu.over(predicted, exclude=name)
            if not over:
                gpu.reserve(name, predicted)
                return
            offered = [
                replace(c, size_bytes=sum(self._gpu_sizes.get(c.name, {}).get(d, 0) for d in over))
                for c in self._candidates(name)
            ]
            offered = [c for c in offered if c.size_bytes > 0]
            victims = self._policy.victims(offered, sum(over.values()), 0)
            if not victims:  # not enough evictable: evict what there is, the readings decide
                victims = [c.name for c in offered if not c.pinned]
            claimed = self._budget.releasing if self._budget is not None else frozenset()
            victims = [v for v in victims if v not in claimed]  # another load unloads those
            if victims:
                for victim in victims:
                    await self._evict_one(victim, name, claimed=False)
                continue
            waiting_on = any(c.pinned or c.name in claimed for c in offered)
            if not waiting_on or not await self._gate.wait(deadline):
                raise OutOfMemoryError(gpu.describe(name, over))

    def _remember_gpu(self, identity: ModelIdentity, gpu_bytes: Mapping[int, int] | None) -> None:
        if self._gpu is not None and gpu_bytes is not None:
            self._gpu.record(identity, gpu_bytes)
            self._gpu_sizes[identity.name] = dict(gpu_bytes)

    async def _load_host_budget(
        self,
        source: ModelSource,
        load: Callable[[], LoadOutcome],
        serving: bool,
        config_override: pb.ModelConfig | None,
    ) -> LoadOutcome:
        """Load under the memory budget (see :mod:`quiver.lifecycle.budget` for the rules):
        reserve the predicted size (evicting models not in use, waiting for pinned ones),
        load once the victims are unloaded, then commit the measured size, growing the
        reservation first when the model measured larger than predicted."""
        name = source.name
        loop = asyncio.get_running_loop()
        budget = self._budget
        identity = ModelIdentity(name, "", self._fingerprints.get(name, ""))
        if budget is None:
            if self._gpu is None or self._gpu.predict(identity) is not None:
                return await loop.run_in_executor(self._pool, load)
            outcome, footprint = await loop.run_in_executor(
                self._pool, functools.partial(self._meter.measure, load)
            )
            if outcome.models:
                self._remember_gpu(identity, footprint.gpu_bytes)
            return outcome
        await self._prime_framework(source, config_override)
        prediction = self._predictor.predict(identity, source.path)
        timeout = self._load_wait_timeout
        admission = await self._gate.reserve(
            name, prediction.bytes, self._policy, functools.partial(self._candidates, name), timeout=timeout
        )
        # A model measured before (same files) is not measured again: measuring serialises
        # loads and costs two garbage collections; its size is known.
        known = prediction.source == "measured"
        try:
            await self._evict(admission, name)
            await self._gate.covered(name, self._gate.clock() + timeout)
            started = time.monotonic()
            if known:
                outcome = await loop.run_in_executor(
                    self._pool, functools.partial(self._meter.shared, load)
                )
                measured = prediction.bytes
            else:
                outcome, footprint = await loop.run_in_executor(
                    self._pool, functools.partial(self._meter.measure, load)
                )
                measured = footprint.host_bytes
                if outcome.models:
                    self._remember_gpu(identity, footprint.gpu_bytes)
            seconds = time.monotonic() - started
        except BaseException:
            budget.cancel(name)
            raise
        if not outcome.models:
            budget.cancel(name)
            return outcome
        if known:
            size = prediction.bytes
        else:
            # RSS growth undercounts when the load reuses memory an eviction just freed (the
            # heap does not always shrink): a model never counts for less than its files suggest.
            from_files = await loop.run_in_executor(self._pool, self._predictor.from_files, source.path)
            size = max(measured, int((from_files or 0) / self._predictor.file_factor))
            self._predictor.record(identity, size)
        try:
            await self._cover_overrun(name, size)
        except BaseException:
            budget.cancel(name)
            await self._unload_models(outcome.models)
            raise
        for model in outcome.models:
            model.size_bytes = size
            model.last_used = time.monotonic()
        self._policy.touch(name, size, time.monotonic(), load_cost_s=seconds)
        budget.commit(name, size)
        logger.info(
            "model '%s' takes %d bytes of host memory (%s %d, predicted %d from %s); "
            "%d of %d bytes in use",
            name,
            size,
            "known" if known else "measured",
            measured,
            prediction.bytes,
            prediction.source,
            budget.used,
            budget.limit_bytes,
        )
        return outcome

    async def _cover_overrun(self, name: str, size: int) -> None:
        """The model measured ``size`` bytes: if that is more than its reservation, reserve the
        excess as a load would (free bytes, evictions, waiting for pins) before it is READY;
        if that cannot be had, OutOfMemoryError (the caller unloads the model)."""
        budget = self._budget
        assert budget is not None
        granted = budget.reservation(name)
        if size <= granted:
            return
        logger.warning(
            "model '%s' measured %d bytes, %d more than its reservation; reserving the excess "
            "before it is served",
            name,
            size,
            size - granted,
        )
        try:
            admission = await self._gate.reserve(
                name,
                size - granted,
                self._policy,
                functools.partial(self._candidates, name),
                timeout=self._load_wait_timeout,
                grow=True,
            )
            await self._evict(admission, name)
            await self._gate.covered(name, self._gate.clock() + self._load_wait_timeout)
        except OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"model '{name}' measured {size} bytes when loaded, more than the {granted} "
                f"bytes predicted, and the excess does not fit: {exc.message}"
            ) from None

    async def _prime_framework(self, source: ModelSource, config_override: pb.ModelConfig | None) -> None:
        """Pay the model's framework's one-time process cost (import, first session) once, in
        a measured section of its own, so no model's measured size includes it. Reported,
        not counted in the budget (see :mod:`quiver.lifecycle.memory`)."""
        loop = asyncio.get_running_loop()
        backend = await loop.run_in_executor(
            self._pool,
            functools.partial(backend_name, source, strict=self._strict, override=config_override),
        )
        if not backend or backend in self._frameworks:
            return
        async with self._prime_lock:
            if backend in self._frameworks:
                return
            try:
                _, footprint = await loop.run_in_executor(
                    self._pool, functools.partial(self._meter.measure, functools.partial(prime, backend))
                )
            except Exception as exc:  # e.g. the package is missing: the load says so
                logger.debug("priming framework '%s' failed: %s", backend, exc)
                return
            self._frameworks[backend] = footprint.host_bytes
            logger.info(
                "framework '%s' took %d bytes of host memory once for this process (import and "
                "first session); not charged to any model nor to the model memory limit",
                backend,
                footprint.host_bytes,
            )

    def _candidates(self, loading: str) -> list[Candidate]:
        """Loaded models as eviction candidates; pinned when a request or a load uses them
        (or an ensemble in flight or loading that they are part of)."""
        busy_ensembles = {
            e for e in self._composing if any(m.scheduler.inflight for m in self._ready.get(e, {}).values())
        }
        busy_composing = {m for e in busy_ensembles for m in self._composing[e]}
        for members in self._composing_loading.values():
            busy_composing |= members
        # An archive is pinned as a whole: while it loads, or while any of its models is in use.
        busy_namespaces = {
            served
            for served, members in self._namespace.items()
            if any(self._in_use(n) for n in (served, *members))
        }
        candidates = []
        for name, versions in self._ready.items():
            if name == loading or not versions:
                continue
            pinned = (
                self._lock(name).locked()
                or name in self._awaiting
                or any(m.scheduler.inflight for m in versions.values())
                or name in busy_composing
                or self._namespace_of.get(name) in busy_namespaces
            )
            candidates.append(
                Candidate(
                    name,
                    sum(m.size_bytes for m in versions.values()),
                    max(m.last_used for m in versions.values()),
                    pinned,
                )
            )
        return candidates

    def _in_use(self, name: str) -> bool:
        """Being loaded or unloaded, or serving a request now (or about to)."""
        return self._lock(name).locked() or name in self._awaiting or any(
            m.scheduler.inflight for m in self._ready.get(name, {}).values()
        )

    async def _evict(self, admission: Admission, loading: str) -> None:
        """Unload the models the admission claimed for ``loading`` (ensembles that need them
        first); their bytes come to its reservation as each unload finishes."""
        for victim in admission.victims:
            await self._evict_one(victim, loading, claimed=True)

    async def _evict_one(self, victim: str, loading: str, *, claimed: bool) -> None:
        """Unload ``victim`` to make room for ``loading``. A claimed victim is unloaded only
        while still claimed for ``loading``: one unloaded meanwhile (the repository API, a
        cascade) already gave its bytes, and a model loaded again since is not the victim."""
        budget = self._budget

        def still_victim() -> bool:
            if claimed:
                return budget is not None and budget.claimant(victim) == loading
            return victim in self._ready

        if not still_victim():
            return
        reason = f"evicted to make room for model '{loading}'"
        for dependent in self._dependents(victim):
            await self._unload_cascade(dependent, f"composing model '{victim}' was unloaded")
        async with self._lock(victim):
            if not still_victim():
                return
            loaded = self._latest.get(victim)
            if loaded is not None:
                self.multi_model.evictions += 1
                self.multi_model.eviction_age_s.observe(max(0.0, time.monotonic() - loaded.loaded_at))
            await self._unload_locked(victim, reason)

    async def _ensure_composing(
        self, ensemble: str, names: list[str], visiting: frozenset[str]
    ) -> tuple[dict[str, ModelConfig], str]:
        """The READY configs of an ensemble's composing models, loading those that never
        loaded (or any, in explicit mode); or the reason one is not available."""
        configs: dict[str, ModelConfig] = {}
        sources: dict[str, ModelSource] | None = None
        for dep in names:
            if dep in visiting:
                return {}, f"ensemble '{ensemble}' and model '{dep}' contain each other"
            if dep not in self._ready:
                attempted = dep in self._status
                if not attempted or self.control_mode in _API_MODES:
                    source = self._members.get(dep)  # a model of the same archive
                    if source is None:
                        if sources is None:
                            sources, _ = await self._scan()
                        source = sources.get(dep)
                    if source is None:
                        return {}, (
                            f"ensemble '{ensemble}': composing model '{dep}' is not in the "
                            "model repository"
                        )
                    await self._load_missing(source, visiting)
            model = self._latest.get(dep)
            if model is None:
                reason = next((s.reason for s in self._status.get(dep, []) if s.reason), "not loaded")
                return {}, f"ensemble '{ensemble}': composing model '{dep}' is not available: {reason}"
            configs[dep] = model.config
        return configs, ""

    async def _load_missing(self, source: ModelSource, visiting: frozenset[str]) -> dict[str, str]:
        """Load a model on demand (a request's, or an ensemble's composing model) unless a
        load that held its lock meanwhile loaded it: loading it again would be a reload,
        wasted, and under a full budget one that needs room for a second copy while its
        first is pinned (two such reloads would wait for each other). Returns failures."""
        try:
            async with self._lock(source.name):
                if source.name in self._ready:
                    return {}
                return await self._load_locked(source, None, visiting)
        finally:
            self._gate.notify()

    def _dependents(self, name: str) -> list[str]:
        """Loaded ensembles that have ``name`` among their composing models."""
        return [e for e, deps in self._composing.items() if name in deps and e in self._ready]

    def _install(self, name: str, outcome: LoadOutcome) -> None:
        statuses: list[VersionStatus] = []
        if outcome.error:
            statuses.append(VersionStatus(name, "", ModelState.UNAVAILABLE, outcome.error))
        for version, reason in sorted(outcome.failures.items()):
            statuses.append(VersionStatus(name, str(version), ModelState.UNAVAILABLE, reason))
        if outcome.models:
            versions = {m.version: m for m in outcome.models}
            self._ready[name] = versions
            self._latest[name] = versions[max(versions)]
            statuses.extend(VersionStatus(name, m.version_str, ModelState.READY) for m in outcome.models)
            self._tell_residency(name, True)
        else:
            if self._ready.pop(name, None):
                self._tell_residency(name, False)
            self._latest.pop(name, None)
        statuses.sort(key=lambda s: (int(s.version) if s.version else -1))
        self._status[name] = statuses

    async def load(
        self,
        name: str,
        *,
        config_json: str | None = None,
        files: dict[str, bytes] | None = None,
    ) -> None:
        """The repository API's load: (re)load ``name``, optionally with a config and files
        given in the request instead of the repository's. Raises if nothing could load."""
        if self.control_mode not in _API_MODES:
            raise UnsupportedError(
                f"failed to load '{name}': explicit model load / unload is not allowed in "
                f"model control mode '{self.control_mode}' (start with --model-control-mode=explicit)"
            )
        check_model_name(name)
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
            stores = self._key_stores(name)
            await self._single_flight(name, functools.partial(self._load_archive, name, name, stores))
            return
        async with self._lock(name):
            new_root: Path | None = None
            if files:
                if override is None:
                    raise InvalidArgumentError(
                        f"failed to load '{name}': 'file:' parameters need the 'config' parameter too"
                    )
                source = await self._write_override(name, files)
                new_root = source.repository
            else:
                sources, _ = await self._scan()
                source = sources.get(name)  # type: ignore[assignment]
                if source is None:
                    raise NotFoundError(
                        f"failed to load '{name}': no model named '{name}' in the model repository"
                    )
            try:
                failures = await self._load_locked(source, override)
            except BaseException:
                failures = {name: "load interrupted"}
                raise
            finally:
                # The files of the versions that serve stay until a load replaced them.
                loaded = name not in failures and name in self._ready
                if loaded:
                    await self._drop_override(name)
                    if new_root is not None:
                        self._overrides[name] = new_root
                elif new_root is not None:
                    await self._remove_tree(new_root)
        if name in failures or name not in self._ready:
            reason = failures.get(name) or next(iter(failures.values()), "no version loaded")
            kept = " (the loaded versions keep serving)" if name in self._ready else ""
            raise InvalidArgumentError(f"failed to load '{name}': {reason}{kept}")
        if failures:
            logger.warning("model '%s' loaded, some versions failed: %s", name, failures)

    async def _is_key(self, name: str) -> bool:
        """Whether ``name`` is served from a storage key (archive, S3 folder) rather than a
        local model folder: loaded from one, or no local model folder has that name."""
        if name in self._leases or name in self._namespace:
            return True
        if name in self._overrides:
            return False
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(self._pool, self._repository.find, name) is not None:
            return False
        sources, clashes = await self._scan()
        return name not in sources and name not in clashes

    async def _write_override(self, name: str, files: dict[str, bytes]) -> ModelSource:
        """Write request-supplied model files to a private folder: ``<version>/<file>`` paths
        only (checked by :func:`check_file_paths` before anything is written)."""
        check_file_paths(list(files), name)

        def write() -> Path:
            root = Path(tempfile.mkdtemp(prefix="quiver-load-"))
            try:
                folder = root / name
                folder.mkdir()
                for relative, content in files.items():
                    target = folder / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                (folder / CONFIG_FILENAME).write_text("")  # the config comes from the request
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            return root

        loop = asyncio.get_running_loop()
        try:
            root = await loop.run_in_executor(self._pool, write)
        except OSError as exc:  # a full or read-only temporary folder: the server's state
            raise UnavailableError(
                f"failed to load '{name}': cannot write its files under {tempfile.gettempdir()}: {exc}"
            ) from None
        return ModelSource(name, root, root / name)

    async def _drop_override(self, name: str) -> None:
        root = self._overrides.pop(name, None)
        if root is not None:
            await self._remove_tree(root)

    async def _remove_tree(self, root: Path) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, functools.partial(shutil.rmtree, root, True))

    # -- unload ------------------------------------------------------------------------

    async def unload(self, name: str, *, unload_dependents: bool = False) -> None:
        """The repository API's unload. Loaded ensembles that need ``name`` are unloaded
        first (an ensemble never runs without its composing models); with
        ``unload_dependents``, an ensemble's composing models that no other loaded ensemble
        needs are unloaded after it."""
        if self.control_mode not in _API_MODES:
            raise UnsupportedError(
                f"failed to unload '{name}': explicit model load / unload is not allowed in "
                f"model control mode '{self.control_mode}' (start with --model-control-mode=explicit)"
            )
        check_model_name(name)
        if name not in self._status and name not in self._ready:
            sources, _ = await self._scan()
            if name not in sources:
                raise NotFoundError(f"failed to unload '{name}': unknown model")
        composing = set(self._composing.get(name, ()))
        for dependent in self._dependents(name):
            await self._unload_cascade(dependent, f"composing model '{name}' was unloaded")
        async with self._lock(name):
            await self._unload_locked(name, "unloaded")
            await self._drop_override(name)
        if unload_dependents:
            for dep in sorted(composing):
                if not self._dependents(dep):
                    await self._unload_cascade(dep, f"unloaded with ensemble '{name}'")

    async def _unload_cascade(self, name: str, reason: str) -> None:
        """Unload ``name`` and, first, every loaded ensemble that needs it."""
        for dependent in self._dependents(name):
            await self._unload_cascade(dependent, f"composing model '{name}' was unloaded")
        async with self._lock(name):
            await self._unload_locked(name, reason)

    async def _unload_locked(self, name: str, reason: str) -> None:
        try:
            await self._unload_and_record(name, reason)
        finally:
            # Released only now that the unload has finished (for an eviction, to the load
            # that claimed it); an unload through the repository API counts the same.
            self._gpu_sizes.pop(name, None)
            if self._budget is not None:
                self._budget.release(name)
                self._policy.forget(name)
            self._gate.notify()
            if name in self._leases or name in self._namespace:
                await self._drop_namespace(name, f"archive model '{name}' was unloaded")

    async def _drop_namespace(self, served: str, reason: str) -> None:
        """Unload the composing models of the archive served as ``served``, forget them,
        and release the archive's cache lease (the cache may then evict its files)."""
        members = self._namespace.pop(served, set())
        try:
            for member in sorted(members):
                if member in self._ready:
                    await self._unload_cascade(member, reason)
        finally:
            for member in members:
                self._namespace_of.pop(member, None)
                self._members.pop(member, None)
                if member not in self._ready:
                    self._status.pop(member, None)
                    self._fingerprints.pop(member, None)
            lease = self._leases.pop(served, None)
            if lease is not None:
                lease.release()

    async def _unload_and_record(self, name: str, reason: str) -> None:
        self._composing.pop(name, None)
        versions = self._ready.pop(name, None)
        self._latest.pop(name, None)
        if versions:
            self._tell_residency(name, False)
        if not versions:
            if is_namespaced(name) and name not in self._namespace_of:
                self._status.pop(name, None)  # a forgotten archive's model: nothing to show
                return
            if name in self._status and not any(s.state is ModelState.READY for s in self._status[name]):
                return
            self._status[name] = [VersionStatus(name, "", ModelState.UNAVAILABLE, reason)]
            return
        models = list(versions.values())
        self._status[name] = [VersionStatus(name, m.version_str, ModelState.UNLOADING) for m in models]
        started = time.monotonic()
        await self._unload_models(models)
        self.multi_model.unloading_time_us.observe((time.monotonic() - started) * 1e6)
        self._status[name] = [
            VersionStatus(name, m.version_str, ModelState.UNAVAILABLE, reason) for m in models
        ]
        logger.info("unloaded model '%s' (%s)", name, reason)

    async def _unload_models(self, models: list[Model]) -> None:
        """Drain the models' schedulers (in-flight requests finish), then free the instances
        (never during a measured load, whose RSS delta the freed memory would shrink) and,
        under a budget, give the freed heap back to the OS before the bytes count as free."""
        await asyncio.gather(*(m.scheduler.stop() for m in models))
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._pool, self._meter.shared, functools.partial(unload_instance, m.name, instance)
                )
                for m in models
                for instance in m.instances
            )
        )
        if self._budget is not None and any(m.instances for m in models):
            await loop.run_in_executor(self._pool, self._meter.shared, release_free_memory)

    # -- poll --------------------------------------------------------------------------

    async def _poll_forever(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.poll()
            except Exception:
                logger.exception("polling the model repository failed")

    async def poll(self) -> None:
        """Rescan the repositories: load new models, reload changed ones, unload removed ones."""
        sources, clashes = await self._scan()
        loop = asyncio.get_running_loop()
        work: list[Coroutine[Any, Any, object]] = []
        for name, source in sources.items():
            if self._lock(name).locked():
                continue  # a load or unload of it is under way; look again next time
            current = await loop.run_in_executor(self._pool, fingerprint, source.path)
            if self._fingerprints.get(name) != current:
                logger.info("model '%s' is new or changed in the repository; loading it", name)
                work.append(self._load_source(source))
        for name in list(self._fingerprints):
            if name not in sources and name not in self._overrides:
                logger.info("model '%s' was removed from the repository; unloading it", name)
                del self._fingerprints[name]
                work.append(self._unload_removed(name))
        for name, reason in clashes.items():
            self._status[name] = [VersionStatus(name, "", ModelState.UNAVAILABLE, reason)]
        results = await asyncio.gather(*work, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, QuiverError):
                logger.error("repository poll: %s", result)

    async def _unload_removed(self, name: str) -> None:
        await self._unload_cascade(name, "removed from the model repository")

    # -- lookup (hot path) -------------------------------------------------------------

    def get(self, name: str, version: str = "") -> Model:
        """The READY model serving ``name`` (latest loaded version when ``version`` is empty).

        Every version a client names (HTTP paths, gRPC fields, the SageMaker and ensemble
        paths) is checked here, once: not a positive integer is INVALID_ARG."""
        number = parse_version(name, version) if version else None
        if number is None:
            model = self._latest.get(name)
            if model is not None:
                model.last_used = _monotonic()
                if self._touch_policy:
                    self._policy.touch(name, model.size_bytes, model.last_used)
                return model
            raise self._missing(name, "")
        found = self._ready.get(name, {}).get(number)
        if found is not None:
            found.last_used = _monotonic()
            return found
        raise self._missing(name, str(number))

    def _missing(self, name: str, version: str) -> Exception:
        statuses = self._status.get(name)
        if statuses is None:
            return NotFoundError(f"unknown model: '{name}'")
        specific = bool(version)
        what = f"model '{name}'" + (f" version {version}" if specific else "")
        if specific:
            mine = [s for s in statuses if s.version == version]
            if not mine:
                if any(s.state is ModelState.READY for s in statuses):
                    loaded = ", ".join(s.version for s in statuses if s.state is ModelState.READY)
                    return NotFoundError(f"{what} is not served; versions served: {loaded}")
                mine = [s for s in statuses if s.version == ""]
            statuses = mine or statuses
        status = statuses[0]
        detail = f": {status.reason}" if status.reason else ""
        return UnavailableError(f"{what} is not ready ({status.state.value}){detail}")

    # -- on demand -----------------------------------------------------------------------

    @property
    def on_demand(self) -> bool:
        return self.control_mode == "on_demand"

    async def acquire(self, name: str, version: str = "") -> Model:
        """The READY model for ``name``, loading it first in on-demand mode. Concurrent
        requests for a model that is not loaded wait for one load (single flight); a request
        gives up after the load wait timeout with UNAVAILABLE while the load goes on; a failed
        load is reported to every waiting request, and the next request tries again."""
        try:
            return self.get(name, version)
        except (NotFoundError, UnavailableError):
            if not self.on_demand:
                raise
        check_model_name(name)
        self.multi_model.cache_misses += 1
        waited_from = time.monotonic()
        try:
            return await self._acquire_loading(name, version, waited_from + self._load_wait_timeout)
        finally:
            self.multi_model.loading_wait_time_us.observe((time.monotonic() - waited_from) * 1e6)

    async def _acquire_loading(self, name: str, version: str, deadline: float) -> Model:
        # A request waiting for its model's load pins it: once loaded, the model is not
        # evicted before the waiting requests reach it (they enqueue without yielding after
        # get(), which makes them in flight).
        self._awaiting[name] = self._awaiting.get(name, 0) + 1
        try:
            return await self._acquire_loading_pinned(name, version, deadline)
        finally:
            left = self._awaiting[name] - 1
            if left:
                self._awaiting[name] = left
            else:
                del self._awaiting[name]
                self._gate.notify()

    async def _acquire_loading_pinned(self, name: str, version: str, deadline: float) -> Model:
        while True:
            task = self._loading.get(name)
            if task is None:
                task = asyncio.ensure_future(self._load_on_demand(name))
                self._loading[name] = task
                task.add_done_callback(functools.partial(self._loaded_on_demand, name))
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise UnavailableError(
                    f"model '{name}' is still loading after {self._load_wait_timeout:g} s "
                    "(--model-load-wait-timeout); the load goes on: try again"
                ) from None
            try:
                return self.get(name, version)
            except (NotFoundError, UnavailableError):
                # Evicted again before this request got to it (every other model was in
                # use): load it again while the wait allows.
                if time.monotonic() >= deadline or name in self._ready:
                    raise

    def _loaded_on_demand(self, name: str, task: asyncio.Task[None]) -> None:
        if self._loading.get(name) is task:
            del self._loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: waiters that timed out must not leave it unobserved

    async def _load_on_demand(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        # A direct look at <repository>/<name> first: listing 1,000 folders per miss costs.
        source = await loop.run_in_executor(self._pool, self._repository.find, name)
        if source is None:
            sources, _ = await self._scan()
            source = sources.get(name)
        if source is None:
            await self._load_archive(name, name, self._key_stores(name))
            return
        failures = await self._load_missing(source, frozenset())
        if name not in self._ready:
            reason = failures.get(name) or next(iter(failures.values()), "no version loaded")
            raise UnavailableError(f"model '{name}' failed to load: {reason}")

    # -- archives and storage keys -------------------------------------------------------

    def _key_stores(self, name: str) -> list[Storage]:
        """The stores in which ``name``, not a local model folder, is looked up as a key:
        local repositories hold archives next to their model folders; S3 ones hold archives
        and folders. NotFoundError when none may hold it."""
        if is_namespaced(name):
            raise NotFoundError(
                f"unknown model: '{name}' (a model of an archive is served only while the "
                "archive's own model is loaded)"
            )
        check_key_name(name)
        archive = is_archive_key(name)
        stores = [s for s in self._stores if archive or not isinstance(s, LocalStorage)]
        if not stores:
            raise NotFoundError(f"unknown model: '{name}' (no such model in the model repository)")
        return stores

    async def _single_flight(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Wait for the load of ``name`` under way (on-demand, ``POST /models`` or the
        repository API), or start one with ``start()``; the load goes on if the caller
        is cancelled."""
        task = self._loading.get(name)
        if task is None:
            task = asyncio.ensure_future(start())
            self._loading[name] = task
            task.add_done_callback(functools.partial(self._loaded_on_demand, name))
        await asyncio.shield(task)

    async def _disk_cache(self) -> DiskCache:
        """The model cache, started on first use. When the default folder is held by another
        server process, a private folder under the temp folder is used instead."""
        async with self._cache_lock:
            if self._cache is not None:
                return self._cache
            explicit = self._cache_dir is not None
            cache = self._new_cache(self._cache_dir or default_cache_dir())
            try:
                await cache.start()
            except InvalidArgumentError as exc:  # another process holds the folder
                if explicit:
                    raise UnavailableError(f"model cache: {exc}") from None
                private = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="quiver-model-cache-"))
                logger.warning("%s; using %s for this process", exc, private)
                self._cache_private = private
                cache = self._new_cache(private)
                await cache.start()
            except OSError as exc:
                raise UnavailableError(f"model cache: cannot open {cache.root}: {exc}") from None
            self._cache = cache
            return cache

    def _new_cache(self, root: Path) -> DiskCache:
        def downloaded(key: str, size: int, duration_ns: int) -> None:
            self.multi_model.downloading_time_us.observe(duration_ns / 1000)

        return DiskCache(
            root,
            self._cache_size,
            limits=self._archive_limits,
            on_download=downloaded,
            revalidate_timeout=self._cache_revalidate_timeout,
        )

    @property
    def disk_cache_stats(self) -> CacheStats | None:
        """The disk cache's counters (None until a model was fetched through it)."""
        return self._cache.stats if self._cache is not None else None

    @property
    def disk_cache_usage(self) -> tuple[int, int]:
        """Bytes of the disk cache in use and its size (0, 0 before it is used)."""
        if self._cache is None:
            return 0, 0
        return self._cache.bytes_used + self._cache.bytes_reserved, self._cache.max_bytes

    async def _fetch(self, served: str, key: str, stores: list[Storage]) -> CacheLease:
        """A lease on ``key`` from the first store that has it (fetched into the cache)."""
        cache = await self._disk_cache()
        for store in stores:
            try:
                return await cache.acquire(key, store)
            except NotFoundError:
                continue
        where = ", ".join(s.location for s in stores)
        raise NotFoundError(f"unknown model: '{served}' (no archive or folder '{key}' in {where})")

    async def _load_archive(self, served: str, key: str, stores: list[Storage]) -> None:
        """Fetch ``key`` through the disk cache and load the model it holds as ``served``,
        with the archive's other models in its namespace; the cache lease is kept until
        ``served`` is unloaded."""
        if served in self._namespace or served in self._leases:
            await self._drop_namespace(served, f"archive model '{served}' is loaded again")
        lease = await self._fetch(served, key, stores)
        loop = asyncio.get_running_loop()
        try:
            source, members = await loop.run_in_executor(
                self._pool, archive_layout, served, key, lease.path
            )
        except BaseException:
            lease.release()
            raise
        self._leases[served] = lease
        self._namespace[served] = {m.name for m in members}
        for member in members:
            self._members[member.name] = member
            self._namespace_of[member.name] = served
        try:
            failures = await self._load_source(source)
        except BaseException:
            if served not in self._ready:
                await self._drop_namespace(served, f"archive '{key}' failed to load")
            raise
        if served not in self._ready:
            await self._drop_namespace(served, f"archive '{key}' failed to load")
            reason = failures.get(served) or next(iter(failures.values()), "no version loaded")
            raise UnavailableError(f"model '{served}' failed to load: {reason}")
        logger.info(
            "model '%s' served from '%s' (%s)%s",
            served,
            key,
            lease.path,
            f" with {', '.join(sorted(self._namespace[served]))}" if self._namespace.get(served) else "",
        )

    async def load_url(self, name: str, url: str) -> str:
        """Load the model at ``url`` (``s3://bucket/prefix/key.tar.gz``, an S3 folder, a
        local archive or folder) as ``name``: SageMaker's ``POST /models``. Returns the name
        it is served under. AlreadyExistsError when ``name`` is loaded."""
        if not self.on_demand:
            raise UnsupportedError(
                f"cannot load '{name}' from '{url}': loading from S3, archives and other "
                "folders needs the multi-model manager (--model-control-mode=on_demand)"
            )
        check_key_name(name)
        if not url.startswith("s3://"):
            check_local_path(url.removeprefix("file://"), "url")
        if name in self._ready:
            raise AlreadyExistsError(f"model '{name}' is already loaded")
        loop = asyncio.get_running_loop()
        store, key = await loop.run_in_executor(self._pool, self._store_for_url, url)
        await self._single_flight(name, functools.partial(self._load_archive, name, key, [store]))
        return name

    def _store_for_url(self, url: str) -> tuple[Storage, str]:
        """(storage, key) for a model location (blocking: it looks at the local disk)."""
        if url.startswith("s3://"):
            bucket, prefix = parse_s3_url(url)
            path = prefix.rstrip("/")
            if not path:
                raise InvalidArgumentError(f"url '{url}' names a bucket, not a model in it")
            parent, _, key = path.rpartition("/")
            location = f"s3://{bucket}/{parent}/" if parent else f"s3://{bucket}/"
            for store in self._stores:
                if store.location == location:
                    return store, key
            known = self._url_stores.get(location)
            if known is None:
                known = self._url_stores[location] = S3Storage(location, **self._s3_options)
            return known, key
        local = url.removeprefix("file://")
        if "://" in local:
            raise UnsupportedError(f"cannot load from '{url}': only s3:// URLs and local paths are supported")
        target = Path(os.path.abspath(local))
        if str(target).startswith(("/dev/", "/proc/", "/sys/")) or str(target) in ("/dev", "/proc", "/sys"):
            raise InvalidArgumentError(f"url '{url}' may not be under /dev, /proc or /sys")
        if not target.exists():
            raise NotFoundError(f"url '{url}' does not exist")
        if not target.is_dir() and not is_archive_key(target.name):
            raise InvalidArgumentError(f"url '{url}' is neither a folder nor a .tar.gz archive")
        folder = str(target.parent)
        local_store = self._url_stores.get(folder)
        if local_store is None:
            local_store = self._url_stores[folder] = LocalStorage(target.parent)
        return local_store, target.name

    def is_ready(self, name: str, version: str = "") -> bool:
        """Whether ``name`` (``version``) is READY; a version that is not a positive integer
        is INVALID_ARG, as in Triton's ModelReady."""
        try:
            self.get(name, version)
        except (NotFoundError, UnavailableError):
            return False
        return True

    def versions(self, name: str) -> list[Model]:
        return [m for _, m in sorted(self._ready.get(name, {}).items())]

    def index(self) -> list[VersionStatus]:
        """Every model version the manager knows of, with its state and reason."""
        return [s for name in sorted(self._status) for s in self._status[name]]

    async def repository_index(self) -> list[VersionStatus]:
        """Like :meth:`index`, plus models in the repositories never loaded (no state): model
        folders and, in on-demand mode, the keys it would load: archives in the local
        repositories, archives and folders in the S3 ones (an S3 repository that cannot be
        listed is left out, with a warning)."""
        sources, _ = await self._scan()
        names = set(sources)
        if self.on_demand:
            loop = asyncio.get_running_loop()
            for store in self._stores:
                names.update(await loop.run_in_executor(self._pool, self._stored_keys, store))
        known = {s.name for s in self.index()}
        entries = self.index() + [
            VersionStatus(name, "", ModelState.UNKNOWN) for name in names if name not in known
        ]
        return sorted(entries, key=lambda s: (s.name, int(s.version) if s.version else -1))

    @staticmethod
    def _stored_keys(store: Storage) -> list[str]:
        """The keys a store serves (blocking): archives next to a local repository's model
        folders (top level only; no walk through the folders), archives and folders in S3."""
        if isinstance(store, LocalStorage):
            try:
                with os.scandir(store.root) as entries:
                    return [
                        e.name
                        for e in entries
                        if is_archive_key(e.name) and not e.name.startswith(".") and e.is_file()
                    ]
            except OSError as exc:
                logger.warning("listing archives in %s failed: %s", store.location, exc)
                return []
        try:
            return model_keys(store.list())
        except Exception as exc:  # a store that is down must not take the index down with it
            logger.warning("listing models in %s failed: %s", store.location, exc)
            return []

    @property
    def memory(self) -> tuple[int, int]:
        """Bytes of the memory budget in use (resident, retiring and reserved: never above
        the limit) and its limit (0, 0 without a budget)."""
        if self._budget is None:
            return 0, 0
        return self._budget.used, self._budget.limit_bytes

    @property
    def memory_reserved(self) -> int:
        """Bytes of the budget reserved by loads under way (part of :attr:`memory`'s used)."""
        return 0 if self._budget is None else self._budget.reserved_bytes

    @property
    def framework_bytes(self) -> dict[str, int]:
        """Each framework's one-time host memory, measured once (outside the budget)."""
        return dict(self._frameworks)

    def request_done(self, model: Model) -> None:
        """A request on ``model`` finished (its pin may be released): loads waiting for room
        look again."""
        self._gate.notify()

    @property
    def ready_models(self) -> list[Model]:
        return [m for versions in self._ready.values() for m in versions.values()]

    # -- stopping ----------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop polling, drain every model's scheduler, unload the instances (``finalize`` runs)."""
        self._closed = True
        self._gate.close()  # loads waiting for room give up now
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
        models = self.ready_models
        for name, versions in self._ready.items():
            self._status[name] = [VersionStatus(name, str(v), ModelState.UNLOADING) for v in versions]
        self._ready.clear()
        self._latest.clear()
        await self._unload_models(models)
        for name in list(self._overrides):
            await self._drop_override(name)
        for lease in self._leases.values():
            lease.release()
        self._leases.clear()
        self._namespace.clear()
        self._namespace_of.clear()
        self._members.clear()
        if self._cache is not None:
            await self._cache.close()
        if self._cache_private is not None:
            await self._remove_tree(self._cache_private)
        self._pool.shutdown(wait=False)
