"""InferenceService: the one transport-neutral entry point.

Frontends decode bytes into an :class:`InferenceRequest`, call :meth:`InferenceService.infer`
and encode what comes back. Everything a request is checked against (the model's inputs,
datatypes, shapes, batch size, requested outputs) is checked here, once, for every
transport and backend. No HTTP or protobuf here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as pb

import quiver
from quiver import logs
from quiver.backends.base import SERVER
from quiver.config import ModelConfig
from quiver.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
    UnsupportedError,
)
from quiver.lifecycle import Model, ModelRepositoryManager, ModelState
from quiver.lifecycle.budget import OutOfMemoryError
from quiver.lifecycle.dependencies import ensemble_steps
from quiver.lifecycle.urls import CAPACITY_ERRORS, load_failure, url_folder
from quiver.raw_input import deduce as deduce_raw_input
from quiver.repository.cache import CacheFullError
from quiver.response_cache import ResponseCache
from quiver.scheduling.core import batch_rows
from quiver.shared_memory import SharedMemoryManager, read_inputs, write_outputs
from quiver.streaming import Cancellation, ResponseStream, StreamResponse
from quiver.tracing import Trace, TraceManager
from quiver.types import InferenceRequest, InferenceResponse
from quiver.validation import select_outputs, validate_request

#: What a frontend wraps a queued request's wait in (see :meth:`InferenceService.infer`).
Watch = Callable[[Awaitable[InferenceResponse]], Awaitable[InferenceResponse]]

logger = logging.getLogger(__name__)

#: Reasons of models that are UNAVAILABLE because they were unloaded, not because they failed.
_UNLOADED = ("unloaded", "evicted")

#: What :meth:`InferenceService.infer` says of a decoupled model unless told otherwise.
DECOUPLED_ERROR = (
    "model '{model}' uses the decoupled transaction policy: its answers stream through gRPC "
    "ModelStreamInfer or HTTP generate_stream (an ensemble step takes one answer)"
)

#: Extensions Quiver implements, by Triton's names (server metadata lists them).
EXTENSIONS = [
    "classification", "model_repository", "model_repository(unload_dependents)", "model_configuration",
    "binary_tensor_data", "system_shared_memory", "cuda_shared_memory", "parameters", "statistics",
    "trace", "logging",
]


@dataclass(slots=True)
class Registration:
    """A model loaded through SageMaker's ``POST /models``: its name -> the Quiver model."""

    name: str
    model: str
    url: str
    target: str = ""


