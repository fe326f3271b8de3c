"""PyTorch backend for TorchScript models: ``platform: "pytorch_libtorch"`` / ``backend: "pytorch"``.

``torch`` is an optional dependency (``pip install 'quiver[torch]'``): this module is imported
only when a TorchScript model is loaded, and without torch that model's load fails with a
message saying what to install (see ``quiver.backends.base.get_backend``).

Each instance runs ``model.pt`` (or ``default_model_filename``), loaded with
``torch.jit.load(path, map_location=device)``, on its own thread; torch releases the GIL while
it computes, so ``count: 2`` runs two executions at once.

Tensor names follow Triton's PyTorch backend:

* inputs: when every configured input is the name of an argument of ``forward()`` (the
  TorchScript schema), inputs go to those arguments; else when every name is
  ``<anything>__<index>`` (``INPUT__0``), the index is the argument's position; else inputs go
  positionally in configuration order. A ``forward`` taking one ``Dict[str, Tensor]`` gets
  every input in that dict, keyed by its configured name.
* outputs: ``<anything>__<index>`` names pick that element of the returned tuple (or list);
  else outputs are taken positionally in configuration order. A single returned tensor is
  output 0. A returned ``Dict[str, Tensor]`` (which Triton rejects) is read by configured name.
* BYTES tensors are ``List[str]`` arguments and results, one-dimensional only, as in Triton.

Parameters (``string_value`` in the configuration's ``parameters``), Triton's names and
defaults: ``INFERENCE_MODE`` (true: ``torch.inference_mode``; false: ``torch.no_grad``),
``DISABLE_OPTIMIZED_EXECUTION``, ``ENABLE_WEIGHT_SHARING``, ``ENABLE_CACHE_CLEANING``,
``DISABLE_CUDNN``, ``ENABLE_JIT_EXECUTOR``, ``ENABLE_JIT_PROFILING``, ``ENABLE_TENSOR_FUSER``,
``ENABLE_NVFUSER``, ``INTRA_OP_THREAD_COUNT``, ``INTER_OP_THREAD_COUNT``. Inference mode and
optimized execution are per thread, so per model; the JIT executor, profiling and fuser
switches, cuDNN and the thread counts are process-wide in torch (see :func:`_apply_switches`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import (
    ExecuteResult,
    InstanceSpec,
    ModelFiles,
    ThreadedInstance,
    format_exception,
    model_path,
)
from quiver.config import ModelConfig
from quiver.config.model_config import TensorConfig
from quiver.config.sequence import SequenceSettings, sequence_settings
from quiver.errors import ConfigError, InternalError, InvalidArgumentError, QuiverError
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

#: Triton datatype -> torch dtype. BYTES is List[str], not a tensor.
TORCH_DTYPES: dict[DataType, torch.dtype] = {
    DataType.BOOL: torch.bool,
    DataType.UINT8: torch.uint8,
    DataType.UINT16: torch.uint16,
    DataType.UINT32: torch.uint32,
    DataType.UINT64: torch.uint64,
    DataType.INT8: torch.int8,
    DataType.INT16: torch.int16,
    DataType.INT32: torch.int32,
    DataType.INT64: torch.int64,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.FP32: torch.float32,
    DataType.FP64: torch.float64,
}
_FROM_TORCH = {dtype: datatype for datatype, dtype in TORCH_DTYPES.items()}

_INDEXED = re.compile(r"__(\d+)$")

#: Messages of torch errors that are the request's fault (wrong shapes for this model).
_SHAPE_ERROR = re.compile(
    r"shapes cannot be multiplied|must match the size of tensor|size mismatch|"
    r"shape '\[.*\]' is invalid|expected .*(dimension|dim|shape|size)|"
    r"(dimension|dim) out of range|input.* of size",
    re.IGNORECASE,
)

#: torch.jit.load has no type annotations.
_jit_load: Any = torch.jit.load
#: warnings.catch_warnings is not thread-safe: loads on several load threads take turns.
_LOAD_LOCK = threading.Lock()

_TRUE = ("true", "on", "1")
_FALSE = ("false", "off", "0")


# --- parameters -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TorchSettings:
    """The model's parameters, parsed. ``None`` means "not set: leave torch's default"."""

    inference_mode: bool = True
    optimized_execution: bool = True
    weight_sharing: bool = False
    cache_cleaning: bool = False
    cudnn: bool = True
    nvfuser: bool | None = None
    jit_executor: bool | None = None
    jit_profiling: bool | None = None
    tensor_fuser: bool | None = None
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None

    @property
    def global_switches(self) -> dict[str, bool]:
        """Process-wide JIT switches this model sets explicitly, by parameter name."""
        switches = {
            "ENABLE_JIT_EXECUTOR": self.jit_executor,
            "ENABLE_JIT_PROFILING": self.jit_profiling,
            "ENABLE_TENSOR_FUSER": self.tensor_fuser,
        }
        return {k: v for k, v in switches.items() if v is not None}


