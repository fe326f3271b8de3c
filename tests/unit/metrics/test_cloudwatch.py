"""CloudWatch publishing's parts: the EMF events of a collection, PutLogEvents batches, and
the sender's retries and hand-over of unsent events to the next round."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from quiver.metrics import cloudwatch
from quiver.metrics.cloudwatch import CloudWatchPublisher, CounterState, batches, emf_events


def collection(success: float) -> list[Any]:
    counter = CounterMetricFamily("nv_inference_request_success", "ok", labels=["model", "version"])
    counter.add_metric(["m", "1"], success)
    duration = CounterMetricFamily("nv_inference_request_duration_us", "us", labels=["model", "version"])
    duration.add_metric(["m", "1"], success * 100)
    gauge = GaugeMetricFamily("quiver_loaded_model_count", "loaded", value=1)
    histogram = HistogramMetricFamily("quiver_inference_request_duration_us", "h", labels=["model", "version"])
    histogram.add_metric(["m", "1"], [("100", 1), ("+Inf", success)], sum_value=success * 50)
    return [counter, duration, gauge, histogram]


def test_events_group_series_by_labels_and_send_counter_increases() -> None:
    counters = CounterState()
    first = emf_events(collection(3), "ns", 1000, counters)
    by_dims = {tuple(e["_aws"]["CloudWatchMetrics"][0]["Dimensions"][0]): e for e in first}
    model = by_dims[("model", "version")]
    assert model["model"] == "m" and model["version"] == "1"
    assert model["nv_inference_request_success"] == 3
    assert model["quiver_inference_request_duration_us_count"] == 3
    assert model["quiver_inference_request_duration_us_sum"] == 150
    assert not any(k.endswith("_bucket") or k.endswith("_total") for k in model)
    directive = model["_aws"]["CloudWatchMetrics"][0]
    assert directive["Namespace"] == "ns" and model["_aws"]["Timestamp"] == 1000
    units = {m["Name"]: m["Unit"] for m in directive["Metrics"]}
    assert units == {
        "nv_inference_request_success": "Count",
        "nv_inference_request_duration_us": "Microseconds",
        "quiver_inference_request_duration_us_count": "Count",
        "quiver_inference_request_duration_us_sum": "Microseconds",
    }
    assert by_dims[()]["quiver_loaded_model_count"] == 1
    second = emf_events(collection(5), "ns", 2000, counters)
    model = next(e for e in second if e.get("model") == "m")
    assert model["nv_inference_request_success"] == 2  # the increase
    reset = emf_events(collection(1), "ns", 3000, counters)
    assert next(e for e in reset if e.get("model") == "m")["nv_inference_request_success"] == 1


def test_batches_respect_cloudwatch_limits() -> None:
    small = [(i, b"x") for i in range(25_000)]
    cut = batches(small)
    assert [len(b) for b in cut] == [10_000, 10_000, 5_000]
    big = [(i, b"y" * 300_000) for i in range(7)]
    for batch in batches(big):
        assert sum(len(m) + cloudwatch.EVENT_OVERHEAD for _, m in batch) <= cloudwatch.MAX_BATCH_BYTES
    assert [ts for b in batches(list(reversed(big))) for ts, _ in b] == list(range(7))  # time order


class FlakyLogs:
    """A CloudWatch Logs client that fails its first ``failures`` PutLogEvents calls."""

    class exceptions:
        class ResourceAlreadyExistsException(Exception):
            pass

        class ResourceNotFoundException(Exception):
            pass

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.received: list[dict[str, Any]] = []

    def create_log_group(self, **kwargs: Any) -> None:
        pass

    def create_log_stream(self, **kwargs: Any) -> None:
        pass

    def put_log_events(self, **kwargs: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("refused")
        self.received += [json.loads(e["message"]) for e in kwargs["logEvents"]]


def test_a_failed_batch_is_retried_then_kept_for_the_next_round(monkeypatch: Any) -> None:
    monkeypatch.setattr(cloudwatch, "BACKOFF_SECONDS", 0.01)
    client = FlakyLogs(failures=4)  # round 1: 3 attempts fail; round 2: 1 fails, 1 succeeds
    values = iter([1, 2])
    publisher = CloudWatchPublisher(
        lambda: collection(next(values)), log_group="g", namespace="ns", client_factory=lambda: client
    )

    async def main() -> None:
        await publisher.publish_once()
        assert client.calls == 3 and not client.received and publisher.failures == 1
        await publisher.publish_once()
        await publisher.stop()

    asyncio.run(main())
    assert client.calls == 5
    successes = [e["nv_inference_request_success"] for e in client.received if "nv_inference_request_success" in e]
    assert successes == [1, 1]  # nothing lost, nothing counted twice
    assert publisher.sent == len(client.received)


def test_events_older_than_a_day_are_dropped_not_retried_forever(monkeypatch: Any) -> None:
    client = FlakyLogs(failures=0)
    publisher = CloudWatchPublisher(lambda: collection(1), log_group="g", namespace="ns", client_factory=lambda: client)
    stale = int(time.time() * 1000) - cloudwatch.MAX_AGE_MS - 60_000
    publisher._pending.append((stale, b'{"stale": 1}'))

    async def main() -> None:
        await publisher.publish_once()
        await publisher.stop()

    asyncio.run(main())
    assert client.received and not any("stale" in e for e in client.received)
