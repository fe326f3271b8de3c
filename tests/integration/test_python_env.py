"""``EXECUTION_ENV_PATH``: a Python model runs with the Python environment packed next to it
(conda-pack's layout, built here with ``venv``), unpacked once into the cache with the safe
extraction; a package that exists only there imports, the server's own packages do not; an
environment without numpy, a corrupt archive and a hostile one each fail their model's load
with the reason, and the other models load."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from support.models import write_python
from support.server import QuiverServer

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
parameters {{ key: "EXECUTION_ENV_PATH" value {{ string_value: "{env}" }} }}
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "PYTHON", data_type: TYPE_STRING, dims: [ 1 ] }} ]
"""

# tinypkg_only_here exists only in the packed environment; psutil only in the server's.
MODEL = """
import importlib.util
import sys

import numpy as np
import tinypkg_only_here
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        leaked = importlib.util.find_spec("psutil") is not None
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor(
                    "OUTPUT0",
                    pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
                    + tinypkg_only_here.VALUE + (1000 if leaked else 0),
                ),
                pb_utils.Tensor("PYTHON", np.array([sys.executable.encode()], dtype=object)),
            ])
            for r in requests
        ]
"""


def make_env(folder: Path, numpy_dir: Path | None) -> Path:
    """A relocatable environment in conda-pack's layout (bin/python3, lib/python3.X/site-packages)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    subprocess.run([str(base), "-m", "venv", "--without-pip", "--copies", str(folder)], check=True)
    site = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "tinypkg_only_here").mkdir()
    (site / "tinypkg_only_here" / "__init__.py").write_text("VALUE = 42\n")
    if numpy_dir is not None:
        # numpy itself is not copied in (73 MB): a path file names a folder holding only it
        (site / "numpy_only.pth").write_text(f"{numpy_dir}\n")
    return folder


def pack(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return archive


@pytest.fixture(scope="module")
def numpy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("numpy_only")
    real = Path(np.__file__).parent
    os.symlink(real, folder / "numpy")
    libs = real.parent / "numpy.libs"
    if libs.exists():
        os.symlink(libs, folder / "numpy.libs")
    return folder


def test_models_run_with_their_packed_environment(tmp_path: Path, numpy_dir: Path) -> None:
    repo = tmp_path / "repo"
    env = make_env(tmp_path / "env", numpy_dir)
    packed = write_python(repo, "packed", MODEL, CONFIG.format(name="packed", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz"))
    pack(env, packed / "env.tar.gz")
    twin = write_python(repo, "twin", MODEL, CONFIG.format(name="twin", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz"))
    pack(env, twin / "env.tar.gz")
    write_python(repo, "folder", MODEL, CONFIG.format(name="folder", env=str(env)))
    no_numpy = write_python(repo, "no_numpy", MODEL, CONFIG.format(name="no_numpy", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz"))
    pack(make_env(tmp_path / "bare", None), no_numpy / "env.tar.gz")
    corrupt = write_python(repo, "corrupt", MODEL, CONFIG.format(name="corrupt", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz"))
    (corrupt / "env.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    hostile = write_python(repo, "hostile", MODEL, CONFIG.format(name="hostile", env="$$TRITON_MODEL_DIRECTORY/env.tar.gz"))
    with tarfile.open(hostile / "env.tar.gz", "w:gz") as tar:
        link = tarfile.TarInfo("bin")
        link.type, link.linkname = tarfile.SYMTYPE, "/usr/bin"
        tar.addfile(link)
        data = b"#!/bin/sh\n"
        member = tarfile.TarInfo("bin/python3")
        member.size, member.mode = len(data), 0o755
        tar.addfile(member, io.BytesIO(data))
    cache = tmp_path / "cache"
    flags = ("--exit-on-error=false", f"--model-cache-dir={cache}")
    with QuiverServer(repo, args=flags, timeout=120) as server:
        client = httpclient.InferenceServerClient(server.url)
        for name in ("packed", "twin", "folder"):
            tensor = httpclient.InferInput("INPUT0", [2], "FP32")
            tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
            result = client.infer(name, [tensor])
            # 42 from the package only the environment has; no 1000: psutil (the server's) is not seen
            assert result.as_numpy("OUTPUT0").tolist() == [43.0, 44.0], name
            python = result.as_numpy("PYTHON")[0].decode()
            assert python != sys.executable and python.endswith("bin/python3"), python
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["no_numpy"]["state"] == "UNAVAILABLE"
        assert "model 'no_numpy'" in index["no_numpy"]["reason"] and "has no numpy" in index["no_numpy"]["reason"]
        assert index["corrupt"]["state"] == "UNAVAILABLE"
        assert "model 'corrupt'" in index["corrupt"]["reason"] and "not a valid tar.gz" in index["corrupt"]["reason"]
        assert index["hostile"]["state"] == "UNAVAILABLE"
        assert "model 'hostile'" in index["hostile"]["reason"] and "symlink 'bin'" in index["hostile"]["reason"]
    # unpacked once: packed and twin hold the same archive, so they share one copy
    unpacked = [p for p in (cache / "python-envs").iterdir() if not p.name.startswith(".")]
    assert len(unpacked) == 2  # the good environment and the one without numpy
