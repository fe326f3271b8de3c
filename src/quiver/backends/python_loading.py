"""Importing a Python model's ``model.py`` for :mod:`quiver.backends.python`: each instance
gets the file as a fresh module in a private package (so two models whose files are both
``model.py`` do not share state), imported under a lock (imports change ``sys.path`` and
``sys.modules``) and forgotten again on release; and finding its ``TritonPythonModel``.

Imports only worker-safe modules: a model's worker process runs it too (possibly under another
Python, see :mod:`quiver.backends.python_stub`).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any, Protocol

from quiver.backends.python_convert import _model_error
from quiver.errors import InternalError, format_exception


class ModelFiles(Protocol):
    """Where the model is (``quiver.backends.base.ModelFiles`` is one; a worker has its own)."""

    @property
    def model_dir(self) -> Path: ...

    @property
    def version(self) -> int: ...

    @property
    def version_dir(self) -> Path: ...

#: Serialises imports: they change sys.path and sys.modules.
_IMPORT_LOCK = threading.Lock()
_module_counter = itertools.count(1)


def _slug(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _is_within(path: str | None, folder: Path) -> bool:
    if not path:
        return False
    try:
        return Path(path).resolve().is_relative_to(folder)
    except (OSError, ValueError):
        return False


class _LoadedModule:
    """A model file imported as ``<private package>.<stem>``."""

    def __init__(self, module: types.ModuleType, package: str) -> None:
        self.module = module
        self.package = package

    def forget(self) -> None:
        """Drop the private package and everything under it from ``sys.modules``."""
        prefix = self.package + "."
        # list() copies the keys in one step: another thread (a model loading in parallel) may
        # import while this runs, and iterating sys.modules itself would then fail.
        for name in [n for n in list(sys.modules) if n == self.package or n.startswith(prefix)]:
            sys.modules.pop(name, None)


def _import_model_file(path: Path, files: ModelFiles, where: str, model_name: str) -> _LoadedModule:
    """Import ``path`` under a unique module name.

    As in Triton, the version folder and the model folder are on ``sys.path`` while the
    file is imported (only then, here), and the file's folder is a package, so both
    ``import helpers`` and ``from . import helpers`` find sibling modules. Modules
    imported from the model's own folder are taken out of ``sys.modules`` afterwards
    so another model's ``helpers.py`` is not mistaken for this one's.
    """
    if not path.is_file():
        raise InternalError(f"{where}: Python model file not found: '{path}'")
    package = f"_quiver_python_model_{_slug(model_name)}_v{files.version}_{next(_module_counter)}"
    module_name = f"{package}.{_slug(path.stem)}"
    model_root = files.model_dir.resolve()
    with _IMPORT_LOCK:
        package_module = types.ModuleType(package)
        package_module.__path__ = [str(path.parent)]
        package_module.__package__ = package
        sys.modules[package] = package_module
        loader = importlib.machinery.SourceFileLoader(module_name, str(path))
        spec = importlib.util.spec_from_loader(module_name, loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        loaded = _LoadedModule(module, package)

        added = [
            folder
            for folder in (str(files.version_dir), str(files.model_dir))
            if folder not in sys.path
        ]
        sys.path.extend(added)
        before = set(sys.modules)
        try:
            loader.exec_module(module)
        except (Exception, SystemExit) as exc:
            loaded.forget()
            raise _model_error(
                exc, f"{where}: importing {path.name} failed: {format_exception(exc)}"
            ) from exc
        finally:
            for folder in added:
                with contextlib.suppress(ValueError):
                    sys.path.remove(folder)
            for name in set(sys.modules) - before:
                if name == package or name.startswith(package + "."):
                    continue
                found = sys.modules.get(name)
                if _is_within(getattr(found, "__file__", None), model_root):
                    sys.modules.pop(name, None)
    return loaded


def _model_class(loaded: _LoadedModule, path: Path, where: str) -> Any:
    cls = getattr(loaded.module, "TritonPythonModel", None)
    if cls is None or not isinstance(cls, type):
        raise InternalError(f"{where}: {path.name} does not define a class 'TritonPythonModel'")
    return cls
