"""Publishing the metrics to Amazon CloudWatch, as SageMaker's Triton image does.

Triton's image runs the CloudWatch agent, which scrapes the Prometheus endpoint and writes
each scrape into a CloudWatch Logs group as *embedded metric format* (EMF) events, from which
CloudWatch extracts the metrics into a namespace. :class:`CloudWatchPublisher` does the same
from inside the server, with boto3 and no agent:

- every ``interval`` seconds it takes the registry's metrics (the Triton-named ``nv_*`` ones
  and the multi-model ``quiver_*`` ones), on the event loop, as a scrape does;
- it turns them into EMF events (:func:`emf_events`): one event per label set (model and
  version, GPU, or none), the labels as dimensions, counters as the increase since the last
  publication (as the agent publishes Prometheus counters), histograms as their ``_sum`` and
  ``_count`` increases, gauges as they are;
- a thread of its own sends them with ``PutLogEvents`` in batches (at most 10,000 events and
  1 MiB each, CloudWatch's limits), retrying a failed batch with backoff; events not sent wait
  for the next round, the oldest dropped past :data:`MAX_PENDING` or :data:`MAX_AGE_MS` (with a
  warning; CloudWatch refuses a batch spanning a day). Nothing of
  this runs on the event loop: a slow or unreachable CloudWatch never holds a request;
- failures are logged, never fatal; :meth:`stop` publishes one last time (one attempt,
  bounded by the client's timeouts) and stops the thread.

The log group (and the stream, named after the host) are created when missing. Credentials,
region and endpoint are boto3's: ``AWS_REGION``, ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS``, the profile, ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

#: CloudWatch Logs' PutLogEvents limits: events and bytes (each event counts 26 more).
MAX_BATCH_EVENTS = 10_000
MAX_BATCH_BYTES = 1_048_576
EVENT_OVERHEAD = 26
#: EMF allows at most 100 metrics per directive and 30 dimensions per dimension set.
MAX_METRICS_PER_EVENT = 100
MAX_DIMENSIONS = 30
#: Events kept for the next round when CloudWatch cannot take them, at most.
MAX_PENDING = 50_000
#: Events older than this are dropped unsent: CloudWatch refuses a batch spanning 24 hours.
MAX_AGE_MS = 23 * 3600 * 1000
#: Attempts per batch within one round, and the first backoff (doubling) between them.
ATTEMPTS = 3
BACKOFF_SECONDS = 0.5

_STREAM_SAFE = re.compile(r"[^A-Za-z0-9_.\-/#]")


def _unit(name: str) -> str:
    if name.endswith("_us"):
        return "Microseconds"
    if name.endswith("_secs") or name.endswith("_seconds"):
        return "Seconds"
    if name.endswith("_bytes"):
        return "Bytes"
    return "None"


class CounterState:
    """The last value of each counter series, to publish increases."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def increase(self, name: str, labels: tuple[tuple[str, str], ...], value: float) -> float:
        key = (name, labels)
        previous = self._last.get(key, 0.0)
        self._last[key] = value
        # A counter that went down was reset (its model reloaded): all of it is new.
        return value - previous if value >= previous else value


def emf_events(
    metrics: Iterable[Metric], namespace: str, timestamp_ms: int, counters: CounterState
) -> list[dict[str, Any]]:
    """The EMF events of one collection (see the module notes)."""
    groups: dict[tuple[tuple[str, str], ...], dict[str, tuple[float, str]]] = {}
    for family in metrics:
        kind = family.type
        for sample in family.samples:
            name = sample.name
            if kind == "counter":
                if name.endswith("_created"):
                    continue
                if name == family.name + "_total":
                    name = family.name  # Triton's names carry no _total
            elif kind == "histogram" or kind == "summary":
                if not (name.endswith("_sum") or name.endswith("_count")):
                    continue  # buckets and quantiles stay on the Prometheus endpoint
            elif kind != "gauge":
                continue
            value = float(sample.value)
            if not math.isfinite(value):
                continue
            labels = tuple(sorted(sample.labels.items()))[:MAX_DIMENSIONS]
            if kind != "gauge":
                value = counters.increase(name, labels, value)
            if kind != "gauge" and name.endswith("_count"):
                unit = "Count"
            else:
                unit = _unit(family.name)
                if unit == "None" and kind == "counter":
                    unit = "Count"
            groups.setdefault(labels, {})[name] = (value, unit)
    events = []
    for labels, values in groups.items():
        names = sorted(values)
        for start in range(0, len(names), MAX_METRICS_PER_EVENT):
            chunk = names[start : start + MAX_METRICS_PER_EVENT]
            event: dict[str, Any] = {
                "_aws": {
                    "Timestamp": timestamp_ms,
                    "CloudWatchMetrics": [
                        {
                            "Namespace": namespace,
                            "Dimensions": [[k for k, _ in labels]],
                            "Metrics": [{"Name": n, "Unit": values[n][1]} for n in chunk],
                        }
                    ],
                },
            }
            event.update(labels)
            for n in chunk:
                event[n] = values[n][0]
            events.append(event)
    return events


def batches(events: list[tuple[int, bytes]]) -> list[list[tuple[int, bytes]]]:
    """``events`` (timestamp, message) cut into PutLogEvents batches, in time order."""
    out: list[list[tuple[int, bytes]]] = []
    batch: list[tuple[int, bytes]] = []
    size = 0
    for event in sorted(events, key=lambda e: e[0]):
        cost = len(event[1]) + EVENT_OVERHEAD
        if batch and (len(batch) >= MAX_BATCH_EVENTS or size + cost > MAX_BATCH_BYTES):
            out.append(batch)
            batch, size = [], 0
        batch.append(event)
        size += cost
    if batch:
        out.append(batch)
    return out


