"""Prometheus metrics with Triton's names, labels, types and HELP texts.

:class:`TritonCollector` is a ``prometheus_client`` collector: at scrape time it reads the
per model-version :class:`~quiver.metrics.statistics.ModelStatistics` (nothing is recorded
for it on the request path) and the machine's CPU, memory and, with NVML, GPU gauges.
:func:`render` writes a registry in the text format exactly as Triton's ``/metrics`` shows
it: counters keep their names (``nv_inference_request_success``, with ``# TYPE ... counter``,
where ``prometheus_client``'s own exposition would append ``_total``), labels are sorted by
name, and values are written in their shortest form (``5``, not ``5.0``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from quiver.metrics.cache import CacheView, cache_metrics
from quiver.metrics.model_families import (
    ModelLike,
    TextFamily,
    escape,
    format_value,
    model_families,
)
from quiver.metrics.statistics import (
    Histogram,
    MultiModelStatistics,
)

logger = logging.getLogger(__name__)

#: ``Content-Type`` of the classic Prometheus text format, the one Triton serves.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

class TritonCollector(Collector):
    """Triton's per model-version metrics and machine gauges, read when scraped.

    ``models`` returns the versions being served (``manager.ready_models``). The CPU, memory
    and GPU gauges are read at most once per ``interval_ms`` (Triton's
    ``--metrics-interval-ms``); a scrape sooner gets the previous reading, and
    ``nv_cpu_utilization`` is the machine's CPU use between two readings, as Triton's
    polling thread measures it. Per model-version counters are always current.
    """

    def __init__(
        self,
        models: Callable[[], Iterable[ModelLike]],
        *,
        multi_model: Callable[[], MultiModelView | None] | None = None,
        cpu: bool = True,
        gpu: bool = True,
        interval_ms: int = 2000,
        clock: Callable[[], float] = time.monotonic,
        response_cache: CacheView | None = None,
    ) -> None:
        self._models = models
        self._response_cache = response_cache
        self._multi_model = multi_model
        self._interval = max(interval_ms, 0) / 1000
        self._clock = clock
        self._read_at: float | None = None
        self._gauges: list[Metric] = []
        self._cpu = _CpuReader() if cpu else None
        self._gpu = _GpuReader.open() if gpu else None

    def describe(self) -> Iterable[Metric]:
        return []  # nothing to check at registration: collect() only runs when scraped

    def collect(self) -> Iterator[Metric]:
        models = sorted(self._models(), key=lambda m: (m.name, int(m.version_str)))
        yield from model_families(models)
        yield from cache_metrics(models, self._response_cache)
        view = self._multi_model() if self._multi_model is not None else None
        if view is not None:
            yield from _multi_model_metrics(view)
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self._interval:
            self._read_at = now
            self._gauges = []
            if self._cpu is not None:
                self._gauges += self._cpu.read()
            if self._gpu is not None:
                self._gauges += self._gpu.read()
        yield from self._gauges

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None


@dataclass(frozen=True, slots=True)
class MultiModelView:
    """What the multi-model metrics read: the server-wide counters, the resident bytes of
    each loaded model, the memory budget (used, limit; 0, 0 without one), and the disk
    cache's hits, misses, stale hits, hits checked later, outdated copies, damaged entries and
    bytes (zeros before it is used)."""

    stats: MultiModelStatistics
    resident: dict[str, int]
    memory_used: int
    memory_limit: int
    disk_cache_hits: int = 0
    disk_cache_misses: int = 0
    disk_cache_stale_hits: int = 0
    disk_cache_checked_later: int = 0
    disk_cache_outdated: int = 0
    disk_cache_damaged: int = 0
    disk_cache_used: int = 0
    disk_cache_size: int = 0
    memory_reserved: int = 0
    framework_bytes: dict[str, int] = field(default_factory=dict)


def _histogram(name: str, help_text: str, histogram: Histogram) -> Metric:
    family = HistogramMetricFamily(name, help_text)
    bounds = [format_value(b) for b in histogram.bounds] + ["+Inf"]
    cumulative, buckets = 0, []
    for bound, count in zip(bounds, histogram.buckets, strict=True):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    family.add_metric([], buckets, histogram.total)
    return family


def _multi_model_metrics(view: MultiModelView) -> Iterator[Metric]:
    """SageMaker's multi-model endpoint metrics, in Prometheus style (``quiver_`` names)."""
    stats = view.stats
    yield GaugeMetricFamily(
        "quiver_loaded_model_count", "Models loaded now", value=len(view.resident)
    )
    yield _histogram(
        "quiver_model_loading_wait_time_us",
        "How long requests waited for their model to load, in microseconds",
        stats.loading_wait_time_us,
    )
    yield _histogram(
        "quiver_model_loading_time_us", "Model load time in microseconds", stats.loading_time_us
    )
    yield _histogram(
        "quiver_model_unloading_time_us",
        "Model unload time in microseconds",
        stats.unloading_time_us,
    )
    yield _histogram(
        "quiver_model_downloading_time_us",
        "Model download time into the disk cache in microseconds",
        stats.downloading_time_us,
    )
    yield _histogram(
        "quiver_model_eviction_age_seconds",
        "Seconds a model had been loaded when it was evicted",
        stats.eviction_age_s,
    )
    for name, help_text, value in (
        ("quiver_model_cache_hit", "Requests whose model was loaded already", stats.cache_hits),
        (
            "quiver_model_cache_miss",
            "Requests that had to wait for their model to load",
            stats.cache_misses,
        ),
        ("quiver_model_evictions", "Models unloaded to make room for others", stats.evictions),
        ("quiver_model_load_failures", "Model loads that failed", stats.load_failures),
        (
            "quiver_disk_cache_hit",
            "Model fetches the disk cache answered without a download",
            view.disk_cache_hits,
        ),
        ("quiver_disk_cache_miss", "Model fetches that downloaded", view.disk_cache_misses),
        (
            "quiver_disk_cache_stale_hit",
            "Model fetches answered from the disk cache because the store was down or slow",
            view.disk_cache_stale_hits,
        ),
        (
            "quiver_disk_cache_checked_later",
            "Model fetches answered from the disk cache at once, the store asked in the background "
            "(--model-cache-revalidate=background)",
            view.disk_cache_checked_later,
        ),
        (
            "quiver_disk_cache_outdated",
            "Background checks that found a new version in the store (or the key gone), fetched by the next load",
            view.disk_cache_outdated,
        ),
        (
            "quiver_disk_cache_damaged",
            "Disk cache entries found changed or incomplete on disk, dropped and fetched again",
            view.disk_cache_damaged,
        ),
    ):
        yield CounterMetricFamily(name, help_text, value=value)  # exposed as NAME_total
    resident = GaugeMetricFamily(
        "quiver_model_resident_bytes",
        "Host memory a loaded model takes, as measured",
        labels=["model"],
    )
    for name, size in sorted(view.resident.items()):
        resident.add_metric([name], size)
    yield resident
    yield GaugeMetricFamily(
        "quiver_model_memory_used_bytes",
        "Bytes of the model memory budget in use",
        value=view.memory_used,
    )
    yield GaugeMetricFamily(
        "quiver_model_memory_limit_bytes",
        "The model memory budget (--model-memory-limit)",
        value=view.memory_limit,
    )
    yield GaugeMetricFamily(
        "quiver_model_memory_reserved_bytes",
        "Bytes of the model memory budget reserved by loads under way (part of the used bytes)",
        value=view.memory_reserved,
    )
    frameworks = GaugeMetricFamily(
        "quiver_model_framework_bytes",
        "Host memory a framework took once for the process (import, first session), "
        "outside the model memory budget",
        labels=["framework"],
    )
    for framework, size in sorted(view.framework_bytes.items()):
        frameworks.add_metric([framework], size)
    yield frameworks
    yield GaugeMetricFamily(
        "quiver_disk_cache_used_bytes",
        "Bytes of the model disk cache in use (extracted models and downloads in flight)",
        value=view.disk_cache_used,
    )
    yield GaugeMetricFamily(
        "quiver_disk_cache_size_bytes",
        "The model disk cache size (--model-cache-size)",
        value=view.disk_cache_size,
    )