def _bool_param(config: ModelConfig, key: str) -> bool | None:
    if key not in config.parameters:
        return None
    value = config.parameters[key].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{config.source}: parameter '{key}' of model '{config.name}' must be true or false, "
        f"got '{config.parameters[key]}'"
    )


def _int_param(config: ModelConfig, key: str) -> int | None:
    if key not in config.parameters:
        return None
    try:
        value = int(config.parameters[key].strip())
    except ValueError:
        raise ConfigError(
            f"{config.source}: parameter '{key}' of model '{config.name}' must be an integer, "
            f"got '{config.parameters[key]}'"
        ) from None
    return value if value > 0 else None  # Triton: 0 or less leaves torch's default


def parse_settings(config: ModelConfig) -> TorchSettings:
    """Read the PyTorch backend's parameters; a value that is not a boolean is a config error."""

    def flag(key: str, default: bool) -> bool:
        value = _bool_param(config, key)
        return default if value is None else value

    disable_optimized = flag("DISABLE_OPTIMIZED_EXECUTION", False)
    disable_cudnn = flag("DISABLE_CUDNN", False)
    return TorchSettings(
        inference_mode=flag("INFERENCE_MODE", True),
        optimized_execution=not disable_optimized,
        weight_sharing=flag("ENABLE_WEIGHT_SHARING", False),
        cache_cleaning=flag("ENABLE_CACHE_CLEANING", False),
        cudnn=not disable_cudnn,
        nvfuser=_bool_param(config, "ENABLE_NVFUSER"),
        jit_executor=_bool_param(config, "ENABLE_JIT_EXECUTOR"),
        jit_profiling=_bool_param(config, "ENABLE_JIT_PROFILING"),
        tensor_fuser=_bool_param(config, "ENABLE_TENSOR_FUSER"),
        intra_op_threads=_int_param(config, "INTRA_OP_THREAD_COUNT"),
        inter_op_threads=_int_param(config, "INTER_OP_THREAD_COUNT"),
    )


# --- process-wide torch state -------------------------------------------------------------


@dataclass(slots=True)
class _GlobalState:
    """torch switches that are process-wide, and which loaded models set them."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: (parameter, model) -> value, for every model with a live instance that sets it.
    switches: dict[tuple[str, str], bool] = field(default_factory=dict)
    switch_users: dict[tuple[str, str], int] = field(default_factory=dict)
    #: INTRA_OP_THREAD_COUNT / INTER_OP_THREAD_COUNT: the first model to set one decides.
    threads: dict[str, tuple[str, int]] = field(default_factory=dict)


_GLOBAL = _GlobalState()


def _claim_switches(model: str, settings: TorchSettings) -> None:
    """Record the model's process-wide switches; warn when a loaded model disagrees."""
    with _GLOBAL.lock:
        for key, value in settings.global_switches.items():
            for (other_key, other_model), other in _GLOBAL.switches.items():
                if other_key == key and other_model != model and other != value:
                    logger.warning(
                        "model '%s' sets %s=%s but loaded model '%s' sets it to %s; torch has "
                        "one such switch per process, so each execution sets it again and "
                        "concurrent executions of the two models may run with either value",
                        model,
                        key,
                        str(value).lower(),
                        other_model,
                        str(other).lower(),
                    )
            _GLOBAL.switches[(key, model)] = value
            _GLOBAL.switch_users[(key, model)] = _GLOBAL.switch_users.get((key, model), 0) + 1


