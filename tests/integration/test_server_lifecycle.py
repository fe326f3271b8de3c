"""Start-up and shutdown as an operator sees them: flags, exit codes, draining."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
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
        assert client.is_server_ready()
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
