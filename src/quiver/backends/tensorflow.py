"""TensorFlow backend: ``platform: "tensorflow_graphdef"`` / ``"tensorflow_savedmodel"``
(``backend: "tensorflow"``).

``tensorflow`` is an optional dependency (``pip install 'quiver[tensorflow]'``, the CPU build):
this module is imported only when a TensorFlow model loads. Importing TensorFlow takes seconds
and about 0.6 GB of host memory, once per process: the import is logged with what it took
(``get_backend``: RSS growth), and it is not charged to a model under ``--model-memory-limit`` (a model
measured with it would keep that size after TensorFlow stays loaded, and could no longer be
reloaded in a budget that fits it). Leave that much headroom; each TensorFlow model's own
load is measured as any other.

Each instance owns a ``tf.compat.v1.Session`` over its own graph and runs on its own thread
(``Session.run`` releases the GIL, so ``count: 2`` runs two executions at once). As in
Triton's TensorFlow backend:

* GraphDef (``model.graphdef``, a frozen ``GraphDef``): inputs are ``Placeholder`` nodes and
  outputs any node, named in the configuration by node name (``input``,
  ``InceptionV3/Predictions/Softmax``; ``name:N`` picks another output of the node). There is
  no auto-complete: the configuration names the tensors. The configured datatypes and shapes
  are checked against the graph where it knows them. A graph whose placeholder has a fixed
  batch of 1 (``[1, 299, 299, 3]``) may still have ``max_batch_size > 0``: batches run one
  row at a time.
* SavedModel (``model.savedmodel/``): loaded with the ``serve`` tag (``TF_GRAPH_TAG``) and the
  ``serving_default`` signature (``TF_SIGNATURE_DEF``; without either, the first signature that
  is not an init or train op, with a warning). Tensor names are the signature's keys.
  Auto-complete fills inputs, outputs and ``max_batch_size`` from the signature (4, with
  dynamic batching, when every tensor's first dimension is variable), as Triton does.

Parameters, Triton's names: ``TF_NUM_INTRA_THREADS``, ``TF_NUM_INTER_THREADS``,
``TF_USE_PER_SESSION_THREADS``, ``TF_GRAPH_TAG``, ``TF_SIGNATURE_DEF``, ``TF_INIT_OPS_FILE``
(a JSON file ``{"init_ops": [...]}`` in the version folder or the model folder, run once per
session). ``SAGEMAKER_TRITON_TENSORFLOW_VERSION`` (Triton's ``--backend-config
tensorflow,version``) is accepted: 2 is what runs; 1 is logged as served by TensorFlow 2.

Pieces: parameters are :mod:`quiver.backends.tensorflow_settings`; reading models, their
signatures, auto-complete and the checks of configured tensors are
:mod:`quiver.backends.tensorflow_signatures`; this module keeps the instance and the backend.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's C++ start-up chatter, before import

import numpy as np
import tensorflow as tf
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import (
    ExecuteResult,
    InstanceSpec,
    ModelFiles,
    ThreadedInstance,
    format_exception,
)
from quiver.backends.batch import (
    concatenate,
    not_batchable,
    requested_names,
    reshaped,
    split_rows,
)
from quiver.backends.tensorflow_settings import (
    TFSettings,
    _check_version_variable,
    _session_config,
    parse_settings,
)
from quiver.backends.tensorflow_signatures import (
    DEFAULT_MAX_BATCH_SIZE,
    GRAPHDEF,
    SAVEDMODEL,
    TensorInfo,
    _check_tensor,
    _graph_info,
    _graph_tensors,
    _listing,
    auto_complete_saved_model,
    read_graphdef,
    read_saved_model,
    signature_tensors,
)
from quiver.backends.tensorflow_signatures import _batch_hint as _batch_hint
from quiver.config import ModelConfig
from quiver.config.model_config import PLATFORM_MODEL_FILENAME
from quiver.errors import ConfigError, InternalError, InvalidArgumentError, QuiverError
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

__all__ = [
    "BACKEND",
    "DEFAULT_MAX_BATCH_SIZE",
    "GRAPHDEF",
    "SAVEDMODEL",
    "TFSettings",
    "TensorFlowBackend",
    "TensorFlowInstance",
    "TensorInfo",
    "auto_complete_saved_model",
    "parse_settings",
    "read_graphdef",
    "read_saved_model",
    "signature_tensors",
]

logger = logging.getLogger(__name__)
tf.get_logger().setLevel(logging.ERROR)  # the v1 loader's deprecation notices, once per load


def _platform(proto: pb.ModelConfig, version_dir: Path) -> str:
    """The configured platform, else the one its model file shows (backend "tensorflow")."""
    platform = str(proto.platform)
    if platform in (GRAPHDEF, SAVEDMODEL):
        return platform
    filename = str(proto.default_model_filename)
    if filename:
        return SAVEDMODEL if (version_dir / filename).is_dir() else GRAPHDEF
    if (version_dir / PLATFORM_MODEL_FILENAME[SAVEDMODEL]).exists():
        return SAVEDMODEL
    return GRAPHDEF


def _model_path(config: ModelConfig, files: ModelFiles) -> Path:
    platform = _platform(config.proto, files.version_dir)
    filename = config.proto.default_model_filename or PLATFORM_MODEL_FILENAME[platform]
    return files.version_dir / filename


# --- instances ----------------------------------------------------------------------------


class TensorFlowInstance(ThreadedInstance):
    """One session; feeds the configured inputs and fetches the configured outputs by the
    model's tensor names. Requests batched together are concatenated on dim 0."""

    inline_safe = True  # Session.run may be called from any thread

    def __init__(
        self,
        config: ModelConfig,
        session: Any,
        feeds: dict[str, str],
        fetches: dict[str, str],
        name: str,
        *,
        row_by_row: bool = False,
    ) -> None:
        super().__init__(name)
        self._config = config
        self._session = session
        self._feeds = feeds
        self._fetches = fetches
        self._outputs = [o.name for o in config.outputs]
        self._out_cfg = {o.name: o for o in config.outputs}
        self._in_reshape = {i.name: i.reshape for i in config.inputs if i.reshape is not None}
        self._out_reshape = {o.name: o.dims for o in config.outputs if o.reshape is not None}
        self._batching = config.max_batch_size > 0
        self._row_by_row = row_by_row and self._batching

    def _names(self, requests: list[InferenceRequest]) -> list[str]:
        return requested_names(requests, self._outputs)

    def _feed(self, request: InferenceRequest) -> dict[str, Any]:
        feed: dict[str, Any] = {}
        for tensor in request.inputs:
            data = reshaped(tensor.data, self._in_reshape.get(tensor.name), self._batching)
            feed[self._feeds[tensor.name]] = data
        return feed

    def _run(self, names: list[str], feed: dict[str, Any]) -> list[Any]:
        fetches = [self._fetches[n] for n in names]
        try:
            if not self._row_by_row:
                return list(self._session.run(fetches, feed))
            rows = next(iter(feed.values())).shape[0] if feed else 1
            parts = [
                self._session.run(fetches, {k: v[i : i + 1] for k, v in feed.items()})
                for i in range(rows)
            ]
            return [np.concatenate([p[j] for p in parts]) for j in range(len(fetches))]
        except tf.errors.InvalidArgumentError as exc:
            raise InvalidArgumentError(
                f"model '{self._config.name}': tensorflow refused the input: {_first_line(exc)}"
            ) from None
        except Exception as exc:
            raise InternalError(
                f"model '{self._config.name}': tensorflow failed: {_first_line(exc)}"
            ) from None

    def _tensors(self, names: list[str], arrays: list[Any]) -> list[Tensor]:
        tensors = []
        for name, array in zip(names, arrays, strict=True):
            cfg = self._out_cfg[name]
            array = np.asarray(array)
            if cfg.datatype is DataType.BYTES:
                array = array.astype(object)
            elif array.dtype != cfg.datatype.numpy_dtype:
                raise InternalError(
                    f"model '{self._config.name}': output '{name}' is {array.dtype} in the "
                    f"model but {cfg.datatype.config_name} in the configuration"
                )
            array = reshaped(array, self._out_reshape.get(name), self._batching)
            tensors.append(Tensor(name, cfg.datatype, tuple(array.shape), array))
        return tensors

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        timing = self.timing
        t0 = time.monotonic_ns()
        names = self._names(requests)
        try:
            feeds = [self._feed(r) for r in requests]
            if len(requests) == 1:
                feed, sizes = feeds[0], [0]
            else:
                feed, sizes = concatenate(self._config.name, feeds)
            t1 = time.monotonic_ns()
            arrays = self._run(names, feed)
            t2 = time.monotonic_ns()
            per_request = [arrays] if len(requests) == 1 else split_rows(arrays, sizes)
            results: ExecuteResult = [
                InferenceResponse(self._config.name, "", self._tensors(names, parts), request.id)
                for request, parts in zip(requests, per_request, strict=True)
            ]
        except QuiverError as exc:
            return [exc for _ in requests]
        except ValueError as exc:
            return [not_batchable(self._config.name, exc) for _ in requests]
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.monotonic_ns() - t2
        return results

    def release(self) -> None:
        self._session.close()
        del self._session


