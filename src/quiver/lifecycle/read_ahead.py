"""Configurations read ahead: the local repositories' model configurations parsed (and
prepared, where that needs nothing more) while the server is idle, before their models' first
requests.

A model's first miss reads its ``config.pbtxt`` and parses it (protobuf's text format, in
Python), then completes and validates it, before the framework can create its session: 0.13
and 0.05 ms on a warm core, 0.4-0.5 and 0.3 ms as a miss finds them, their code out of the
CPU's caches after the server was idle, on a 3-4 ms miss. In ``on_demand`` mode the manager
reads the configurations of the local model folders ahead (:class:`ReadAhead`), one folder
per trip to a load thread, only while no request came or went for :data:`IDLE_S`, into the
:class:`~quiver.lifecycle.configs.ConfigCache` its loads read from. A configuration is also
prepared (auto-completed, validated: :func:`~quiver.lifecycle.loader.prepare_ahead`) when its
framework has been imported and completes it without opening the model; the folders read
before their framework was imported are looked at again once every folder was read. Entries
are keyed by the fingerprint of the folder's files, taken with the read: a file changed
afterwards is a new fingerprint, read again when the model loads, so nothing stale is ever
used; a configuration that cannot be read is left for its load to report.

It costs what the cache keeps for a model that loaded once (a few KB), for at most half the
cache's capacity (the rest stays for the loads' entries), and nothing on the requests' path: a
trip holds the memory meter's shared section, so it never runs while a load is measured, and
waits while requests come and go. Folders added after the start, and models the index knows
already (loaded, or tried), are read by their loads.

A request can still arrive while a trip runs (the lull before it was only a gap between
requests, e.g. while the client read ``/metrics``); the trip then stops at its next step
(before the walk, the parse or the preparation) and the miss waits for that step only. The
lull the next trip waits for doubles after each trip a request came during (up to
:data:`MAX_LULL_S`), and halves back towards :data:`IDLE_S` when a trip starts after a lull
at least twice as long as the one it waited for: a stream of requests with short gaps between
them meets a trip or two, not one per gap, and a long lull reads at full speed again. The
work is as long as the repository (0.4-0.5 ms a folder): with 10,000 folders, reading the
first 5,000 takes seconds of lulls, and without that rule a miss at 10,000 models met a trip
in most gaps and cost more than one at 1,000, whose reading was long done (#19).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from quiver.errors import QuiverError
from quiver.lifecycle.clock import Clock
from quiver.lifecycle.configs import ConfigCache
from quiver.lifecycle.idle import IDLE_S, Activity
from quiver.lifecycle.loader import prepare_ahead
from quiver.lifecycle.memory import MemoryMeter
from quiver.lifecycle.pool import LoadPool
from quiver.lifecycle.sources import fingerprint_and_size
from quiver.lifecycle.watch import FolderWatch
from quiver.repository.local import ModelSource

__all__ = ["BUSY", "IDLE_S", "MAX_LULL_S", "ReadAhead", "read_config"]  # IDLE_S: lifecycle/idle.py's, re-exported

logger = logging.getLogger(__name__)


#: What :func:`read_config` says when a request came before it was done (it stopped: again later).
BUSY = "busy"

#: The longest lull a trip waits for after trips that requests came during (see the module notes).
MAX_LULL_S = 1.0


def read_config(
    source: ModelSource,
    configs: ConfigCache,
    strict: bool,
    watch: FolderWatch | None = None,
    idle: Callable[[], bool] | None = None,
) -> str:
    """Blocking (a load thread): ``source``'s configuration read, and prepared where it can be
    (:func:`~quiver.lifecycle.loader.prepare_ahead`), into ``configs`` under the fingerprint of
    its files: "prepared", "read", or "" (it cannot be read: its load says why). ``watch``:
    the walk of the folder goes through it (its first miss then walks nothing). ``idle``:
    asked before the walk, before the configuration is parsed and before it is prepared;
    :data:`BUSY` when it says no before the parse (a request came: reading a configuration
    takes 0.3-0.4 ms of a core and of the GIL, which a miss arriving meanwhile waited for),
    "read" when it says no after it."""
    if idle is not None and not idle():
        return BUSY
    if watch is not None:
        fingerprint, _ = watch.walk(source, fingerprint_and_size)
    else:
        fingerprint, _ = fingerprint_and_size(source.path)
    if idle is not None and not idle():
        return BUSY
    try:
        return "prepared" if prepare_ahead(source, strict, configs, fingerprint, idle) else "read"
    except QuiverError:
        return ""


class ReadAhead:
    """Reads the configurations of the folders :meth:`run` is given while the server is idle
    (:meth:`busy` is told of every request)."""

    def __init__(
        self,
        *,
        configs: ConfigCache,
        pool: LoadPool,
        meter: MemoryMeter,
        clock: Clock,
        strict: bool,
        activity: Activity | None = None,
    ) -> None:
        self._configs = configs
        self._pool = pool
        self._meter = meter
        self._strict = strict
        self._clock = clock
        self._activity = activity if activity is not None else Activity(clock)
        #: The walks of the folders go through it (set by the manager once started).
        self.watch: FolderWatch | None = None
        self.read = 0  # configurations read ahead
        self.prepared = 0  # ...and prepared too
        #: The lull (seconds) the next trip waits for: longer after trips requests came during.
        self.lull = IDLE_S

    def busy(self) -> None:
        """A request came or went: the server is not idle for :data:`IDLE_S`."""
        self._activity.busy()

    async def run(self, sources: list[ModelSource]) -> None:
        """Read the configurations of ``sources``, in order, each when the server is idle,
        until the cache holds half its capacity; then once more those only read (their
        framework may have been imported since)."""
        again = [s for s in sources if await self._one(s) == "read"]
        for source in again:
            await self._one(source)
        logger.debug("%d model configuration(s) read ahead, %d prepared", self.read, self.prepared)

    async def _one(self, source: ModelSource) -> str:
        """One folder read when idle: what :func:`read_config` says ("" also when the cache
        holds half its capacity, or the folder could not be walked)."""
        if len(self._configs) >= self._configs.capacity // 2:
            return ""
        activity = self._activity
        done = BUSY
        while done == BUSY:  # stopped by a request: again at the next lull
            await activity.idle(self.lull)
            since = activity.last
            if self._clock.now() - since >= 2 * self.lull * 1e9:  # a lull twice as long: gaps are long again
                self.lull = max(IDLE_S, self.lull / 2)

            def still_idle() -> bool:
                return activity.last == since  # noqa: B023 - read while this round lasts

            read = functools.partial(read_config, source, self._configs, self._strict, self.watch, still_idle)
            try:
                done = await self._pool.run(self._meter.shared, read)
            except Exception as exc:  # an OS error: that folder is its load's business
                logger.debug("reading the configuration of '%s' ahead failed: %s", source.name, exc)
                return ""
            if activity.last != since:  # a request came while this trip ran: the lull was a gap
                self.lull = min(MAX_LULL_S, self.lull * 2)
        self.read += bool(done)
        self.prepared += done == "prepared"
        return done