class InferenceService:
    def __init__(
        self,
        manager: ModelRepositoryManager,
        repositories: Sequence[Path] = (),
        *,
        tracing: TraceManager | None = None,
        response_cache: ResponseCache | None = None,
        shared_memory: SharedMemoryManager | None = None,
        server_id: str = "quiver",
        strict_readiness: bool = False,
    ) -> None:
        self.manager = manager
        #: Triton's trace extension: the settings and which requests are traced.
        self.tracing = tracing if tracing is not None else TraceManager()
        #: The server-wide response cache (``--cache-config local,size=N``), or None.
        self.response_cache = response_cache
        #: The client shared-memory regions (both frontends register them here).
        self.shared_memory = shared_memory or SharedMemoryManager()
        self.server_id = server_id
        #: --strict-readiness: ready only while every model that is not unloaded is READY.
        self.strict_readiness = strict_readiness
        #: The frontends call it as every request arrives, whatever it asks (health, metadata,
        #: index, metrics, inference): the manager's idle detector (lifecycle/idle.py) sees
        #: the server busy. One clock read and one store; no allocation.
        self.request_came: Callable[[], None] = manager.request_came
        manager.bind(self.infer)
        SERVER.infer_stream = self.infer_stream  # Python models' decoupled BLS calls
        SERVER.decoupled = self.decoupled
        self.ready = False  # set by the runner once start-up finished
        #: The local ``--model-repository`` folders (SageMaker urls inside them load by name).
        self.repositories = [p.resolve() for p in repositories]
        #: SageMaker model_name -> registration; TargetModel header value -> model_name.
        self.registered: dict[str, Registration] = {}
        self._targets: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- health and metadata ---------------------------------------------------------

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.server_id, "version": quiver.__version__, "extensions": EXTENSIONS}

    def server_ready(self) -> bool:
        """Triton's server readiness: started (and not stopping); with strict readiness also
        every model version the repository manager knows READY, unless it was unloaded (or
        evicted). With on-demand loading, what clients' requests load (or fail to) does not
        decide readiness: one bad model asked for must not take the server out of rotation."""
        if not self.ready:
            return False
        if not self.strict_readiness or self.manager.on_demand:
            return True
        for status in self.manager.index():
            if status.state is ModelState.READY:
                continue
            if status.state is ModelState.UNAVAILABLE and status.reason.startswith(_UNLOADED):
                continue
            return False
        return True

    def model_ready(self, name: str, version: str = "") -> bool:
        return self.manager.is_ready(name, version)

    async def model_ready_checked(self, name: str, version: str = "") -> bool:
        """:meth:`model_ready`, and every instance's own check (``is_ready()``) agrees."""
        if not self.manager.is_ready(name, version):
            return False
        checks = [
            check()
            for instance in self.manager.get(name, version).instances
            if (check := getattr(instance, "user_ready", None)) is not None
        ]
        return all(await asyncio.gather(*checks)) if checks else True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        model = self.manager.get(name, version)
        config = model.config
        batch = config.max_batch_size
        return {
            "name": model.name,
            "versions": [m.version_str for m in self.manager.versions(name)],
            "platform": config.platform or config.backend,
            "inputs": [
                {"name": t.name, "datatype": t.datatype.value, "shape": t.full_shape(batch)}
                for t in config.inputs
            ],
            "outputs": [
                {"name": t.name, "datatype": t.datatype.value, "shape": t.full_shape(batch)}
                for t in config.outputs
            ],
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return self.manager.get(name, version).config.to_json()

    def model_config_proto(self, name: str, version: str = "") -> pb.ModelConfig:
        return self.manager.get(name, version).config.proto

    def check_model(self, name: str, version: str = "") -> None:
        """NotFoundError or UnavailableError, with the reason, unless the model is READY."""
        self.manager.get(name, version)

    # -- repository extension ----------------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's index: every model in the repositories, with state and reason per version."""
        entries: list[dict[str, str]] = []
        for status in await self.manager.repository_index():
            if ready_only and status.state is not ModelState.READY:
                continue
            entry = {"name": status.name}
            if status.version:
                entry["version"] = status.version
            if status.state is not ModelState.UNKNOWN:
                entry["state"] = status.state.value
            if status.reason:
                entry["reason"] = status.reason
            entries.append(entry)
        return entries

    async def load_model(
        self, name: str, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        await self.manager.load(name, config_json=config_json, files=files)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        await self.manager.unload(name, unload_dependents=unload_dependents)

    # -- SageMaker's multi-model API ------------------------------------------------------

    def top_level_models(self) -> list[str]:
        """READY models that are not composing models of a READY ensemble, sorted."""
        models = self.manager.ready_models
        steps: set[str] = set()
        for model in models:
            steps |= (ensemble_steps(model.config.proto) or set()) - {model.name}
        return sorted({m.name for m in models} - steps)

    def resolve_target(self, target: str) -> str:
        """The Quiver model for a SageMaker name (``model_name`` of ``POST /models``, or the
        TargetModel that came with it); any other name is a Quiver model name."""
        registration = self.registered.get(target)
        if registration is None:
            alias = self._targets.get(target)
            registration = self.registered.get(alias) if alias is not None else None
        return registration.model if registration is not None else target

    def aliases(self) -> dict[str, str]:
        """SageMaker names and target-model values of registered, READY models -> the model
        each stands for."""
        out = {}
        for name, registration in list(self.registered.items()):
            if self.model_ready(registration.model):
                out[name] = registration.model
                if registration.target:
                    out[registration.target] = registration.model
        return out

    def sagemaker_models(self) -> dict[str, str]:
        """modelName -> modelUrl of every loaded model: registered ones under their SageMaker
        name, other READY top-level models (loaded at start, by the v2 repository API, or on
        demand) under their own name and the repository folder they came from."""
        entries: dict[str, str] = {}
        served: set[str] = set()
        for name in list(self.registered):
            registration = self._loaded(name)
            if registration is not None:
                entries[name] = registration.url
                served.add(registration.model)
        for model in self.top_level_models():
            if model not in served and model not in entries:
                entries[model] = next(
                    (str(root / model) for root in self.repositories if (root / model).is_dir()), ""
                )
        return entries

    async def register_sagemaker_model(self, name: str, url: str, target: str = "") -> str:
        """Load what ``url`` holds as SageMaker's ``name`` (AlreadyExistsError when that name
        is loaded); returns the Quiver model serving it."""
        async with self._lock(name):
            if name in self.sagemaker_models():
                raise AlreadyExistsError(f"model '{name}' is already loaded")
            model = await self._load_url(name, url)
            self.registered[name] = Registration(name, model, url, target)
            if target and target != name:
                self._targets[target] = name
        logger.info(
            "SageMaker: loaded TargetModel '%s' as model '%s' (Quiver model '%s') from %s",
            target or name,
            name,
            model,
            url,
        )
        return model

    async def unregister_sagemaker_model(self, name: str) -> None:
        """Unload SageMaker's ``name`` with the ensemble's composing models nothing else uses
        (the model stays while another SageMaker name or a READY ensemble uses it)."""
        async with self._lock(name):
            registration = self._loaded(name)
            if registration is not None:
                model = registration.model
            elif name in self.sagemaker_models():
                model = name
            else:
                raise NotFoundError(f"model '{name}' is not loaded")
            self._forget(name)
            try:
                if not self._in_use(model):
                    await self._unload_with_dependents(model)
            except BaseException:
                if registration is not None and self.model_ready(model):
                    self.registered[name] = registration  # still loaded: still registered
                    if registration.target and registration.target != name:
                        self._targets[registration.target] = name
                raise
        logger.info("SageMaker: unloaded model '%s' (Quiver model '%s')", name, model)

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    def _loaded(self, name: str) -> Registration | None:
        """The registration of a SageMaker name whose model is READY (stale ones dropped)."""
        registration = self.registered.get(name)
        if registration is None:
            return None
        if self.model_ready(registration.model):
            return registration
        self._forget(name)
        return None

    def _forget(self, name: str) -> None:
        registration = self.registered.pop(name, None)
        if registration is not None and registration.target:
            self._targets.pop(registration.target, None)

    async def _load_url(self, name: str, url: str) -> str:
        """Load what ``url`` holds; returns the Quiver model serving it. A local model folder,
        or a repository (:func:`~quiver.lifecycle.dependencies.served_folder`'s rule), inside
        a ``--model-repository`` loads by name (or is registered as it is when READY); other
        locations (the platform's folders under /opt/ml/models, S3, archives) are copied or
        fetched through the disk cache and load as ``name`` in their own namespace
        (:meth:`ModelRepositoryManager.load_url`, in explicit and on_demand modes). Errors are
        :func:`~quiver.lifecycle.urls.load_failure`'s."""
        local = url.removeprefix("file://")
        if "://" in local or local.endswith((".tar.gz", ".tgz", ".tar")):
            return await self._load_elsewhere(name, url, "it is not a local folder")
        folder = await asyncio.to_thread(url_folder, local, url)
        if folder.parent.resolve() not in self.repositories:
            try:
                return await self._load_elsewhere(
                    name, url, "it is outside the --model-repository folders"
                )
            except QuiverError as exc:
                raise load_failure(exc) from None
        model = folder.name
        for registration in self.registered.values():
            if registration.model == model and self.model_ready(model):
                raise AlreadyExistsError(
                    f"model '{model}' at '{url}' is already loaded as '{registration.name}'"
                )
        if not self.model_ready(model):
            try:
                await self.load_model(model)
            except QuiverError as exc:
                raise load_failure(exc) from None
        return model

    async def _load_elsewhere(self, name: str, url: str, why: str) -> str:
        if self.manager.control_mode not in ("explicit", "on_demand"):
            raise UnsupportedError(
                f"cannot load '{name}' from '{url}': {why}, and loading from other locations "
                "(S3, archives, other folders) is not allowed in model control mode "
                f"'{self.manager.control_mode}' (start with --model-control-mode=explicit, as "
                "Triton's SageMaker image does, or on_demand)"
            )
        return await self.manager.load_url(name, url)

    def _in_use(self, model: str) -> bool:
        """Whether a SageMaker name still maps to ``model``, or a READY ensemble runs it."""
        if any(r.model == model for r in self.registered.values()):
            return True
        return any(model in (ensemble_steps(m.config.proto) or ()) for m in self.manager.ready_models)

    async def _unload_with_dependents(self, model: str) -> None:
        """Unload ``model``, then its composing models (if an ensemble) that nothing else
        uses: no other READY ensemble, and no other SageMaker name."""
        composing: set[str] = set()
        for loaded in self.manager.ready_models:
            if loaded.name == model:
                composing |= ensemble_steps(loaded.config.proto) or set()
        await self.unload_model(model, unload_dependents=False)
        for dep in sorted(composing - {model}):
            if self.model_ready(dep) and not self._in_use(dep):
                await self._unload_with_dependents(dep)

    # -- statistics extension ------------------------------------------------------------

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's ``{"model_stats": [...]}`` for every READY model, one model, or one version."""
        if not name:
            models = sorted(self.manager.ready_models, key=lambda m: (m.name, m.version))
        elif version:
            models = [self.manager.get(name, version)]  # checks the version
        else:
            models = self.manager.versions(name)
            if not models:
                self.manager.get(name)  # raises NOT_FOUND or UNAVAILABLE with the reason
        return {"model_stats": [m.stats.to_json(m.name, m.version_str) for m in models]}

    # -- logging extension -----------------------------------------------------------------

    def log_settings(self) -> dict[str, Any]:
        return logs.settings()

    def update_log_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        return logs.update(changes)

    # -- trace extension -------------------------------------------------------------------

    def trace_settings(self, model: str = "", changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """Triton's trace settings, global or ``model``'s, after applying ``changes`` (a POST:
        values as text or lists of text, None to clear one)."""
        if model and not self.manager.is_ready(model):
            raise InvalidArgumentError(f"Request for unknown model : {model}")
        if changes:
            return self.tracing.update(model, changes)
        return self.tracing.settings_json(model)

    def start_trace(self, model: str, headers: Callable[[], Mapping[str, str]] | None = None) -> Trace | None:
        """The trace of a request to ``model`` arriving now, if it is sampled; ``headers()``
        may give an OpenTelemetry ``traceparent`` (asked for only in that mode). The frontend
        records its own timestamps on it, sets it on the request and releases it once it
        has answered."""
        return self.tracing.sample(model, headers)

    # -- inference -------------------------------------------------------------------

    def queues(self, name: str, version: str = "") -> bool:
        """Whether requests for this model may wait in a queue (a batcher), where a client
        that goes away should take its request out rather than cost compute."""
        try:
            return self.manager.get(name, version).scheduler.queueing
        except QuiverError:
            return False

    def decoupled(self, name: str, version: str = "") -> bool:
        """Whether the READY model ``name`` is decoupled (False when not READY)."""
        try:
            return bool(self.manager.get(name, version).config.proto.model_transaction_policy.decoupled)
        except QuiverError:
            return False

    async def serving_config(self, name: str, version: str = "") -> ModelConfig:
        """The configuration of the model a request for ``name`` runs on (loaded on demand)."""
        try:
            return self.manager.get(name, version).config
        except (NotFoundError, UnavailableError):
            if not self.manager.on_demand:
                raise
            return (await self.manager.acquire(name, version, use=False)).config  # the request counts

    def _found(self, request: InferenceRequest) -> Model | None:
        """The READY model for ``request``, the request checked; None if it loads first (on demand)."""
        manager = self.manager
        try:
            model = manager.get(request.model_name, request.model_version, use=True)
        except (NotFoundError, UnavailableError):
            if not manager.on_demand:
                raise
            return None
        if manager.on_demand:
            manager.multi_model.cache_hits += 1
        return self._checked(model, request)

    async def _admit(self, request: InferenceRequest) -> Model:
        """The READY model for ``request`` (loaded first, on demand), the request checked."""
        if (found := self._found(request)) is not None:
            return found
        return self._checked(await self.manager.acquire(request.model_name, request.model_version), request)

    def _checked(self, model: Model, request: InferenceRequest) -> Model:
        try:
            if request.raw:
                deduce_raw_input(model.config, request)
            validate_request(model.config, request)
        except QuiverError:
            model.stats.record_failure(0, "REJECTED")
            raise
        return model

    async def infer(
        self, request: InferenceRequest, *, decoupled_error: str = DECOUPLED_ERROR, watch: Watch | None = None
    ) -> InferenceResponse:
        """One request, one response; a decoupled model is UNSUPPORTED (``decoupled_error``).
        Inputs in client shared-memory regions are read first, outputs written into them after.
        ``watch``: wraps the wait for the answer when the model's requests may wait in a queue
        (a frontend cancels the wait when its client goes away, so the request leaves the
        queue); such a wait is not wrapped otherwise (the model is found only once)."""
        if request.input_placements is None and request.output_placements is None:
            return await self._infer(request, decoupled_error, watch)
        lease = read_inputs(self.shared_memory, request)
        try:
            response = await self._infer(request, decoupled_error, watch)
            write_outputs(self.shared_memory, lease, request, response)
            return response
        finally:
            self.shared_memory.release(lease)

    def _infer(self, request: InferenceRequest, decoupled_error: str, watch: Watch | None = None) -> Awaitable[InferenceResponse]:
        """The answer to await; a model found READY admits the request now (no coroutine)."""
        started = time.monotonic_ns() if request.trace is not None else 0
        model = self._found(request)
        if model is None:
            return self._infer_loaded(request, decoupled_error, watch, started)
        self._refuse_decoupled(model, decoupled_error)
        return self._execute(model, request, started, watch)

    async def _infer_loaded(self, request: InferenceRequest, decoupled_error: str, watch: Watch | None, started: int) -> InferenceResponse:
        # loaded on demand: _found just missed it (no await since), so no second look first
        model = self._checked(await self.manager.acquire(request.model_name, request.model_version, missed=True), request)
        self._refuse_decoupled(model, decoupled_error)
        return await self._execute(model, request, started, watch)

    def _refuse_decoupled(self, model: Model, decoupled_error: str) -> None:
        if model.config.proto.model_transaction_policy.decoupled:
            model.stats.record_failure(0, "REJECTED")
            self.manager.request_done(model)
            raise UnsupportedError(decoupled_error.replace("{model}", model.name))

    async def _execute(
        self, model: Model, request: InferenceRequest, started: int, watch: Watch | None = None
    ) -> InferenceResponse:
        """A request to a model that is not decoupled, admitted: traced, answered from the
        response cache when the model enables it, else scheduled."""
        trace: Trace | None = request.trace
        if trace is not None:
            trace.start(model.name, request.model_version, request.id, started)
            trace.capture("QUEUE_START")
            trace.tensors("TENSOR_QUEUE_INPUT", request.inputs)
        cache = self.response_cache
        try:
            work: Awaitable[InferenceResponse]
            if cache is not None and model.config.proto.response_cache.enable:
                rows = batch_rows(request, model.config.max_batch_size > 0)
                work = cache.infer(
                    model.name, model.version_str, request, model.stats, rows, model.scheduler.enqueue, model.loaded_at
                )
            else:
                work = model.scheduler.enqueue(request)
            if watch is not None and model.scheduler.queueing:
                work = watch(work)
            response = await work
        except asyncio.CancelledError:
            request.cancellation = request.cancellation or Cancellation()  # the model reads it
            request.cancellation.cancel()
            raise
        finally:
            self.manager.request_done(model)  # loads waiting for room look again
            if trace is not None:
                trace.capture("REQUEST_END")
        return self._finish(model, request, response)

    def _finish(self, model: Model, request: InferenceRequest, response: InferenceResponse) -> InferenceResponse:
        response.model_name = model.name
        response.model_version = model.version_str
        response.id = request.id
        if request.outputs is not None:
            response.outputs = select_outputs(model, request, response)
        return response

    async def open_stream(self, request: InferenceRequest) -> tuple[bool, AsyncGenerator[StreamResponse, None]]:
        """Whether the model is decoupled (:meth:`decoupled`) and :meth:`infer_stream`'s
        answers: what a stream frontend needs, in one call a remote service can answer."""
        return self.decoupled(request.model_name, request.model_version), self.infer_stream(request)

    async def infer_stream(self, request: InferenceRequest) -> AsyncGenerator[StreamResponse, None]:
        """The responses to ``request``, the last one final (a decoupled model's may be a
        flag-only final). An error of the request as a whole raises before the first item;
        errors the model sends are items. Leaving early cancels the request."""
        cancellation = request.cancellation = request.cancellation or Cancellation()
        if request.input_placements is not None or request.output_placements is not None:
            # Client shared memory: one response, from a model that is not decoupled.
            try:
                response = await self.infer(request)
            except QuiverError as error:
                yield StreamResponse(error=error, final=True)
                return
            yield StreamResponse(response=response, final=True)
            return
        started = time.monotonic_ns() if request.trace is not None else 0
        model = await self._admit(request)
        if not model.config.proto.model_transaction_policy.decoupled:
            try:
                response = await self._execute(model, request, started)
            except QuiverError as error:
                yield StreamResponse(error=error, final=True)
                return
            yield StreamResponse(response=response, final=True)
            return
        stream = request.stream = ResponseStream(cancellation)
        running = asyncio.ensure_future(model.scheduler.enqueue(request))
        running.add_done_callback(stream.executed)
        finished = False
        try:
            async for item in stream.responses():
                if item.response is not None:
                    item.response = self._finish(model, request, item.response)
                finished = item.final
                yield item
        finally:
            if not finished:
                cancellation.cancel()
                if not running.done():
                    running.cancel()  # still queued: it leaves the queue
            self.manager.request_done(model)


__all__ = ["CAPACITY_ERRORS", "CacheFullError", "InferenceService", "OutOfMemoryError", "QuiverError", "Registration"]
