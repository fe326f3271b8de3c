"""W-TinyLFU: an admission filter over a frequency sketch, a small recency window and a
segmented main region, sized in bytes.

The idea is Einziger, Friedman & Manes, "TinyLFU: A Highly Efficient Cache Admission Policy"
(2017), as Caffeine runs it: LRU throws frequency away, so a one-off request for a cold model
evicts a model that is used every second. Here every use is counted in a small
:class:`FrequencySketch` (count-min, 4-bit counters, all halved every few thousand uses so that
old popularity fades), and models live in three LRU segments:

- the **window** (``window_fraction`` of the room, 1% by default): every newly loaded model
  enters here, so a burst of requests for a new model is served from memory before the model
  has to prove itself;
- **probation**: models that left the window and won their admission, and models demoted from
  protected; the main region's victims come from here first;
- **protected** (``protected_fraction`` of the main region, 80% by default): models used again
  while on probation.

When a load needs room, models leaving the window (its least recent first, while the window
is over its share) are *candidates* for the main region: each is compared to the main
region's next victim and the one with the lower estimated frequency **per byte** goes (a tie evicts the candidate, so a scan of models used
once cannot flush the main region). Per byte makes it size-aware as GreedyDual-Size-Frequency
is: to keep the most hits in a given room, a model twice the size must be used twice as
often. With equal sizes it is plain frequency, as in TinyLFU. The main region's victim is
taken from probation (protected when probation has none evictable): of its 16 least recent
models, the lowest frequency per byte.

Popularity that shifts is followed two ways: the sketch halves its counters every
``40 * models held`` uses, and when the hit rate over the last tenth of that period falls 5
points or more below its usual level (an exponential average of the tenths before), the counts
are stale: they age at once, to an eighth. A long period keeps stationary popularity well
counted; the fall of the hit rate catches a shift within a tenth of it. (On the traces of
``benchmarks.eviction``, over five seeds, this took stationary Zipf 1.0 from 0.899x Belady to
0.905x and shifting popularity from 0.802x to 0.810x; an online LFU that counts every past
request exactly, and never forgets, reaches 0.909x on stationary Zipf 1.0.)

The policy cannot refuse a load (the server must load a model to answer its request): the new
model always enters the window, and admission decides which model leaves the cache, the
window's candidate or the main region's victim.

The room is learnt from each :meth:`WTinyLFUPolicy.victims` call (free bytes plus what the
candidates hold). A touch of a model the policy does not hold is its load (it enters the window,
not counted as a use: the request that asked for it touches it again when it is served); a
touch of a model it holds is a use.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from quiver.lifecycle.eviction import Candidate, fits_at_all

__all__ = ["FrequencySketch", "WTinyLFUPolicy"]

_COUNTER_MAX = 15  # 4-bit counters, as in TinyLFU
_ROWS = 4
_SHIFT = 0.05  # a fall of the hit rate below its usual level that ages the sketch at once
_SHIFT_AGES = 3  # how many halvings it ages by then (counts to an eighth)
_LOOKS = 10  # looks at the hit rate per sketch period
_USUAL = 0.3  # weight of the latest look in the usual hit rate (an exponential average)
_HALVE = bytes(i >> 1 for i in range(256))  # bytes.translate table: every counter halved
_MAX_WIDTH = 1 << 20  # counters per row at most (4 MiB in all): room for 256k models' counts


class FrequencySketch:
    """A count-min sketch of model uses with aging.

    ``_ROWS`` rows of 4-bit counters (kept one per byte), ``width`` counters per row (a power
    of two). :meth:`increment` adds one to the smallest of a name's counters (conservative
    update, which keeps over-counting from hash collisions low); :meth:`estimate` is the
    smallest. After ``sample_size`` increments every counter is halved (aging), so the sketch
    reflects roughly the last ``sample_size`` uses. :meth:`ensure_capacity` sizes it for a
    cache holding that many models: sample ``sample_factor * models``, and width at least
    ``4 * models``. The width also follows the number of models counted (at least 4 counters
    per name, rounded up to a power of two, up to ``_MAX_WIDTH``): a repository of many
    models with room for a few would otherwise share every counter among several models and
    over-count the rare ones. Growing keeps every count (each known name is counted again in
    the wider rows), so the first uses, counted before the room is known, are not lost.
    """

    def __init__(self, models: int = 16, *, sample_factor: int = 10) -> None:
        self._sample_factor = sample_factor
        self._width = 0
        self._rows: list[bytearray] = []
        self.sample_size = 0
        self.additions = 0
        self._hashes: dict[str, tuple[int, ...]] = {}  # name -> its row hashes (32 bits each)
        self.ensure_capacity(models)

    @property
    def width(self) -> int:
        return self._width

    def ensure_capacity(self, models: int) -> None:
        """Size the sketch for a cache of ``models`` models (grows only, keeping the counts)."""
        models = max(16, models)
        self.sample_size = max(self.sample_size, self._sample_factor * models)
        self._grow(models)

    def _grow(self, models: int) -> None:
        width = min(_MAX_WIDTH, 1 << (4 * models - 1).bit_length())
        if width <= self._width:
            return
        counts = [(name, self.estimate(name)) for name in self._hashes] if self._rows else []
        self._width = width
        self._rows = [bytearray(width) for _ in range(_ROWS)]
        mask = width - 1
        for name, count in counts:
            if count:
                for row, h in zip(self._rows, self._hashes[name], strict=True):
                    row[h & mask] = max(row[h & mask], count)

    def _index(self, name: str) -> tuple[int, ...]:
        found = self._hashes.get(name)
        if found is None:
            digest = hashlib.blake2b(name.encode(), digest_size=4 * _ROWS).digest()
            found = tuple(int.from_bytes(digest[4 * r : 4 * r + 4], "little") for r in range(_ROWS))
            if len(self._hashes) >= _MAX_WIDTH:  # names are bounded; this is a backstop
                self._hashes.clear()
            self._hashes[name] = found
            if 4 * len(self._hashes) > self._width:
                self._grow(len(self._hashes))
        mask = self._width - 1
        return tuple(h & mask for h in found)

    def estimate(self, name: str) -> int:
        """How often ``name`` was used lately (an over-estimate only through collisions)."""
        return min(row[i] for row, i in zip(self._rows, self._index(name), strict=True))

    def increment(self, name: str) -> None:
        indexes = self._index(name)
        current = min(row[i] for row, i in zip(self._rows, indexes, strict=True))
        if current >= _COUNTER_MAX:
            return
        for row, i in zip(self._rows, indexes, strict=True):
            if row[i] == current:
                row[i] = current + 1
        self.additions += 1
        if self.additions >= self.sample_size:
            self.age()

    def age(self, times: int = 1) -> None:
        """Halve every counter (``times`` times)."""
        table = _HALVE if times == 1 else bytes(i >> times for i in range(256))
        self._rows = [bytearray(row.translate(table)) for row in self._rows]
        self.additions >>= times


class WTinyLFUPolicy:
    """W-TinyLFU with size-aware admission (see the module notes).

    ``window_fraction`` is the window's share of the room, ``protected_fraction`` the
    protected segment's share of the main region, ``sample_factor`` the sketch's period in
    uses per model held, ``sample`` how many of a segment's least recent models the main
    region's victim is chosen among (by frequency per byte), ``adapt`` whether a sudden fall
    of the hit rate ages the sketch at once. The defaults are tuned on the traces of
    ``benchmarks.eviction`` (stationary Zipf, shifting popularity, scans, mixed sizes).
    """

    name = "tinylfu"

    def __init__(
        self,
        *,
        window_fraction: float = 0.01,
        protected_fraction: float = 0.8,
        sample_factor: int = 40,
        sample: int = 16,
        adapt: bool = True,
    ) -> None:
        if not 0 < window_fraction < 1:
            raise ValueError("window_fraction must be between 0 and 1")
        if not 0 < protected_fraction < 1:
            raise ValueError("protected_fraction must be between 0 and 1")
        if sample_factor < 1 or sample < 1:
            raise ValueError("sample_factor and sample must be positive")
        self._window_fraction = window_fraction
        self._protected_fraction = protected_fraction
        # name -> size in bytes; least recently used first
        self._window: OrderedDict[str, int] = OrderedDict()
        self._probation: OrderedDict[str, int] = OrderedDict()
        self._protected: OrderedDict[str, int] = OrderedDict()
        self._sample = sample
        self._room = 0  # bytes, learnt from victims()
        self.sketch = FrequencySketch(sample_factor=sample_factor)
        self._adapt = adapt
        self._unserved: set[str] = set()  # loaded, the request that asked not yet served
        self._hits = self._misses = 0  # since the last look at the hit rate
        self._usual_rate: float | None = None

    def _count(self, hit: bool) -> None:
        """Popularity shifts: every tenth of a sketch period of requests, once the room is
        known, compare the hit rate with its usual level (an exponential average of the looks
        before, which noise moves less than a single look); when it fell by ``_SHIFT`` or more,
        the counts are stale, so they age now, by ``_SHIFT_AGES`` halvings, rather than at the
        end of the period, and the usual level starts again from here."""
        if hit:
            self._hits += 1
        else:
            self._misses += 1
        total = self._hits + self._misses
        if not self._adapt or self._room <= 0 or total < max(1, self.sketch.sample_size // _LOOKS):
            return
        rate = self._hits / total
        self._hits = self._misses = 0
        usual = self._usual_rate
        if usual is not None and rate <= usual - _SHIFT:
            self.sketch.age(times=_SHIFT_AGES)
        elif usual is not None:
            rate = _USUAL * rate + (1 - _USUAL) * usual
        self._usual_rate = rate

    # -- what the manager tells it ----------------------------------------------------------

    def segment(self, name: str) -> str | None:
        """``"window"``, ``"probation"``, ``"protected"``, or None (not held)."""
        for label, segment in self._segments():
            if name in segment:
                return label
        return None

    def _segments(self) -> tuple[tuple[str, OrderedDict[str, int]], ...]:
        return (
            ("window", self._window),
            ("probation", self._probation),
            ("protected", self._protected),
        )

    def touch(self, name: str, size: int, now: float, *, load_cost_s: float | None = None) -> None:
        if name in self._window:
            self._window[name] = size
            self._window.move_to_end(name)
        elif name in self._probation:
            del self._probation[name]
            self._protected[name] = size
            self._rebalance_protected()
        elif name in self._protected:
            self._protected[name] = size
            self._protected.move_to_end(name)
        else:
            self._window[name] = size  # just loaded: not a use yet (see the module notes)
            self._unserved.add(name)
            return
        self.sketch.increment(name)
        if name in self._unserved:
            self._unserved.discard(name)
            self._count(hit=False)
        else:
            self._count(hit=True)

    def forget(self, name: str) -> None:
        self._unserved.discard(name)
        for _, segment in self._segments():
            segment.pop(name, None)

    def _rebalance_protected(self) -> None:
        """Protected over its share: its least recent models go back to probation."""
        if self._room <= 0:
            return
        limit = self._protected_fraction * (self._room - self._window_limit())
        total = sum(self._protected.values())
        while total > limit and len(self._protected) > 1:
            name, size = self._protected.popitem(last=False)
            self._probation[name] = size
            total -= size

    def _window_limit(self) -> int:
        return max(1, int(self._window_fraction * self._room))

    # -- choosing ---------------------------------------------------------------------------

    def _density(self, name: str, size: int) -> float:
        return self.sketch.estimate(name) / max(1, size)

    def victims(
        self, candidates: Sequence[Candidate], need_bytes: int, free_bytes: int
    ) -> list[str]:
        if need_bytes <= free_bytes or not fits_at_all(candidates, need_bytes, free_bytes):
            return []
        loaded = {c.name: c for c in candidates}
        window, probation, protected = self._window, self._probation, self._protected
        for c in candidates:  # sizes as measured; a model never touched counts as just loaded
            name = c.name
            if name in probation:
                probation[name] = c.size_bytes
            elif name in protected:
                protected[name] = c.size_bytes
            else:
                window[name] = c.size_bytes
        self._room = free_bytes + sum(c.size_bytes for c in candidates)
        self.sketch.ensure_capacity(len(candidates) + 1)
        evictable = {n for n, c in loaded.items() if not c.pinned}
        chosen: list[str] = []
        freed = 0
        # The new model enters the window: the window's least recent models beyond its share
        # become candidates for the main region.
        window_bytes = need_bytes + sum(s for n, s in self._window.items() if n in loaded)
        window_limit = self._window_limit()
        leaving = [n for n in self._window if n in evictable]

        def evict(name: str) -> None:
            nonlocal freed
            freed += loaded[name].size_bytes
            chosen.append(name)
            evictable.discard(name)
            self.forget(name)

        # The main region's share: the room less the window's, or less what is needed when
        # that is more (a model larger than the window's share, or free bytes kept for the
        # next loads: those are not the main region's to fill).
        main_room = self._room - max(window_limit, need_bytes)
        main_bytes = sum(
            c.size_bytes
            for c in candidates
            if c.name in self._probation or c.name in self._protected
        )
        for candidate in leaving:
            if window_bytes <= window_limit:
                break
            size = loaded[candidate].size_bytes
            window_bytes -= size
            victim = self._main_victim(evictable)
            contest = main_bytes + size > main_room and free_bytes + freed < need_bytes
            if contest and victim is not None:
                if self._density(candidate, size) <= self._density(
                    victim, loaded[victim].size_bytes
                ):
                    evict(candidate)  # no more valuable than what the main region would lose
                    continue
                main_bytes -= loaded[victim].size_bytes
                evict(victim)
            # the main region has room for it, or it won its admission
            del self._window[candidate]
            self._probation[candidate] = size
            main_bytes += size
        while free_bytes + freed < need_bytes:
            # the window is within its share: the main region's victims go (or, when all that
            # is evictable is in the window, the window's least recent)
            victim = self._main_victim(evictable) or next(
                (n for n in self._window if n in evictable), None
            )
            assert victim is not None  # fits_at_all: something evictable remains
            evict(victim)
        return chosen

    def _main_victim(self, evictable: set[str]) -> str | None:
        """The main region's next victim: from probation, else protected; of the segment's
        ``sample`` least recent evictable models, the lowest frequency per byte (the least
        recent of those on a tie)."""
        for segment in (self._probation, self._protected):
            oldest = list(itertools.islice((n for n in segment if n in evictable), self._sample))
            if oldest:
                return min(oldest, key=lambda n: self._density(n, segment[n]))
        return None
