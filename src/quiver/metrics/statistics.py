"""Per model-version statistics: Triton's statistics extension and the source of the metrics.

Recording is a handful of integer additions on the request path; the statistics API and the
Prometheus collector read the same counters when asked, so neither costs anything per
request beyond this.
"""

from __future__ import annotations

from bisect import bisect_left
from time import time_ns
from typing import Any

#: Upper bounds (microseconds) of the request-latency histogram buckets.
LATENCY_BUCKETS_US: tuple[float, ...] = (
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
)


class Duration:
    """A count and the nanoseconds they took, as Triton's ``StatisticDuration``."""

    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class BatchStatistics:
    __slots__ = ("compute_infer", "compute_input", "compute_output")

    def __init__(self) -> None:
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()


class ModelStatistics:
    """What happened to one model version since it was loaded."""

    __slots__ = (
        "batches",
        "cache_hit",
        "cache_miss",
        "compute_infer",
        "compute_input",
        "compute_output",
        "execution_count",
        "fail",
        "fail_reasons",
        "inference_count",
        "last_inference_ms",
        "latency_buckets",
        "latency_sum_us",
        "pending",
        "queue",
        "success",
    )

    def __init__(self) -> None:
        self.success = Duration()
        self.fail = Duration()
        self.fail_reasons: dict[str, int] = {}  # Triton's failure reasons: REJECTED, BACKEND, ...
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self.batches: dict[int, BatchStatistics] = {}
        self.latency_buckets = [0] * (len(LATENCY_BUCKETS_US) + 1)
        self.latency_sum_us = 0.0
        self.pending = 0  # requests accepted and not yet answered
        self.cache_hit = Duration()  # response cache: answered from it, and the lookup time
        self.cache_miss = Duration()  # ... not found: the lookup and insertion time

    # -- recording (request path) ------------------------------------------------------

    def record_success(
        self, request_ns: int, queue_ns: int, input_ns: int, infer_ns: int, output_ns: int, rows: int
    ) -> None:
        # Every request: the additions written out (a Duration.add call each costs more).
        success, queue = self.success, self.queue
        success.count += 1
        success.ns += request_ns
        queue.count += 1
        queue.ns += queue_ns
        compute = self.compute_input
        compute.count += 1
        compute.ns += input_ns
        compute = self.compute_infer
        compute.count += 1
        compute.ns += infer_ns
        compute = self.compute_output
        compute.count += 1
        compute.ns += output_ns
        self.inference_count += rows
        self.last_inference_ms = time_ns() // 1_000_000
        us = request_ns / 1000
        self.latency_sum_us += us
        self.latency_buckets[bisect_left(LATENCY_BUCKETS_US, us)] += 1

    def record_failure(self, request_ns: int, reason: str = "BACKEND") -> None:
        """A failed request; ``reason`` is Triton's: REJECTED (never ran: bad input, unloading),
        BACKEND (the model failed), CANCELED, OTHER."""
        self.fail.add(request_ns)
        self.fail_reasons[reason] = self.fail_reasons.get(reason, 0) + 1
        self.last_inference_ms = time_ns() // 1_000_000
        self._latency(request_ns)

    def record_cache_hit(self, request_ns: int, rows: int) -> None:
        """A request answered from the response cache in ``request_ns`` (Triton counts it a
        success, not an inference or an execution)."""
        self.success.add(request_ns)
        self.queue.add(0)
        self.cache_hit.add(request_ns)
        self.last_inference_ms = time_ns() // 1_000_000
        self._latency(request_ns)

    def record_cache_miss(self, cache_ns: int) -> None:
        """A request not in the response cache: ``cache_ns`` spent looking it up and inserting
        its answer (added to the request's duration, as Triton adds it)."""
        self.cache_miss.add(cache_ns)
        self.success.ns += cache_ns

    def record_execution(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        batch = self.batches.get(batch_size)
        if batch is None:
            batch = self.batches[batch_size] = BatchStatistics()
        compute = batch.compute_input
        compute.count += 1
        compute.ns += input_ns
        compute = batch.compute_infer
        compute.count += 1
        compute.ns += infer_ns
        compute = batch.compute_output
        compute.count += 1
        compute.ns += output_ns

    def _latency(self, request_ns: int) -> None:
        us = request_ns / 1000
        self.latency_sum_us += us
        self.latency_buckets[bisect_left(LATENCY_BUCKETS_US, us)] += 1

    # -- reading -----------------------------------------------------------------------

    def to_json(self, name: str, version: str) -> dict[str, Any]:
        """Triton's ``ModelStatistics`` JSON (the HTTP statistics extension's field names)."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
                "cache_hit": self.cache_hit.to_json(),
                "cache_miss": self.cache_miss.to_json(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": batch.compute_input.to_json(),
                    "compute_infer": batch.compute_infer.to_json(),
                    "compute_output": batch.compute_output.to_json(),
                }
                for size, batch in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }


#: Upper bounds (microseconds) of the model loading/unloading/waiting histograms.
LOAD_BUCKETS_US: tuple[float, ...] = (
    1_000, 10_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000, 30_000_000, 60_000_000, 120_000_000,
)
#: Upper bounds (seconds) of the age-at-eviction histogram.
AGE_BUCKETS_S: tuple[float, ...] = (1, 10, 60, 300, 900, 3_600, 21_600, 86_400)


class Histogram:
    """Fixed buckets, a count and a sum: what a Prometheus histogram is made of."""

    __slots__ = ("bounds", "buckets", "count", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value


class MultiModelStatistics:
    """What the multi-model machinery did, server-wide (SageMaker's MME metrics, in
    Prometheus style): loads, unloads, how long requests waited for loads, cache hits and
    misses (a request that found its model loaded, or had to wait for a load), evictions,
    and how long model downloads into the disk cache took."""

    __slots__ = (
        "cache_hits",
        "cache_misses",
        "downloading_time_us",
        "eviction_age_s",
        "evictions",
        "load_failures",
        "loading_time_us",
        "loading_wait_time_us",
        "unloading_time_us",
    )

    def __init__(self) -> None:
        self.loading_time_us = Histogram(LOAD_BUCKETS_US)
        self.unloading_time_us = Histogram(LOAD_BUCKETS_US)
        self.loading_wait_time_us = Histogram(LOAD_BUCKETS_US)
        self.eviction_age_s = Histogram(AGE_BUCKETS_S)
        self.downloading_time_us = Histogram(LOAD_BUCKETS_US)
        self.cache_hits = 0
        self.cache_misses = 0
        self.evictions = 0
        self.load_failures = 0
