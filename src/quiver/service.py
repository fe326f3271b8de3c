"""InferenceService: the one transport-neutral entry point.

Frontends decode bytes into an :class:`InferenceRequest`, call :meth:`InferenceService.infer`
and encode what comes back. Everything a request is checked against (the model's inputs,
datatypes, shapes, batch size, requested outputs) is checked here, once, for every
transport and backend. No HTTP or protobuf here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import quiver
from quiver import logs
from quiver.config import ModelConfig
from quiver.errors import (
    InvalidArgumentError,
    NotFoundError,
    QuiverError,
    UnavailableError,
)
from quiver.lifecycle import Model, ModelRepositoryManager, ModelState
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

#: Extensions Quiver implements, by Triton's names (server metadata lists them).
EXTENSIONS = [
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "logging",
]


class InferenceService:
    def __init__(self, manager: ModelRepositoryManager) -> None:
        self.manager = manager
        manager.bind(self.infer)
        self.ready = False  # set by the runner once start-up finished

    # -- health and metadata ---------------------------------------------------------

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "quiver", "version": quiver.__version__, "extensions": EXTENSIONS}

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

    # -- inference -------------------------------------------------------------------

    def queues(self, name: str, version: str = "") -> bool:
        """Whether requests for this model may wait in a queue (a batcher), where a client
        that goes away should take its request out rather than cost compute."""
        try:
            return self.manager.get(name, version).scheduler.queueing
        except QuiverError:
            return False

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
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
            _validate(model.config, request)
        except QuiverError:
            model.stats.record_failure(0, "REJECTED")
            raise
        try:
            response = await model.scheduler.enqueue(request)
        finally:
            manager.request_done(model)  # loads waiting for room look again
        response.model_name = model.name
        response.model_version = model.version_str
        response.id = request.id
        if request.outputs is not None:
            response.outputs = _select_outputs(model, request, response)
        return response


def _validate(config: ModelConfig, request: InferenceRequest) -> None:
    inputs = config.input_map
    batching = config.max_batch_size > 0
    batch_size = -1
    name = config.name
    for tensor in request.inputs:
        spec = inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgumentError(
                f"unexpected inference input '{tensor.name}' for model '{name}'; it expects: "
                f"{', '.join(inputs) or 'no inputs'}"
            )
        if tensor.datatype is not spec.datatype:
            raise InvalidArgumentError(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype.value}', but "
                f"model '{name}' expects '{spec.datatype.value}'"
            )
        shape = tensor.shape
        dims = spec.dims
        if batching:
            if len(shape) != len(dims) + 1:
                raise _shape_error(tensor, spec.full_shape(config.max_batch_size), name)
            if batch_size < 0:
                batch_size = shape[0]
                if batch_size < 1 or batch_size > config.max_batch_size:
                    raise InvalidArgumentError(
                        f"inference request batch-size must be <= {config.max_batch_size} for "
                        f"model '{name}', got {batch_size} (input '{tensor.name}')"
                    )
            elif shape[0] != batch_size:
                raise InvalidArgumentError(
                    f"inputs of one request must share the batch size: input '{tensor.name}' "
                    f"has {shape[0]}, another has {batch_size} (model '{name}')"
                )
            shape = shape[1:]
        elif len(shape) != len(dims):
            raise _shape_error(tensor, list(dims), name)
        for got, want in zip(shape, dims, strict=True):
            if want != -1 and got != want:
                raise _shape_error(tensor, spec.full_shape(config.max_batch_size), name)
    given = {t.name for t in request.inputs}
    if len(given) != len(request.inputs):
        raise InvalidArgumentError(f"an input is given twice in the request for model '{name}'")
    if len(given) != len(inputs):
        missing = [t.name for t in config.inputs if t.name not in given and not t.optional]
        if missing:
            raise InvalidArgumentError(
                f"expected {len(inputs)} inputs but got {len(request.inputs)} inputs for model "
                f"'{name}'; missing required input(s): {', '.join(missing)}"
            )
    if request.outputs is not None:
        outputs = config.output_map
        for requested in request.outputs:
            if requested.name not in outputs:
                raise InvalidArgumentError(
                    f"unexpected inference output '{requested.name}' for model '{name}'; it has: "
                    f"{', '.join(outputs)}"
                )
            k = requested.parameters.get("classification")
            if k is not None and (type(k) is not int or k < 0):
                raise InvalidArgumentError(
                    f"output '{requested.name}': 'classification' must be a non-negative integer"
                )


def _shape_error(tensor: Tensor, expected: list[int], model: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"unexpected shape for input '{tensor.name}' for model '{model}'. Expected "
        f"{expected}, got {list(tensor.shape)}"
    )


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
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            out[r, c] = text.encode("utf-8")
    result = out if batched else out.reshape(k)
    return Tensor(tensor.name, DataType.BYTES, result.shape, result)


__all__ = ["InferenceService", "QuiverError"]
