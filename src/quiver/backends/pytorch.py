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

Pieces: parameters and process-wide switches are :mod:`quiver.backends.pytorch_settings`,
tensor names :mod:`quiver.backends.pytorch_naming`, loading and weight sharing
:mod:`quiver.backends.pytorch_loading`; this module keeps the instance and the backend.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
from quiver.backends.batch import not_batchable, requested_names, reshaped, split_rows
from quiver.backends.pytorch_loading import (
    _SHARED,
    _check_bytes_dims,
    _device_for,
    _load_module,
    _sequence,
    _warn_no_effect,
)
from quiver.backends.pytorch_naming import (
    InputBinding,
    _result_types,
    _schema_arguments,
    bind_inputs,
    bind_outputs,
    tensor_index,
)
from quiver.backends.pytorch_settings import _GLOBAL as _GLOBAL
from quiver.backends.pytorch_settings import (
    TorchSettings,
    _apply_switches,
    _claim_switches,
    _release_switches,
    _set_thread_counts,
    parse_settings,
)
from quiver.config import ModelConfig
from quiver.config.model_config import TensorConfig
from quiver.errors import ConfigError, InternalError, InvalidArgumentError, QuiverError
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

__all__ = [
    "BACKEND",
    "TORCH_DTYPES",
    "InputBinding",
    "PyTorchBackend",
    "TorchInstance",
    "TorchSettings",
    "bind_inputs",
    "bind_outputs",
    "parse_settings",
    "tensor_index",
]

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


#: Messages of torch errors that are the request's fault (wrong shapes for this model).
_SHAPE_ERROR = re.compile(
    r"shapes cannot be multiplied|must match the size of tensor|size mismatch|"
    r"shape '\[.*\]' is invalid|expected .*(dimension|dim|shape|size)|"
    r"(dimension|dim) out of range|input.* of size",
    re.IGNORECASE,
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
        self._cache_cleaning = (
            settings.cache_cleaning and device is not None and device.type == "cuda"
        )
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
        grad_mode = torch.inference_mode() if settings.inference_mode else torch.no_grad()
        # Optimized execution is per thread in torch (torch.jit.optimized_execution does this).
        previous = torch._C._get_graph_executor_optimize()
        torch._C._set_graph_executor_optimize(settings.optimized_execution)
        try:
            with grad_mode:
                yield
        finally:
            torch._C._set_graph_executor_optimize(previous)

    def _names(self, requests: list[InferenceRequest]) -> list[str]:
        return requested_names(requests, self._outputs, self._state_outputs)

    def _gather(self, requests: list[InferenceRequest]) -> tuple[dict[str, Any], list[int]]:
        """Each input, the requests' values concatenated along dim 0; and rows per request."""
        per_name: dict[str, list[Any]] = {}
        sizes: list[int] = []
        for request in requests:
            rows = 1
            for tensor in request.inputs:
                data = reshaped(tensor.data, self._in_reshape.get(tensor.name), self._batching)
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
                    raise not_batchable(self._model, exc) from None
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
        per_request = [arrays] if len(requests) == 1 else split_rows(arrays, sizes)
        for request, parts in zip(requests, per_request, strict=True):
            tensors = [self._tensor(name, part) for name, part in zip(names, parts, strict=True)]
            results.append(InferenceResponse(self._model, "", tensors, request.id))
        timing.input_ns = t1 - t0
        timing.infer_ns = t2 - t1
        timing.output_ns = time.monotonic_ns() - t2
        return results

    def _tensor(self, name: str, array: Any) -> Tensor:
        array = reshaped(array, self._out_reshape.get(name), self._batching)
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
