"""Start-up and shutdown as an operator sees them: flags, exit codes, draining."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from build_repository import SIMPLE_CONFIG, simple_onnx

from support.models import write_onnx, write_python
from support.server import QuiverServer, run_quiver

SLOW_MODEL = """
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = Path(args["model_repository"]) / "finalized"

    def execute(self, requests):
        time.sleep(1.5)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)])
            for r in requests
        ]

    def finalize(self):
        self.marker.write_text("done")
"""

SLOW_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""

BROKEN_CONFIG = """
name: "bad_config"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] shape_of_things: 3 } ]
"""


def test_help_explains_the_flags() -> None:
    top = run_quiver("--help")
    assert top.returncode == 0 and "serve" in top.stdout
    serve = run_quiver("serve", "--help")
    assert serve.returncode == 0
    for flag in (
        "--model-repository",
        "--http-port",
        "--grpc-port",
        "--metrics-port",
        "--http-address",
        "--model-control-mode",
        "--strict-model-config",
        "--exit-on-error",
        "--log-verbose",
        "--http-max-input-size",
    ):
        assert flag in serve.stdout, flag


def test_missing_repository_is_a_clear_error(tmp_path: Path) -> None:
    result = run_quiver("serve", "--model-repository", str(tmp_path / "nope"), "--http-port", "0")
    assert result.returncode == 2
    assert "is not a directory" in result.stderr


def test_bad_boolean_flag_value(tmp_path: Path) -> None:
    result = run_quiver("serve", "--model-repository", str(tmp_path), "--exit-on-error=maybe")
    assert result.returncode == 2 and "expected true or false" in result.stderr


def test_exit_on_error_fails_start_up_naming_the_file_and_field(tmp_path: Path) -> None:
    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_onnx(tmp_path, "bad_config", simple_onnx(), BROKEN_CONFIG)
    result = run_quiver("serve", "--model-repository", str(tmp_path), "--http-port", "0")
    assert result.returncode == 1
    assert "bad_config/config.pbtxt" in result.stderr
    assert 'no field named "shape_of_things"' in result.stderr
    assert "--exit-on-error" in result.stderr


def test_exit_on_error_false_serves_the_models_that_loaded(tmp_path: Path) -> None:
    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    write_onnx(tmp_path, "bad_config", simple_onnx(), BROKEN_CONFIG)
    with QuiverServer(tmp_path, args=("--exit-on-error=false",)) as server:
        client = httpclient.InferenceServerClient(server.url)
        # --strict-readiness is true by default, as in Triton: a model failed, so not ready
        assert client.is_server_live() and not client.is_server_ready()
        assert client.is_model_ready("simple")
        assert not client.is_model_ready("bad_config")
        assert "UNAVAILABLE" in server.log and "shape_of_things" in server.log


def test_strict_model_config_refuses_a_model_without_config(tmp_path: Path) -> None:
    write_onnx(tmp_path, "autocomplete", simple_onnx(), None)
    result = run_quiver(
        "serve", "--model-repository", str(tmp_path), "--http-port", "0", "--strict-model-config=true"
    )
    assert result.returncode == 1
    assert "--strict-model-config" in result.stderr and "config.pbtxt does not exist" in result.stderr


def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    folder = write_python(tmp_path, "slow", SLOW_MODEL, SLOW_CONFIG)
    server = QuiverServer(tmp_path).start()
    results: dict[str, object] = {}

    def call() -> None:
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}).encode()
        req = urllib.request.Request(f"{server.http}/v2/models/slow/infer", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=30) as response:
            results["status"] = response.status
            results["body"] = json.loads(response.read())

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)  # the request is now executing
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    thread.join(30)
    assert server.wait(30) == 0, server.log
    assert results["status"] == 200
    body = results["body"]
    assert isinstance(body, dict)
    np.testing.assert_array_equal(body["outputs"][0]["data"], [2.0, 4.0])
    assert (folder / "finalized").read_text() == "done"


def test_sigint_stops_an_idle_server_with_exit_zero(tmp_path: Path) -> None:
    write_onnx(tmp_path, "simple", simple_onnx(), SIMPLE_CONFIG)
    server = QuiverServer(tmp_path).start()
    assert server.stop(signal.SIGINT) == 0, server.log
    assert "stopped" in server.log


# -- a start-up that fails part way closes what it opened, last first ---------------------------


def _free_ports(count: int) -> list[int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _serve_to_exit(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``quiver serve`` over a repository holding the ``slow`` Python model (which writes
    ``finalized`` when unloaded), with the temp folder in ``tmp_path/tmp``; waits for its exit."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.run(
        [sys.executable, "-m", "quiver", "serve", "--model-repository", str(tmp_path / "repo"), *flags],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("taken", ["http", "grpc", "sagemaker", "metrics"])
def test_a_taken_port_fails_start_up_and_closes_what_was_opened(tmp_path: Path, taken: str) -> None:
    write_python(tmp_path / "repo", "slow", SLOW_MODEL, SLOW_CONFIG)
    ports = dict(zip(("http", "grpc", "sagemaker", "metrics"), _free_ports(4), strict=True))
    with socket.create_server(("127.0.0.1", ports[taken])):
        result = _serve_to_exit(
            tmp_path,
            *(f"--{name}-port={port}" for name, port in ports.items()),
            "--allow-sagemaker=true",
        )
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{ports[taken]}" in result.stderr
    assert "Traceback" not in result.stderr and "started HTTP service" not in result.stderr
    # The models loaded before the listeners were unloaded (finalize ran) ...
    assert (tmp_path / "repo" / "slow" / "finalized").read_text() == "done"
    # ... every listener opened before the failure is closed again ...
    for name, port in ports.items():
        if name != taken:
            socket.create_server(("127.0.0.1", port)).close()
    # ... and nothing is left in the temp folder.
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_model_that_fails_to_load_closes_the_manager_before_any_listener_opens(tmp_path: Path) -> None:
    write_python(tmp_path / "repo", "slow", SLOW_MODEL, SLOW_CONFIG)
    write_onnx(tmp_path / "repo", "bad_config", simple_onnx(), BROKEN_CONFIG)
    http, metrics = _free_ports(2)
    result = _serve_to_exit(
        tmp_path, f"--http-port={http}", f"--metrics-port={metrics}", "--grpc-port=0", "--exit-on-error=true"
    )
    assert result.returncode == 1
    assert "1 model(s) failed to load and --exit-on-error is true" in result.stderr
    assert "started" not in result.stderr  # no listener opened
    assert (tmp_path / "repo" / "slow" / "finalized").read_text() == "done"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_an_unusable_log_file_dir_fails_before_anything_opens(tmp_path: Path) -> None:
    write_python(tmp_path / "repo", "slow", SLOW_MODEL, SLOW_CONFIG)
    (tmp_path / "afile").write_text("")
    result = _serve_to_exit(
        tmp_path, "--allow-log-file-api", f"--log-file-dir={tmp_path / 'afile'}", "--http-port=0", "--grpc-port=0",
        "--metrics-port=0",
    )  # fmt: skip
    assert result.returncode == 2 and "--log-file-dir" in result.stderr
    assert not (tmp_path / "repo" / "slow" / "finalized").exists()  # no model was loaded
    assert list((tmp_path / "tmp").iterdir()) == []


def test_an_unusable_log_file_fails_before_anything_opens(tmp_path: Path) -> None:
    write_python(tmp_path / "repo", "slow", SLOW_MODEL, SLOW_CONFIG)
    result = _serve_to_exit(
        tmp_path, f"--log-file={tmp_path / 'missing' / 'quiver.log'}", "--http-port=0", "--grpc-port=0",
        "--metrics-port=0",
    )  # fmt: skip
    assert result.returncode == 2 and "quiver: error:" in result.stderr, result.stderr
    assert not (tmp_path / "repo" / "slow" / "finalized").exists()
