"""ONNX Runtime sessions and their threads: the multi-model endpoint (on_demand) shares the
process's thread pools, Triton's backend settings choose, and every model serves either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer

CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}
"""
SHARED = "onnxruntime sessions share the process's thread pools"
IGNORED = "its intra_op_thread_count / inter_op_thread_count do not apply"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("threads")
    for i in range(4):
        write_onnx(repo, f"m{i}", add_constant_onnx(float(i)), CONFIG.format(name=f"m{i}", extra=""))
    threads = 'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }'
    write_onnx(repo, "tuned", add_constant_onnx(9.0), CONFIG.format(name="tuned", extra=threads))
    write_onnx(repo, "completed", add_constant_onnx(7.0), None)  # auto-completed from the model
    return repo


def serve_all(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for name, value in [*((f"m{i}", float(i)) for i in range(4)), ("tuned", 9.0), ("completed", 7.0)]:
        tensor = httpclient.InferInput("INPUT0", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(name, [tensor])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + value)


def test_on_demand_sessions_share_the_thread_pools(repository: Path) -> None:
    args = ("--model-control-mode=on_demand", "--log-verbose=1")
    with QuiverServer(repository, args=args) as server:
        serve_all(server)
        assert server.wait_for_log(SHARED), server.log
        assert server.wait_for_log(f"model 'tuned': {IGNORED}"), server.log
        assert f"model 'm0': {IGNORED}" not in server.log


@pytest.mark.parametrize(
    ("args", "shared"),
    [
        (("--model-control-mode=on_demand", "--backend-config=onnxruntime,enable-global-threadpool=0"), False),
        (("--model-control-mode=explicit", "--load-model=*"), False),  # Triton's default
        (
            (
                "--model-control-mode=explicit",
                "--load-model=*",
                "--backend-config=onnxruntime,enable-global-threadpool=1",
                "--backend-config=onnxruntime,intra_op_thread_count=2",
            ),
            True,
        ),
    ],
)
def test_the_backend_settings_choose(repository: Path, args: tuple[str, ...], shared: bool) -> None:
    with QuiverServer(repository, args=(*args, "--log-verbose=1")) as server:
        serve_all(server)
        if shared:
            assert server.wait_for_log(f"{SHARED} (2 intra-op, default inter-op threads"), server.log
        else:
            assert SHARED not in server.log and IGNORED not in server.log, server.log
        assert "has no effect" not in server.log, server.log
