"""ModelRepositoryManager: decides what is loaded and answers "which model serves this?".

In ``none`` control mode every model in the repositories is loaded at start. Loads run on
a bounded thread pool (``--model-load-thread-count``) so several models load at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quiver.backends.base import INLINE_THRESHOLD_NS
from quiver.errors import InvalidArgumentError, NotFoundError, UnavailableError
from quiver.lifecycle.loader import LoadOutcome, load_model, unload_instance
from quiver.lifecycle.model import Model, ModelState, VersionStatus
from quiver.repository.local import LocalRepository

logger = logging.getLogger(__name__)


class ModelRepositoryManager:
    def __init__(
        self,
        repositories: list[Path],
        *,
        strict_config: bool = False,
        load_threads: int = 4,
        inline_threshold_ns: int = INLINE_THRESHOLD_NS,
    ) -> None:
        self._inline_threshold_ns = inline_threshold_ns
        self._repository = LocalRepository(repositories)
        self._strict = strict_config
        self._pool = ThreadPoolExecutor(max_workers=max(1, load_threads), thread_name_prefix="quiver-load")
        self._ready: dict[str, dict[int, Model]] = {}
        self._latest: dict[str, Model] = {}
        self._status: dict[str, list[VersionStatus]] = {}

    # -- loading -----------------------------------------------------------------

    async def load_all(self) -> dict[str, str]:
        """Load every model found; returns model name -> failure reason for the ones that failed."""
        sources, clashes = self._repository.scan()
        for name, reason in clashes.items():
            logger.error("%s", reason)
            self._status[name] = [VersionStatus(name, "", ModelState.UNAVAILABLE, reason)]
        loop = asyncio.get_running_loop()
        for name in sources:
            self._status[name] = [VersionStatus(name, "", ModelState.LOADING)]
        outcomes = await asyncio.gather(
            *(
                loop.run_in_executor(self._pool, functools.partial(
                        load_model,
                        s,
                        strict=self._strict,
                        inline_threshold_ns=self._inline_threshold_ns,
                    ),)
                for s in sources.values()
            )
        )
        failures = dict(clashes)
        for name, outcome in zip(sources, outcomes, strict=True):
            self._install(name, outcome)
            if outcome.error:
                failures[name] = outcome.error
            for version, reason in outcome.failures.items():
                failures[f"{name}:{version}"] = reason
        return failures

    def _install(self, name: str, outcome: LoadOutcome) -> None:
        statuses: list[VersionStatus] = []
        if outcome.error:
            statuses.append(VersionStatus(name, "", ModelState.UNAVAILABLE, outcome.error))
        for version, reason in sorted(outcome.failures.items()):
            statuses.append(VersionStatus(name, str(version), ModelState.UNAVAILABLE, reason))
        if outcome.models:
            versions = {m.version: m for m in outcome.models}
            self._ready[name] = versions
            self._latest[name] = versions[max(versions)]
            statuses.extend(VersionStatus(name, m.version_str, ModelState.READY) for m in outcome.models)
        statuses.sort(key=lambda s: (int(s.version) if s.version else -1))
        self._status[name] = statuses

    # -- lookup (hot path) -----------------------------------------------------------

    def get(self, name: str, version: str = "") -> Model:
        """The READY model serving ``name`` (latest loaded version when ``version`` is empty)."""
        if not version or version == "-1":
            model = self._latest.get(name)
            if model is not None:
                return model
        else:
            try:
                number = int(version)
            except ValueError:
                raise InvalidArgumentError(
                    f"model '{name}': version '{version}' is not a number"
                ) from None
            found = self._ready.get(name, {}).get(number)
            if found is not None:
                return found
        raise self._missing(name, version)

    def _missing(self, name: str, version: str) -> Exception:
        statuses = self._status.get(name)
        if statuses is None:
            return NotFoundError(f"unknown model: '{name}'")
        specific = version and version != "-1"
        what = f"model '{name}'" + (f" version {version}" if specific else "")
        if specific:
            mine = [s for s in statuses if s.version == version]
            if not mine:
                if any(s.state is ModelState.READY for s in statuses):
                    loaded = ", ".join(s.version for s in statuses if s.state is ModelState.READY)
                    return NotFoundError(f"{what} is not served; versions served: {loaded}")
                mine = [s for s in statuses if s.version == ""]
            statuses = mine or statuses
        status = statuses[0]
        detail = f": {status.reason}" if status.reason else ""
        return UnavailableError(f"{what} is not ready ({status.state.value}){detail}")

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except (NotFoundError, UnavailableError, InvalidArgumentError):
            return False
        return True

    def versions(self, name: str) -> list[Model]:
        return [m for _, m in sorted(self._ready.get(name, {}).items())]

    def index(self) -> list[VersionStatus]:
        return [s for name in sorted(self._status) for s in self._status[name]]

    @property
    def ready_models(self) -> list[Model]:
        return [m for versions in self._ready.values() for m in versions.values()]

    # -- stopping --------------------------------------------------------------------

    async def stop(self) -> None:
        """Drain every model's scheduler, then unload the instances (``finalize`` runs)."""
        models = self.ready_models
        self._ready.clear()
        self._latest.clear()
        await asyncio.gather(*(m.scheduler.stop() for m in models))
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(
                loop.run_in_executor(self._pool, unload_instance, m.name, instance)
                for m in models
                for instance in m.instances
            )
        )
        self._pool.shutdown(wait=False)
