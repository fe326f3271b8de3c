"""The one validator of names and paths that come from clients and end up on the filesystem.

Every name a client sends that Quiver may turn into a path passes through here before any
``stat``, ``open`` or ``mkdir`` sees it, so a name the filesystem would reject (a NUL byte, a
component longer than ``NAME_MAX``) or one that could leave its folder (``..``, an absolute
path, a backslash) is an :class:`~quiver.errors.InvalidArgumentError` naming it, never an
``OSError`` or ``ValueError`` from deep inside a load (which would be a 500):

- :func:`check_model_name`: a model name as requests carry it (the v2 routes, gRPC, the
  repository API, SageMaker's TargetModel). One folder name: no ``/``, ``\\``, NUL or other
  control characters, not ``.`` or ``..``, at most :data:`NAME_MAX` bytes encoded (an
  archive's namespaced ``<key>::<folder>`` names count each side apart).
- :func:`check_key_name`: a model name that is looked up as a storage key (an archive
  ``resnet_v0.tar.gz`` or an S3 folder): letters, digits and ``._-+=@,`` only, starting with
  a letter or digit, no ``..``, at most :data:`NAME_MAX` bytes.
- :func:`check_key`: a ``/``-separated key relative to a storage root (S3 object keys,
  objects of an S3 model folder): relative, no ``.``/``..``/empty components, no backslash or
  control characters, each component at most :data:`NAME_MAX` bytes, the whole at most
  :data:`MAX_KEY_BYTES` (S3's own limit).
- :func:`check_file_path`: a ``file:`` parameter of the repository API's load
  (``file:1/model.onnx``): a key as above whose first component is a version number.
- :func:`check_local_path`: a local path a client names (SageMaker's ``url``): no NUL or
  control characters, each component at most :data:`NAME_MAX` bytes, the whole at most
  :data:`PATH_MAX` bytes.

Lengths are counted in bytes of the UTF-8 encoding (what the kernel counts); a name that
cannot be encoded (a lone surrogate) is refused too.
"""

from __future__ import annotations

import re

from quiver.errors import InvalidArgumentError

#: Longest file or folder name (bytes) Linux filesystems take (ext4, xfs, tmpfs, overlayfs).
NAME_MAX = 255
#: Longest path (bytes) the kernel takes in one call.
PATH_MAX = 4096
#: Longest storage key (bytes): S3's limit on object keys.
MAX_KEY_BYTES = 1024

#: Separates an archive's key from the folder name of one of its composing models.
NAMESPACE_SEPARATOR = "::"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@,-]*")


def _q(text: str, limit: int = 80, *, size: bool = True) -> str:
    """``text`` quoted for a message: control characters escaped, a long one cut short
    (with its length in bytes when ``size``)."""
    safe = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    if len(safe) <= limit:
        return f"'{safe}'"
    if not size:
        return f"'{safe[:limit]}...'"
    return f"'{safe[:limit]}...' ({len(text.encode('utf-8', 'surrogatepass'))} bytes)"


def _size(text: str) -> int | None:
    """Bytes of ``text`` in UTF-8; None when it cannot be encoded (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _components_problem(parts: list[str]) -> str:
    """Why one of ``parts`` cannot be a file name ('' when none)."""
    for part in parts:
        size = _size(part)
        if size is None:
            return "it is not valid UTF-8"
        if size > NAME_MAX:
            which = "it" if len(parts) == 1 else f"its component {_q(part, 40, size=False)}"
            return f"{which} is {size} bytes, more than the {NAME_MAX} a file name may have"
    return ""


def _model_name_problem(name: str) -> str:
    if not name:
        return "it is empty"
    if _CONTROL.search(name):
        return "it contains a NUL or control character"
    if name in (".", "..") or "/" in name or "\\" in name:
        return "it must be a folder name, without '/', '\\' or NUL, and not '.' or '..'"
    return _components_problem(name.split(NAMESPACE_SEPARATOR))


def check_model_name(name: str) -> str:
    """A model name from a request; returns it. See the module docstring."""
    problem = _model_name_problem(name)
    if problem:
        raise InvalidArgumentError(f"{_q(name)} is not a valid model name: {problem}")
    return name


def check_key_name(name: str) -> str:
    """A model name that becomes a storage key; returns it. See the module docstring."""
    problem = _model_name_problem(name)
    if not problem and (not _KEY_NAME.fullmatch(name) or ".." in name):
        problem = (
            f"a model addressed by archive or storage key may use letters, digits and "
            f"'._-+=@,' (at most {NAME_MAX} bytes), must start with a letter or digit, and may "
            "not contain '..', '/' or '\\'"
        )
    if problem:
        raise InvalidArgumentError(f"{_q(name)} is not a valid model name: {problem}")
    return name


def _key_problem(key: str) -> str:
    if _CONTROL.search(key):
        return "it contains a NUL or control character"
    if key.startswith("/") or "\\" in key:
        return "it must be a relative path with '/' separators"
    parts = key[:-1].split("/") if key.endswith("/") else key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "'.', '..' and empty components are not allowed"
    size = _size(key)
    if size is not None and size > MAX_KEY_BYTES:
        return f"it is {size} bytes, more than {MAX_KEY_BYTES}"
    return _components_problem(parts)


def check_key(key: str, *, allow_empty: bool = False, what: str = "storage key") -> str:
    """A ``/``-separated key relative to a storage root; returns it. A trailing ``/`` (a
    prefix) is allowed. See the module docstring."""
    if not key and allow_empty:
        return key
    problem = _key_problem(key) if key else "it is empty"
    if problem:
        raise InvalidArgumentError(f"invalid {what} {_q(key)}: {problem}")
    return key


def check_file_paths(paths: list[str], model: str) -> None:
    """The paths of a load's ``file:`` parameters (``1/model.onnx``): each a key as
    :func:`check_key` takes it, inside a version folder, and none a folder of another
    (``1/a`` and ``1/a/b`` cannot both be files)."""
    known = set(paths)
    for path in paths:
        parts = path.split("/")
        problem = _key_problem(path) if path else "it is empty"
        if not problem and (path.endswith("/") or len(parts) < 2 or not parts[0].isdecimal()):
            problem = "it is not inside a version folder"
        if not problem:
            for depth in range(1, len(parts)):
                folder = "/".join(parts[:depth])
                if folder in known:
                    problem = f"{_q('file:' + folder)} is a file too, not a folder"
                    break
        if problem:
            raise InvalidArgumentError(
                f"failed to load {_q(model)}: file parameter {_q('file:' + path)}: {problem}; "
                "it must name a file inside a version folder, such as 'file:1/model.onnx'"
            )


def check_local_path(path: str, what: str = "path") -> str:
    """A local path a client names (absolute or relative); returns it."""
    size = _size(path)
    if not path:
        problem = "it is empty"
    elif _CONTROL.search(path):
        problem = "it contains a NUL or control character"
    elif size is not None and size > PATH_MAX:
        problem = f"it is {size} bytes, more than {PATH_MAX}"
    else:
        problem = _components_problem([p for p in path.split("/") if p])
    if problem:
        raise InvalidArgumentError(f"{what} {_q(path)} is not a usable path: {problem}")
    return path


__all__ = [
    "MAX_KEY_BYTES",
    "NAMESPACE_SEPARATOR",
    "NAME_MAX",
    "PATH_MAX",
    "check_file_paths",
    "check_key",
    "check_key_name",
    "check_local_path",
    "check_model_name",
]
