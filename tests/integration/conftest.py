"""One shared server over a repository that exercises every feature of the HTTP frontend."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from build_repository import (
    ADD_SUB_CONFIG,
    ADD_SUB_MODEL,
    CLASSIFIER_CONFIG,
    LABELS,
    SIMPLE_CONFIG,
    STRING_CONFIG,
    STRING_MODEL,
    classifier_onnx,
    simple_onnx,
)

from support.models import (
    ONNX_TYPES,
    add_constant_onnx,
    write_identities,
    write_onnx,
    write_python,
)
from support.server import QuiverServer

RAISING_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("tokenizer exploded")
"""

BROKEN_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights file is corrupt")

    def execute(self, requests):
        return []
"""

VERSIONED_CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
{policy}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

#: Small on purpose, so the size-limit test need not send much.
MAX_INPUT_SIZE = 1 << 20


def build_repository(root: Path) -> Path:
    repo = root / "models"
    repo.mkdir()
    write_identities(repo, ONNX_TYPES)
    write_onnx(repo, "simple", simple_onnx(), SIMPLE_CONFIG)
    folder = write_onnx(repo, "classifier", classifier_onnx(), CLASSIFIER_CONFIG)
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    # No config at all, and a partial one: both completed from the ONNX model.
    write_onnx(repo, "autocomplete", simple_onnx(), None)
    write_onnx(repo, "partial", simple_onnx(), 'backend: "onnxruntime"\nmax_batch_size: 2\n')
    for name, policy in (
        ("versioned", "version_policy: { latest: { num_versions: 2 } }"),
        ("versioned_all", "version_policy: { all: {} }"),
        ("versioned_specific", "version_policy: { specific: { versions: [1, 3] } }"),
    ):
        for version in (1, 2, 3):
            write_onnx(
                repo,
                name,
                add_constant_onnx(float(version)),
                VERSIONED_CONFIG.format(name=name, policy=policy),
                version=version,
            )
    write_python(repo, "add_sub", ADD_SUB_MODEL, ADD_SUB_CONFIG)
    write_python(
        repo,
        "broken",
        BROKEN_MODEL,
        """
        backend: "python"
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """,
    )
    write_python(
        repo,
        "raises",
        RAISING_MODEL,
        """
        backend: "python"
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """,
    )
    write_python(repo, "string_upper", STRING_MODEL, STRING_CONFIG)
    corrupt = repo / "corrupt_onnx" / "1"
    corrupt.mkdir(parents=True)
    (corrupt / "model.onnx").write_bytes(b"this is not a protobuf")
    (repo / "corrupt_onnx" / "config.pbtxt").write_text(
        'backend: "onnxruntime"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [1] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [1] } ]\n'
    )
    write_onnx(
        repo,
        "gpu_simple",
        simple_onnx(),
        SIMPLE_CONFIG.replace('name: "simple"', 'name: "gpu_simple"').replace("KIND_CPU", "KIND_GPU"),
    )
    return repo


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="session")
def server(repository: Path) -> Iterator[QuiverServer]:
    with QuiverServer(
        repository,
        args=(
            "--exit-on-error=false",
            # broken models on purpose: ready anyway (Triton's qa does the same)
            "--strict-readiness=false",
            "--http-max-input-size",
            str(MAX_INPUT_SIZE),
            "--grpc-max-message-size",
            str(MAX_INPUT_SIZE),
        ),
    ) as running:
        yield running
    assert running.process is not None
    assert running.process.returncode == 0, running.log


def pytest_addoption(parser: pytest.Parser) -> None:
    """The fuzz tests' knobs (tests/support/fuzz.py); QUIVER_FUZZ_EXAMPLES and QUIVER_FUZZ_SEED
    say the same (and work whatever paths pytest is given)."""
    group = parser.getgroup("quiver fuzz")
    group.addoption("--fuzz-examples", type=int, default=None, help="examples per fuzz test (test_fuzz_*.py)")
    group.addoption("--fuzz-seed", default=None, help="fuzz seed: an integer, or 'random' (default: derandomized)")


def pytest_configure(config: pytest.Config) -> None:
    # The fuzz modules build their hypothesis settings when imported, which is after this.
    for option, variable in (("--fuzz-examples", "QUIVER_FUZZ_EXAMPLES"), ("--fuzz-seed", "QUIVER_FUZZ_SEED")):
        value = config.getoption(option, default=None)
        if value is not None:
            os.environ[variable] = str(value)