def _first_line(exc: BaseException) -> str:
    """TensorFlow's messages carry the whole graph trace; the first lines say what is wrong."""
    text = getattr(exc, "message", None) or str(exc)
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    head = " ".join(lines[:2]) if lines else type(exc).__name__
    return head if len(head) <= 600 else head[:600] + "..."


# --- backend ------------------------------------------------------------------------------


class TensorFlowBackend:
    name = "tensorflow"

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Settle the platform (backend "tensorflow" alone: from the model file); complete a
        SavedModel's inputs, outputs and max_batch_size from its signature, as Triton does.
        GraphDefs carry no signature: their configuration must name the tensors."""
        _check_version_variable()
        platform = _platform(config, files.version_dir)
        if not config.platform:
            config.platform = platform
        if strict or platform != SAVEDMODEL:
            return
        filename = config.default_model_filename or PLATFORM_MODEL_FILENAME[SAVEDMODEL]
        path = files.version_dir / filename
        if not path.exists():
            return  # the load reports the missing file
        parameters = {k: v.string_value for k, v in config.parameters.items()}
        settings = parse_settings(parameters, config.name, f"model '{config.name}'")
        auto_complete_saved_model(config, path, settings)

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> TensorFlowInstance:
        path = _model_path(config, files)
        if not path.exists():
            raise InvalidArgumentError(
                f"model '{config.name}' version {files.version}: model file {path} does not exist"
            )
        if spec.group.kind == "KIND_GPU" and not tf.config.list_physical_devices("GPU"):
            logger.warning(
                "model '%s' instance %s: KIND_GPU asked for, but TensorFlow sees no GPU here; "
                "running on the CPU",
                config.name,
                spec.name,
            )
        settings = parse_settings(config.parameters, config.name, config.source)
        name = f"{config.name}_{files.version}_{spec.name}"
        if _platform(config.proto, files.version_dir) == SAVEDMODEL:
            return self._saved_model(config, files, path, settings, name)
        return self._graphdef(config, files, path, settings, name)

    def _graphdef(
        self, config: ModelConfig, files: ModelFiles, path: Path, settings: TFSettings, name: str
    ) -> TensorFlowInstance:
        graph_def = read_graphdef(path, config.name)
        graph = tf.Graph()
        try:
            with graph.as_default():
                tf.compat.v1.import_graph_def(graph_def, name="")
        except Exception as exc:
            raise InvalidArgumentError(
                f"model '{config.name}': {path.name} is not a usable TensorFlow GraphDef: "
                f"{_first_line(exc)}"
            ) from None
        placeholders, nodes = _graph_tensors(graph)
        if not config.inputs or not config.outputs:
            raise ConfigError(
                f"{config.source}: model '{config.name}': a GraphDef carries no signature, so "
                "the configuration must declare its inputs and outputs by node name "
                f"(placeholders: {_listing(list(placeholders))})"
            )
        feeds: dict[str, str] = {}
        fetches: dict[str, str] = {}
        row_by_row = False
        for tensor in config.inputs:
            info = _graph_info(tensor.name, placeholders)
            if info is None:
                raise ConfigError(
                    f"{config.source}: unexpected inference input '{tensor.name}' for model "
                    f"'{config.name}', allowed inputs are: {_listing(list(placeholders))}"
                )
            dims = tensor.reshape if tensor.reshape is not None else tensor.dims
            row_by_row |= _check_tensor(config, "input", tensor.name, tensor.datatype, dims, info)
            feeds[tensor.name] = info.tensor
        for tensor in config.outputs:
            info = _graph_info(tensor.name, nodes) or _graph_info(tensor.name, placeholders)
            if info is None:
                raise ConfigError(
                    f"{config.source}: unexpected inference output '{tensor.name}' for model "
                    f"'{config.name}', allowed outputs are: {_listing(list(nodes))}"
                )
            dims = tensor.reshape if tensor.reshape is not None else tensor.dims
            row_by_row |= _check_tensor(config, "output", tensor.name, tensor.datatype, dims, info)
            fetches[tensor.name] = info.tensor
        if row_by_row:
            logger.info(
                "model '%s': the graph fixes its batch dimension to 1; batches of up to %d run "
                "one row at a time",
                config.name,
                config.max_batch_size,
            )
        session = tf.compat.v1.Session(graph=graph, config=_session_config(settings))
        self._run_init_ops(config, files, session, settings)
        return TensorFlowInstance(config, session, feeds, fetches, name, row_by_row=row_by_row)

    def _saved_model(
        self, config: ModelConfig, files: ModelFiles, path: Path, settings: TFSettings, name: str
    ) -> TensorFlowInstance:
        tag, signature = read_saved_model(path, config.name, settings)
        inputs, outputs = signature_tensors(signature)
        graph = tf.Graph()
        session = tf.compat.v1.Session(graph=graph, config=_session_config(settings))
        try:
            with graph.as_default():
                tf.compat.v1.saved_model.loader.load(session, [tag], str(path))
        except Exception as exc:
            session.close()
            raise InvalidArgumentError(
                f"model '{config.name}': TensorFlow could not load the SavedModel "
                f"{path.name}: {_first_line(exc)}"
            ) from None
        try:
            feeds, fetches = self._check_signature(config, inputs, outputs)
            self._run_init_ops(config, files, session, settings)
        except BaseException:
            session.close()
            raise
        return TensorFlowInstance(config, session, feeds, fetches, name)

    @staticmethod
    def _check_signature(
        config: ModelConfig, inputs: list[TensorInfo], outputs: list[TensorInfo]
    ) -> tuple[dict[str, str], dict[str, str]]:
        by_input = {t.name: t for t in inputs}
        by_output = {t.name: t for t in outputs}
        feeds: dict[str, str] = {}
        fetches: dict[str, str] = {}
        for tensor in config.inputs:
            info = by_input.get(tensor.name)
            if info is None:
                raise ConfigError(
                    f"{config.source}: unexpected inference input '{tensor.name}' for model "
                    f"'{config.name}', allowed inputs are: {_listing(list(by_input))}"
                )
            dims = tensor.reshape if tensor.reshape is not None else tensor.dims
            if _check_tensor(config, "input", tensor.name, tensor.datatype, dims, info):
                raise ConfigError(
                    f"{config.source}: model '{config.name}': input '{tensor.name}' has a fixed "
                    f"batch of 1 but max_batch_size is {config.max_batch_size}"
                )
            feeds[tensor.name] = info.tensor
        missing = set(by_input) - set(feeds)
        if missing:
            raise ConfigError(
                f"{config.source}: unable to load model '{config.name}', configuration expects "
                f"{len(config.inputs)} inputs, model provides {len(by_input)} (missing: "
                f"{', '.join(sorted(missing))})"
            )
        for tensor in config.outputs:
            info = by_output.get(tensor.name)
            if info is None:
                raise ConfigError(
                    f"{config.source}: unexpected inference output '{tensor.name}' for model "
                    f"'{config.name}', allowed outputs are: {_listing(list(by_output))}"
                )
            dims = tensor.reshape if tensor.reshape is not None else tensor.dims
            _check_tensor(config, "output", tensor.name, tensor.datatype, dims, info)
            fetches[tensor.name] = info.tensor
        return feeds, fetches

    @staticmethod
    def _run_init_ops(
        config: ModelConfig, files: ModelFiles, session: Any, settings: TFSettings
    ) -> None:
        if not settings.init_ops_file:
            return
        candidates = [
            files.version_dir / settings.init_ops_file,
            files.model_dir / settings.init_ops_file,
        ]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ConfigError(
                f"{config.source}: TF_INIT_OPS_FILE '{settings.init_ops_file}' of model "
                f"'{config.name}' is in neither the version folder nor the model folder"
            )
        try:
            ops = json.loads(path.read_text(encoding="utf-8"))["init_ops"]
            if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
                raise TypeError("'init_ops' must be a list of operation names")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{config.source}: TF_INIT_OPS_FILE {path.name} of model '{config.name}': "
                f"{format_exception(exc)}"
            ) from None
        try:
            session.run(ops)
        except Exception as exc:
            raise InternalError(
                f"model '{config.name}': init ops {ops} failed: {_first_line(exc)}"
            ) from None


BACKEND = TensorFlowBackend()
