"""W-TinyLFU: the frequency sketch, the segments, admission by frequency per byte, and the
policy against LRU and Belady on the synthetic traces (seeded, so the answers are known)."""

from __future__ import annotations

import pytest

from quiver.lifecycle.eviction import (
    Candidate,
    LRUPolicy,
    belady,
    mixed_sizes,
    scan_trace,
    shifting_trace,
    simulate,
    zipf_trace,
)
from quiver.lifecycle.policies import DEFAULT_POLICY, make_policy
from quiver.lifecycle.tinylfu import FrequencySketch, WTinyLFUPolicy

# -- the sketch -------------------------------------------------------------------------------


def test_sketch_counts_uses_and_caps_at_fifteen() -> None:
    sketch = FrequencySketch(64, sample_factor=1000)
    for _ in range(3):
        sketch.increment("a")
    sketch.increment("b")
    assert sketch.estimate("a") == 3
    assert sketch.estimate("b") == 1
    assert sketch.estimate("never") == 0
    for _ in range(40):
        sketch.increment("a")
    assert sketch.estimate("a") == 15


def test_sketch_halves_every_counter_after_its_sample() -> None:
    sketch = FrequencySketch(16, sample_factor=1)  # sample: 16 increments
    assert sketch.sample_size == 16
    for _ in range(8):
        sketch.increment("a")
    for _ in range(7):
        sketch.increment("b")
    assert (sketch.estimate("a"), sketch.estimate("b")) == (8, 7)
    sketch.increment("c")  # the 16th: everything halves
    assert (sketch.estimate("a"), sketch.estimate("b"), sketch.estimate("c")) == (4, 3, 0)
    assert sketch.additions == 8


def test_sketch_grows_with_the_cache_and_keeps_its_counts() -> None:
    sketch = FrequencySketch(16)
    sketch.increment("a")
    width = sketch.width
    sketch.ensure_capacity(8)  # smaller: nothing changes
    assert (sketch.width, sketch.estimate("a")) == (width, 1)
    sketch.ensure_capacity(1000)
    assert sketch.width == 4096 and sketch.sample_size == 10_000
    assert sketch.estimate("a") == 1  # the uses counted before the room was known stay


def test_sketch_widens_with_the_models_it_counts() -> None:
    """Room for 16, 1,000 models used: the rows widen to 4 counters per model counted (so rare
    models do not share counters with hot ones), the period stays the room's, the counts stay."""
    sketch = FrequencySketch(16, sample_factor=1000)
    for _ in range(9):
        sketch.increment("hot")
    for i in range(1000):
        sketch.increment(f"m{i}")
    assert sketch.width == 4096 and sketch.sample_size == 16_000
    assert sketch.estimate("hot") == 9
    over = sum(sketch.estimate(f"m{i}") for i in range(1000)) - 1000
    assert over <= 5  # collisions over-count a handful at most


def test_sketch_ages_several_halvings_at_once() -> None:
    sketch = FrequencySketch(16, sample_factor=1000)
    for _ in range(12):
        sketch.increment("a")
    sketch.age(times=3)
    assert sketch.estimate("a") == 1 and sketch.additions == 1


# -- segments and admission -------------------------------------------------------------------


def held(policy: WTinyLFUPolicy, names: list[str]) -> list[Candidate]:
    return [Candidate(n, 1, 0.0) for n in names]


def load(policy: WTinyLFUPolicy, name: str, uses: int = 1) -> None:
    """``name`` loaded (a touch the policy takes as the load) and used ``uses`` times."""
    policy.touch(name, 1, 0.0)
    for _ in range(uses):
        policy.touch(name, 1, 0.0)


def test_a_new_model_enters_the_window_and_a_reuse_on_probation_is_protected() -> None:
    policy = WTinyLFUPolicy()
    load(policy, "a")
    assert policy.segment("a") == "window"
    load(policy, "b")
    assert policy.victims(held(policy, ["a", "b"]), need_bytes=1, free_bytes=1) == []  # fits
    # room 3, a new model of 2 (more than the window's share: it leaves the main region 1):
    # both leave the window; a enters the main region, then b must win its admission against
    # a and loses the tie
    assert policy.victims(held(policy, ["a", "b"]), need_bytes=2, free_bytes=1) == ["b"]
    assert policy.segment("a") == "probation"
    policy.touch("a", 1, 0.0)
    assert policy.segment("a") == "protected"
    policy.forget("a")
    assert policy.segment("a") is None
    policy.forget("never")  # unknown: nothing happens


def test_a_one_off_model_loses_its_admission_to_a_used_one() -> None:
    """Room for 2: 'hot' used often, then 'once' loaded and used once; the next load evicts
    'once' (it leaves the window and loses to 'hot'), where LRU evicts 'hot', the least recent."""
    policy = WTinyLFUPolicy()
    load(policy, "hot", uses=5)
    load(policy, "once")
    assert policy.victims(held(policy, ["hot", "once"]), need_bytes=1, free_bytes=0) == ["once"]
    assert policy.segment("hot") == "probation"
    lru = LRUPolicy().victims([Candidate("hot", 1, 1.0), Candidate("once", 1, 2.0)], 1, 0)
    assert lru == ["hot"]


