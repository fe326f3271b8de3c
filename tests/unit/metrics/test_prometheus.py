"""The collector and Triton's text exposition, without a server."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from quiver.metrics.prometheus import TritonCollector, format_value, render
from quiver.metrics.statistics import ModelStatistics


@dataclass
class FakeModel:
    name: str
    version: int
    stats: ModelStatistics = field(default_factory=ModelStatistics)
    load_seconds: float = 0.25

    @property
    def version_str(self) -> str:
        return str(self.version)


def _simple() -> FakeModel:
    model = FakeModel("simple", 1)
    stats = model.stats
    stats.record_execution(2, 3_000, 40_000, 5_000)
    stats.record_success(90_000, 2_000, 3_000, 40_000, 5_000, rows=2)
    stats.record_execution(1, 1_000, 20_000, 1_000)
    stats.record_success(30_500, 1_500, 1_000, 20_000, 1_000, rows=1)
    stats.record_failure(0, "REJECTED")
    stats.record_failure(700_000, "BACKEND")
    return model


def _registry(*models: FakeModel, **options: Any) -> tuple[CollectorRegistry, TritonCollector]:
    options = {"cpu": False, "gpu": False, **options}
    collector = TritonCollector(lambda: list(models), **options)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry, collector


#: Triton's own /metrics text for these families (HELP, TYPE, label order, value form),
#: with this test's values.
TRITON_TEXT = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="simple",version="1"} 2
# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="simple",reason="REJECTED",version="1"} 1
nv_inference_request_failure{model="simple",reason="CANCELED",version="1"} 0
nv_inference_request_failure{model="simple",reason="BACKEND",version="1"} 1
nv_inference_request_failure{model="simple",reason="OTHER",version="1"} 0
# HELP nv_inference_count Number of inferences performed (does not include cached requests)
# TYPE nv_inference_count counter
nv_inference_count{model="simple",version="1"} 3
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="simple",version="1"} 2
# HELP nv_inference_request_duration_us Cumulative inference request duration in microseconds (includes cached requests)
# TYPE nv_inference_request_duration_us counter
nv_inference_request_duration_us{model="simple",version="1"} 120
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds (includes cached requests)
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="simple",version="1"} 3
# HELP nv_inference_compute_input_duration_us Cumulative compute input duration in microseconds (does not include cached requests)
# TYPE nv_inference_compute_input_duration_us counter
nv_inference_compute_input_duration_us{model="simple",version="1"} 4
# HELP nv_inference_compute_infer_duration_us Cumulative compute inference duration in microseconds (does not include cached requests)
# TYPE nv_inference_compute_infer_duration_us counter
nv_inference_compute_infer_duration_us{model="simple",version="1"} 60
# HELP nv_inference_compute_output_duration_us Cumulative inference compute output duration in microseconds (does not include cached requests)
# TYPE nv_inference_compute_output_duration_us counter
nv_inference_compute_output_duration_us{model="simple",version="1"} 6
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="simple",version="1"} 0
# HELP nv_model_load_duration_secs Model load time in seconds
# TYPE nv_model_load_duration_secs gauge
nv_model_load_duration_secs{model="simple",version="1"} 0.25
"""


def test_text_is_tritons_byte_for_byte() -> None:
    registry, _ = _registry(_simple())
    text = render(registry).decode()
    assert text.startswith(TRITON_TEXT)
    assert "_total" not in text and "_created" not in text


def test_prometheus_client_alone_would_rename_the_counters() -> None:
    """Why render() exists: generate_latest writes Triton's counters with ``_total``."""
    registry, _ = _registry(_simple())
    assert b"# TYPE nv_inference_request_success_total counter" in generate_latest(registry)
    assert b"# TYPE nv_inference_request_success counter" in render(registry)


def test_latency_histogram() -> None:
    registry, _ = _registry(_simple())
    text = render(registry).decode()
    assert "# TYPE quiver_inference_request_duration_us histogram\n" in text
    assert 'quiver_inference_request_duration_us_bucket{model="simple",version="1",le="100"} 3\n' in text
    assert 'quiver_inference_request_duration_us_bucket{model="simple",version="1",le="500"} 3\n' in text
    assert 'quiver_inference_request_duration_us_bucket{model="simple",version="1",le="1000"} 4\n' in text
    assert 'quiver_inference_request_duration_us_bucket{model="simple",version="1",le="+Inf"} 4\n' in text
    assert 'quiver_inference_request_duration_us_count{model="simple",version="1"} 4\n' in text
    assert 'quiver_inference_request_duration_us_sum{model="simple",version="1"} 820.5\n' in text


def test_parses_as_prometheus_text() -> None:
    registry, _ = _registry(_simple(), FakeModel("other", 3))
    families = {f.name: f for f in text_string_to_metric_families(render(registry).decode())}
    success = families["nv_inference_request_success"]
    assert success.type == "counter"
    values = {s.labels["model"]: s.value for s in success.samples}
    assert values == {"simple": 2, "other": 0}
    assert families["quiver_inference_request_duration_us"].type == "histogram"


def test_versions_are_separate_series_in_order() -> None:
    registry, _ = _registry(FakeModel("m", 10), FakeModel("m", 2), FakeModel("a", 1))
    lines = [line for line in render(registry).decode().splitlines() if line.startswith("nv_inference_count")]
    assert lines == [
        'nv_inference_count{model="a",version="1"} 0',
        'nv_inference_count{model="m",version="2"} 0',
        'nv_inference_count{model="m",version="10"} 0',
    ]


def test_label_values_are_escaped() -> None:
    registry, _ = _registry(FakeModel('we"ird\\name', 1))
    assert b'nv_inference_count{model="we\\"ird\\\\name",version="1"} 0' in render(registry)