def _release_switches(model: str, settings: TorchSettings) -> None:
    with _GLOBAL.lock:
        for key in settings.global_switches:
            users = _GLOBAL.switch_users.get((key, model), 0) - 1
            if users <= 0:
                _GLOBAL.switch_users.pop((key, model), None)
                _GLOBAL.switches.pop((key, model), None)
            else:
                _GLOBAL.switch_users[(key, model)] = users


def _set_thread_counts(model: str, settings: TorchSettings) -> None:
    """INTRA/INTER_OP_THREAD_COUNT are process-wide in torch: the first model decides, as in
    Triton; a later different value is ignored with a warning."""
    wanted = (
        ("INTRA_OP_THREAD_COUNT", settings.intra_op_threads, torch.set_num_threads),
        ("INTER_OP_THREAD_COUNT", settings.inter_op_threads, torch.set_num_interop_threads),
    )
    with _GLOBAL.lock:
        for key, value, setter in wanted:
            if value is None:
                continue
            owner = _GLOBAL.threads.get(key)
            if owner is not None:
                if owner[1] != value:
                    logger.warning(
                        "model '%s': %s=%d ignored; it is process-wide in torch and model '%s' "
                        "already set it to %d",
                        model,
                        key,
                        value,
                        owner[0],
                        owner[1],
                    )
                continue
            try:
                setter(value)
            except RuntimeError as exc:  # inter-op threads: only before any parallel work
                logger.warning("model '%s': %s=%d not applied: %s", model, key, value, exc)
                continue
            _GLOBAL.threads[key] = (model, value)
            logger.info("model '%s': torch %s set to %d (process-wide)", model, key, value)


def _apply_switches(settings: TorchSettings) -> None:
    """Set the process-wide switches the model asks for, before each execution, as Triton
    does; switches the model leaves unset keep whatever value torch has."""
    if settings.jit_profiling is not None:
        torch._C._jit_set_profiling_mode(settings.jit_profiling)
    if settings.jit_executor is not None:
        torch._C._jit_set_profiling_executor(settings.jit_executor)
    if settings.tensor_fuser is not None:
        torch._C._jit_set_texpr_fuser_enabled(settings.tensor_fuser)


# --- tensor naming ------------------------------------------------------------------------


def tensor_index(name: str) -> int | None:
    """The index in a ``<name>__<index>`` tensor name (``INPUT__0`` -> 0), else None."""
    match = _INDEXED.search(name)
    if match is None or name.find("__") != match.start():
        return None
    return int(match.group(1))


@dataclass(frozen=True, slots=True)
class InputBinding:
    """How configured inputs reach ``forward``: by position, or all in one dict."""

    convention: str  # "forward_argument", "named_index", "config_order", "dict"
    positions: dict[str, int]  # input name -> argument position (ignored for "dict")
    arity: int  # number of forward arguments (1 for "dict")


def bind_inputs(
    names: list[str], arguments: list[tuple[str, str]], model: str, source: str
) -> InputBinding:
    """Map input names to forward() arguments by Triton's rules.

    ``arguments`` are forward's ``(name, kind)`` without ``self``; kind is the TorchScript type
    kind (``TensorType``, ``ListType``, ``DictType``, ...).
    """
    if not names:
        raise ConfigError(
            f"{source}: model '{model}' declares no input; the PyTorch backend cannot "
            "auto-complete inputs (TorchScript models carry no tensor types), so config.pbtxt "
            "must list them"
        )
    if len(arguments) == 1 and arguments[0][1] == "DictType":
        return InputBinding("dict", dict.fromkeys(names, 0), 1)
    for arg, kind in arguments:
        if kind == "DictType":
            raise ConfigError(
                f"{source}: model '{model}': forward() argument '{arg}' is a Dict; only a single "
                "Dict[str, Tensor] argument, or arguments of type Tensor and List[str], are "
                "supported"
            )
        if kind not in ("TensorType", "ListType"):
            raise ConfigError(
                f"{source}: model '{model}': forward() argument '{arg}' has type {kind}; only "
                "Tensor and List[str] arguments (or a single Dict[str, Tensor]) are supported"
            )
    if len(arguments) != len(names):
        raise ConfigError(
            f"{source}: model '{model}': the configuration declares {len(names)} input(s) "
            f"({', '.join(names)}) but forward() takes {len(arguments)} "
            f"({', '.join(a for a, _ in arguments)})"
        )
    arg_names = [a for a, _ in arguments]
    if all(n in arg_names for n in names):
        return InputBinding(
            "forward_argument", {n: arg_names.index(n) for n in names}, len(arguments)
        )
    indices = [tensor_index(n) for n in names]
    if all(i is not None for i in indices):
        positions = {n: i for n, i in zip(names, indices, strict=True) if i is not None}
        _check_indices(positions, len(arguments), "input", model, source)
        return InputBinding("named_index", positions, len(arguments))
    if any("__" in n for n in names):
        logger.warning(
            "model '%s': inputs are neither all forward() arguments (%s) nor all of the form "
            "<name>__<index>; feeding them in configuration order",
            model,
            ", ".join(arg_names),
        )
    return InputBinding("config_order", {n: i for i, n in enumerate(names)}, len(arguments))


