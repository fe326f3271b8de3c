"""CloudWatch publishing from the SageMaker container (SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH):
embedded-metric-format events arrive in a real CloudWatch Logs-compatible server (moto's server
mode) with the Triton-named and multi-model metrics in the namespace asked for; CloudWatch
unreachable or refusing leaves inference untouched and the server stops cleanly."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_sagemaker import invoke, outputs
from test_sagemaker_platform import Platform, X

from support.archives import single_archive
from support.sagemaker import EntrypointServer

pytest.importorskip("moto", reason="moto[server] (quiver[test]) is the CloudWatch Logs of these tests")
boto3 = pytest.importorskip("boto3")
from moto.server import ThreadedMotoServer  # noqa: E402

GROUP = "/aws/SageMaker/Endpoints/TritonMetrics/QuiverTest"
NAMESPACE = "/aws/SageMaker/Endpoints/TritonMetrics/QuiverTestNamespace"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def publishing_env(endpoint: str) -> dict[str, str]:
    return {
        "SAGEMAKER_MULTI_MODEL": "true",
        "SAGEMAKER_TRITON_ALLOW_METRICS": "true",
        "SAGEMAKER_TRITON_METRICS_PORT": "0",
        "SAGEMAKER_TRITON_PUBLISH_METRICS_TO_CLOUDWATCH": "true",
        "SAGEMAKER_TRITON_CLOUDWATCH_LOG_GROUP": GROUP,
        "SAGEMAKER_TRITON_CLOUDWATCH_METRIC_NAMESPACE": NAMESPACE,
        "SAGEMAKER_TRITON_ADDITIONAL_ARGS": "--cloudwatch-interval=0.5",
        "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": endpoint,
        **CREDENTIALS,
    }


@pytest.fixture
def moto_logs() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def events(endpoint: str) -> list[dict[str, Any]]:
    client = boto3.client(
        "logs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        found = client.filter_log_events(logGroupName=GROUP)["events"]
    except client.exceptions.ResourceNotFoundException:
        return []
    return [json.loads(e["message"]) for e in found]


def successes(found: list[dict[str, Any]], model: str) -> float:
    return sum(e.get("nv_inference_request_success", 0) for e in found if e.get("model") == model)


def test_metrics_arrive_as_embedded_metric_format_events(moto_logs: str, tmp_path: Path) -> None:
    with EntrypointServer(tmp_path / "unused", tmp_path / "sm", env=publishing_env(moto_logs)) as server:
        platform = Platform(server, tmp_path / "models")
        name, reply = platform.load("m.tar.gz", single_archive(2.0, folder="m", name="m"))
        assert reply.status == 200, reply.body
        for _ in range(3):
            np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + 2)
        deadline = time.monotonic() + 30
        found: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            found = events(moto_logs)
            if successes(found, name) >= 3:
                break
            time.sleep(0.3)
        assert successes(found, name) == 3, found  # counters are sent as increases: they add up
        assert server.stop() == 0
        assert "publishing metrics to CloudWatch every 0.5 s" in server.log
        assert f"publishing metrics to CloudWatch log group '{GROUP}' failed" not in server.log
    model_event = next(e for e in found if e.get("model") == name and "nv_inference_request_success" in e)
    directive = model_event["_aws"]["CloudWatchMetrics"][0]
    assert directive["Namespace"] == NAMESPACE
    assert directive["Dimensions"] == [["model", "version"]]
    assert model_event["version"] == "1"
    metric_names = {m["Name"] for m in directive["Metrics"]}
    assert {"nv_inference_request_success", "nv_inference_count", "nv_inference_request_duration_us"} <= metric_names
    units = {m["Name"]: m["Unit"] for m in directive["Metrics"]}
    assert units["nv_inference_request_duration_us"] == "Microseconds" and units["nv_inference_count"] == "Count"
    assert isinstance(model_event["_aws"]["Timestamp"], int)
    # the multi-model metrics, without dimensions
    plain = [e for e in found if "quiver_loaded_model_count" in e]
    assert plain and plain[-1]["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [[]]
    assert max(e["quiver_loaded_model_count"] for e in plain) == 1


def test_cloudwatch_unreachable_does_not_touch_inference(tmp_path: Path) -> None:
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    with EntrypointServer(tmp_path / "unused", tmp_path / "sm", env=publishing_env(closed)) as server:
        platform = Platform(server, tmp_path / "models")
        name, reply = platform.load("m.tar.gz", single_archive(2.0, folder="m", name="m"))
        assert reply.status == 200
        deadline = time.monotonic() + 30
        while "publishing metrics to CloudWatch log group" not in server.log and time.monotonic() < deadline:
            np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + 2)
            time.sleep(0.2)
        assert f"publishing metrics to CloudWatch log group '{GROUP}' failed" in server.log
        np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + 2)
        started = time.monotonic()
        assert server.stop(timeout=60) == 0
        assert time.monotonic() - started < 45  # a clean stop, not a hang on CloudWatch
        assert "stopped" in server.log


class _Refusing(http.server.BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self) -> None:
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"__type": "ServiceUnavailableException", "message": "try later"}'
        self.send_response(503)
        self.send_header("Content-Type", "application/x-amz-json-1.1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_cloudwatch_refusing_is_retried_logged_and_not_fatal(tmp_path: Path) -> None:
    refusing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=refusing.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{refusing.server_address[1]}"
        with EntrypointServer(tmp_path / "unused", tmp_path / "sm", env=publishing_env(endpoint)) as server:
            platform = Platform(server, tmp_path / "models")
            name, reply = platform.load("m.tar.gz", single_archive(2.0, folder="m", name="m"))
            assert reply.status == 200
            deadline = time.monotonic() + 30
            while _Refusing.calls < 4 and time.monotonic() < deadline:
                outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))
                time.sleep(0.2)
            assert _Refusing.calls >= 4  # rounds go on, each one tried again
            assert server.stop(timeout=60) == 0  # then every line of the log has been read
            assert "try later" in server.log and "inference is not affected" in server.log
            assert server.log.count(f"publishing metrics to CloudWatch log group '{GROUP}' failed") == 1  # once per streak
    finally:
        refusing.shutdown()
        refusing.server_close()


def test_a_hanging_cloudwatch_never_holds_a_request(tmp_path: Path) -> None:
    """CloudWatch accepts the connection and never answers: the publisher's thread waits, the
    requests do not, and the server still stops in time."""
    hanging = socket.socket()
    hanging.bind(("127.0.0.1", 0))
    hanging.listen(64)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        hanging.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(hanging.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{hanging.getsockname()[1]}"
        with EntrypointServer(tmp_path / "unused", tmp_path / "sm", env=publishing_env(endpoint)) as server:
            platform = Platform(server, tmp_path / "models")
            name, reply = platform.load("m.tar.gz", single_archive(2.0, folder="m", name="m"))
            assert reply.status == 200
            deadline = time.monotonic() + 6
            slowest = 0.0
            while time.monotonic() < deadline or not held:
                started = time.monotonic()
                np.testing.assert_array_equal(outputs(invoke(platform.base, f"/models/{name}/invoke", X, "INPUT0"))["OUTPUT0"], X + 2)
                slowest = max(slowest, time.monotonic() - started)
                assert time.monotonic() < deadline + 30, "the publisher never connected"
            assert held  # a publication is under way, hanging
            assert slowest < 5.0, slowest  # none waited for it (a held call lasts 10 s)
            started = time.monotonic()
            assert server.stop(timeout=60) == 0
            assert time.monotonic() - started < 25  # the call under way ends at its 10 s read timeout
    finally:
        done.set()
        thread.join(5)
        for conn in held:
            conn.close()
        hanging.close()
