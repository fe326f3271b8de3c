"""ONNX Runtime backend: ``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"``.

One ``InferenceSession`` per instance, each on its own thread. Parameters as Triton's
onnxruntime backend reads them: ``intra_op_thread_count``, ``inter_op_thread_count``,
``execution_mode`` (0 sequential, 1 parallel), ``enable_mem_arena``; the graph optimization
level from ``optimization { graph { level } }``. KIND_GPU uses the CUDA execution provider
when onnxruntime has it and falls back to the CPU with a log line when it does not. Sessions
have thread pools of their own, or share the process's (:mod:`.onnxruntime_threads`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import (
    ExecuteResult,
    InstanceSpec,
    ModelFiles,
    ThreadedInstance,
    format_exception,
    model_path,
)
from quiver.backends.batch import concatenate, requested_names, reshaped, split_rows
from quiver.backends.onnxruntime_optimized import optimized_models
from quiver.backends.onnxruntime_threads import metadata_options, shares_thread_pools
from quiver.config import ModelConfig
from quiver.config.model_config import DEFAULT_MODEL_FILENAME, TensorConfig
from quiver.config.sequence import SequenceSettings, sequence_settings
from quiver.errors import ConfigError, InternalError, InvalidArgumentError, QuiverError
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

#: Triton's default when auto-complete finds a model that batches.
DEFAULT_MAX_BATCH_SIZE = 4

_ORT_TYPES = {
    "tensor(bool)": DataType.BOOL,
    "tensor(uint8)": DataType.UINT8,
    "tensor(uint16)": DataType.UINT16,
    "tensor(uint32)": DataType.UINT32,
    "tensor(uint64)": DataType.UINT64,
    "tensor(int8)": DataType.INT8,
    "tensor(int16)": DataType.INT16,
    "tensor(int32)": DataType.INT32,
    "tensor(int64)": DataType.INT64,
    "tensor(float16)": DataType.FP16,
    "tensor(float)": DataType.FP32,
    "tensor(double)": DataType.FP64,
    "tensor(string)": DataType.BYTES,
    "tensor(bfloat16)": DataType.BF16,
}


def _dims(shape: list[Any]) -> list[int]:
    """ONNX shapes use None or a symbol for variable dimensions; Triton uses -1."""
    return [d if isinstance(d, int) and d > 0 else -1 for d in shape]


def _io_of(session: ort.InferenceSession) -> tuple[list[Any], list[Any]]:
    return list(session.get_inputs()), list(session.get_outputs())


def _ort_datatype(node: Any, model: str) -> DataType:
    datatype = _ORT_TYPES.get(node.type)
    if datatype is None:
        raise ConfigError(
            f"model '{model}': ONNX tensor '{node.name}' has type {node.type}, which Triton "
            "datatypes cannot carry"
        )
    return datatype


#: Session options by what they are made from (ONNX Runtime copies them into each session it
#: creates, so one object serves every model configured alike: making them took 0.06 ms of a
#: miss, their code out of the CPU's caches).
_OPTIONS: dict[tuple[Any, ...], ort.SessionOptions] = {}
_OPTIONS_KEPT = 64


def _session_options(config: ModelConfig, optimized: bool = False) -> ort.SessionOptions:
    """``optimized``: for a graph optimized already (:mod:`.onnxruntime_optimized`), so none
    of ONNX Runtime's graph optimizations run again."""
    params = config.parameters
    key = (
        params.get("intra_op_thread_count"),
        params.get("inter_op_thread_count"),
        params.get("execution_mode"),
        params.get("enable_mem_arena"),
        config.proto.optimization.graph.level,
        optimized,
    )
    made = _OPTIONS.get(key)
    if made is None or key[0] or key[1]:  # thread counts: checked (and said not to apply) each time
        made = _make_session_options(config)
        if optimized:
            made.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if len(_OPTIONS) < _OPTIONS_KEPT:
            _OPTIONS[key] = made
    return made