@pytest.mark.parametrize(
    ("value", "text"),
    [(5, "5"), (5.0, "5"), (0.25, "0.25"), (16101933056.0, "16101933056"), (float("inf"), "+Inf"), (-1.5, "-1.5")],
)
def test_values_in_shortest_form(value: float, text: str) -> None:
    assert format_value(value) == text


def test_cpu_gauges_are_read_at_most_once_per_interval() -> None:
    now = [100.0]
    registry, _ = _registry(cpu=True, interval_ms=2000, clock=lambda: now[0])
    families = {f.name: f for f in registry.collect()}
    utilization = families["nv_cpu_utilization"].samples[0].value
    total = families["nv_cpu_memory_total_bytes"].samples[0].value
    used = families["nv_cpu_memory_used_bytes"].samples[0].value
    assert 0.0 <= utilization <= 1.0
    assert 0 < used < total
    first = families["nv_cpu_memory_used_bytes"]
    now[0] += 1.0
    assert {f.name: f for f in registry.collect()}["nv_cpu_memory_used_bytes"] is first
    now[0] += 1.0
    assert {f.name: f for f in registry.collect()}["nv_cpu_memory_used_bytes"] is not first
    text = render(registry).decode()
    assert "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]\n# TYPE nv_cpu_utilization gauge\n" in text
    assert "# HELP nv_cpu_memory_total_bytes CPU total memory (RAM), in bytes\n" in text
    assert "# HELP nv_cpu_memory_used_bytes CPU used memory (RAM), in bytes\n" in text


def test_no_cpu_gauges_when_off() -> None:
    registry, _ = _registry(_simple(), cpu=False)
    assert b"nv_cpu_" not in render(registry)


# -- GPU, through a stand-in for pynvml --------------------------------------------------


class _NVMLError(Exception):
    pass


def _fake_pynvml(gpus: int, fail_init: bool = False) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if fail_init:
            raise _NVMLError("NVML Shared Library Not Found")

    module.NVMLError = _NVMLError  # type: ignore[attr-defined]
    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: gpus  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + h, memory=1)  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=16 << 30, used=(1 + h) << 30, free=0)  # type: ignore[attr-defined]

    def power(handle: int) -> int:
        if handle == 1:
            raise _NVMLError("Not Supported")
        return 61_250

    module.nvmlDeviceGetPowerUsage = power  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


def test_gpu_gauges_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_pynvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    registry, collector = _registry(gpu=True)
    text = render(registry).decode()
    uuid0 = 'gpu_uuid="GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"'
    uuid1 = 'gpu_uuid="GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"'
    assert "# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)\n# TYPE nv_gpu_utilization gauge\n" in text
    assert f"nv_gpu_utilization{{{uuid0}}} 0.4\n" in text
    assert f"nv_gpu_utilization{{{uuid1}}} 0.41\n" in text
    assert "# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes\n" in text
    assert f"nv_gpu_memory_total_bytes{{{uuid0}}} 17179869184\n" in text
    assert "# HELP nv_gpu_memory_used_bytes GPU used memory, in bytes\n" in text
    assert f"nv_gpu_memory_used_bytes{{{uuid1}}} 2147483648\n" in text
    assert "# HELP nv_gpu_power_usage GPU power usage in watts\n# TYPE nv_gpu_power_usage gauge\n" in text
    assert f"nv_gpu_power_usage{{{uuid0}}} 61.25\n" in text
    assert f"nv_gpu_power_usage{{{uuid1}}}" not in text  # NVML could not say: left out
    collector.close()
    assert fake.calls == ["init", "shutdown"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (None, "pynvml is not installed"),
        (_fake_pynvml(gpus=0, fail_init=True), "NVML is not available"),
        (_fake_pynvml(gpus=0), "NVML found no GPU"),
    ],
)
def test_no_gpu_is_one_info_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fake: types.ModuleType | None, reason: str
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # None: the import fails
    with caplog.at_level(logging.INFO, logger="quiver.metrics.prometheus"):
        registry, collector = _registry(_simple(), gpu=True)
        text = render(registry)
        collector.close()
    assert b"nv_gpu_" not in text
    records = [r for r in caplog.records if r.name == "quiver.metrics.prometheus"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert reason in records[0].getMessage()


class _Plain:
    """The collector's families re-made as plain ``prometheus_client`` metrics from their
    samples, so ``render`` writes them by its generic path."""

    def __init__(self, collector: TritonCollector) -> None:
        self._collector = collector

    def collect(self) -> Any:
        from prometheus_client.metrics_core import Metric

        for family in self._collector.collect():
            plain = Metric(family.name, family.documentation, family.type)
            plain.samples = list(family.samples)
            yield plain


def test_per_model_families_written_fast_as_the_generic_path_writes_them() -> None:
    odd = FakeModel('we"ird\\name\nx', 3, load_seconds=1.5e-3)
    odd.stats.record_failure(1_000, "TIMEOUT")  # a reason beyond Triton's four
    worker = FakeModel("worker", 2)
    worker.process_memory_bytes = lambda: 123_456_789  # type: ignore[attr-defined]
    models = [_simple(), odd, worker, FakeModel("idle", 1, load_seconds=0.0)]
    registry, collector = _registry(*models)
    fast = render(registry)
    generic = CollectorRegistry(auto_describe=False)
    generic.register(_Plain(collector))  # type: ignore[arg-type]
    assert render(generic) == fast
    assert b'model="we\\"ird\\\\name\\nx"' in fast and b'reason="TIMEOUT"' in fast
    assert b'quiver_model_process_memory_bytes{model="worker",version="2"} 123456789' in fast
    # prometheus_client's own exposition still reads the families' samples
    assert b'nv_inference_request_success_total{model="simple",version="1"} 2.0' in generate_latest(registry)
