"""A server without TensorFlow or DALI (their imports made to fail, as on an install without the
extras): such models are UNAVAILABLE with what to install, and the others serve."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from support.archives import ADD
from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer

MISSING = 'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n'


def hide(folder: Path, module: str) -> None:
    """A package shadowing ``module`` whose import fails as a missing one does."""
    package = folder.joinpath(*module.split("."))  # parents made plain folders
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(MISSING.format(name=module))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    root = tmp_path_factory.mktemp("no_extras")
    blocked = root / "blocked"
    hide(blocked, "tensorflow")
    hide(blocked, "nvidia.dali")
    (blocked / "nvidia" / "__init__.py").write_text("")  # a regular package: site-packages' is not searched
    repo = root / "models"
    repo.mkdir()
    for name, config, filename in (
        ("tf_model", 'platform: "tensorflow_graphdef"\n', "model.graphdef"),
        ("dali_model", 'backend: "dali"\n', "model.dali"),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / filename).write_bytes(b"unused")
    write_onnx(repo, "add", add_constant_onnx(1.0), ADD.format(name="add"))
    with QuiverServer(repo, args=("--exit-on-error=false",), env={"PYTHONPATH": str(blocked)}) as running:
        yield running


@pytest.mark.parametrize(("model", "extra"), [("tf_model", "tensorflow"), ("dali_model", "dali")])
def test_a_model_without_its_extra_says_what_to_install(server: QuiverServer, model: str, extra: str) -> None:
    client = httpclient.InferenceServerClient(server.url)
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index[model]["state"] == "UNAVAILABLE"
    assert f"pip install 'quiver[{extra}]'" in index[model]["reason"], index[model]["reason"]
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    assert client.infer("add", [inp]).as_numpy("OUTPUT0")[0, 0] == 1.0
