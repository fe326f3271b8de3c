"""TensorRT plans (``platform: "tensorrt_plan"`` / ``backend: "tensorrt"``): refused, clearly.

A TensorRT plan is an engine compiled for one NVIDIA GPU architecture and one TensorRT version;
it cannot run anywhere else, and Quiver has no TensorRT runtime. Such a model fails to load
with the reason (the model is UNAVAILABLE in the index with it), and the other models of the
same repository or archive load as usual. An ensemble with a TensorRT step is UNAVAILABLE too,
its reason naming that step.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import NoReturn

from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import InstanceSpec, ModelFiles, ModelInstance
from quiver.config import ModelConfig
from quiver.errors import UnavailableError


def _nvidia_gpu_count() -> int:
    """NVIDIA GPUs NVML sees; 0 without NVML (``quiver[gpu]``) or a driver."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def refusal(model: str) -> str:
    """Why the TensorRT model ``model`` cannot load here."""
    missing = []
    if _nvidia_gpu_count() == 0:
        missing.append("no NVIDIA GPU found")
    if importlib.util.find_spec("tensorrt") is None:
        missing.append("TensorRT not installed")
    why = "; ".join(missing) if missing else "and Quiver has no TensorRT runtime"
    return (
        f"model '{model}': platform 'tensorrt_plan' requires an NVIDIA GPU and TensorRT "
        f"({why}); a plan runs only on the GPU and TensorRT version it was built for. Serve "
        "the ONNX model it was built from with platform 'onnxruntime_onnx' instead"
    )


class TensorRTBackend:
    name = "tensorrt"

    def auto_complete(self, config: pb.ModelConfig, files: ModelFiles, strict: bool) -> None:
        """Refuse before any version loads: the reason is the model's, not a version's."""
        raise UnavailableError(refusal(config.name))

    def create_instance(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec
    ) -> ModelInstance:
        _refuse(config.name)


def _refuse(model: str) -> NoReturn:
    raise UnavailableError(refusal(model))


BACKEND = TensorRTBackend()
