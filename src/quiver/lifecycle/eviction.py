"""Eviction policy: which loaded models to unload so that a new one fits in the memory budget.

A policy only *chooses*; the model manager unloads. The manager describes every loaded model as
a :class:`Candidate` (its measured size, when it was last used, whether it is pinned by
requests in flight or by an in-flight ensemble) and asks :meth:`EvictionPolicy.victims` for
the names to unload. Policies never return a pinned candidate, stop as soon as the need fits,
and return ``[]`` when the need cannot fit even after evicting everything evictable: the
caller then raises its out-of-memory error instead of unloading models for nothing.

Two policies:

- :class:`LRUPolicy`: least recently used first (what SageMaker multi-model endpoints do).
- :class:`GreedyDualSizePolicy`: GreedyDual-Size (Cao & Irani, 1997). Each model has the
  priority ``H = L + cost / size`` set when it is used; the lowest ``H`` is evicted and the
  global inflation value ``L`` rises to the evicted ``H``, so models that are not used again
  age relative to those that are. With ``cost="uniform"`` (GDS-1, cost 1) the policy
  maximises the hit *count*: many small hot models are kept over one big cold one. With
  ``cost="load_time"`` the cost is the model's measured load time, so the policy minimises
  the total time spent loading instead.

For comparing policies on the same request trace there is :func:`simulate`, the offline
:func:`belady` reference, the online :func:`exact_lfu` reference and seeded trace generators
(:func:`zipf_trace` and its variants).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = [
    "Candidate",
    "EvictionPolicy",
    "GreedyDualSizePolicy",
    "LRUPolicy",
    "SimulationResult",
    "belady",
    "exact_lfu",
    "fits_at_all",
    "mixed_sizes",
    "scan_trace",
    "shifting_trace",
    "simulate",
    "zipf_trace",
]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A loaded model as the eviction policy sees it.

    ``size_bytes`` is the measured footprint (the prediction while none is known),
    ``last_used`` a monotonic timestamp in seconds (the manager's clock), ``pinned`` true
    while requests are in flight on it or an in-flight ensemble uses it, ``load_cost_s`` the
    measured time its last load took (used by cost-aware policies; ``None`` when unknown).
    """

    name: str
    size_bytes: int
    last_used: float
    pinned: bool = False
    load_cost_s: float | None = None


class EvictionPolicy(Protocol):
    """What the model manager needs from an eviction policy.

    The manager calls :meth:`touch` when a model finishes loading and whenever it serves a
    request, :meth:`forget` after a model is unloaded (for any reason), and
    :meth:`victims` before a load when the predicted size does not fit in the free bytes.
    A policy may keep state between calls (GreedyDual-Size does); it must treat a candidate
    it never saw touched sensibly (as if it had just been touched).
    """

    name: str

    def touch(self, name: str, size: int, now: float, *, load_cost_s: float | None = None) -> None:
        """``name`` (``size`` bytes) was used at ``now``; ``load_cost_s`` when a load was measured."""
        ...

    def forget(self, name: str) -> None:
        """``name`` is no longer loaded."""
        ...

    def victims(
        self, candidates: Sequence[Candidate], need_bytes: int, free_bytes: int
    ) -> list[str]:
        """Names to unload, in order, so that ``need_bytes`` fits in ``free_bytes`` plus what
        they free. Never a pinned candidate; ``[]`` when it already fits or cannot fit."""
        ...


def fits_at_all(candidates: Sequence[Candidate], need_bytes: int, free_bytes: int) -> bool:
    evictable = sum(c.size_bytes for c in candidates if not c.pinned)
    return free_bytes + evictable >= need_bytes


def _take_until_fits(
    ordered: Sequence[Candidate], need_bytes: int, free_bytes: int
) -> list[Candidate]:
    chosen: list[Candidate] = []
    for candidate in ordered:
        if free_bytes >= need_bytes:
            break
        chosen.append(candidate)
        free_bytes += candidate.size_bytes
    return chosen


