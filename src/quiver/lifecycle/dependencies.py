"""What models need of each other: the one place that answers "is this a model folder", "is
this an ensemble (and of what)", "which model does this repository serve", and keeps the
graph of what is loaded, pinned and unloaded together.

Two kinds of edges, both kept by :class:`DependencyGraph` (pure: no I/O, no asyncio):

- **ensemble -> composing models**: an ensemble never runs without its composing models, so
  they load before it, are pinned while it is in flight or loading, and unloading one of
  them unloads the ensembles that need it first (its *dependents*).
- **archive namespace**: a model served from an archive (or storage folder) and the other
  models of that archive, served as ``<key>::<folder>`` (:mod:`quiver.lifecycle.archives`);
  the namespace is loaded, pinned, evicted and unloaded as one, and holds the archive's
  disk-cache lease while its model is loaded.

The functions above the class read configs and folders (they block: call them on a load
thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as pb

from quiver.config import parse_model_config
from quiver.errors import InvalidArgumentError, QuiverError
from quiver.lifecycle.configs import ConfigCache
from quiver.lifecycle.loader import read_proto
from quiver.repository.local import CONFIG_FILENAME, ModelSource, config_file

__all__ = [
    "DependencyGraph",
    "Namespace",
    "composing_of",
    "ensemble_steps",
    "folder_steps",
    "is_model_folder",
    "model_folders",
    "served_folder",
    "served_model",
]


def is_model_folder(path: Path) -> bool:
    """True when ``path`` is one model's folder (a config.pbtxt or a numeric version folder),
    False when it is a repository of model folders (archives and SageMaker urls hold either)."""
    return (path / CONFIG_FILENAME).is_file() or any(
        p.name.isdigit() and p.is_dir() for p in path.iterdir()
    )


def ensemble_steps(proto: pb.ModelConfig) -> set[str] | None:
    """The models an ensemble config's steps run; None when it is not an ensemble."""
    if proto.platform != "ensemble":
        return None
    return {s.model_name for s in proto.ensemble_scheduling.step if s.model_name}


def folder_steps(folder: Path) -> set[str] | None:
    """:func:`ensemble_steps` of a model folder's config.pbtxt as written (step names as the
    folder's repository uses them); None when it is not an ensemble or cannot be read (its
    load reports why)."""
    try:
        path = config_file(folder)
        text = path.read_text(encoding="utf-8")
        proto = parse_model_config(text, path, folder.name, name_must_match=False)
    except (OSError, UnicodeDecodeError, QuiverError):
        return None
    return ensemble_steps(proto)


def composing_of(
    source: ModelSource,
    *,
    strict: bool,
    override: pb.ModelConfig | None = None,
    configs: ConfigCache | None = None,
    fingerprint: str = "",
) -> list[str] | None:
    """The models the ensemble at ``source`` is composed of, sorted (the names it is served
    with: an archive's steps are namespaced); None when it is not an ensemble or its config
    cannot be read (errors are left for the load to report)."""
    try:
        proto = read_proto(source, strict=strict, override=override, configs=configs, fingerprint=fingerprint)
    except QuiverError:
        return None
    steps = ensemble_steps(proto)
    return None if steps is None else sorted(steps)


def served_model(what: str, models: Mapping[str, set[str] | None]) -> str:
    """Which of a repository's ``models`` (folder name -> its ensemble steps, None for other
    models) it serves, by Triton's rule: its only model, else the one ensemble that no other
    model of the repository uses. InvalidArgumentError naming ``what`` otherwise."""
    if len(models) == 1:
        return next(iter(models))
    ensembles = {name: steps for name, steps in models.items() if steps is not None}
    used = set().union(*ensembles.values()) if ensembles else set()
    tops = [name for name in models if name in ensembles and name not in used]
    if len(tops) == 1:
        return tops[0]
    why = (
        f"several ensembles that no other model uses ({', '.join(tops)})"
        if tops
        else "no ensemble that no other model uses"
    )
    raise InvalidArgumentError(
        f"{what} holds several models ({', '.join(models)}) and {why}: cannot tell which "
        "one to serve (Triton's rule: the only model, else the one top-level ensemble)"
    )


def model_folders(content: Path) -> list[Path]:
    """The model folders of a repository folder: folders (not hidden, not symbolic links)
    with a config.pbtxt, sorted."""
    return sorted(
        d
        for d in content.iterdir()
        if d.is_dir() and not d.is_symlink() and not d.name.startswith(".") and (d / CONFIG_FILENAME).is_file()
    )


