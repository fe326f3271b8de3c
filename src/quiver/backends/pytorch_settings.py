"""The PyTorch backend's parameters (:func:`parse_settings`, Triton's names and defaults) and
the torch switches that are process-wide: which loaded models set them, the warning when
two disagree, and applying them (:func:`_apply_switches`); see :mod:`quiver.backends.pytorch`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from quiver.config import ModelConfig
from quiver.errors import ConfigError

logger = logging.getLogger("quiver.backends.pytorch")  # the backend's logger, as before the split

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
