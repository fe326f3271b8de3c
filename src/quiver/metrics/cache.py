"""Triton's response cache metrics (``docs/user_guide/metrics.md``, Response Cache Metrics).

Per model version, for the models that use the cache (their config enables
``response_cache`` and the server has one): ``nv_cache_num_hits_per_model``,
``nv_cache_num_misses_per_model``, ``nv_cache_hit_duration_per_model`` and
``nv_cache_miss_duration_per_model`` (microseconds), with Triton's HELP texts. For the
``local`` cache as a whole, Triton's older cache gauges: ``nv_cache_num_entries``,
``nv_cache_num_lookups``, ``nv_cache_num_hits``, ``nv_cache_num_misses``,
``nv_cache_num_evictions`` and ``nv_cache_util`` (the fraction of its bytes in use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from quiver.metrics.statistics import ModelStatistics


class CacheView(Protocol):
    size: int
    used: int
    evictions: int
    lookups: int
    hits: int

    def __len__(self) -> int: ...


_PER_MODEL: tuple[tuple[str, str, Callable[[ModelStatistics], int]], ...] = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda s: s.cache_hit.count),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", lambda s: s.cache_miss.count),
    (
        "nv_cache_hit_duration_per_model",
        "Total cache hit duration per model, in microseconds",
        lambda s: s.cache_hit.ns // 1000,
    ),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (insert+lookup) duration per model, in microseconds",
        lambda s: s.cache_miss.ns // 1000,
    ),
)


def uses_cache(model: Any) -> bool:
    config = getattr(model, "config", None)
    return bool(config is not None and config.proto.response_cache.enable)


def cache_metrics(models: Iterable[Any], cache: CacheView | None) -> Iterator[Metric]:
    """The response cache metrics (nothing when the server has no response cache)."""
    if cache is None:
        return
    cached = [m for m in models if uses_cache(m)]
    for name, help_text, read in _PER_MODEL:
        family = CounterMetricFamily(name, help_text, labels=["model", "version"])
        for model in cached:
            family.add_metric([model.name, model.version_str], read(model.stats))
        yield family
    lookups, hits = cache.lookups, cache.hits
    for name, help_text, value in (
        ("nv_cache_num_entries", "Number of responses stored in response cache", len(cache)),
        ("nv_cache_num_lookups", "Number of cache lookups in response cache", lookups),
        ("nv_cache_num_hits", "Number of cache hits in response cache", hits),
        ("nv_cache_num_misses", "Number of cache misses in response cache", lookups - hits),
        ("nv_cache_num_evictions", "Number of cache evictions in response cache", cache.evictions),
        ("nv_cache_util", "Cache utilization [0.0 - 1.0]", cache.used / cache.size if cache.size else 0.0),
    ):
        yield GaugeMetricFamily(name, help_text, value=value)
