"""GPU memory for the model lifecycle: what this process and each device use (NVML, else
torch's allocator), and ``--model-load-gpu-limit`` (:class:`GpuMemoryLimit`), the check a load
passes before it may take a GPU's memory past a fraction of its total. Without a GPU or NVML
every reading is ``None``, silently. :mod:`quiver.lifecycle.memory` measures loads with
:func:`gpu_memory_used` and re-exports these names.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quiver.lifecycle.memory import ModelIdentity

__all__ = ["GpuMemoryLimit", "gpu_memory_info", "gpu_memory_used"]

logger = logging.getLogger("quiver.lifecycle.memory")

_NVML_STATE: dict[str, Any] = {}  # "module" -> pynvml once initialized, "failed" -> True


def _nvml() -> Any | None:
    if _NVML_STATE.get("failed"):
        return None
    module = _NVML_STATE.get("module")
    if module is not None:
        return module
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
    except Exception:  # no package, no driver, no GPU: no GPU accounting, silently
        _NVML_STATE["failed"] = True
        return None
    _NVML_STATE["module"] = pynvml
    return pynvml


def _gpu_used_nvml(pynvml: Any) -> dict[int, int] | None:
    pid = os.getpid()
    used: dict[int, int] = {}
    for index in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mine: int | None = None
        try:
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    mine = (mine or 0) + int(proc.usedGpuMemory)
        except pynvml.NVMLError:
            mine = None
        if mine is None:
            # Per-process figures are unavailable in some containers: the device's used memory
            # still moves by what this process allocates (other processes add noise).
            mine = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        used[index] = mine
    return used or None


def _gpu_used_torch() -> dict[int, int] | None:
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None:
        return None
    cuda = torch.cuda
    if not cuda.is_available() or not cuda.is_initialized():
        return None
    return {i: int(cuda.memory_reserved(i)) for i in range(int(cuda.device_count()))}


def gpu_memory_used() -> dict[int, int] | None:
    """GPU memory this process uses, per device index; ``None`` without a GPU or NVML.

    NVML first (it sees every framework's allocations: ONNX Runtime's CUDA provider and
    torch alike), else torch's caching allocator if torch is already imported and CUDA is up.
    Never raises.
    """
    try:
        pynvml = _nvml()
        if pynvml is not None:
            return _gpu_used_nvml(pynvml)
        return _gpu_used_torch()
    except Exception:
        logger.debug("reading GPU memory failed", exc_info=True)
        return None


def gpu_memory_info() -> dict[int, tuple[int, int]] | None:
    """Each GPU's used and total memory in bytes (NVML, the whole device: every process's
    allocations), per device index; ``None`` without a GPU or NVML. Never raises."""
    try:
        pynvml = _nvml()
        if pynvml is None:
            return None
        info: dict[int, tuple[int, int]] = {}
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            info[index] = (int(memory.used), int(memory.total))
        return info or None
    except Exception:
        logger.debug("reading GPU memory failed", exc_info=True)
        return None


# -- GpuMemoryLimit ----------------------------------------------------------------------------


class GpuMemoryLimit:
    """``--model-load-gpu-limit``: a load may not take any GPU's used memory past ``fraction``
    of its total.

    A model's GPU footprint is the per-device growth the :class:`MemoryMeter` measured when it
    last loaded (:attr:`Footprint.gpu_bytes`), remembered per :class:`ModelIdentity` (and per
    name, for another version or content). Before a load, :meth:`over` reads the devices
    (``reader``: NVML's used and total bytes per device) and answers, per device, how many
    bytes past the limit the load would end: ``used + in-flight loads' predictions +
    this model's prediction - fraction * total``. Only the devices the model grew before are
    looked at; a model never measured is predicted to add nothing, on every device (so a
    load is refused while a GPU is already past the limit, as Triton's check does). The
    caller evicts models with GPU memory on those devices, or refuses the load
    (:class:`OutOfMemoryError`). :meth:`reserve` counts a load's prediction until
    :meth:`settle` (it finished: NVML now shows its memory) so concurrent loads cannot both
    claim the same room. Thread-safe.
    """

    def __init__(
        self,
        fraction: float,
        *,
        reader: Callable[[], Mapping[int, tuple[int, int]] | None] = gpu_memory_info,
    ) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"the GPU memory limit must be a fraction in (0, 1], got {fraction}")
        self.fraction = fraction
        self._reader = reader
        self._measured: dict[ModelIdentity, dict[int, int]] = {}
        self._by_name: dict[str, dict[int, int]] = {}
        self._reserved: dict[str, dict[int, int]] = {}
        self._lock = threading.Lock()

    def read(self) -> Mapping[int, tuple[int, int]] | None:
        """The reader's per-device (used, total) bytes, or ``None`` (no GPU; never raises)."""
        try:
            return self._reader()
        except Exception:
            return None

    def record(self, identity: ModelIdentity, gpu_bytes: Mapping[int, int]) -> None:
        """Remember a load's measured GPU growth per device."""
        value = {d: max(0, int(b)) for d, b in gpu_bytes.items()}
        with self._lock:
            self._measured[identity] = value
            self._by_name[identity.name] = value

    def predict(self, identity: ModelIdentity) -> dict[int, int] | None:
        """The GPU growth per device measured for this identity, else for its name; ``None``
        when never measured."""
        with self._lock:
            found = self._measured.get(identity, self._by_name.get(identity.name))
            return None if found is None else dict(found)

    def over(self, predicted: Mapping[int, int] | None, *, exclude: str = "") -> dict[int, int]:
        """Bytes past the limit per device if a load with this prediction ran now (only the
        devices that would exceed it; ``{}`` when it fits, or without a GPU reading).
        ``exclude`` is the load's own name, whose reservation is not counted twice."""
        reading = self.read()
        if not reading:
            return {}
        with self._lock:
            pending: dict[int, int] = {}
            for name, devices in self._reserved.items():
                if name != exclude:
                    for d, b in devices.items():
                        pending[d] = pending.get(d, 0) + b
        if predicted is None:
            looked_at = {d: 0 for d in reading}
        else:
            looked_at = {d: b for d, b in predicted.items() if b > 0 and d in reading}
        result: dict[int, int] = {}
        for device, adds in looked_at.items():
            used, total = reading[device]
            after = used + pending.get(device, 0) + adds
            limit = int(self.fraction * total)
            if after > limit:
                result[device] = after - limit
        return result

    def reserve(self, name: str, predicted: Mapping[int, int] | None) -> None:
        with self._lock:
            self._reserved[name] = {d: b for d, b in (predicted or {}).items() if b > 0}

    def settle(self, name: str) -> None:
        """The load of ``name`` finished or failed: its memory is now in the readings (or gone)."""
        with self._lock:
            self._reserved.pop(name, None)

    def describe(self, name: str, over: Mapping[int, int]) -> str:
        devices = ", ".join(f"GPU {d} by {b} bytes" for d, b in sorted(over.items()))
        return (
            f"not enough GPU memory to load model '{name}': it would exceed the GPU load limit "
            f"of {self.fraction:g} of each GPU's memory (--model-load-gpu-limit) on {devices}, "
            "and no model not in use holds memory there to evict"
        )
