"""Loading TorchScript modules for the PyTorch backend: the device an instance runs on, the
module itself (``torch.jit.load`` under the load lock), modules shared between instances
(``ENABLE_WEIGHT_SHARING``), and the load-time checks of the configuration.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from quiver.backends.base import (
    InstanceSpec,
    format_exception,
)
from quiver.backends.pytorch_settings import TorchSettings
from quiver.config import ModelConfig
from quiver.config.model_config import TensorConfig
from quiver.config.sequence import SequenceSettings, sequence_settings
from quiver.errors import ConfigError, InternalError
from quiver.types import DataType

logger = logging.getLogger("quiver.backends.pytorch")  # the backend's logger, as before the split

#: torch.jit.load has no type annotations.
_jit_load: Any = torch.jit.load
#: warnings.catch_warnings is not thread-safe: loads on several load threads take turns.
_LOAD_LOCK = threading.Lock()

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


def _warn_no_effect(
    config: ModelConfig, settings: TorchSettings, device: torch.device | None
) -> None:
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


def _load_module(
    path: str, device: torch.device | None, settings: TorchSettings, model: str
) -> Any:
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
