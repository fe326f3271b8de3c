"""``quiver sagemaker-serve`` started as the container starts it: single-model mode from the
model root (its checks and messages), the variables' behaviour on a running server, and
start-up failures that name the variable."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from test_sagemaker import call, invoke, outputs

from support.archives import pipeline_archive, single_archive
from support.sagemaker import EntrypointServer, run_entrypoint

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def extract(archive: bytes, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(into, filter="data")
    return into


def test_single_model_ensemble_by_default_model_name(tmp_path: Path) -> None:
    """/opt/ml/model holds an ensemble and its steps: SAGEMAKER_TRITON_DEFAULT_MODEL_NAME names
    the ensemble, which loads with its composing models; ping is 'ready'."""
    root = extract(pipeline_archive(5.0), tmp_path / "model")
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "pipe"}
    with EntrypointServer(root, tmp_path / "sm", env=env) as server:
        assert "--load-model=pipe" in server.log and "MME mode" not in server.log
        assert call(server.sagemaker_url, "GET", "/ping").status == 200
        np.testing.assert_array_equal(outputs(invoke(server.sagemaker_url, "/invocations", X))["OUT"], X + 105)


def test_single_model_with_one_folder_needs_no_name(tmp_path: Path) -> None:
    root = extract(single_archive(4.0, folder="only", name="only"), tmp_path / "model")
    with EntrypointServer(root, tmp_path / "sm") as server:
        assert "No SAGEMAKER_TRITON_DEFAULT_MODEL_NAME provided" in server.log
        assert "Starting with the only existing model directory only" in server.log
        reply = invoke(server.sagemaker_url, "/invocations", X, "INPUT0")
        np.testing.assert_array_equal(outputs(reply)["OUTPUT0"], X + 4)


def test_safe_port_range_picks_a_port_inside_it(tmp_path: Path) -> None:
    root = extract(single_archive(1.0, folder="only", name="only"), tmp_path / "model")
    env = {"SAGEMAKER_SAFE_PORT_RANGE": "23000-23200"}  # with SAGEMAKER_BIND_TO_PORT=0
    with EntrypointServer(root, tmp_path / "sm", env=env) as server:
        assert 23000 <= server.sagemaker_port <= 23200
        assert call(server.sagemaker_url, "GET", "/ping").status == 200


@pytest.mark.parametrize(
    ("layout", "env", "message"),
    [
        ((), {}, "ERROR: No model found in model repository"),
        (("a", "b"), {}, "ERROR: More than 1 model directory found in model repository."),
        (("a",), {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "c"}, "provided SAGEMAKER_TRITON_DEFAULT_MODEL_NAME c does not exist"),
        (("config.pbtxt",), {}, "Model directory needs to contain the top level folder"),
        (("a",), {"SAGEMAKER_TRITON_INFERENCE_TYPE": "incorrect_inference_type"}, "ERROR: Invalid SAGEMAKER_TRITON_INFERENCE_TYPE"),
        (("a",), {"SAGEMAKER_TRITON_THREAD_COUNT": "many"}, "SAGEMAKER_TRITON_THREAD_COUNT must be an integer"),
        (("a",), {"SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--model-memory-limit=lots"}, "SAGEMAKER_TRITON_ADDITIONAL_ARGS"),
    ],
)
def test_start_failures_say_why(tmp_path: Path, layout: tuple[str, ...], env: dict[str, str], message: str) -> None:
    root = tmp_path / "model"
    root.mkdir()
    for entry in layout:
        if entry.endswith(".pbtxt"):
            (root / entry).write_text('name: "m"')
        else:
            (root / entry).mkdir()
    result = run_entrypoint(root, tmp_path / "sm", env)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert "started SageMaker service" not in result.stderr


def test_print_command_shows_the_server_command(tmp_path: Path) -> None:
    result = run_entrypoint(tmp_path, tmp_path / "sm", {"SAGEMAKER_MULTI_MODEL": "true"}, "--print-command")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("quiver serve --allow-sagemaker=true --allow-http=false --model-control-mode=explicit")
    assert not (tmp_path / "sm").exists()  # deciding creates nothing


def test_verbose_logging_as_tritons_image_unless_turned_off(tmp_path: Path) -> None:
    root = extract(single_archive(1.0, folder="only", name="only"), tmp_path / "model")
    with EntrypointServer(root, tmp_path / "sm", env={"SAGEMAKER_TRITON_LOG_VERBOSE": "true"}) as server:
        invoke(server.sagemaker_url, "/invocations", X, "INPUT0")
        assert "--log-verbose=true" in server.log
        deadline = time.monotonic() + 10  # the log is read on a thread of the test's
        wanted = " D quiver.frontends.sagemaker] SageMaker POST /invocations: 200"
        while not any(wanted in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.05)  # (not any debug line: the heap's comes at start, before it)
        assert any(wanted in line for line in server.lines), server.log
    with EntrypointServer(root, tmp_path / "sm", env={"SAGEMAKER_TRITON_LOG_VERBOSE": "false"}) as quiet:
        invoke(quiet.sagemaker_url, "/invocations", X, "INPUT0")
        time.sleep(0.5)
        assert not any(" D quiver" in line for line in quiet.lines), quiet.log

