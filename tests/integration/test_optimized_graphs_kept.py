"""The multi-model endpoint keeps each ONNX model's optimized graph after its first load, and
its next loads open that copy: the answers do not change, a broken copy is replaced by the
model's own file, and the setting turns it off."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from support.models import foldable_onnx, write_onnx
from support.server import QuiverServer

CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
OPENED = "opened its optimized graph"


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    for i in range(2):
        write_onnx(repo, f"m{i}", foldable_onnx(float(i + 1)), CONFIG.format(name=f"m{i}"))
    return repo


def infer(client: httpclient.InferenceServerClient, name: str) -> np.ndarray:
    tensor = httpclient.InferInput("INPUT0", [2, 4], "FP32")
    tensor.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
    return np.asarray(client.infer(name, [tensor]).as_numpy("OUTPUT0"))


def copies(cache: Path) -> list[Path]:
    return sorted(p for p in cache.glob("onnxruntime-optimized/*/*.onnx") if not p.name.startswith("."))


def wait_for_copies(cache: Path, count: int, timeout: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(copies(cache)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return copies(cache)


def test_a_reload_opens_the_kept_graph_and_answers_the_same(repository: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ("--model-control-mode=on_demand", f"--model-cache-dir={cache}", "--log-verbose=1")
    expected = np.arange(8, dtype=np.float32).reshape(2, 4) + 2.0
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        np.testing.assert_array_equal(infer(client, "m0"), expected)
        assert len(wait_for_copies(cache, 1)) == 1
        assert OPENED not in server.log
        client.unload_model("m0")
        np.testing.assert_array_equal(infer(client, "m0"), expected)  # loaded again, from the copy
        assert server.wait_for_log(f"model 'm0': {OPENED}"), server.log
        np.testing.assert_array_equal(infer(client, "m1"), expected + 2.0)  # another file, its own copy
        assert len(wait_for_copies(cache, 2)) == 2
        client.close()


def test_a_broken_copy_is_replaced_by_the_models_own_file(repository: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ("--model-control-mode=on_demand", f"--model-cache-dir={cache}", "--log-verbose=1")
    expected = np.arange(8, dtype=np.float32).reshape(2, 4) + 2.0
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        infer(client, "m0")
        [copy] = wait_for_copies(cache, 1)
        copy.write_bytes(b"\x00" * 64)  # damaged on disk
        client.unload_model("m0")
        np.testing.assert_array_equal(infer(client, "m0"), expected)
        assert server.wait_for_log("its optimized graph"), server.log
        assert "did not open" in server.log, server.log
        assert not copy.exists()  # removed, and not made again by this server
        client.close()


def test_the_setting_turns_it_off(repository: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = (
        "--model-control-mode=on_demand", f"--model-cache-dir={cache}",
        "--backend-config=onnxruntime,optimized-model-cache=0",
    )  # fmt: skip
    with QuiverServer(repository, args=args) as server:
        client = httpclient.InferenceServerClient(server.url)
        infer(client, "m0")
        client.unload_model("m0")
        infer(client, "m0")
        client.close()
        assert "has no effect" not in server.log
    assert copies(cache) == []