def test_a_frequent_newcomer_is_admitted_over_a_rare_main_model() -> None:
    """Room for 2. 'a' and 'b' used once each: 'a' leaves the window for probation, 'b' ties
    with it and goes. Then 'new', used four times in the window, beats 'a'."""
    policy = WTinyLFUPolicy()
    load(policy, "a")
    load(policy, "b")
    assert policy.victims(held(policy, ["a", "b"]), need_bytes=1, free_bytes=0) == ["b"]
    assert policy.segment("a") == "probation"
    load(policy, "new", uses=4)
    assert policy.victims(held(policy, ["a", "new"]), need_bytes=1, free_bytes=0) == ["a"]
    assert policy.segment("new") == "probation"


def test_admission_is_per_byte() -> None:
    """A big model must be used proportionally more often than the small ones it displaces."""
    policy = WTinyLFUPolicy()
    policy.touch("small", 10, 0.0)
    for _ in range(3):
        policy.touch("small", 10, 0.0)
    policy.victims([Candidate("small", 10, 0.0)], need_bytes=10, free_bytes=90)  # room 100
    policy.touch("big", 80, 0.0)
    for _ in range(6):  # used twice as often, but 8 times the size
        policy.touch("big", 80, 0.0)
    candidates = [Candidate("small", 10, 0.0), Candidate("big", 80, 0.0)]
    assert policy.victims(candidates, need_bytes=20, free_bytes=10) == ["big"]


def serve_keeping_room_ahead(policy: WTinyLFUPolicy, trace: list[str], limit: int, size: int) -> int:
    """Replay ``trace`` as the server does with evictions ahead of need: a miss loads into
    free bytes (evicting only if there are none), then victims are asked, among the models
    but the one just loaded, for free bytes for two more loads. The hits."""
    resident: set[str] = set()
    hits = 0
    for name in trace:
        if name in resident:
            hits += 1
            policy.touch(name, size, 0.0)
            continue
        if limit - size * len(resident) < size:
            held = [Candidate(n, size, 0.0) for n in resident]
            for victim in policy.victims(held, size, limit - size * len(resident)):
                resident.discard(victim)
                policy.forget(victim)
        resident.add(name)
        policy.touch(name, size, 0.0)  # loaded
        policy.touch(name, size, 0.0)  # its request served
        free = limit - size * len(resident)
        if free < 2 * size:
            held = [Candidate(n, size, 0.0) for n in resident if n != name]
            for victim in policy.victims(held, 2 * size, free):
                resident.discard(victim)
                policy.forget(victim)
    return hits


def test_free_bytes_kept_for_the_next_loads_are_not_the_main_regions() -> None:
    """Room for 32.5 models, two kept free by evictions ahead of need: 29 models used in turn
    and two one-off models per round. The one-offs lose their admission, so every request for
    the 29 hits after the first round. (Counting the free bytes as the main region's room let
    the one-offs in without a contest, and they pushed out the models used every round.)"""
    hot = [f"h{i:02d}" for i in range(29)]
    trace = [name for r in range(20) for name in [*hot, f"once{r}a", f"once{r}b"]]
    assert serve_keeping_room_ahead(WTinyLFUPolicy(), trace, 325, 10) == 29 * 19


def test_pinned_models_stay_in_their_segment() -> None:
    policy = WTinyLFUPolicy()
    load(policy, "p", uses=1)
    load(policy, "q", uses=9)
    candidates = [Candidate("p", 1, 0.0, pinned=True), Candidate("q", 1, 0.0)]
    assert policy.victims(candidates, need_bytes=1, free_bytes=0) == ["q"]
    assert policy.segment("p") is not None


def test_models_it_never_saw_count_as_just_loaded() -> None:
    policy = WTinyLFUPolicy()
    load(policy, "known", uses=3)
    candidates = [Candidate("known", 1, 0.0), Candidate("stranger", 1, 0.0)]
    assert policy.victims(candidates, need_bytes=1, free_bytes=0) == ["stranger"]


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"window_fraction": 0.0}, {"protected_fraction": 1.0}, {"sample": 0}):
        with pytest.raises(ValueError):
            WTinyLFUPolicy(**kwargs)  # type: ignore[arg-type]


def test_the_policies_by_name() -> None:
    assert DEFAULT_POLICY == "tinylfu"
    assert make_policy("tinylfu").name == "tinylfu"
    assert make_policy("lru").name == "lru"
    assert make_policy("gds").name == make_policy("greedy-dual-size").name == "gds-1"
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        make_policy("fifo")


# -- on the traces ----------------------------------------------------------------------------

N, ROOM = 1000, 113


def unit(trace: list[str]) -> dict[str, int]:
    return dict.fromkeys(trace, 1)


