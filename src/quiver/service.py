"""InferenceService: the one transport-neutral entry point.

Frontends decode bytes into an :class:`InferenceRequest`, call :meth:`InferenceService.infer`
and encode what comes back. Everything a request is checked against (the model's inputs,
datatypes, shapes, batch size, requested outputs) is checked here, once, for every
transport and backend. No HTTP or protobuf here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as pb

import quiver
from quiver import logs, messages
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
from quiver.lifecycle.dependencies import ensemble_steps, is_model_folder, served_folder
from quiver.raw_input import deduce as deduce_raw_input
from quiver.repository.cache import CacheFullError
from quiver.repository.names import check_local_path
from quiver.response_cache import ResponseCache
from quiver.scheduling.core import batch_rows
from quiver.shared_memory import SharedMemoryManager, read_inputs, write_outputs
from quiver.tracing import Trace, TraceManager
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

#: Errors that mean "no room (memory or disk); unload something and try again".
CAPACITY_ERRORS: tuple[type[QuiverError], ...] = (OutOfMemoryError, CacheFullError)
#: Reasons of models that are UNAVAILABLE because they were unloaded, not because they failed.
_UNLOADED = ("unloaded", "evicted")
#: Where Triton's SageMaker frontend refuses to look for models.
_FORBIDDEN_ROOTS = ("/dev/", "/proc/", "/sys/")

#: Extensions Quiver implements, by Triton's names (server metadata lists them).
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "binary_tensor_data",
    "system_shared_memory",
    "cuda_shared_memory",
    "parameters",
    "statistics",
    "trace",
    "logging",
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
        manager.bind(self.infer)
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
        logger.info("SageMaker: loaded model '%s' (Quiver model '%s') from %s", name, model, url)
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
        locations (S3, archives, other folders) go to the multi-model manager."""
        local = url.removeprefix("file://")
        if "://" in local or local.endswith((".tar.gz", ".tgz", ".tar")):
            return await self._load_elsewhere(name, url, "it is not a local folder")
        check_local_path(local, "url")
        path = Path(os.path.abspath(os.path.normpath(local)))
        if str(path).startswith(_FORBIDDEN_ROOTS) or str(path) in ("/dev", "/proc", "/sys"):
            raise InvalidArgumentError(f"url '{url}' may not be under /dev, /proc or /sys")
        if not path.is_dir():
            raise NotFoundError(f"url '{url}' is not a folder")
        folder = await asyncio.to_thread(_url_folder, path, url)
        if folder.parent.resolve() not in self.repositories:
            return await self._load_elsewhere(
                name, url, "it is outside the --model-repository folders"
            )
        model = folder.name
        for registration in self.registered.values():
            if registration.model == model and self.model_ready(model):
                raise AlreadyExistsError(
                    f"model '{model}' at '{url}' is already loaded as '{registration.name}'"
                )
        if not self.model_ready(model):
            await self.load_model(model)
        return model

    async def _load_elsewhere(self, name: str, url: str, why: str) -> str:
        if not self.manager.on_demand:
            raise UnsupportedError(
                f"cannot load '{name}' from '{url}': {why}, and loading from other locations "
                "(S3, archives, other folders) needs the multi-model manager "
                "(--model-control-mode=on_demand)"
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

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        if request.input_placements is None and request.output_placements is None:
            return await self._infer(request)
        lease = read_inputs(self.shared_memory, request)
        try:
            response = await self._infer(request)
            write_outputs(self.shared_memory, lease, request, response)
            return response
        finally:
            self.shared_memory.release(lease)

    async def _infer(self, request: InferenceRequest) -> InferenceResponse:
        trace: Trace | None = request.trace
        started = time.monotonic_ns() if trace is not None else 0
        manager = self.manager
        try:
            model = manager.get(request.model_name, request.model_version)
        except (NotFoundError, UnavailableError):
            if not manager.on_demand:
                raise
            model = await manager.acquire(request.model_name, request.model_version)
        else:
            if manager.on_demand:
                manager.multi_model.cache_hits += 1
        try:
            if request.raw:
                deduce_raw_input(model.config, request)
            _validate(model.config, request)
        except QuiverError:
            model.stats.record_failure(0, "REJECTED")
            raise
        if trace is not None:
            trace.start(model.name, request.model_version, request.id, started)
            trace.capture("QUEUE_START")
            trace.tensors("TENSOR_QUEUE_INPUT", request.inputs)
        cache = self.response_cache
        try:
            if cache is not None and model.config.proto.response_cache.enable:
                rows = batch_rows(request, model.config.max_batch_size > 0)
                response = await cache.infer(
                    model.name, model.version_str, request, model.stats, rows, model.scheduler.enqueue, model.loaded_at
                )
            else:
                response = await model.scheduler.enqueue(request)
        finally:
            manager.request_done(model)  # loads waiting for room look again
            if trace is not None:
                trace.capture("REQUEST_END")
        response.model_name = model.name
        response.model_version = model.version_str
        response.id = request.id
        if request.outputs is not None:
            response.outputs = _select_outputs(model, request, response)
        return response


def _url_folder(path: Path, url: str) -> Path:
    """The model folder a SageMaker ``url`` folder serves: itself when it is a model folder
    (a config.pbtxt is not required: Triton completes configs), else the repository's model
    by :func:`~quiver.lifecycle.dependencies.served_folder`, as for archives."""
    if is_model_folder(path):
        return path
    return served_folder(path, f"url '{url}'")


def _validate(config: ModelConfig, request: InferenceRequest) -> None:
    """The request against the model's configuration, with Triton's checks and messages."""
    inputs = config.input_map
    batching = config.max_batch_size > 0
    batch_size = -1
    name = config.name
    for tensor in request.inputs:
        spec = inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgumentError(messages.unexpected_input(tensor.name, name, list(inputs)))
        if tensor.datatype is not spec.datatype:
            raise InvalidArgumentError(
                messages.input_datatype(tensor.name, tensor.datatype.value, name, spec.datatype.value)
            )
        shape = tensor.shape
        dims = spec.dims
        if batching:
            if len(shape) != len(dims) + 1:
                raise _shape_error(tensor, spec.full_shape(config.max_batch_size), name, batching)
            if batch_size < 0:
                batch_size = shape[0]
                if batch_size < 1 or batch_size > config.max_batch_size:
                    raise InvalidArgumentError(messages.batch_size(config.max_batch_size, name, batch_size, tensor.name))
            elif shape[0] != batch_size:
                raise InvalidArgumentError(
                    f"inputs of one request must share the batch size: input '{tensor.name}' "
                    f"has {shape[0]}, another has {batch_size} (model '{name}')"
                )
            shape = shape[1:]
        elif len(shape) != len(dims):
            raise _shape_error(tensor, list(dims), name, batching)
        for got, want in zip(shape, dims, strict=True):
            if want != -1 and got != want:
                raise _shape_error(tensor, spec.full_shape(config.max_batch_size), name, batching)
    given = {t.name for t in request.inputs}
    if len(given) != len(request.inputs):
        seen: set[str] = set()
        for tensor in request.inputs:
            if tensor.name in seen:
                raise InvalidArgumentError(messages.input_twice(tensor.name))
            seen.add(tensor.name)
    if len(given) != len(inputs):
        missing = [t.name for t in config.inputs if t.name not in given and not t.optional]
        if missing:
            required = sum(1 for t in config.inputs if not t.optional)
            raise InvalidArgumentError(
                messages.missing_inputs(
                    required, len(inputs), [t.name for t in request.inputs], missing, name
                )
            )
    if request.outputs is not None:
        outputs = config.output_map
        asked: set[str] = set()
        for requested in request.outputs:
            if requested.name not in outputs:
                raise InvalidArgumentError(messages.unexpected_output(requested.name, name, list(outputs)))
            if requested.name in asked:
                raise InvalidArgumentError(messages.output_twice(requested.name))
            asked.add(requested.name)
            k = requested.parameters.get("classification")
            if k is not None and (type(k) is not int or k < 0):
                raise InvalidArgumentError(
                    f"output '{requested.name}': 'classification' must be a non-negative integer"
                )


def _shape_error(tensor: Tensor, expected: list[int], model: str, batching: bool) -> InvalidArgumentError:
    return InvalidArgumentError(messages.input_shape(tensor.name, model, expected, list(tensor.shape), batching))


def _select_outputs(model: Model, request: InferenceRequest, response: InferenceResponse) -> list[Tensor]:
    """The requested outputs in the order asked for; classification applied where asked."""
    assert request.outputs is not None
    produced = {t.name: t for t in response.outputs}
    selected: list[Tensor] = []
    for requested in request.outputs:
        tensor = produced.get(requested.name)
        if tensor is None:
            continue  # the model did not produce it (Triton omits it too)
        k = requested.classification
        if k:
            tensor = classify(
                tensor, k, model.labels.get(tensor.name), model.config.max_batch_size > 0, model.name
            )
        selected.append(tensor)
    return selected


def classify(
    tensor: Tensor, k: int, labels: list[str] | None, batched: bool, model: str
) -> Tensor:
    """Triton's classification extension: top-k as ``"value:index[:label]"`` strings."""
    if tensor.datatype in (DataType.BYTES, DataType.BOOL):
        raise InvalidArgumentError(
            f"model '{model}': classification needs a numeric output, '{tensor.name}' is "
            f"{tensor.datatype.value}"
        )
    data = tensor.data
    rows = data.reshape(data.shape[0], -1) if batched and data.ndim > 0 else data.reshape(1, -1)
    if rows.shape[1] == 0:
        # the request's own inputs were empty: the client's mistake, not the server's
        raise InvalidArgumentError(
            f"model '{model}': output '{tensor.name}' is empty; nothing to classify"
        )
    k = min(k, rows.shape[1])
    values = rows.astype(np.float64, copy=False)
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        for c in range(k):
            index = int(order[r, c])
            text = f"{values[r, index]:f}:{index}"
            if labels is not None and index < len(labels) and labels[index]:
                text += f":{labels[index]}"  # no label, as in Triton, for an empty line
            out[r, c] = text.encode("utf-8")
    result = out if batched else out.reshape(k)
    return Tensor(tensor.name, DataType.BYTES, result.shape, result)


__all__ = [
    "CAPACITY_ERRORS",
    "CacheFullError",
    "InferenceService",
    "OutOfMemoryError",
    "QuiverError",
    "Registration",
]