def bind_outputs(names: list[str], model: str, source: str) -> tuple[str, dict[str, int]]:
    """Output name -> position in the model's result: ``<name>__<index>``, else config order."""
    if not names:
        raise ConfigError(
            f"{source}: model '{model}' declares no output; the PyTorch backend cannot "
            "auto-complete outputs, so config.pbtxt must list them"
        )
    indices = [tensor_index(n) for n in names]
    if all(i is not None for i in indices):
        positions = {n: i for n, i in zip(names, indices, strict=True) if i is not None}
        _check_indices(positions, None, "output", model, source)
        return "named_index", positions
    if any("__" in n for n in names):
        logger.warning(
            "model '%s': outputs are not all of the form <name>__<index>; taking them in "
            "configuration order",
            model,
        )
    return "config_order", {n: i for i, n in enumerate(names)}


def _check_indices(
    positions: dict[str, int], arity: int | None, kind: str, model: str, source: str
) -> None:
    seen: dict[int, str] = {}
    for name, index in positions.items():
        if index in seen:
            raise ConfigError(
                f"{source}: model '{model}': {kind}s '{seen[index]}' and '{name}' both name "
                f"position {index}"
            )
        if arity is not None and index >= arity:
            raise ConfigError(
                f"{source}: model '{model}': {kind} '{name}' names position {index} but "
                f"forward() takes {arity} argument(s)"
            )
        seen[index] = name


def _schema_arguments(module: Any) -> list[tuple[str, str, str]]:
    """forward()'s arguments without ``self``: (name, type kind, type as written)."""
    schema = module.forward.schema
    args = list(schema.arguments)
    if args and args[0].type.kind() == "ClassType":
        args = args[1:]
    return [(a.name, a.type.kind(), str(a.type)) for a in args]


def _result_types(module: Any) -> tuple[str, list[str]]:
    """forward()'s return type kind and, for tuples, the element types as written."""
    returns = module.forward.schema.returns
    if len(returns) != 1:
        return "TupleType", [str(r.type) for r in returns]
    rtype = returns[0].type
    kind = rtype.kind()
    if kind == "TupleType":
        return kind, [str(e) for e in rtype.elements()]
    return kind, [str(rtype)]


# --- loading -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Shared:
    module: Any
    config: ModelConfig  # kept so that the key's id() is not reused while this lives
    users: int = 0