def served_folder(content: Path, what: str) -> Path:
    """The model folder a repository folder ``content`` (an extracted archive, a SageMaker
    url) serves: ``content`` itself when it is a model folder (it must have a config.pbtxt),
    else by :func:`served_model` among its model folders (those with a config.pbtxt; hidden
    folders and symbolic links are not looked at). InvalidArgumentError naming ``what``."""
    if is_model_folder(content):
        if not (content / CONFIG_FILENAME).is_file():
            raise InvalidArgumentError(
                f"{what} holds no config.pbtxt: a model archive needs its model's configuration"
            )
        return content
    folders = sorted(
        d for d in content.iterdir() if d.is_dir() and not d.is_symlink() and not d.name.startswith(".")
    )
    models = model_folders(content)
    if not models:
        found = ", ".join(f"'{f.name}/'" for f in folders) or "nothing"
        raise InvalidArgumentError(
            f"{what} holds no model: no config.pbtxt at its top or in a model folder (it holds {found})"
        )
    steps = {f.name: folder_steps(f) if len(models) > 1 else None for f in models}
    return content / served_model(what, steps)


@dataclass(slots=True)
class Namespace:
    """An archive's namespace: the model served under its key, the archive's other models by
    their namespaced names, and how to give back the archive's disk-cache lease."""

    served: str
    key: str
    members: dict[str, ModelSource] = field(default_factory=dict)
    release: Callable[[], None] | None = None


class DependencyGraph:
    def __init__(self) -> None:
        self._composing: dict[str, set[str]] = {}  # loaded ensemble -> its composing models
        self._loading: dict[str, set[str]] = {}  # ensemble loading -> the same
        self._namespaces: dict[str, Namespace] = {}
        self._namespace_of: dict[str, str] = {}  # member -> the served name of its archive

    # -- ensembles ---------------------------------------------------------------------

    @contextlib.contextmanager
    def loading(self, ensemble: str, composing: list[str]) -> Iterator[None]:
        """While ``ensemble`` loads its composing models."""
        self._loading[ensemble] = set(composing)
        try:
            yield
        finally:
            self._loading.pop(ensemble, None)

    def set_composing(self, ensemble: str, composing: list[str]) -> None:
        """``ensemble`` is loaded with these composing models."""
        self._composing[ensemble] = set(composing)

    def forget_ensemble(self, ensemble: str) -> set[str]:
        """``ensemble`` is unloaded; its composing models."""
        return self._composing.pop(ensemble, set())

    def composing(self, ensemble: str) -> set[str]:
        """The composing models of a loaded ensemble (empty for any other model)."""
        return set(self._composing.get(ensemble, ()))

    @property
    def ensembles(self) -> dict[str, set[str]]:
        """Loaded ensemble -> its composing models."""
        return {e: set(c) for e, c in self._composing.items()}

    def requires(self, name: str) -> set[str]:
        """What ``name`` needs, directly: its composing models, loaded or loading."""
        return self._composing.get(name, set()) | self._loading.get(name, set())

    def closure(self, name: str) -> set[str]:
        """Everything ``name`` needs, through nested ensembles."""
        seen: set[str] = set()
        todo = [name]
        while todo:
            for dep in self.requires(todo.pop()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        seen.discard(name)
        return seen

    def dependents(self, name: str, serving: Callable[[str], bool]) -> list[str]:
        """Loaded ensembles (``serving``) that have ``name`` among their composing models."""
        return [e for e, deps in self._composing.items() if name in deps and serving(e)]

    # -- archive namespaces ------------------------------------------------------------

    def add_namespace(self, namespace: Namespace) -> None:
        self._namespaces[namespace.served] = namespace
        for member in namespace.members:
            self._namespace_of[member] = namespace.served

    def has_namespace(self, served: str) -> bool:
        return served in self._namespaces

    def namespace(self, served: str) -> Namespace | None:
        return self._namespaces.get(served)

    def pop_namespace(self, served: str) -> Namespace | None:
        """Forget the namespace of ``served`` (its members are no longer served by name)."""
        namespace = self._namespaces.pop(served, None)
        if namespace is not None:
            for member in namespace.members:
                self._namespace_of.pop(member, None)
        return namespace

    def pop_namespaces(self) -> list[Namespace]:
        namespaces = list(self._namespaces.values())
        self._namespaces.clear()
        self._namespace_of.clear()
        return namespaces

    @property
    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def member(self, name: str) -> ModelSource | None:
        """Where a model of a loaded archive's namespace comes from."""
        served = self._namespace_of.get(name)
        return None if served is None else self._namespaces[served].members.get(name)

    def namespace_of(self, name: str) -> str | None:
        """The served name of the archive ``name`` is a model of, if any."""
        return self._namespace_of.get(name)
