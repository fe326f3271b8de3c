"""The served-model table and the repository index: which versions of which models are READY,
and what the index says of every model the server knows (state and reason per version).

Reading (:meth:`ModelTable.get` is the hot path of every request) is for everyone; changing
is for :class:`quiver.lifecycle.lifecycle.ModelLifeCycle` alone, which calls
:meth:`install`, :meth:`take` and :meth:`mark` as versions load and unload. Residency
listeners (a cluster router) hear every change of what is served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator

from quiver import messages
from quiver.errors import NotFoundError, UnavailableError
from quiver.lifecycle.clock import Clock, seconds
from quiver.lifecycle.loader import LoadOutcome
from quiver.lifecycle.model import Model, ModelState, VersionStatus, parse_version

__all__ = ["ModelTable"]

logger = logging.getLogger(__name__)


class ModelTable:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._ready: dict[str, dict[int, Model]] = {}
        self._latest: dict[str, Model] = {}
        self._status: dict[str, list[VersionStatus]] = {}
        self._listeners: list[Callable[[str, bool], None]] = []
        #: Called with a model each time a request that will run on it looks it up
        #: (``get(..., use=True)``: the eviction policy's use count; None when the policy
        #: does not care).
        self.on_use: Callable[[Model], None] | None = None
        #: (name, version) -> instance -> why it cannot serve (a worker that cannot start)
        self._down: dict[tuple[str, int], dict[str, str]] = {}

    # -- reading -----------------------------------------------------------------------

    def get(self, name: str, version: str = "", *, use: bool = False) -> Model:
        """The READY model serving ``name`` (latest loaded version when ``version`` is empty).

        ``use``: a request will run on it, so it counts as a use (its last use is now, and the
        eviction policy counts it). A look that runs nothing (readiness, metadata, config,
        statistics) is not a use: a client or a probe that polls a model's readiness does not
        keep it in memory, nor make it look more popular than its requests do.

        Every version a client names (HTTP paths, gRPC fields, the SageMaker and ensemble
        paths) is checked here, once: not a positive integer is INVALID_ARG."""
        number = parse_version(name, version) if version else None
        model = self._latest.get(name) if number is None else self._ready.get(name, {}).get(number)
        if model is None:
            raise self._missing(name, "" if number is None else str(number))
        if self._down:
            self._check_health(model)
        if use:
            model.last_used = seconds(self._clock)
            if self.on_use is not None:
                self.on_use(model)
        return model

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except (NotFoundError, UnavailableError):
            return False
        return True

    def serving(self, name: str) -> bool:
        """Whether any version of ``name`` is READY (no lookup is counted)."""
        return name in self._ready

    def latest(self, name: str) -> Model | None:
        """The latest READY version of ``name`` (no lookup is counted)."""
        return self._latest.get(name)

    def loaded(self, name: str) -> list[Model]:
        """The READY versions of ``name``, by version."""
        return [m for _, m in sorted(self._ready.get(name, {}).items())]

    def versions(self) -> Iterator[tuple[str, Collection[Model]]]:
        """Each served name with its READY versions (unordered; iterate without awaiting)."""
        return ((name, versions.values()) for name, versions in self._ready.items())

    @property
    def names(self) -> list[str]:
        return list(self._ready)

    @property
    def models(self) -> list[Model]:
        return [m for versions in self._ready.values() for m in versions.values()]

    def known(self, name: str) -> bool:
        """Whether the index has anything to say of ``name`` (loaded, or tried)."""
        return name in self._status

    def reason(self, name: str) -> str:
        """Why ``name`` is not served, from its index entries."""
        return next((s.reason for s in self._status.get(name, []) if s.reason), "not loaded")

    def index(self) -> list[VersionStatus]:
        """Every model version known, with its state and reason."""
        statuses = [s for name in sorted(self._status) for s in self._status[name]]
        if self._down:
            statuses = [self._health_status(s) for s in statuses]
        return statuses

    # -- instance health (a Python model's workers that cannot start) -------------------

    def set_health(self, name: str, version: int, instance: str, reason: str | None) -> None:
        """An instance of ``name`` cannot serve now (``reason``) or serves again (None).
        While every instance of a version cannot, it is UNAVAILABLE with the reason."""
        key = (name, version)
        if reason is None:
            down = self._down.get(key)
            if down is not None:
                down.pop(instance, None)
                if not down:
                    del self._down[key]
        else:
            self._down.setdefault(key, {})[instance] = reason

    def _unhealthy(self, model: Model) -> str | None:
        down = self._down.get((model.name, model.version))
        if not down or len(down) < max(1, len(model.instances)):
            return None
        return next(iter(down.values()))

    def _check_health(self, model: Model) -> None:
        reason = self._unhealthy(model)
        if reason is not None:
            raise UnavailableError(
                f"model '{model.name}' version {model.version} is not ready (UNAVAILABLE): {reason}"
            )

    def _health_status(self, status: VersionStatus) -> VersionStatus:
        if status.state is not ModelState.READY:
            return status
        model = self._ready.get(status.name, {}).get(int(status.version)) if status.version else None
        reason = self._unhealthy(model) if model is not None else None
        if reason is None:
            return status
        return VersionStatus(status.name, status.version, ModelState.UNAVAILABLE, reason)

    def _missing(self, name: str, version: str) -> Exception:
        statuses = self._status.get(name)
        if statuses is None:
            return NotFoundError(messages.unknown_model(name))
        specific = bool(version)
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

    # -- changing (the life cycle only) ------------------------------------------------

    def mark(self, name: str, state: ModelState, reason: str = "") -> None:
        """One index entry for the whole model (no version)."""
        self._status[name] = [VersionStatus(name, "", state, reason)]

    def mark_loading(self, name: str) -> list[VersionStatus] | None:
        """One LOADING entry for ``name``; returns what the index showed before (None: nothing),
        for :meth:`restore`."""
        before = self._status.get(name)
        self._status[name] = [VersionStatus(name, "", ModelState.LOADING)]
        return before

    def restore(self, name: str, statuses: list[VersionStatus] | None) -> None:
        """Show ``statuses`` for ``name`` again (what :meth:`mark_loading` returned)."""
        if statuses is None:
            self._status.pop(name, None)
        else:
            self._status[name] = statuses

    def mark_versions(self, name: str, models: list[Model], state: ModelState, reason: str = "") -> None:
        self._status[name] = [VersionStatus(name, m.version_str, state, reason) for m in models]

    def was_ready(self, name: str) -> bool:
        """Whether the index shows a READY version of ``name``."""
        return any(s.state is ModelState.READY for s in self._status.get(name, []))

    def forget(self, name: str) -> None:
        self._status.pop(name, None)

    def install(self, name: str, outcome: LoadOutcome) -> None:
        """Serve what a load gave (replacing what served ``name``), with its failures in the index."""
        statuses: list[VersionStatus] = []
        if outcome.error:
            statuses.append(VersionStatus(name, "", ModelState.UNAVAILABLE, outcome.error))
        for version, reason in sorted(outcome.failures.items()):
            statuses.append(VersionStatus(name, str(version), ModelState.UNAVAILABLE, reason))
        if outcome.models:
            now = seconds(self._clock)
            for model in outcome.models:
                model.loaded_at = now
            versions = {m.version: m for m in outcome.models}
            self._ready[name] = versions
            self._latest[name] = versions[max(versions)]
            statuses.extend(VersionStatus(name, m.version_str, ModelState.READY) for m in outcome.models)
            self._tell(name, True)
        else:
            if self._ready.pop(name, None):
                self._tell(name, False)
            self._latest.pop(name, None)
        statuses.sort(key=lambda s: (int(s.version) if s.version else -1))
        self._status[name] = statuses

    def take(self, name: str) -> list[Model]:
        """Take ``name`` out of service (new requests find it not ready); its versions."""
        for key in [k for k in self._down if k[0] == name]:
            del self._down[key]
        versions = self._ready.pop(name, None)
        self._latest.pop(name, None)
        if versions:
            self._tell(name, False)
        return list(versions.values()) if versions else []

    def take_all(self) -> list[Model]:
        """Everything out of service, each model marked UNLOADING (the server stops)."""
        models = self.models
        for name, versions in self._ready.items():
            self._status[name] = [VersionStatus(name, str(v), ModelState.UNLOADING) for v in versions]
        self._ready.clear()
        self._latest.clear()
        return models

    # -- residency ---------------------------------------------------------------------

    def add_listener(self, listener: Callable[[str, bool], None]) -> None:
        self._listeners.append(listener)

    def _tell(self, name: str, resident: bool) -> None:
        for listener in self._listeners:
            try:
                listener(name, resident)
            except Exception:
                logger.exception("residency listener failed for model '%s'", name)
