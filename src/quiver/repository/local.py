"""A Triton model repository on local disk: ``<repo>/<model>/config.pbtxt`` and version folders."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from quiver.errors import InvalidArgumentError

CONFIG_FILENAME = "config.pbtxt"
#: What ``--model-config-name`` may be: a file name's stem (Triton: no spaces).
_CONFIG_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: ``--model-config-name``: a model folder's ``configs/NAME.pbtxt``, when it has one, is its
#: configuration instead of config.pbtxt (Triton's custom model configurations). Set at start.
_custom_config_name = ""


def use_custom_config(name: str) -> None:
    """Make ``configs/NAME.pbtxt`` the configuration of the model folders that have one
    (``""``: config.pbtxt everywhere). InvalidArgumentError for a name that is not a plain
    file name's stem."""
    global _custom_config_name
    if name and not _CONFIG_NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"--model-config-name '{name}' must be a plain name (letters, digits, '_', '.', '-')"
        )
    _custom_config_name = name


def config_file(folder: Path) -> Path:
    """The configuration file of a model folder: ``configs/NAME.pbtxt`` when
    ``--model-config-name`` is NAME and the folder has it, else ``config.pbtxt``."""
    if _custom_config_name:
        custom = folder / "configs" / f"{_custom_config_name}.pbtxt"
        if custom.is_file():
            return custom
    return folder / CONFIG_FILENAME


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One model folder found in a repository, or in an archive (a namespace of its own).

    ``archive`` is the key of the archive (or storage folder) the model came from: its
    config's ``name`` need not match ``name``, which is the name it is served under.
    ``aliases`` maps the model names an ensemble's steps use inside that archive to the
    (namespaced) names those models are served under.
    """

    name: str
    repository: Path
    path: Path
    archive: str = ""
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def config_path(self) -> Path:
        return config_file(self.path)

    def versions(self) -> list[int]:
        """Numeric version folders, ascending. Other entries are ignored, as Triton does, and
        so are names starting with "0" (Triton's docs: a version is an integer > 0, written
        without leading zeros; requests for version 0 are refused)."""
        return sorted(
            {
                int(e.name)
                for e in self.path.iterdir()
                if e.name.isascii() and e.name.isdigit() and e.name[0] != "0" and e.is_dir()
            }
        )


class LocalRepository:
    """Lists the models in a set of local repository folders.

    The listing is incremental: each repository folder's entries are kept with the folder's
    modification time, and listed again only when that changed (adding, removing or renaming
    a model folder changes it), so an index of 10,000 models costs one ``stat`` per
    repository, not 10,000. What changes inside a model folder is the fingerprint's business
    (:func:`quiver.lifecycle.sources.fingerprint`), not the listing's.
    """

    def __init__(self, roots: list[Path]) -> None:
        for root in roots:
            if not root.is_dir():
                raise InvalidArgumentError(f"model repository '{root}' is not a directory")
        self.roots = roots
        self._listings: dict[Path, tuple[int, list[str]]] = {}  # root -> (mtime_ns, folder names)
        self._lock = threading.Lock()
        self._scanned: tuple[list[list[str]], dict[str, ModelSource], dict[str, str]] | None = None

    def has(self, name: str) -> bool:
        """Whether any repository has a model folder ``name`` (one ``stat`` per repository)."""
        return not name.startswith(".") and any((root / name).is_dir() for root in self.roots)

    def _folders(self, root: Path) -> list[str]:
        """The model folder names in ``root``, sorted: listed again only when ``root``'s
        modification time changed since the last listing."""
        try:
            mtime = os.stat(root).st_mtime_ns
        except OSError:
            return []
        with self._lock:
            cached = self._listings.get(root)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        with os.scandir(root) as entries:
            names = sorted(
                e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=True)
            )
        with self._lock:
            self._listings[root] = (mtime, names)
        return names

    def find(self, name: str) -> ModelSource | None:
        """The model folder ``name`` when exactly one repository has it (one ``stat`` per
        repository, no listing); ``None`` otherwise, for :meth:`scan` to explain."""
        if name.startswith("."):
            return None
        found = [root for root in self.roots if os.path.isdir(os.path.join(root, name))]
        if len(found) != 1:
            return None
        return ModelSource(name, found[0], found[0] / name)

    def scan(self) -> tuple[dict[str, ModelSource], dict[str, str]]:
        """Every model folder by name, and the names that clash between repositories (built
        again only when a repository's listing changed; the dicts returned are the caller's)."""
        listings = [self._folders(root) for root in self.roots]
        with self._lock:
            cached = self._scanned
        if cached is not None and len(cached[0]) == len(listings) and all(
            a is b for a, b in zip(cached[0], listings, strict=True)
        ):
            return dict(cached[1]), dict(cached[2])
        models, clashes = self._build(listings)
        with self._lock:
            self._scanned = (listings, models, clashes)
        return dict(models), dict(clashes)

    def _build(self, listings: list[list[str]]) -> tuple[dict[str, ModelSource], dict[str, str]]:
        models: dict[str, ModelSource] = {}
        clashes: dict[str, str] = {}
        for root, names in zip(self.roots, listings, strict=True):
            for name in names:
                if name in models:
                    clashes[name] = (
                        f"model '{name}' is in more than one repository: "
                        f"{models[name].repository} and {root}"
                    )
                    continue
                models[name] = ModelSource(name, root, root / name)
        for name in clashes:
            models.pop(name, None)
        return models, clashes
