"""The repository the frontend-worker tests serve (HTTP and gRPC through workers): Triton's
ONNX ``simple`` twice (``simple``, ``other``) and ``slow``, a Python model that sleeps a second
in ``execute`` (for requests in flight when a worker is killed or told to stop)."""

from __future__ import annotations

from pathlib import Path

from build_repository import SIMPLE_CONFIG, simple_onnx

from support.models import write_onnx, write_python

SLOW_MODEL = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests
        ]
"""
SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 0 }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def write_worker_repository(repo: Path) -> Path:
    """``simple``, ``other`` and ``slow`` in ``repo`` (made); returns ``repo``."""
    repo.mkdir(parents=True, exist_ok=True)
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_onnx(repo, "other", simple_onnx(), SIMPLE_CONFIG.replace('name: "simple"', 'name: "other"'))
    write_python(repo, "slow", SLOW_MODEL, SLOW_CONFIG)
    return repo
