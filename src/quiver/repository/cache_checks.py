"""Asking a store which version of a cached key is current: once, bounded in time (:meth:`ask`),
or later, in the background, after the copy on disk was handed out (:meth:`due`, then
:meth:`start` once the model has loaded from it, so the two do not compete for the CPU).
A background check that finds another version, or the key gone, calls ``outdated(ident)``:
the cache then asks first at the key's next fetch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from quiver.errors import InvalidArgumentError, NotFoundError, UnavailableError
from quiver.repository.cache_download import _resolve
from quiver.repository.cache_types import CacheStats
from quiver.repository.storage import S3Storage, Storage, StoredObject

logger = logging.getLogger("quiver.repository.cache")

#: A cached key: (storage location, key).
Ident = tuple[str, str]


class VersionChecks:
    """The store's answers for one :class:`~quiver.repository.cache.DiskCache`."""

    def __init__(self, timeout: float, stats: CacheStats, outdated: Callable[[Ident], None]) -> None:
        if not timeout > 0:
            raise InvalidArgumentError(f"model cache revalidation timeout must be positive, got {timeout}")
        self.timeout = timeout
        self._stats = stats
        self._outdated = outdated
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: set[Ident] = set()
        self._due: dict[Ident, tuple[str, Storage]] = {}

    async def ask(self, storage: Storage, key: str) -> tuple[str, list[StoredObject]]:
        """The current version of ``key``, asked with one short attempt: UnavailableError
        when the store does not answer within ``timeout``."""
        seconds = self.timeout

        def ask() -> tuple[str, list[StoredObject]]:
            quick = storage.with_timeout(seconds) if isinstance(storage, S3Storage) else storage
            return _resolve(quick, key)

        try:
            return await asyncio.wait_for(asyncio.to_thread(ask), seconds)
        except TimeoutError:
            raise UnavailableError(
                f"{storage.location} did not answer within {seconds:g} s "
                "(--model-cache-revalidate-timeout)"
            ) from None

    def due(self, ident: Ident, version: str, storage: Storage) -> None:
        """``version`` of ``ident`` was handed out unasked: check it at :meth:`start`."""
        self._due[ident] = (version, storage)

    def start(self, ident: Ident) -> None:
        """Start the check left due for ``ident``, if any (one per key at a time)."""
        due = self._due.pop(ident, None)
        if due is None or ident in self._running:
            return
        self._running.add(ident)
        task = asyncio.get_running_loop().create_task(self._check(ident, *due))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, ident: Ident, version: str, storage: Storage) -> None:
        try:
            now, _ = await self.ask(storage, ident[1])
        except NotFoundError:
            now = None
        except Exception as exc:  # the store cannot say now: the next fetch asks again
            logger.debug("model cache: background check of '%s' failed: %s", ident[1], exc)
            return
        finally:
            self._running.discard(ident)
        if now == version:
            return
        self._stats.outdated += 1
        logger.info(
            "model cache: '%s' in %s %s; the next load fetches it again",
            ident[1], storage.location, "is gone" if now is None else f"has a new version ({now})",
        )
        self._outdated(ident)

    async def close(self) -> None:
        """Cancel the checks under way."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Ident", "VersionChecks"]
