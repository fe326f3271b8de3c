"""Prometheus metrics on --metrics-port: Triton's names and exact counts, against a real server."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from build_repository import SIMPLE_CONFIG, simple_onnx
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from support.models import write_onnx
from support.server import QuiverServer, run_quiver

#: Batch sizes of the successful requests, and how many malformed ones follow them.
BATCHES = (1, 2, 3, 1, 4)
REJECTED = 3

COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes",
    "nv_inference_count": "Number of inferences performed (does not include cached requests)",
    "nv_inference_exec_count": "Number of model executions performed (does not include cached requests)",
    "nv_inference_request_duration_us": (
        "Cumulative inference request duration in microseconds (includes cached requests)"
    ),
    "nv_inference_queue_duration_us": (
        "Cumulative inference queuing duration in microseconds (includes cached requests)"
    ),
    "nv_inference_compute_input_duration_us": (
        "Cumulative compute input duration in microseconds (does not include cached requests)"
    ),
    "nv_inference_compute_infer_duration_us": (
        "Cumulative compute inference duration in microseconds (does not include cached requests)"
    ),
    "nv_inference_compute_output_duration_us": (
        "Cumulative inference compute output duration in microseconds (does not include cached requests)"
    ),
}
GAUGES = {
    "nv_inference_pending_request_count": (
        "Instantaneous number of pending requests awaiting execution per-model."
    ),
    "nv_model_load_duration_secs": "Model load time in seconds",
    "nv_cpu_utilization": "CPU utilization rate [0.0 - 1.0]",
    "nv_cpu_memory_total_bytes": "CPU total memory (RAM), in bytes",
    "nv_cpu_memory_used_bytes": "CPU used memory (RAM), in bytes",
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("metrics_repo")
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[QuiverServer]:
    with QuiverServer(repository) as running:
        yield running
    assert running.process is not None and running.process.returncode == 0, running.log


def _inputs(rows: int, columns: int = 16) -> list[httpclient.InferInput]:
    data = np.arange(rows * columns, dtype=np.int32).reshape(rows, columns)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [rows, columns], "INT32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


@pytest.fixture(scope="module")
def traffic(server: QuiverServer) -> dict[str, Any]:
    """Known traffic, then one scrape and one statistics call, both after all of it."""
    client = httpclient.InferenceServerClient(server.url)
    for rows in BATCHES:
        result = client.infer("simple", _inputs(rows))
        assert result.as_numpy("OUTPUT0").shape == (rows, 16)
    for _ in range(REJECTED):
        with pytest.raises(InferenceServerException, match="shape"):
            client.infer("simple", _inputs(1, columns=15))  # wrong shape: REJECTED
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    stats = client.get_inference_statistics("simple")["model_stats"]
    client.close()
    return {"text": text, "content_type": content_type, "stats": stats}


def _families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    wanted = {"model": "simple", "version": "1", **labels} if family.startswith(("nv_inference", "nv_model", "quiver")) else labels
    matches = [
        s.value
        for s in families[family].samples
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in wanted.items())
    ]
    assert len(matches) == 1, (family, sample, labels, families[family].samples)
    return float(matches[0])


def test_counts_are_exact(traffic: dict[str, Any]) -> None:
    families = _families(traffic["text"])
    assert _value(families, "nv_inference_request_success") == len(BATCHES)
    assert _value(families, "nv_inference_request_failure", reason="REJECTED") == REJECTED
    for reason in ("BACKEND", "CANCELED", "OTHER"):
        assert _value(families, "nv_inference_request_failure", reason=reason) == 0
    assert _value(families, "nv_inference_count") == sum(BATCHES)  # batch rows
    assert _value(families, "nv_inference_exec_count") == len(BATCHES)  # rejected ones never ran
    assert _value(families, "nv_inference_request_duration_us") > 0
    assert _value(families, "nv_inference_compute_infer_duration_us") > 0
    for name in (
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_output_duration_us",
    ):
        assert _value(families, name) >= 0
    assert _value(families, "nv_inference_pending_request_count") == 0
    assert _value(families, "nv_model_load_duration_secs") > 0


def test_latency_histogram_counts_every_request(traffic: dict[str, Any]) -> None:
    families = _families(traffic["text"])
    name = "quiver_inference_request_duration_us"
    assert families[name].type == "histogram"
    total = len(BATCHES) + REJECTED
    assert _value(families, name, name + "_count") == total
    assert _value(families, name, name + "_bucket", le="+Inf") == total
    assert _value(families, name, name + "_sum") > 0


def test_cpu_gauges_and_no_gpu(traffic: dict[str, Any]) -> None:
    families = _families(traffic["text"])
    assert 0.0 <= _value(families, "nv_cpu_utilization") <= 1.0
    total = _value(families, "nv_cpu_memory_total_bytes")
    assert 0 < _value(families, "nv_cpu_memory_used_bytes") < total
    assert not any(name.startswith("nv_gpu_") for name in families)  # this machine has none


def test_statistics_api_agrees(traffic: dict[str, Any]) -> None:
    families = _families(traffic["text"])
    (stats,) = traffic["stats"]
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == _value(families, "nv_inference_request_success")
    assert inference["fail"]["count"] == _value(families, "nv_inference_request_failure", reason="REJECTED")
    assert stats["inference_count"] == _value(families, "nv_inference_count")
    assert stats["execution_count"] == _value(families, "nv_inference_exec_count")
    for name, field in (
        ("nv_inference_request_duration_us", "success"),
        ("nv_inference_queue_duration_us", "queue"),
        ("nv_inference_compute_input_duration_us", "compute_input"),
        ("nv_inference_compute_infer_duration_us", "compute_infer"),
        ("nv_inference_compute_output_duration_us", "compute_output"),
    ):
        assert int(inference[field]["ns"]) // 1000 == _value(families, name), name


def test_text_is_tritons(traffic: dict[str, Any]) -> None:
    text, lines = traffic["text"], traffic["text"].splitlines()
    assert traffic["content_type"].startswith("text/plain; version=0.0.4")
    for name, help_text in COUNTERS.items():
        assert f"# HELP {name} {help_text}" in lines
        assert f"# TYPE {name} counter" in lines
    for name, help_text in GAUGES.items():
        assert f"# HELP {name} {help_text}" in lines
        assert f"# TYPE {name} gauge" in lines
    assert not [line for line in lines if line.split("{")[0].endswith("_total")]
    assert "_total" not in text.replace("nv_cpu_memory_total_bytes", "")
    assert f'nv_inference_request_success{{model="simple",version="1"}} {len(BATCHES)}' in lines
    assert f'nv_inference_request_failure{{model="simple",reason="REJECTED",version="1"}} {REJECTED}' in lines
    assert f'nv_inference_count{{model="simple",version="1"}} {sum(BATCHES)}' in lines


def test_only_metrics_is_served(server: QuiverServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(server.metrics_url.replace("/metrics", "/v2/health/ready"), timeout=10)
    raised.value.close()
    assert raised.value.code == 404


def test_allow_metrics_false_opens_no_port(repository: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with QuiverServer(repository, args=("--allow-metrics=false", "--metrics-port", str(port))) as server:
        assert server.metrics_port == 0
        assert "Metrics service" not in server.log
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(RuntimeError, match="no metrics listener"):
            _ = server.metrics_url


def test_metrics_port_in_use_fails_start_up(repository: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_quiver(
            "serve", "--model-repository", str(repository), "--http-port", "0", "--grpc-port", "0",
            "--metrics-port", str(port),
        )
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port} for metrics" in result.stderr