class LRUPolicy:
    """Least recently used first, by :attr:`Candidate.last_used` (ties: by name).

    Stateless: the candidates carry the recency the manager already tracks, so
    :meth:`touch` and :meth:`forget` do nothing. Sizes do not matter to the order.
    """

    name = "lru"

    def touch(self, name: str, size: int, now: float, *, load_cost_s: float | None = None) -> None:
        return None

    def forget(self, name: str) -> None:
        return None

    def victims(
        self, candidates: Sequence[Candidate], need_bytes: int, free_bytes: int
    ) -> list[str]:
        if need_bytes <= free_bytes or not fits_at_all(candidates, need_bytes, free_bytes):
            return []
        ordered = sorted(
            (c for c in candidates if not c.pinned), key=lambda c: (c.last_used, c.name)
        )
        return [c.name for c in _take_until_fits(ordered, need_bytes, free_bytes)]


CostMode = Literal["uniform", "load_time"]


class GreedyDualSizePolicy:
    """GreedyDual-Size: evict the lowest ``H = L + cost / size``; ``L`` rises to each evicted ``H``.

    ``cost="uniform"`` is GDS-1 (cost 1 for every model: favours keeping small models, which
    maximises the hit rate when sizes differ). ``cost="load_time"`` uses the measured load
    time in seconds (``load_cost_s`` given to :meth:`touch`, else the candidate's), falling
    back to ``default_cost_s`` for a model whose load time is unknown.

    Sizes are bytes, so ``cost / size`` values are small; only their order matters. The
    inflation value ``L`` rises in :meth:`victims`, which assumes the caller unloads the
    names it returns (and then calls :meth:`forget`).
    """

    def __init__(self, cost: CostMode = "uniform", *, default_cost_s: float = 1.0) -> None:
        if cost not in ("uniform", "load_time"):
            raise ValueError(f"unknown GreedyDual-Size cost '{cost}' (uniform, load_time)")
        if default_cost_s <= 0:
            raise ValueError("default_cost_s must be positive")
        self.cost = cost
        self.name = "gds-1" if cost == "uniform" else "gds-load-time"
        self._default_cost_s = default_cost_s
        self.inflation = 0.0  # L
        self._priority: dict[str, float] = {}  # H per model touched and not forgotten
        self._cost: dict[str, float] = {}  # last known load time per model

    def _value(self, name: str, size: int, load_cost_s: float | None) -> float:
        if self.cost == "uniform":
            cost = 1.0
        else:
            if load_cost_s is not None and load_cost_s > 0:
                self._cost[name] = load_cost_s
            cost = self._cost.get(name, self._default_cost_s)
        return cost / max(1, size)

    def touch(self, name: str, size: int, now: float, *, load_cost_s: float | None = None) -> None:
        self._priority[name] = self.inflation + self._value(name, size, load_cost_s)

    def forget(self, name: str) -> None:
        self._priority.pop(name, None)
        # The load cost is kept: it predicts the next load of the same model.

    def priority(self, candidate: Candidate) -> float:
        """The candidate's ``H``; one never touched counts as touched now."""
        found = self._priority.get(candidate.name)
        if found is not None:
            return found
        return self.inflation + self._value(
            candidate.name, candidate.size_bytes, candidate.load_cost_s
        )

    def victims(
        self, candidates: Sequence[Candidate], need_bytes: int, free_bytes: int
    ) -> list[str]:
        if need_bytes <= free_bytes or not fits_at_all(candidates, need_bytes, free_bytes):
            return []
        ordered = sorted(
            (c for c in candidates if not c.pinned),
            key=lambda c: (self.priority(c), c.last_used, c.name),
        )
        chosen = _take_until_fits(ordered, need_bytes, free_bytes)
        if chosen:
            self.inflation = max(self.inflation, max(self.priority(c) for c in chosen))
        return [c.name for c in chosen]