class _ModuleCache:
    """ENABLE_WEIGHT_SHARING: one loaded module per (load of a model, version, device)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int, str], _Shared] = {}

    def acquire(self, key: tuple[int, int, str], config: ModelConfig, load: Any) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = _Shared(load(), config)
                self._entries[key] = entry
            else:
                logger.info(
                    "model '%s' version %d: reusing the loaded TorchScript module on %s "
                    "(ENABLE_WEIGHT_SHARING)",
                    config.name,
                    key[1],
                    key[2],
                )
            entry.users += 1
            return entry.module

    def release(self, key: tuple[int, int, str]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users <= 0:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


_SHARED = _ModuleCache()


def _device_for(config: ModelConfig, spec: InstanceSpec) -> torch.device | None:
    """Where the instance runs; None for KIND_MODEL (the model's own devices)."""
    if spec.group.kind == "KIND_GPU":
        if torch.cuda.is_available():
            return torch.device(f"cuda:{spec.device_id}")
        logger.warning(
            "model '%s' instance %s: KIND_GPU asked for, but torch sees no CUDA device here; "
            "running on the CPU",
            config.name,
            spec.name,
        )
    if spec.group.kind == "KIND_MODEL":
        return None
    return torch.device("cpu")


def _warn_no_effect(config: ModelConfig, settings: TorchSettings, device: torch.device | None) -> None:
    on_gpu = device is not None and device.type == "cuda"
    if settings.nvfuser is not None:
        logger.warning(
            "model '%s': parameter ENABLE_NVFUSER has no effect: NVFuser is no longer part of "
            "TorchScript in torch %s",
            config.name,
            torch.__version__,
        )
    if not on_gpu:
        if settings.cache_cleaning:
            logger.warning(
                "model '%s': parameter ENABLE_CACHE_CLEANING has no effect: the model runs on "
                "the CPU (it empties the CUDA cache after each execution on a GPU)",
                config.name,
            )
        if not settings.cudnn:
            logger.warning(
                "model '%s': parameter DISABLE_CUDNN has no effect: the model runs on the CPU",
                config.name,
            )


def _load_module(path: str, device: torch.device | None, settings: TorchSettings, model: str) -> Any:
    try:
        # As Triton: the module is loaded under the mode it will run in.
        with _LOAD_LOCK, warnings.catch_warnings(), torch.inference_mode(settings.inference_mode):
            # torch 2.x deprecates TorchScript (torch.jit.load warns); Triton still serves it.
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.jit")
            module = _jit_load(path, map_location=device)
    except Exception as exc:
        raise InternalError(
            f"model '{model}': torch could not load TorchScript model {path}: "
            f"{format_exception(exc)}"
        ) from None
    module.eval()
    return module


def _sequence(config: ModelConfig) -> SequenceSettings:
    if not config.proto.HasField("sequence_batching"):
        return SequenceSettings()
    return sequence_settings(config)


def _check_bytes_dims(config: ModelConfig, tensors: list[TensorConfig], kind: str) -> None:
    batching = config.max_batch_size > 0
    for tensor in tensors:
        if tensor.datatype is not DataType.BYTES:
            continue
        dims = tensor.reshape if tensor.reshape is not None else tensor.dims
        if len(dims) + (1 if batching else 0) > 1:
            raise ConfigError(
                f"{config.source}: {kind} '{tensor.name}' of model '{config.name}': the PyTorch "
                "backend supports only one-dimensional BYTES tensors (List[str]); it has "
                f"dims {list(tensor.dims)}{' plus the batch dimension' if batching else ''}"
            )


# --- the instance -----------------------------------------------------------------------


class TorchInstance(ThreadedInstance):
    # A TorchScript module may be called from any thread, and concurrently (Triton calls one
    # shared module from several instance threads with weight sharing). What the call needs
    # from its thread, inference mode and optimized execution, is thread-local in torch and
    # set around every call here, so a short execution can run on the event loop thread.
    inline_safe = True

    def __init__(
        self,
        config: ModelConfig,
        module: Any,
        name: str,
        device: torch.device | None,
        settings: TorchSettings,
        shared_key: tuple[int, int, str] | None,
    ) -> None:
        super().__init__(name)
        self._config = config
        self._model = config.name
        self.module = module
        self._device = device
        self._settings = settings
        self._shared_key = shared_key
        self._cache_cleaning = settings.cache_cleaning and device is not None and device.type == "cuda"
        self._batching = config.max_batch_size > 0
        sequence = _sequence(config)

        arguments = _schema_arguments(module)
        input_names = [t.name for t in config.inputs] + list(sequence.injected_inputs)
        self._inputs = bind_inputs(
            input_names, [(a, k) for a, k, _ in arguments], config.name, config.source
        )
        self._arg_types = {a: t for a, _, t in arguments}
        in_types: dict[str, DataType] = {t.name: t.datatype for t in config.inputs}
        in_types.update(sequence.injected_inputs)
        self._in_types = in_types
        self._check_string_arguments(arguments)
        self._in_reshape = {i.name: i.reshape for i in config.inputs if i.reshape is not None}

        self._out_cfg: dict[str, TensorConfig] = {o.name: o for o in config.outputs}
        self._outputs = [o.name for o in config.outputs]
        self._state_outputs: list[str] = []
        for state in sequence.states:
            self._state_outputs.append(state.output_name)
            if state.output_name not in self._out_cfg:
                self._out_cfg[state.output_name] = TensorConfig(
                    state.output_name, state.datatype, state.dims
                )
        all_outputs = self._outputs + [n for n in self._state_outputs if n not in self._outputs]
        self._output_convention, self._out_pos = bind_outputs(
            all_outputs, config.name, config.source
        )
        self._out_reshape = {o.name: o.dims for o in config.outputs if o.reshape is not None}
        self._check_result_type()

    def _check_string_arguments(self, arguments: list[tuple[str, str, str]]) -> None:
        if self._inputs.convention == "dict":
            bad = [n for n, dt in self._in_types.items() if dt is DataType.BYTES]
            if bad:
                raise ConfigError(
                    f"{self._config.source}: model '{self._model}': input(s) {', '.join(bad)} "
                    "are BYTES but forward() takes a Dict[str, Tensor]"
                )
            return
        for name, position in self._inputs.positions.items():
            arg, kind, written = arguments[position]
            is_string = self._in_types[name] is DataType.BYTES
            if kind == "ListType" and written != "List[str]":
                raise ConfigError(
                    f"{self._config.source}: model '{self._model}': forward() argument '{arg}' "
                    f"is {written}; the only list argument supported is List[str] (BYTES)"
                )
            if is_string != (kind == "ListType"):
                raise ConfigError(
                    f"{self._config.source}: model '{self._model}': input '{name}' is "
                    f"{self._in_types[name].config_name} but forward() argument '{arg}' is "
                    f"{written}; BYTES inputs must be List[str] arguments and others Tensor"
                )

    def _check_result_type(self) -> None:
        kind, elements = _result_types(self.module)
        where = f"{self._config.source}: model '{self._model}'"
        count: int | None = None  # None: known only at run time
        if kind == "TensorType":
            count = 1
        elif kind == "ListType":
            if elements[0] == "List[str]":
                count = 1
            elif elements[0] != "List[Tensor]":
                raise ConfigError(
                    f"{where}: forward() returns {elements[0]}; supported lists are List[str] "
                    "and List[Tensor]"
                )
        elif kind == "TupleType":
            count = len(elements)
            for index, element in enumerate(elements):
                if element not in ("Tensor", "List[str]"):
                    raise ConfigError(
                        f"{where}: element {index} of forward()'s result is {element}; only "
                        "Tensor and List[str] are supported"
                    )
        elif kind == "DictType":
            if elements[0] != "Dict[str, Tensor]":
                raise ConfigError(
                    f"{where}: forward() returns {elements[0]}; the only dict supported is "
                    "Dict[str, Tensor]"
                )
        elif kind != "AnyType":
            raise ConfigError(
                f"{where}: forward() returns {elements[0]}; supported are Tensor, List[str], "
                "tuples of them, List[Tensor] and Dict[str, Tensor]"
            )
        self._single_result = count == 1 and kind != "TupleType"
        if count is not None:
            for name, index in self._out_pos.items():
                if index >= count:
                    raise ConfigError(
                        f"{where}: output '{name}' is result {index}, but forward() returns "
                        f"{count} value(s) ({', '.join(elements)})"
                    )

    # -- execution --

    def execute(self, requests: list[InferenceRequest]) -> ExecuteResult:
        try:
            return self._run(requests)
        except QuiverError as exc:
            return [exc for _ in requests]

    @contextmanager
    def _modes(self) -> Iterator[None]:
        settings = self._settings
        _apply_switches(settings)
        if not settings.cudnn:
            torch.backends.cudnn.enabled = False
        grad_mode = (
            torch.inference_mode() if settings.inference_mode else torch.no_grad()
        )
        # Optimized execution is per thread in torch (torch.jit.optimized_execution does this).
        previous = torch._C._get_graph_executor_optimize()
        torch._C._set_graph_executor_optimize(settings.optimized_execution)
        try:
            with grad_mode:
                yield
        finally:
            torch._C._set_graph_executor_optimize(previous)

    def _names(self, requests: list[InferenceRequest]) -> list[str]:
        wanted: set[str] = set()
        for request in requests:
            if request.outputs is None:
                if not self._state_outputs:
                    return self._outputs
                wanted.update(self._outputs)
                break
            wanted.update(o.name for o in request.outputs)
        names = [name for name in self._outputs if name in wanted]
        names += [name for name in self._state_outputs if name not in names]
        return names

    def _gather(self, requests: list[InferenceRequest]) -> tuple[dict[str, Any], list[int]]:
        """Each input, the requests' values concatenated along dim 0; and rows per request."""
        per_name: dict[str, list[Any]] = {}
        sizes: list[int] = []
        for request in requests:
            rows = 1
            for tensor in request.inputs:
                data = tensor.data
                reshape = self._in_reshape.get(tensor.name)
                if reshape is not None:
                    lead = data.shape[:1] if self._batching else ()
                    data = data.reshape(lead + tuple(reshape))
                per_name.setdefault(tensor.name, []).append(data)
                if self._batching and data.ndim:
                    rows = int(data.shape[0])
            sizes.append(rows)
        values: dict[str, Any] = {}
        for name, parts in per_name.items():
            datatype = self._in_types.get(name)
            if datatype is None:
                raise InvalidArgumentError(f"model '{self._model}' has no input '{name}'")
            if datatype is DataType.BYTES:
                values[name] = [_to_str(v, name, self._model) for p in parts for v in p.reshape(-1)]
                continue
            if len(parts) == 1:
                array = parts[0]
            else:
                try:
                    array = np.concatenate(parts)
                except ValueError as exc:
                    raise InvalidArgumentError(
                        f"model '{self._model}': requests cannot be batched together: {exc}"
                    ) from None
            values[name] = self._to_torch(array, datatype)
        missing = [n for n in self._inputs.positions if n not in values]
        if missing:
            raise InvalidArgumentError(
                f"model '{self._model}': missing input(s) {', '.join(missing)}"
            )
        return values, sizes

    def _to_torch(self, array: Any, datatype: DataType) -> torch.Tensor:
        if datatype is DataType.BF16:
            tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.int16).copy())
            tensor = tensor.view(torch.bfloat16)
        else:
            if not array.flags.writeable or not array.flags.c_contiguous:
                array = np.array(array, copy=True, order="C")
            tensor = torch.from_numpy(array)
        if self._device is not None and self._device.type != "cpu":
            tensor = tensor.to(self._device)
        return tensor

    def _arguments(self, values: dict[str, Any]) -> list[Any]:
        binding = self._inputs
        if binding.convention == "dict":
            return [dict(values)]
        args: list[Any] = [None] * binding.arity
        for name, position in binding.positions.items():
            args[position] = values[name]
        return args

    def _forward(self, args: list[Any]) -> Any:
        try:
            with self._modes():
                return self.module(*args)
        except Exception as exc:
            message = format_exception(exc)
            error = InvalidArgumentError if _SHAPE_ERROR.search(message) else InternalError
            raise error(f"model '{self._model}': PyTorch execute failure: {message}") from None
        finally:
            if self._cache_cleaning:
                torch.cuda.empty_cache()

    def _pick(self, result: Any, name: str) -> Any:
        if isinstance(result, dict):
            if name not in result:
                raise InternalError(
                    f"model '{self._model}': forward() returned a dict without key '{name}' "
                    f"(it has {', '.join(map(str, result))})"
                )
            return result[name]
        position = self._out_pos[name]
        if isinstance(result, torch.Tensor) or (self._single_result and isinstance(result, list)):
            values = [result]
        elif isinstance(result, tuple | list):
            values = list(result)
        else:
            raise InternalError(
                f"model '{self._model}': forward() returned {type(result).__name__}; expected "
                "Tensor, List[str] or a tuple of them"
            )
        if position >= len(values):
            raise InternalError(
                f"model '{self._model}': output '{name}' is result {position}, but forward() "
                f"returned {len(values)} value(s)"
            )
        return values[position]

    def _to_numpy(self, value: Any, name: str) -> Any:
        cfg = self._out_cfg[name]
        if isinstance(value, list):
            if cfg.datatype is not DataType.BYTES:
                raise InternalError(
                    f"model '{self._model}': output '{name}' is {cfg.datatype.config_name} but "
                    "the model returned a list of strings"
                )
            return np.array([_to_bytes(v) for v in value], dtype=np.object_)
        if not isinstance(value, torch.Tensor):
            raise InternalError(
                f"model '{self._model}': output '{name}' is a {type(value).__name__}, not a "
                "Tensor or List[str]"
            )
        got = _FROM_TORCH.get(value.dtype)
        if got is not cfg.datatype:
            raise InternalError(
                f"model '{self._model}': configuration expects datatype "
                f"{cfg.datatype.config_name} for output '{name}', model provides {value.dtype}"
            )
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        value = value.contiguous()
        if value.dtype is torch.bfloat16:
            return value.view(torch.int16).numpy().view(DataType.BF16.numpy_dtype)
        return value.numpy()

    def _run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        timing = self.timing
        t0 = time.monotonic_ns()
        names = self._names(requests)
        values, sizes = self._gather(requests)
        args = self._arguments(values)
        t1 = time.monotonic_ns()
        result = self._forward(args)
        t2 = time.monotonic_ns()
        arrays = [self._to_numpy(self._pick(result, name), name) for name in names]
        total = sum(sizes)
        results: ExecuteResult = []
        if len(requests) > 1:
            for name, array in zip(names, arrays, strict=True):
                if array.ndim == 0 or array.shape[0] != total:
                    error = InternalError(
                        f"model '{self._model}': output '{name}' has shape {list(array.shape)}, "
                        f"whose first dimension is not the batch of {total}"
                    )
                    return [error for _ in requests]
        offset = 0
        for request, size in zip(requests, sizes, strict=True):
            parts = arrays if len(requests) == 1 else [a[offset : offset + size] for a in arrays]
            offset += size
            tensors = [self._tensor(name, part) for name, part in zip(names, parts, strict=True)]
            results.append(InferenceResponse(self._model, "", tensors, request.id))
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.monotonic_ns() - t2
        return results

    def _tensor(self, name: str, array: Any) -> Tensor:
        dims = self._out_reshape.get(name)
        if dims is not None:
            lead = array.shape[:1] if self._batching else ()
            array = array.reshape(lead + tuple(dims))
        return Tensor(name, self._out_cfg[name].datatype, tuple(array.shape), array)

    def release(self) -> None:
        if self._shared_key is not None:
            _SHARED.release(self._shared_key)
        _release_switches(self._model, self._settings)
        del self.module