class _CpuReader:
    """The machine's CPU use and memory, as Triton reads ``/proc/stat`` and ``/proc/meminfo``."""

    def __init__(self) -> None:
        self._previous = self._times()

    @staticmethod
    def _times() -> tuple[float, float]:
        """(busy, total) seconds of every CPU; idle counts iowait, as Triton's."""
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        total = t.user + t.system + t.idle
        total += sum(getattr(t, f, 0.0) for f in ("nice", "iowait", "irq", "softirq", "steal"))
        return total - idle, total

    def read(self) -> list[Metric]:
        busy, total = self._times()
        busy_before, total_before = self._previous
        self._previous = (busy, total)
        elapsed = total - total_before
        utilization = min(max((busy - busy_before) / elapsed, 0.0), 1.0) if elapsed > 0 else 0.0
        memory = psutil.virtual_memory()
        return [
            GaugeMetricFamily(
                "nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", utilization
            ),
            GaugeMetricFamily(
                "nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", memory.total
            ),
            GaugeMetricFamily(
                "nv_cpu_memory_used_bytes",
                "CPU used memory (RAM), in bytes",
                memory.total - memory.available,
            ),
        ]


class _GpuReader:
    """NVML's view of every GPU, labelled by ``gpu_uuid`` as Triton's DCGM metrics are."""

    def __init__(self, nvml: Any, devices: list[tuple[str, Any]]) -> None:
        self._nvml = nvml
        self._devices = devices

    @classmethod
    def open(cls) -> _GpuReader | None:
        """The reader, or None (with one INFO line saying why) when there is no GPU to read."""
        try:
            import pynvml
        except ImportError:
            logger.info("GPU metrics off: pynvml is not installed (pip install 'quiver[gpu]')")
            return None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # no driver: NVMLError_LibraryNotFound, DriverNotLoaded, ...
            logger.info("GPU metrics off: NVML is not available (%s)", exc)
            return None
        devices = []
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                devices.append((uuid.decode() if isinstance(uuid, bytes) else str(uuid), handle))
        except Exception as exc:
            logger.info("GPU metrics off: NVML could not list the GPUs (%s)", exc)
            _quietly(pynvml.nvmlShutdown)
            return None
        if not devices:
            logger.info("GPU metrics off: NVML found no GPU")
            _quietly(pynvml.nvmlShutdown)
            return None
        logger.info("GPU metrics on for %d GPU(s)", len(devices))
        return cls(pynvml, devices)

    def read(self) -> list[Metric]:
        nvml = self._nvml
        labels = ["gpu_uuid"]
        utilization = GaugeMetricFamily(
            "nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=labels
        )
        memory_total = GaugeMetricFamily(
            "nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=labels
        )
        memory_used = GaugeMetricFamily(
            "nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=labels
        )
        power = GaugeMetricFamily("nv_gpu_power_usage", "GPU power usage in watts", labels=labels)
        for uuid, handle in self._devices:
            rates = _quietly(nvml.nvmlDeviceGetUtilizationRates, handle)
            if rates is not None:
                utilization.add_metric([uuid], rates.gpu / 100)
            memory = _quietly(nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                memory_total.add_metric([uuid], memory.total)
                memory_used.add_metric([uuid], memory.used)
            milliwatts = _quietly(nvml.nvmlDeviceGetPowerUsage, handle)
            if milliwatts is not None:
                power.add_metric([uuid], milliwatts / 1000)
        return [utilization, memory_total, memory_used, power]

    def close(self) -> None:
        _quietly(self._nvml.nvmlShutdown)


def _quietly(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None when NVML fails (a GPU that does not support a reading)."""
    try:
        return call(*args)
    except Exception:
        logger.debug("NVML call %s failed", getattr(call, "__name__", call), exc_info=True)
        return None


# -- exposition -----------------------------------------------------------------------


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    # Sorted by name, as prometheus-cpp's label map; a histogram's ``le`` comes last.
    names = sorted(k for k in labels if k != "le") + (["le"] if "le" in labels else [])
    return "{" + ",".join(f'{k}="{escape(labels[k])}"' for k in names) + "}"


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format as Triton writes it.

    Triton's counters (``nv_*``) are named as their family with no ``_total`` (``prometheus_client``'s
    ``generate_latest`` would write ``nv_inference_request_success_total`` in both the
    ``# TYPE`` line and the samples, which Triton's dashboards do not query); ``_created``
    samples are left out, as Triton has none.
    """
    out: list[str] = []
    for family in registry.collect():
        name = family.name
        help_text = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        kind = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}.get(
            family.type, family.type
        )
        header = f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"
        if isinstance(family, TextFamily):  # the per model-version families, written fast
            out.append(family.text(header))
            continue
        out.append(header)
        for sample in family.samples:
            sample_name = sample.name
            if family.type == "counter":
                if sample_name == name + "_created":
                    continue
                if sample_name == name + "_total" and name.startswith("nv_"):
                    sample_name = name  # Triton's names; Quiver's own keep Prometheus' _total
            out.append(f"{sample_name}{_labels(sample.labels)} {format_value(sample.value)}\n")
    return "".join(out).encode()
