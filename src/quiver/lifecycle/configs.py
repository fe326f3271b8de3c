"""Model configurations parsed, auto-completed and validated once per version of the files.

A miss that reloads a model evicted earlier would otherwise read and parse its
``config.pbtxt`` three times (is it an ensemble, which framework, the load), open a framework
session just to auto-complete it, and validate it again, every time. :class:`ConfigCache`
remembers, per model folder *and fingerprint of its files* (the manager's fingerprint of a
folder changes when any file is added, removed, resized or rewritten; an archive's
extraction is a new folder), the configuration as read and the configuration as prepared for
a load (completed, validated, its labels and version folders). A changed file is a new
fingerprint, hence a fresh read: nothing stale is ever used. Loads with a configuration
override (the repository API) bypass it.

Entries are shared and must not be changed by their readers. Bounded (least recently used
entries go first), thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tritonclient.grpc import model_config_pb2 as pb

from quiver.config import ModelConfig
from quiver.repository.local import ModelSource

__all__ = ["ConfigCache", "PreparedConfig"]

#: Entries kept: two per model (as read, as prepared) for a repository of 10,000 models.
DEFAULT_CAPACITY = 20_000


@dataclass(frozen=True, slots=True)
class PreparedConfig:
    """A configuration ready to load from: completed and validated, with the model's labels
    and its version folders on disk."""

    proto: pb.ModelConfig
    config: ModelConfig
    labels: dict[str, list[str]]
    versions: tuple[int, ...]


class ConfigCache:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._capacity = capacity
        self._entries: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(kind: str, source: ModelSource, fingerprint: str, strict: bool) -> tuple[Any, ...]:
        return (kind, str(source.path), source.name, source.archive, source.aliases, fingerprint, strict)

    def _get(self, key: tuple[Any, ...]) -> Any:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def _put(self, key: tuple[Any, ...], value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def read(self, source: ModelSource, fingerprint: str, strict: bool) -> pb.ModelConfig | None:
        """The configuration as read (not completed) for these files, if seen before."""
        found: pb.ModelConfig | None = self._get(self._key("read", source, fingerprint, strict))
        return found

    def remember_read(self, source: ModelSource, fingerprint: str, strict: bool, proto: pb.ModelConfig) -> None:
        self._put(self._key("read", source, fingerprint, strict), proto)

    def prepared(self, source: ModelSource, fingerprint: str, strict: bool) -> PreparedConfig | None:
        """The configuration prepared for a load of these files, if one loaded before."""
        found: PreparedConfig | None = self._get(self._key("prepared", source, fingerprint, strict))
        return found

    def remember_prepared(
        self, source: ModelSource, fingerprint: str, strict: bool, prepared: PreparedConfig
    ) -> None:
        self._put(self._key("prepared", source, fingerprint, strict), prepared)

    @property
    def capacity(self) -> int:
        """The most entries kept."""
        return self._capacity

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
