"""Models addressed by key: archives (``resnet_v0.tar.gz``) and storage folders, each its own namespace.

An archive holds one model folder, or a Triton repository (several model folders, such as
an ensemble and its composing models). As in Triton's SageMaker mode, the model served
under the archive's key is its only model, else the one ensemble that no other model of the
archive uses. The other models of the archive are served under namespaced names
(``<key>::<folder>``), so two archives may both hold a ``preprocess`` without colliding; the
steps of the archive's ensembles are rewritten to those names when their configs are read
(:func:`quiver.lifecycle.loader.read_config`, through :attr:`ModelSource.aliases`).

Everything here blocks (it reads the extracted files): run it on a load thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from quiver.errors import AlreadyExistsError
from quiver.lifecycle.dependencies import DependencyGraph, model_folders, served_folder
from quiver.repository.local import ModelSource
from quiver.repository.names import NAMESPACE_SEPARATOR, check_key_name


def namespaced(served: str, folder: str) -> str:
    """The name a composing model of archive ``served`` is served under."""
    return f"{served}{NAMESPACE_SEPARATOR}{folder}"


def is_namespaced(name: str) -> bool:
    return NAMESPACE_SEPARATOR in name


def archive_layout(
    served: str, key: str, content: Path, *, namespacing: bool = True
) -> tuple[ModelSource, list[ModelSource]]:
    """The model served as ``served`` from the extracted archive ``content``, and the other
    models of the archive under their namespaced names (``namespacing``, the default), or
    under their own folder names (``--model-namespacing=false``: two archives may then not
    both hold a model of one name).

    Raises :class:`InvalidArgumentError` naming the archive when it holds no model (no
    config.pbtxt) or several models of which none, or more than one, is the served one.
    """
    top = served_folder(content, f"archive '{key}'")
    if top == content:
        return ModelSource(served, content.parent, content, archive=key), []
    models = model_folders(content)
    def member(folder: str) -> str:
        return namespaced(served, folder) if namespacing else folder

    aliases = tuple((f.name, served if f == top else member(f.name)) for f in models)
    source = ModelSource(served, content, top, archive=key, aliases=aliases)
    members = [
        ModelSource(member(f.name), content, f, archive=key, aliases=aliases)
        for f in models
        if f != top
    ]
    return source, members


__all__ = [
    "NAMESPACE_SEPARATOR",
    "ArchiveLayouts",
    "archive_layout",
    "check_key_name",
    "is_namespaced",
    "namespaced",
]


class ArchiveLayouts:
    """:func:`archive_layout` once per extracted archive. The disk cache extracts each download
    into a folder of its own (its name unique to that download) whose files are checked
    against its manifest each time it is handed out (a file added, missing or changed: it is
    dropped and fetched into a new folder), so what a folder's layout was it stays: a model
    reloaded from the disk cache reads it from here, on the event loop, instead of listing
    the archive's folders on a load thread (0.27 ms of a 5 ms reload, that code out of the
    CPU's caches). At most ``capacity`` kept, the least recently used forgotten first."""

    def __init__(self, *, namespacing: bool = True, capacity: int = 4096) -> None:
        self._namespacing = namespacing
        self._capacity = capacity
        self._kept: OrderedDict[tuple[str, str, Path], tuple[ModelSource, list[ModelSource]]] = OrderedDict()
        self._lock = threading.Lock()

    def kept(self, served: str, key: str, content: Path) -> tuple[ModelSource, list[ModelSource]] | None:
        """The layout read before for this extracted archive, if any (non-blocking)."""
        with self._lock:
            found = self._kept.get((served, key, content))
            if found is not None:
                self._kept.move_to_end((served, key, content))
        return found

    def read(self, served: str, key: str, content: Path) -> tuple[ModelSource, list[ModelSource]]:
        """Blocking: :func:`archive_layout` of ``content``, kept."""
        found = archive_layout(served, key, content, namespacing=self._namespacing)
        with self._lock:
            self._kept[(served, key, content)] = found
            while len(self._kept) > self._capacity:
                self._kept.popitem(last=False)
        return found


def check_members_free(
    served: str,
    key: str,
    members: list[ModelSource],
    graph: DependencyGraph,
    serving: Callable[[str], bool],
    busy: Callable[[str], bool],
) -> None:
    """Without model namespacing an archive's other models keep their own names: one that
    another archive (``graph``'s namespaces) or the repository serves (``serving``), or is
    loading (``busy``), is a conflict (AlreadyExistsError)."""
    taken = []
    for member in members:
        owner = graph.namespace_of(member.name)
        if owner is not None and owner != served:
            taken.append(f"'{member.name}' (loaded with '{owner}')")
        elif owner is None and (serving(member.name) or busy(member.name)):
            taken.append(f"'{member.name}'")
    if taken:
        raise AlreadyExistsError(
            f"cannot load '{served}' from '{key}': its model(s) {', '.join(taken)} are already "
            "loaded; without model namespacing (--model-namespacing=false) no two loaded "
            "folders may hold models of one name"
        )
