"""A worker under a model's own Python (EXECUTION_ENV_PATH) gets a private copy of the Quiver
modules it needs: every module those modules import from Quiver must be in the copy."""

from __future__ import annotations

import ast
from pathlib import Path

import quiver
from quiver.backends.python_env import WORKER_MODULES

SRC = Path(quiver.__file__).parent.parent


def _module_file(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] not in ("quiver", "triton_python_backend_utils"):
        return None
    base = SRC.joinpath(*parts)
    if (base / "__init__.py").exists():
        return str((base / "__init__.py").relative_to(SRC))
    return str(base.with_suffix(".py").relative_to(SRC))


def test_the_worker_modules_are_closed_under_their_imports() -> None:
    copied = set(WORKER_MODULES)
    missing: dict[str, set[str]] = {}
    for relative in WORKER_MODULES:
        tree = ast.parse((SRC / relative).read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                path = _module_file(name)
                if path is not None and (SRC / path).exists() and path not in copied:
                    missing.setdefault(relative, set()).add(path)
    assert not missing, f"imported by worker modules but not copied for a foreign Python: {missing}"