def test_a_scan_does_not_flush_the_hot_models() -> None:
    """Room for 10; 5 hot models used in turn, then 100 models once each, then the hot ones
    again: W-TinyLFU keeps the hot models through the scan (LRU loses them all)."""
    hot = [f"hot{i}" for i in range(5)]
    trace = hot * 20 + [f"scan{i}" for i in range(100)] + hot * 2
    tiny = simulate(WTinyLFUPolicy(), trace, unit(trace), 10)
    lru = simulate(LRUPolicy(), trace, unit(trace), 10)
    assert tiny.misses == 5 + 100  # the hot models' first loads and the scan: nothing else
    assert lru.misses == 5 + 100 + 5


def shift_agings(policy: WTinyLFUPolicy) -> list[int]:
    """Record the sketch's agings of more than one halving (a shift caught early)."""
    calls: list[int] = []
    age = policy.sketch.age

    def counting(times: int = 1) -> None:
        if times > 1:
            calls.append(times)
        age(times)

    policy.sketch.age = counting  # type: ignore[method-assign]
    return calls


def test_a_shift_in_popularity_ages_the_counts_at_once() -> None:
    """Room for 11: ten models used in turn 40 times each, then ten others 20 times. The hit
    rate falls at the shift, so the counts age at once (to an eighth) and the new favourites
    win their admission within a few rounds; counts that only age at the end of the period
    keep the old favourites (their counts are as high) and the new ones miss every time."""
    old, new = [f"a{i}" for i in range(10)], [f"b{i}" for i in range(10)]
    trace = old * 40 + new * 20
    adaptive = WTinyLFUPolicy()
    caught = shift_agings(adaptive)
    fixed = WTinyLFUPolicy(adapt=False)
    tiny = simulate(adaptive, trace, unit(trace), 11)
    slow = simulate(fixed, trace, unit(trace), 11)
    assert caught == [3]
    assert all(adaptive.segment(n) is not None for n in new)
    assert not any(fixed.segment(n) for n in new[:-1])  # the last one is in the window
    assert slow.misses == 10 + 200 and tiny.misses < slow.misses / 2


@pytest.mark.parametrize("seed", [1, 2])
def test_stationary_popularity_is_not_taken_for_a_shift(seed: int) -> None:
    policy = WTinyLFUPolicy()
    caught = shift_agings(policy)
    trace = zipf_trace(N, 30_000, 1.0, seed=seed)
    simulate(policy, trace, unit(trace), ROOM)
    assert caught == []


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stationary_zipf_within_ten_percent_of_belady(seed: int) -> None:
    trace = zipf_trace(N, 30_000, 1.0, seed=seed)
    tiny = simulate(WTinyLFUPolicy(), trace, unit(trace), ROOM)
    best = belady(trace, unit(trace), ROOM)
    lru = simulate(LRUPolicy(), trace, unit(trace), ROOM)
    assert tiny.hit_rate >= 0.9 * best.hit_rate
    assert tiny.hit_rate > lru.hit_rate + 0.05


@pytest.mark.parametrize("kind", ["zipf0.8", "zipf1.2", "shifting", "scan", "mixed"])
def test_no_worse_than_lru_on_any_trace(kind: str) -> None:
    names = [f"model_{k:05d}" for k in range(N)]
    sizes: dict[str, int]
    if kind.startswith("zipf"):
        trace = zipf_trace(N, 20_000, float(kind[4:]), seed=2)
    elif kind == "shifting":
        trace = shifting_trace(N, 20_000, 1.0, seed=2, period=3000)
    elif kind == "scan":
        trace = scan_trace(N, 20_000, 1.0, seed=2)
    else:
        trace = zipf_trace(N, 20_000, 1.0, seed=2)
    sizes = mixed_sizes(names, 10, 10.0, seed=2) if kind == "mixed" else unit(names)
    budget = ROOM * (sum(sizes.values()) // len(sizes))
    tiny = simulate(WTinyLFUPolicy(), trace, sizes, budget)
    lru = simulate(LRUPolicy(), trace, sizes, budget)
    assert tiny.hit_rate >= lru.hit_rate


def test_traces_are_what_they_say() -> None:
    shifting = shifting_trace(100, 2000, 1.2, seed=1, period=1000)
    first, second = shifting[:1000], shifting[1000:]
    top = max(set(first), key=first.count)
    assert first.count(top) > 5 * max(1, second.count(top))  # the favourite changed
    scan = scan_trace(50, 300, 1.0, seed=1, scans=1)
    assert len(scan) == 350
    assert sorted(scan[150:200]) == [f"model_{k:05d}" for k in range(50)]
    sizes = mixed_sizes([f"m{i}" for i in range(500)], 10, 10.0, seed=1)
    assert min(sizes.values()) >= 10 and max(sizes.values()) <= 100
    assert max(sizes.values()) / min(sizes.values()) > 8
    assert shifting == shifting_trace(100, 2000, 1.2, seed=1, period=1000)
