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

from pathlib import Path

from quiver.config import parse_model_config
from quiver.errors import InvalidArgumentError, QuiverError
from quiver.repository.local import CONFIG_FILENAME, ModelSource
from quiver.repository.names import NAMESPACE_SEPARATOR, check_key_name


def namespaced(served: str, folder: str) -> str:
    """The name a composing model of archive ``served`` is served under."""
    return f"{served}{NAMESPACE_SEPARATOR}{folder}"


def is_namespaced(name: str) -> bool:
    return NAMESPACE_SEPARATOR in name


def _is_model_folder(path: Path) -> bool:
    return (path / CONFIG_FILENAME).is_file() or any(
        p.name.isdigit() and p.is_dir() for p in path.iterdir()
    )


def _ensemble_steps(folder: Path) -> set[str] | None:
    """The step model names of an ensemble folder; None when it is not an ensemble."""
    try:
        text = (folder / CONFIG_FILENAME).read_text(encoding="utf-8")
        proto = parse_model_config(text, folder / CONFIG_FILENAME, folder.name, name_must_match=False)
    except (OSError, UnicodeDecodeError, QuiverError):
        return None  # the load reports it
    if proto.platform != "ensemble":
        return None
    return {s.model_name for s in proto.ensemble_scheduling.step if s.model_name}


def archive_layout(served: str, key: str, content: Path) -> tuple[ModelSource, list[ModelSource]]:
    """The model served as ``served`` from the extracted archive ``content``, and the other
    models of the archive under their namespaced names.

    Raises :class:`InvalidArgumentError` naming the archive when it holds no model (no
    config.pbtxt) or several models of which none, or more than one, is the served one.
    """
    if _is_model_folder(content):
        if not (content / CONFIG_FILENAME).is_file():
            raise InvalidArgumentError(
                f"archive '{key}' holds no config.pbtxt: a model archive needs its model's "
                "configuration"
            )
        return ModelSource(served, content.parent, content, archive=key), []
    folders = sorted(
        d for d in content.iterdir() if d.is_dir() and not d.is_symlink() and not d.name.startswith(".")
    )
    models = [f for f in folders if (f / CONFIG_FILENAME).is_file()]
    if not models:
        found = ", ".join(f"'{f.name}/'" for f in folders) or "nothing"
        raise InvalidArgumentError(
            f"archive '{key}' holds no model: no config.pbtxt at its top or in a model folder "
            f"(it holds {found})"
        )
    if len(models) == 1:
        top = models[0]
    else:
        ensembles: dict[str, set[str]] = {}
        for folder in models:
            steps = _ensemble_steps(folder)
            if steps is not None:
                ensembles[folder.name] = steps
        used = set().union(*ensembles.values()) if ensembles else set()
        tops = [f for f in models if f.name in ensembles and f.name not in used]
        if len(tops) != 1:
            names = ", ".join(f.name for f in models)
            why = (
                f"several ensembles that no other model uses ({', '.join(f.name for f in tops)})"
                if tops
                else "no ensemble that no other model uses"
            )
            raise InvalidArgumentError(
                f"archive '{key}' holds several models ({names}) and {why}: cannot tell which "
                "one to serve (Triton's rule: the only model, else the one top-level ensemble)"
            )
        top = tops[0]
    aliases = tuple(
        (f.name, served if f == top else namespaced(served, f.name)) for f in models
    )
    source = ModelSource(served, content, top, archive=key, aliases=aliases)
    members = [
        ModelSource(namespaced(served, f.name), content, f, archive=key, aliases=aliases)
        for f in models
        if f != top
    ]
    return source, members


__all__ = [
    "NAMESPACE_SEPARATOR",
    "archive_layout",
    "check_key_name",
    "is_namespaced",
    "namespaced",
]