def _default_client() -> Any:
    import boto3
    from botocore.config import Config

    # One attempt per call (this module retries, between rounds too), short timeouts.
    config = Config(retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=3, read_timeout=10)
    # SageMaker sets AWS_REGION; boto3 itself reads AWS_DEFAULT_REGION and the profile.
    region = os.environ.get("AWS_REGION") or None
    return boto3.client("logs", config=config, region_name=region)


class CloudWatchPublisher:
    """Publishes ``collect()``'s metrics to CloudWatch every ``interval`` seconds (see the
    module notes). :meth:`start` on the event loop; :meth:`stop` when the server stops."""

    def __init__(
        self,
        collect: Callable[[], Iterable[Metric]],
        *,
        log_group: str,
        namespace: str,
        interval: float = 60.0,
        stream: str | None = None,
        client_factory: Callable[[], Any] = _default_client,
    ) -> None:
        self._collect = collect
        self.log_group = log_group
        self.namespace = namespace
        self.interval = interval
        self.stream = stream or _STREAM_SAFE.sub("_", f"quiver-metrics-{socket.gethostname()}")[:512]
        self._client_factory = client_factory
        self._client: Any = None
        self._counters = CounterState()
        self._pending: deque[tuple[int, bytes]] = deque()
        self._ready = False  # log group and stream exist
        self._stopping = threading.Event()
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quiver-cloudwatch")
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        #: Events CloudWatch accepted, and rounds that failed (for logs and tests).
        self.sent = 0
        self.failures = 0

    # -- the loop side ---------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="quiver-cloudwatch")
        logger.info(
            "publishing metrics to CloudWatch every %g s: log group '%s', stream '%s', namespace '%s'",
            self.interval,
            self.log_group,
            self.stream,
            self.namespace,
        )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.publish_once()

    async def publish_once(self, *, attempts: int = ATTEMPTS) -> None:
        """Collect now (on the loop) and send on the sender thread; never raises."""
        try:
            events = self._events()
        except Exception:
            logger.exception("collecting the metrics for CloudWatch failed")
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._sender, self._send, events, attempts)
        except RuntimeError:  # the sender was shut down: the server is stopping
            pass
        except Exception:
            logger.exception("publishing the metrics to CloudWatch failed")

    def _events(self) -> list[tuple[int, bytes]]:
        now = int(time.time() * 1000)
        return [
            (now, orjson.dumps(event))
            for event in emf_events(self._collect(), self.namespace, now, self._counters)
        ]

    async def stop(self) -> None:
        """Publish one last time (one attempt; not when CloudWatch is failing, so a stop does
        not wait on it twice), then stop the sender thread. A round under way gives up its
        backoff waits at once; a call under way ends within the client's timeouts."""
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            if not self._failing:
                await self.publish_once(attempts=1)
        await asyncio.get_running_loop().run_in_executor(None, self._sender.shutdown, True)
        if self._pending:
            logger.warning("%d metric events were not published to CloudWatch", len(self._pending))

    # -- the sender thread -----------------------------------------------------------------

    def _send(self, events: list[tuple[int, bytes]], attempts: int) -> None:
        self._pending.extend(events)
        if self._stopping.is_set() and self._failing:
            return  # stopping, and the round before failed: do not wait on CloudWatch again
        dropped = 0
        oldest = int(time.time() * 1000) - MAX_AGE_MS
        while self._pending and (len(self._pending) > MAX_PENDING or self._pending[0][0] < oldest):
            self._pending.popleft()
            dropped += 1
        if dropped:
            logger.warning("CloudWatch: dropped the %d oldest unpublished metric events", dropped)
        try:
            client = self._ensure()
            for batch in batches(list(self._pending)):
                self._put(client, batch, attempts)
                for _ in batch:
                    self._pending.popleft()
                self.sent += len(batch)
        except Exception as exc:
            self.failures += 1
            if self._stopping.is_set() and attempts > 1:
                logger.debug("CloudWatch round given up: the server is stopping (%s)", exc)
                return
            if not self._failing:
                logger.error(
                    "publishing metrics to CloudWatch log group '%s' failed (inference is not "
                    "affected; %d events wait for the next attempt): %s",
                    self.log_group,
                    len(self._pending),
                    exc,
                )
            else:
                logger.debug("CloudWatch still failing: %s", exc)
            self._failing = True
            return
        if self._failing:
            logger.info("publishing metrics to CloudWatch works again")
        self._failing = False

    def _ensure(self) -> Any:
        if self._client is None:
            self._client = self._client_factory()
        if not self._ready:
            client = self._client
            for call, kwargs in (
                (client.create_log_group, {"logGroupName": self.log_group}),
                (client.create_log_stream, {"logGroupName": self.log_group, "logStreamName": self.stream}),
            ):
                with contextlib.suppress(client.exceptions.ResourceAlreadyExistsException):
                    call(**kwargs)
            self._ready = True
        return self._client

    def _put(self, client: Any, batch: list[tuple[int, bytes]], attempts: int) -> None:
        delay = BACKOFF_SECONDS
        for attempt in range(1, attempts + 1):
            try:
                client.put_log_events(
                    logGroupName=self.log_group,
                    logStreamName=self.stream,
                    logEvents=[{"timestamp": ts, "message": m.decode("utf-8")} for ts, m in batch],
                )
                return
            except client.exceptions.ResourceNotFoundException:
                self._ready = False  # the group or stream was deleted: create them again
                if attempt == attempts:
                    raise
                self._ensure()
            except Exception:
                if attempt == attempts or self._stopping.is_set():
                    raise
            if self._stopping.wait(delay):
                raise RuntimeError("stopping")
            delay *= 2


__all__ = ["CloudWatchPublisher", "CounterState", "batches", "emf_events"]