# -- simulation ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Counts from replaying a request trace against a byte budget.

    ``misses`` counts every request for a model that was not resident; ``loads`` the misses
    that loaded it; ``rejected`` the misses that could not load (the model is bigger than
    what could be freed); ``evictions`` the models unloaded to make room.
    """

    hits: int
    misses: int
    loads: int
    evictions: int
    hit_rate: float
    rejected: int = 0


def _result(hits: int, misses: int, loads: int, evictions: int, rejected: int) -> SimulationResult:
    total = hits + misses
    return SimulationResult(
        hits, misses, loads, evictions, hits / total if total else 0.0, rejected
    )


def simulate(
    policy: EvictionPolicy,
    trace: Sequence[str],
    sizes: Mapping[str, int],
    budget: int,
    *,
    load_costs: Mapping[str, float] | None = None,
) -> SimulationResult:
    """Replay ``trace`` (model names, one per request) through ``policy`` under ``budget`` bytes.

    The clock is the request index. Nothing is pinned (requests are served one at a time).
    A miss loads the model (evicting the policy's victims first); ``load_costs`` gives
    cost-aware policies a load time per model (seconds).

    As in the server, a model is touched when its load finishes and again when the request
    that asked for it is served (so a miss touches it twice, a hit once).
    """
    resident: dict[str, Candidate] = {}
    used = hits = misses = loads = evictions = rejected = 0
    for now, name in enumerate(trace):
        size = sizes[name]
        cost = load_costs.get(name) if load_costs is not None else None
        if name in resident:
            hits += 1
            resident[name] = Candidate(name, size, float(now), False, cost)
            policy.touch(name, size, float(now))
            continue
        misses += 1
        free = budget - used
        if size > free:
            victims = policy.victims(list(resident.values()), size, free)
            for victim in victims:
                used -= resident.pop(victim).size_bytes
                policy.forget(victim)
                evictions += 1
            if size > budget - used:
                rejected += 1
                continue
        resident[name] = Candidate(name, size, float(now), False, cost)
        used += size
        loads += 1
        policy.touch(name, size, float(now), load_cost_s=cost)
        policy.touch(name, size, float(now))
    return _result(hits, misses, loads, evictions, rejected)


def belady(trace: Sequence[str], sizes: Mapping[str, int], budget: int) -> SimulationResult:
    """The offline reference: on a miss, evict the resident models used again farthest in the future.

    With equal sizes this is Belady's MIN, which is optimal: no policy, online or offline,
    gets more hits on this trace with this budget, so it is the "best possible" hit rate.

    With different sizes it is the standard approximation (often called Belady-Size): evict
    by farthest next use until the model fits. It is *not* guaranteed optimal there: choosing
    what to evict becomes a knapsack-like problem (one far-off big model versus several
    nearer small ones), and computing the optimal hit count with variable sizes is NP-hard
    (Chrobak, Woeginger, Makino & Xu, "Caching is hard - even in the fault model", 2012);
    Berger, Beckmann & Harchol-Balter ("Practical bounds on optimal caching with variable
    object sizes", 2018) bound it with flow relaxations. So with variable sizes treat this
    number as a strong reference, not a ceiling: a size-aware policy such as GDS-1 can beat
    it on some traces. Like :func:`simulate` (and the server, which must load a model to
    serve it) it always admits the requested model.
    """
    never = math.inf
    next_use: list[float] = [never] * len(trace)
    last_seen: dict[str, int] = {}
    for index in range(len(trace) - 1, -1, -1):
        name = trace[index]
        next_use[index] = last_seen.get(name, never)
        last_seen[name] = index
    return _replay(trace, sizes, budget, lambda index, name: (-next_use[index],))


def exact_lfu(trace: Sequence[str], sizes: Mapping[str, int], budget: int) -> SimulationResult:
    """An online reference: LFU with an exact count of every past request of every model,
    never forgotten (often called Perfect-LFU). On a miss it evicts the resident models with
    the fewest requests so far per byte (the least recent first on a tie) until the new one
    fits, and always admits it, as :func:`simulate` does.

    With stationary popularity the count of past requests is all an online policy can learn
    popularity from, so this is about the best one can do without knowing the future: the gap
    to :func:`belady` is the price of learning popularity from the counts, which is large on
    a short trace. It forgets nothing, so it is no reference when popularity shifts.
    """
    counts: dict[str, int] = {}

    def key(index: int, name: str) -> tuple[float, ...]:
        counts[name] = counts.get(name, 0) + 1
        return (counts[name] / max(1, sizes[name]), index)

    return _replay(trace, sizes, budget, key)


def _replay(
    trace: Sequence[str], sizes: Mapping[str, int], budget: int, key_of: Callable[[int, str], tuple[float, ...]]
) -> SimulationResult:
    """Replay ``trace`` through a cache that, to make room, evicts the resident model with the
    smallest key (what ``key_of(index, name)`` said at its last request; it is asked at every
    request, admitted or not) and always admits the requested model when it fits at all."""
    resident: dict[str, tuple[float, ...]] = {}  # name -> its key in the heap
    heap: list[tuple[Any, ...]] = []  # (*key, name); stale entries skipped lazily
    used = hits = misses = loads = evictions = rejected = 0
    for index, name in enumerate(trace):
        key = key_of(index, name)
        size = sizes[name]
        if name in resident:
            hits += 1
        else:
            misses += 1
            if size > budget:
                rejected += 1
                continue
            while used + size > budget:
                entry = heapq.heappop(heap)
                victim = entry[-1]
                if resident.get(victim) != entry[:-1]:
                    continue  # stale entry
                del resident[victim]
                used -= sizes[victim]
                evictions += 1
            used += size
            loads += 1
        resident[name] = key
        heapq.heappush(heap, (*key, name))
    return _result(hits, misses, loads, evictions, rejected)


def zipf_trace(n_models: int, n_requests: int, s: float, seed: int) -> list[str]:
    """``n_requests`` model names drawn from a Zipf law with exponent ``s`` over ``n_models``.

    Model ``model_00000`` is the most popular (rank 1, weight 1); rank ``k`` has weight
    ``1 / k**s``. ``s = 0`` is uniform; around 1 is typical of real request mixes. The same
    seed gives the same trace.
    """
    if n_models <= 0:
        raise ValueError("n_models must be positive")
    if n_requests < 0:
        raise ValueError("n_requests must not be negative")
    width = max(5, len(str(n_models - 1)))
    names = [f"model_{k:0{width}d}" for k in range(n_models)]
    cumulative = list(itertools.accumulate(1.0 / (k**s) for k in range(1, n_models + 1)))
    total = cumulative[-1]
    rng = random.Random(seed)
    picks = [bisect.bisect_left(cumulative, rng.random() * total) for _ in range(n_requests)]
    return [names[min(p, n_models - 1)] for p in picks]


def shifting_trace(
    n_models: int, n_requests: int, s: float, seed: int, *, period: int
) -> list[str]:
    """A Zipf(``s``) trace whose popularity shifts every ``period`` requests: at each shift the
    ranks are dealt to the models afresh (a seeded shuffle), so yesterday's hot models turn
    cold and cold ones hot."""
    if period <= 0:
        raise ValueError("period must be positive")
    base = zipf_trace(n_models, n_requests, s, seed)
    width = max(5, len(str(n_models - 1)))
    names = [f"model_{k:0{width}d}" for k in range(n_models)]
    rng = random.Random(seed + 1)
    trace: list[str] = []
    for start in range(0, n_requests, period):
        shuffled = names[:]
        rng.shuffle(shuffled)
        rank = dict(zip(names, shuffled, strict=True))
        trace.extend(rank[name] for name in base[start : start + period])
    return trace


def scan_trace(
    n_models: int, n_requests: int, s: float, seed: int, *, scans: int = 2
) -> list[str]:
    """A Zipf(``s``) trace with ``scans`` batch jobs mixed in: each touches every model once
    (in a seeded random order), inserted at evenly spaced points of the trace."""
    base = zipf_trace(n_models, n_requests, s, seed)
    width = max(5, len(str(n_models - 1)))
    names = [f"model_{k:0{width}d}" for k in range(n_models)]
    rng = random.Random(seed + 2)
    trace: list[str] = []
    step = n_requests // (scans + 1) if scans else n_requests
    for index in range(scans + 1):
        trace.extend(base[index * step : (index + 1) * step if index < scans else n_requests])
        if index < scans:
            batch = names[:]
            rng.shuffle(batch)
            trace.extend(batch)
    return trace


def mixed_sizes(names: Sequence[str], unit: int, spread: float, seed: int) -> dict[str, int]:
    """Sizes for ``names`` spread log-uniformly over ``[unit, spread * unit]`` (seeded,
    independent of popularity)."""
    if spread < 1:
        raise ValueError("spread must be at least 1")
    rng = random.Random(seed + 3)
    return {name: max(1, round(unit * spread ** rng.random())) for name in sorted(set(names))}
