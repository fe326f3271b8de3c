"""A Triton model repository on local disk: ``<repo>/<model>/config.pbtxt`` and version folders."""

from __future__ import annotations

import re
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
    """Lists the models in a set of local repository folders."""

    def __init__(self, roots: list[Path]) -> None:
        for root in roots:
            if not root.is_dir():
                raise InvalidArgumentError(f"model repository '{root}' is not a directory")
        self.roots = roots

    def find(self, name: str) -> ModelSource | None:
        """The model folder ``name`` when exactly one repository has it (one ``stat`` per
        repository, no listing); ``None`` otherwise, for :meth:`scan` to explain."""
        found = [root for root in self.roots if (root / name).is_dir()]
        if len(found) != 1 or name.startswith("."):
            return None
        return ModelSource(name, found[0], found[0] / name)

    def scan(self) -> tuple[dict[str, ModelSource], dict[str, str]]:
        """Every model folder by name, and the names that clash between repositories."""
        models: dict[str, ModelSource] = {}
        clashes: dict[str, str] = {}
        for root in self.roots:
            for entry in sorted(root.iterdir()):
                if not entry.is_dir() or entry.name.startswith("."):
                    continue
                if entry.name in models:
                    clashes[entry.name] = (
                        f"model '{entry.name}' is in more than one repository: "
                        f"{models[entry.name].repository} and {root}"
                    )
                    continue
                models[entry.name] = ModelSource(entry.name, root, entry)
        for name in clashes:
            models.pop(name, None)
        return models, clashes
