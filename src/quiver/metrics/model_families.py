"""Triton's per model-version metric families, written straight to exposition text.

A multi-model endpoint serves hundreds of model versions, and each has about 40 samples
(counters, gauges, a latency histogram). Built as ``prometheus_client`` samples (a named
tuple and a label dict per value, the labels sorted and escaped per sample), a scrape with 300
models loaded made 12,000 of them and took about 30 ms, on the event loop that serves every
request. A :class:`TextFamily` keeps one row per value instead, with each model version's
label text escaped once per scrape, and :func:`quiver.metrics.prometheus.render` copies its
text; its ``samples`` are still there, built when read, for ``prometheus_client``'s own
readers (``generate_latest``, tests). The text is exactly what the generic path writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from quiver.metrics.statistics import LATENCY_BUCKETS_US, ModelStatistics

__all__ = ["FAIL_REASONS", "ModelLike", "TextFamily", "escape", "format_value", "model_families"]

#: Triton's ``reason`` label values of ``nv_inference_request_failure``; every one is
#: reported for every model version, zero or not, as Triton does.
FAIL_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")

# (name, HELP, the statistic it reads), in Triton's order. HELP texts are Triton's.
COUNTERS: tuple[tuple[str, str, Callable[[ModelStatistics], int]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: s.success.ns // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
        lambda s: s.compute_output.ns // 1000,
    ),
)


class ModelLike(Protocol):
    """What the collector reads of a served model version (``lifecycle.Model`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def version_str(self) -> str: ...

    @property
    def stats(self) -> ModelStatistics: ...

    @property
    def load_seconds(self) -> float: ...


def format_value(value: float) -> str:
    """A sample value in its shortest form, as Triton's prometheus-cpp writes it: ``5``,
    ``0.25``, ``+Inf``."""
    if type(value) is int:
        return str(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


#: One value: its sample name as written, the label text inside the braces (sorted by name,
#: escaped; ``le`` last), the labels (for ``samples``) and the value.
Row = tuple[str, str, tuple[tuple[str, str], ...], float]


class TextFamily(Metric):
    """A metric family kept as rows, written to text without a sample object per value.

    ``name``, ``documentation`` and ``type`` are ``prometheus_client``'s; ``rows`` carry the
    sample names as ``prometheus_client`` names them (a counter's end in ``_total``)."""

    def __init__(self, name: str, documentation: str, typ: str, rows: list[Row]) -> None:
        super().__init__(name, documentation, typ)
        self.rows = rows

    @property
    def samples(self) -> list[Sample]:
        return [Sample(sample, dict(labels), value, None, None) for sample, _, labels, value in self.rows]

    @samples.setter
    def samples(self, value: list[Sample]) -> None:  # Metric.__init__ sets an empty list
        if value:
            raise AttributeError("a TextFamily's samples are its rows")

    def text(self, header: str) -> str:
        """``header`` (the HELP and TYPE lines), then one line per row, as ``render`` writes
        samples: a Triton counter (``nv_*``) keeps its family name, without ``_total``."""
        total = self.name + "_total"
        rename = self.type == "counter" and self.name.startswith("nv_")
        lines = [header]
        for sample, labels, _, value in self.rows:
            if rename and sample == total:
                sample = self.name
            text = str(value) if type(value) is int else format_value(value)
            lines.append(f"{sample}{{{labels}}} {text}\n")
        return "".join(lines)


def _label_text(pairs: Sequence[tuple[str, str]]) -> str:
    return ",".join(f'{k}="{escape(v)}"' for k, v in pairs)


def model_families(models: list[ModelLike]) -> Iterator[TextFamily]:
    """Triton's per model-version families for ``models`` (in this order), and Quiver's
    request latency histogram and worker-process memory."""
    keys = [(("model", m.name), ("version", m.version_str)) for m in models]
    texts = [_label_text(key) for key in keys]
    for index, (name, help_text, read) in enumerate(COUNTERS):
        sample = name + "_total"
        rows: list[Row] = [
            (sample, text, key, read(m.stats)) for key, text, m in zip(keys, texts, models, strict=True)
        ]
        yield TextFamily(name, help_text, "counter", rows)
        if index == 0:
            yield _failures(models)
    pending: list[Row] = []
    load: list[Row] = []
    latency: list[Row] = []
    bounds = [format_value(b) for b in LATENCY_BUCKETS_US] + ["+Inf"]
    for key, text, model in zip(keys, texts, models, strict=True):
        stats = model.stats
        pending.append(("nv_inference_pending_request_count", text, key, stats.pending))
        load.append(("nv_model_load_duration_secs", text, key, model.load_seconds))
        cumulative = 0
        for bound, count in zip(bounds, stats.latency_buckets, strict=True):
            cumulative += count
            labels = (*key, ("le", bound))
            latency.append(("quiver_inference_request_duration_us_bucket", f'{text},le="{bound}"', labels, cumulative))
        latency.append(("quiver_inference_request_duration_us_count", text, key, cumulative))
        latency.append(("quiver_inference_request_duration_us_sum", text, key, stats.latency_sum_us))
    yield TextFamily(
        "nv_inference_pending_request_count",
        "Instantaneous number of pending requests awaiting execution per-model.",
        "gauge",
        pending,
    )
    yield TextFamily("nv_model_load_duration_secs", "Model load time in seconds", "gauge", load)
    yield TextFamily(
        "quiver_inference_request_duration_us",
        "Inference request duration in microseconds, successful and failed requests",
        "histogram",
        latency,
    )
    processes: list[Row] = []
    for key, text, model in zip(keys, texts, models, strict=True):
        measure = getattr(model, "process_memory_bytes", None)
        size = measure() if measure is not None else None
        if size is not None:
            processes.append(("quiver_model_process_memory_bytes", text, key, size))
    if processes:
        yield TextFamily(
            "quiver_model_process_memory_bytes",
            "Host memory of the worker processes a model version runs in (their unique set size)",
            "gauge",
            processes,
        )


def _failures(models: list[ModelLike]) -> TextFamily:
    rows: list[Row] = []
    sample = "nv_inference_request_failure_total"
    for model in models:
        reasons = model.stats.fail_reasons
        name, version = f'model="{escape(model.name)}",reason="', f'",version="{escape(model.version_str)}"'
        for reason in (*FAIL_REASONS, *sorted(set(reasons) - set(FAIL_REASONS))):
            labels = (("model", model.name), ("reason", reason), ("version", model.version_str))
            rows.append((sample, f"{name}{escape(reason)}{version}", labels, reasons.get(reason, 0)))
    return TextFamily(
        "nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "counter", rows
    )
