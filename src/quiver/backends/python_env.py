"""Which Python a model's workers run: the server's own, or the model's ``EXECUTION_ENV_PATH``.

``parameters { key: "EXECUTION_ENV_PATH" value: { string_value:
"$$TRITON_MODEL_DIRECTORY/processing_env.tar.gz" } }`` names a Python environment packed with
``conda-pack`` (a ``.tar.gz`` holding ``bin/python``, ``lib/...``) or a folder holding one.
``$$TRITON_MODEL_DIRECTORY`` is the model's folder; a relative path is taken from there. An
archive is unpacked once into ``<cache>/python-envs/<sha256 of the archive>`` with the disk
cache's safe extraction (:func:`quiver.repository.archive.extract_archive`: no member escapes,
no link is followed, sizes and counts capped), so models sharing an environment share the copy
and a changed archive gets a fresh one. The environment must provide numpy, as Triton requires.

Such a worker runs isolated (``python -I``): it sees its environment's packages and, on its
``sys.path`` first, a private copy of the few Quiver modules a worker needs (:func:`worker_tree`),
never the server's own packages.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import quiver
from quiver.errors import ConfigError, InvalidArgumentError
from quiver.repository.archive import extract_archive

#: The model config parameter naming the environment.
ENV_PARAMETER = "EXECUTION_ENV_PATH"
_MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")

#: The modules a worker imports, relative to the folder holding the ``quiver`` package.
WORKER_MODULES = (
    "triton_python_backend_utils.py",
    "quiver/__init__.py",
    "quiver/errors.py",
    "quiver/profiling.py",
    "quiver/types.py",
    "quiver/streaming.py",
    "quiver/protocol/__init__.py",
    "quiver/protocol/bytes_codec.py",
    "quiver/ipc/__init__.py",
    "quiver/ipc/channel.py",
    "quiver/ipc/inbox.py",
    "quiver/ipc/messages.py",
    "quiver/ipc/shm.py",
    "quiver/ipc/tensors.py",
    "quiver/backends/__init__.py",
    "quiver/backends/python_convert.py",
    "quiver/backends/python_loading.py",
    "quiver/backends/python_readiness.py",
    "quiver/backends/python_sender.py",
    "quiver/backends/python_stub.py",
    "quiver/backends/python_stub_bls.py",
    "quiver/backends/python_stub_senders.py",
    "quiver/backends/python_stub_wire.py",
)

_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class PythonEnv:
    """A model's Python: the interpreter, its environment's root (None: the server's own)."""

    python: str
    root: Path | None = None

    @property
    def isolated(self) -> bool:
        return self.root is not None

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """The worker's environment variables: as ``conda activate`` would set them."""
        env = dict(base)
        if self.root is not None:
            env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
            libs = str(self.root / "lib")
            env["LD_LIBRARY_PATH"] = f"{libs}{os.pathsep}{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else libs
            env["CONDA_PREFIX"] = str(self.root)
            for name in ("PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV"):
                env.pop(name, None)
        return env


def source_root() -> Path:
    """The folder holding the ``quiver`` package (and ``triton_python_backend_utils``)."""
    return Path(quiver.__file__).resolve().parent.parent


def worker_tree(cache_root: Path) -> Path:
    """A folder holding a copy of :data:`WORKER_MODULES`, keyed by their content (made once)."""
    source = source_root()
    digest = hashlib.sha256()
    for relative in WORKER_MODULES:
        digest.update(relative.encode())
        digest.update((source / relative).read_bytes())
    folder = cache_root / "python-worker" / digest.hexdigest()[:24]
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        for relative in WORKER_MODULES:
            target = temporary / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / relative, target)
        try:
            temporary.rename(folder)
        except OSError:  # another server made it meanwhile
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder


def resolve(parameters: dict[str, str], model: str, model_dir: Path, cache_root: Path) -> PythonEnv | None:
    """The environment the model's ``EXECUTION_ENV_PATH`` names (unpacked when it is an
    archive), or None when it names none. ConfigError / InvalidArgumentError name the model."""
    value = parameters.get(ENV_PARAMETER, "").strip()
    if not value:
        return None
    path = Path(value.replace(_MODEL_DIRECTORY, str(model_dir)))
    if not path.is_absolute():
        path = model_dir / path
    where = f"model '{model}': {ENV_PARAMETER} '{value}'"
    if path.is_dir():
        root = path
    elif path.is_file() and path.name.endswith(_ARCHIVE_SUFFIXES):
        root = _unpack(path, cache_root, where)
    elif path.exists():
        raise ConfigError(f"{where} is neither a folder nor a .tar.gz archive")
    else:
        raise ConfigError(f"{where}: '{path}' does not exist")
    for name in ("python3", "python"):
        python = root / "bin" / name
        if python.is_file() and os.access(python, os.X_OK):
            return PythonEnv(str(python), root)
    raise ConfigError(f"{where} holds no Python interpreter (bin/python3 or bin/python)")


def _unpack(archive: Path, cache_root: Path, where: str) -> Path:
    digest = hashlib.sha256()
    with open(archive, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    envs = cache_root / "python-envs"
    folder = envs / digest.hexdigest()[:32]
    with _lock:
        if folder.is_dir():
            return folder
        envs.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=".tmp-", dir=envs))
        try:
            try:
                extract_archive(archive, temporary, name=archive.name)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{where}: {exc.message}") from None
            try:
                temporary.rename(folder)
            except OSError:
                if not folder.is_dir():
                    raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(temporary)
    return folder