def _make_session_options(config: ModelConfig) -> ort.SessionOptions:
    options = ort.SessionOptions()
    params = config.parameters

    def int_param(key: str) -> int | None:
        if key not in params or params[key] == "":
            return None
        try:
            return int(params[key])
        except ValueError:
            raise ConfigError(
                f"{config.source}: parameter '{key}' must be an integer, got '{params[key]}'"
            ) from None

    intra = int_param("intra_op_thread_count")
    inter = int_param("inter_op_thread_count")
    if shares_thread_pools():
        options.use_per_session_threads = False
        if intra or inter:
            logger.info(
                "model '%s': its intra_op_thread_count / inter_op_thread_count do not apply: "
                "onnxruntime sessions share the process's thread pools "
                "(--backend-config=onnxruntime,enable-global-threadpool)",
                config.name,
            )
    else:
        if intra is not None:
            options.intra_op_num_threads = intra
        if inter is not None:
            options.inter_op_num_threads = inter
    mode = int_param("execution_mode")
    if mode is not None:
        options.execution_mode = (
            ort.ExecutionMode.ORT_PARALLEL if mode == 1 else ort.ExecutionMode.ORT_SEQUENTIAL
        )
    if params.get("enable_mem_arena", "").lower() in ("0", "false", "off"):
        options.enable_cpu_mem_arena = False
    level = config.proto.optimization.graph.level
    options.graph_optimization_level = {
        -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    options.log_severity_level = 3
    return options


def _level_name(config: ModelConfig) -> str:
    """The graph optimization level :func:`_make_session_options` sets, by its
    :mod:`.onnxruntime_optimizer` name."""
    return {-1: "basic", 1: "extended"}.get(config.proto.optimization.graph.level, "all")


def _open_session(
    path: str, config: ModelConfig, providers: list[Any], optimized: bool = False
) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(
            path, sess_options=_session_options(config, optimized), providers=providers
        )
    except QuiverError:
        raise
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
        raise InternalError(
            f"model '{config.name}': onnxruntime could not load {path}: {format_exception(exc)}"
        ) from None


class OnnxInstance(ThreadedInstance):
    inline_safe = True  # InferenceSession.run may be called from any thread
    first_call_guess = True  # a first Run costs a small part of creating the session

    def __init__(self, config: ModelConfig, session: ort.InferenceSession, name: str) -> None:
        super().__init__(name)
        self._config = config
        self._session = session
        self._batching = config.max_batch_size > 0
        self._outputs = [o.name for o in config.outputs]
        self._out_cfg = {o.name: o for o in config.outputs}
        self._in_reshape = {i.name: i.reshape for i in config.inputs if i.reshape is not None}
        self._out_reshape = {o.name: o.dims for o in config.outputs if o.reshape is not None}
        self._string_inputs = {i.name for i in config.inputs if i.datatype is DataType.BYTES}
        # Sequence batching: state outputs are always fetched (the batcher takes them out).
        self._state_outputs: list[str] = []
        for state in _sequence(config).states:
            self._state_outputs.append(state.output_name)
            if state.output_name not in self._out_cfg:
                self._out_cfg[state.output_name] = TensorConfig(
                    state.output_name, state.datatype, state.dims
                )
            if state.datatype is DataType.BYTES:
                self._string_inputs.add(state.input_name)

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        if len(requests) == 1:
            request = requests[0]
            try:
                return [self._run_one(request)]
            except QuiverError as exc:
                return [exc]
        return self._run_batch(requests)

    def _feed(self, request: InferenceRequest) -> dict[str, Any]:
        feed: dict[str, Any] = {}
        for tensor in request.inputs:
            data = tensor.data
            if tensor.name in self._string_inputs and data.size:
                try:
                    data = np.vectorize(_to_str, otypes=[object])(data)
                except UnicodeDecodeError as exc:
                    raise InvalidArgumentError(
                        f"input '{tensor.name}': onnxruntime string tensors hold UTF-8 text, and "
                        f"an element is not: {exc.reason} at byte {exc.start} (model "
                        f"'{self._config.name}')"
                    ) from None
            feed[tensor.name] = reshaped(data, self._in_reshape.get(tensor.name), self._batching)
        return feed

    def _names(self, requests: list[InferenceRequest]) -> list[str]:
        return requested_names(requests, self._outputs, self._state_outputs)

    def _session_run(self, names: list[str], feed: dict[str, Any]) -> list[Any]:
        try:
            return list(self._session.run(names, feed))
        except Exception as exc:
            message = format_exception(exc)
            error = InvalidArgumentError if "INVALID_ARGUMENT" in message else InternalError
            raise error(f"model '{self._config.name}': onnxruntime failed: {message}") from None

    def _tensors(self, names: list[str], arrays: list[Any]) -> list[Tensor]:
        tensors = []
        for name, array in zip(names, arrays, strict=True):
            cfg = self._out_cfg[name]
            if cfg.datatype is DataType.BYTES:
                array = np.array([_to_bytes(v) for v in array.reshape(-1)], dtype=object).reshape(
                    array.shape
                )
            array = reshaped(array, self._out_reshape.get(name), self._batching)
            tensors.append(Tensor(name, cfg.datatype, array.shape, array))
        return tensors

    def _run_one(self, request: InferenceRequest) -> InferenceResponse:
        timing = self.timing
        t0 = time.monotonic_ns()
        names = self._names([request])
        feed = self._feed(request)
        t1 = time.monotonic_ns()
        arrays = self._session_run(names, feed)
        t2 = time.monotonic_ns()
        tensors = self._tensors(names, arrays)
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.monotonic_ns() - t2
        return InferenceResponse(self._config.name, "", tensors, request.id)

    def _run_batch(self, requests: list[InferenceRequest]) -> ExecuteResult:
        """Run several requests as one batch: concatenate on dim 0, split the outputs."""
        timing = self.timing
        t0 = time.monotonic_ns()
        names = self._names(requests)
        feeds: list[dict[str, Any]] = []
        for request in requests:
            try:
                feeds.append(self._feed(request))
            except QuiverError as exc:  # that request's own mistake: the others still run
                good = [r for r in requests if r is not request]
                answers = iter(self.execute(good))
                return [exc if r is request else next(answers) for r in requests]
        try:
            feed, sizes = concatenate(self._config.name, feeds)
            t1 = time.monotonic_ns()
            arrays = self._session_run(names, feed)
            t2 = time.monotonic_ns()
        except QuiverError as exc:
            return [exc for _ in requests]
        results: ExecuteResult = [
            InferenceResponse(self._config.name, "", self._tensors(names, parts), request.id)
            for request, parts in zip(requests, split_rows(arrays, sizes), strict=True)
        ]
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.monotonic_ns() - t2
        return results

    def release(self) -> None:
        self.__dict__.pop("_session", None)  # freed once; a second unload finds nothing

    def unload(self) -> None:
        """Once the instance's thread has finished what it was given, free the session here:
        onnxruntime sessions may be freed from any thread, so no trip to the instance's own."""
        self._executor.shutdown(wait=True)
        self.release()


def _to_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _to_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


class OnnxRuntimeBackend:
    name = "onnxruntime"

    def completes_without_files(self, config: pb.ModelConfig, strict: bool) -> bool:
        """Whether :meth:`auto_complete` leaves ``config`` as it is without opening the model
        (a configuration may then be prepared ahead of its load: lifecycle/read_ahead.py)."""
        return strict or _complete(config)

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Fill inputs, outputs and max_batch_size from the model, as Triton does."""
        if strict:
            return
        if _complete(config):
            return  # nothing to fill in: no session opened (as Triton skips it)
        filename = config.default_model_filename or DEFAULT_MODEL_FILENAME["onnxruntime"]
        path = files.version_dir / filename
        if not path.exists():
            return  # the load reports the missing file
        try:
            session = ort.InferenceSession(
                str(path), sess_options=metadata_options(), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise InternalError(
                f"model '{config.name}': onnxruntime could not load {path}: {format_exception(exc)}"
            ) from None
        inputs, outputs = _io_of(session)
        nodes = inputs + outputs
        batches = bool(nodes) and all(len(n.shape) > 0 and _dims(n.shape)[0] == -1 for n in nodes)
        if config.max_batch_size == 0 and batches and not config.input and not config.output:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
            if not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
                config.dynamic_batching.SetInParent()
            logger.info(
                "model '%s': auto-completed max_batch_size to %d",
                config.name,
                DEFAULT_MAX_BATCH_SIZE,
            )
        skip = 1 if config.max_batch_size > 0 else 0
        # A sequence model's control and state tensors come from the batcher, not the client.
        batcher = config.sequence_batching
        injected = {c.name for c in batcher.control_input} | {s.input_name for s in batcher.state}
        state_outputs = {s.output_name for s in batcher.state}
        _complete_io(config, config.input, [n for n in inputs if n.name not in injected], skip)
        _complete_io(
            config, config.output, [n for n in outputs if n.name not in state_outputs], skip
        )

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> OnnxInstance:
        path = model_path(config, files)
        providers: list[Any] = ["CPUExecutionProvider"]
        if spec.group.kind == "KIND_GPU":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers = [("CUDAExecutionProvider", {"device_id": spec.device_id}), *providers]
            else:
                logger.warning(
                    "model '%s' instance %s: KIND_GPU asked for, but onnxruntime has no CUDA "
                    "execution provider here; running on the CPU",
                    config.name,
                    spec.name,
                )
        kept = optimized_models() if len(providers) == 1 else None  # CPU sessions only
        level = _level_name(config)
        key = kept.key(str(path), level) if kept is not None else None
        session = None
        if kept is not None and key is not None:
            copy = kept.find(key)
            if copy is not None:
                try:
                    session = _open_session(copy, config, providers, optimized=True)
                    logger.debug("model '%s': opened its optimized graph %s", config.name, copy)
                except InternalError as exc:
                    if os.path.lexists(copy):  # (gone meanwhile, trimmed by a server: no fault)
                        kept.discard(key)
                    logger.warning(
                        "model '%s': its optimized graph %s did not open (%s); opened from %s",
                        config.name, copy, exc.message, path,
                    )  # fmt: skip
        if session is None:
            session = self._open_own(config, files, path, providers)
            if kept is not None and key is not None:
                kept.submit(str(path), level, key)
        _check_io_once(config, session, str(path))
        return OnnxInstance(config, session, f"{config.name}_{files.version}_{spec.name}")

    @staticmethod
    def _open_own(
        config: ModelConfig, files: ModelFiles, path: Path, providers: list[Any]
    ) -> ort.InferenceSession:
        """A session from the model's own file (its graph optimized as it opens)."""
        try:
            return _open_session(str(path), config, providers)
        except InternalError:
            # Looked for only now: a stat before every load was a miss's first file system
            # call once its folder is not walked (watch.py), 0.05 ms with that code out of the
            # CPU's caches, which the session's own open of the file pays anyway.
            if not path.exists():
                raise InvalidArgumentError(
                    f"model '{config.name}' version {files.version}: model file {path} does not exist"
                ) from None
            raise


def _complete(config: pb.ModelConfig) -> bool:
    """Whether auto-complete has nothing to fill in: inputs and outputs are configured, each
    with its datatype and dims (or a reshape). ``max_batch_size`` is only ever completed for
    a configuration without tensors."""

    def whole(entries: Any) -> bool:
        return len(entries) > 0 and all(
            e.data_type != pb.TYPE_INVALID and (len(e.dims) > 0 or e.HasField("reshape"))
            for e in entries
        )

    return whole(config.input) and whole(config.output)


def _complete_io(config: pb.ModelConfig, entries: Any, nodes: list[Any], skip: int) -> None:
    if len(entries) == 0:
        for node in nodes:
            entry = entries.add()
            entry.name = node.name
            entry.data_type = _ort_datatype(node, config.name).triton_value
            dims = _dims(node.shape)[skip:]
            entry.dims.extend(dims)
            if not dims and not entry.HasField("reshape"):
                entry.reshape.SetInParent()
        return
    by_name = {n.name: n for n in nodes}
    for entry in entries:
        node = by_name.get(entry.name)
        if node is None:
            continue  # reported with the list of names at load
        if entry.data_type == pb.TYPE_INVALID:
            entry.data_type = _ort_datatype(node, config.name).triton_value
        if len(entry.dims) == 0 and not entry.HasField("reshape"):
            entry.dims.extend(_dims(node.shape)[skip:])


def _sequence(config: ModelConfig) -> SequenceSettings:
    """The validated ``sequence_batching`` section (empty settings without one)."""
    if not config.proto.HasField("sequence_batching"):
        return SequenceSettings()
    return sequence_settings(config)


#: Configurations whose tensors matched their model file's session (:func:`_check_io`), by
#: the configuration's id and the file. A configuration prepared once per version of a
#: model's files (the lifecycle's ConfigCache, keyed by their fingerprint) is the same object
#: at every load of those files, so its check holds for the next load of the same file: a
#: reload after an eviction skips it (0.07 ms of a 3 ms miss, its code out of the CPU's
#: caches). The object is kept with its id, so the id cannot be reused meanwhile.
_IO_CHECKED: OrderedDict[tuple[int, str], ModelConfig] = OrderedDict()
_IO_CHECKED_KEPT = 4096
_IO_CHECKED_LOCK = threading.Lock()


def _check_io_once(config: ModelConfig, session: ort.InferenceSession, path: str) -> None:
    """:func:`_check_io`, unless ``config`` was checked against the model file ``path`` before."""
    key = (id(config), path)
    with _IO_CHECKED_LOCK:
        if _IO_CHECKED.get(key) is config:
            return
    _check_io(config, session)
    with _IO_CHECKED_LOCK:
        _IO_CHECKED[key] = config
        while len(_IO_CHECKED) > _IO_CHECKED_KEPT:
            _IO_CHECKED.popitem(last=False)


def _check_io(config: ModelConfig, session: ort.InferenceSession) -> None:
    """The configured tensors must exist in the model with the same datatype.

    Control and state inputs of a sequence model are not in the configuration's ``input``
    list (the sequence batcher supplies them); they count as declared.
    """
    inputs, outputs = _io_of(session)
    sequence = _sequence(config)
    by_input = {n.name: n for n in inputs}
    for name, datatype in sequence.injected_inputs.items():
        node = by_input.get(name)
        if node is None:
            raise ConfigError(
                f"{config.source}: sequence_batching input '{name}' of model '{config.name}' is "
                f"not an input of the ONNX model; it has inputs: {', '.join(sorted(by_input))}"
            )
        if _ort_datatype(node, config.name) is not datatype:
            raise ConfigError(
                f"{config.source}: sequence_batching input '{name}' of model '{config.name}' is "
                f"{datatype.config_name} in the configuration but "
                f"{_ort_datatype(node, config.name).config_name} in the model"
            )
    output_names = {n.name for n in outputs}
    for state in sequence.states:
        if state.output_name not in output_names:
            raise ConfigError(
                f"{config.source}: sequence_batching state output '{state.output_name}' of model "
                f"'{config.name}' is not an output of the ONNX model; it has outputs: "
                f"{', '.join(sorted(output_names))}"
            )
    skip = 1 if config.max_batch_size > 0 else 0
    for kind, configured, nodes in (
        ("input", config.inputs, inputs),
        ("output", config.outputs, outputs),
    ):
        by_name = {n.name: n for n in nodes}
        for tensor in configured:
            node = by_name.get(tensor.name)
            if node is None:
                raise ConfigError(
                    f"{config.source}: unexpected {kind} '{tensor.name}' for model "
                    f"'{config.name}'; the ONNX model has {kind}s: {', '.join(sorted(by_name))}"
                )
            datatype = _ort_datatype(node, config.name)
            if datatype is not tensor.datatype:
                raise ConfigError(
                    f"{config.source}: {kind} '{tensor.name}' of model '{config.name}' is "
                    f"{tensor.datatype.config_name} in the configuration but "
                    f"{datatype.config_name} in the model"
                )
            if skip and tensor.reshape is None:
                dims = _dims(node.shape)
                if not dims or dims[0] != -1:
                    raise ConfigError(
                        f"{config.source}: model '{config.name}' has max_batch_size "
                        f"{config.max_batch_size} but {kind} '{tensor.name}' has shape "
                        f"{dims}, whose first dimension is not variable"
                    )
        if kind == "input":
            required = {n.name for n in nodes} - {t.name for t in configured}
            required -= set(sequence.injected_inputs)
            if required:
                raise ConfigError(
                    f"{config.source}: model '{config.name}' needs input(s) "
                    f"{', '.join(sorted(required))}, which the configuration does not declare"
                )


BACKEND = OnnxRuntimeBackend()


#: ``y = Identity(x)``, x and y FP32 [1], opset 13: the smallest model ONNX Runtime will open.
_IDENTITY_ONNX = (
    b'\x08\x08\x12\x00:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05primeZ\x0f\n\x01x\x12\n\n'
    b"\x08\x08\x01\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B"
    b"\x04\n\x00\x10\r"
)


def prime() -> None:
    """Pay onnxruntime's one-time process cost (its environment, the shared thread pools when
    they are on, kernel registries): open a tiny session and run it once."""
    session = ort.InferenceSession(
        _IDENTITY_ONNX, sess_options=metadata_options(), providers=["CPUExecutionProvider"]
    )
    session.run(None, {"x": np.ones(1, np.float32)})