def _to_str(value: Any, name: str, model: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgumentError(
                f"model '{model}': input '{name}' holds bytes that are not UTF-8; TorchScript "
                "takes BYTES as List[str]"
            ) from None
    return str(value)


def _to_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


# --- the backend --------------------------------------------------------------------------


class PyTorchBackend:
    name = "pytorch"

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Nothing to complete: TorchScript models carry no reliable tensor types, so (as in
        Triton) inputs and outputs must be in config.pbtxt; the load says so if they are not."""
        if not strict and (len(config.input) == 0 or len(config.output) == 0):
            logger.warning(
                "model '%s': skipping configuration auto-complete: not supported for the "
                "pytorch backend",
                config.name,
            )

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> TorchInstance:
        settings = parse_settings(config)
        path = model_path(config, files)
        if not path.exists():
            raise InvalidArgumentError(
                f"model '{config.name}' version {files.version}: model file {path} does not exist"
            )
        _check_bytes_dims(config, config.inputs, "input")
        _check_bytes_dims(config, config.outputs, "output")
        device = _device_for(config, spec)
        first = spec.index == 0 and spec.group == config.instance_groups[0]
        if first:
            _warn_no_effect(config, settings, device)
        _set_thread_counts(config.name, settings)
        name = f"{config.name}_{files.version}_{spec.name}"

        def load() -> Any:
            return _load_module(str(path), device, settings, config.name)

        shared_key = None
        if settings.weight_sharing:
            shared_key = (id(config), files.version, str(device))
            module = _SHARED.acquire(shared_key, config, load)
        else:
            module = load()
        try:
            instance = TorchInstance(config, module, name, device, settings, shared_key)
        except BaseException:
            if shared_key is not None:
                _SHARED.release(shared_key)
            raise
        _claim_switches(config.name, settings)
        return instance


BACKEND = PyTorchBackend()
