"""The ONNX Runtime backend in-process: auto-complete opens a session only when it has
something to fill in, and an instance frees its session on unload."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends import onnxruntime as ob
from quiver.backends.base import ModelFiles, instance_specs
from quiver.config import ModelConfig, parse_model_config
from quiver.errors import ConfigError, InternalError, InvalidArgumentError
from quiver.types import DataType, InferenceRequest, Tensor
from support.models import add_constant_onnx

COMPLETE = """
name: "m"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def folder(tmp_path: Path, config: str, model: bytes) -> tuple[pb.ModelConfig, ModelFiles]:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(model)
    path = tmp_path / "m" / "config.pbtxt"
    path.write_text(textwrap.dedent(config))
    return parse_model_config(path.read_text(), path, "m"), ModelFiles(tmp_path, tmp_path / "m", 1)


def test_auto_complete_opens_no_session_when_the_config_has_nothing_to_fill_in(tmp_path: Path) -> None:
    """A file onnxruntime cannot read shows whether a session was opened: with inputs and
    outputs complete (names, datatypes, dims) it is not, as Triton skips auto-complete."""
    config, files = folder(tmp_path, COMPLETE, b"not an onnx model")
    before = config.SerializeToString()
    ob.BACKEND.auto_complete(config, files, strict=False)
    assert config.SerializeToString() == before


@pytest.mark.parametrize(
    "config",
    [
        'name: "m" backend: "onnxruntime"',  # nothing configured
        COMPLETE.replace(" dims: [ 4 ] } ]\noutput", " } ]\noutput"),  # an input without dims
        COMPLETE.replace('output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]', ""),
    ],
)
def test_auto_complete_reads_the_model_when_something_is_missing(tmp_path: Path, config: str) -> None:
    bad, files = folder(tmp_path, config, b"not an onnx model")
    with pytest.raises(InternalError, match="onnxruntime could not load"):
        ob.BACKEND.auto_complete(bad, files, strict=False)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(add_constant_onnx(1.0).SerializeToString())
    ob.BACKEND.auto_complete(bad, files, strict=False)
    assert [i.name for i in bad.input] == ["INPUT0"] and [o.name for o in bad.output] == ["OUTPUT0"]
    assert list(bad.input[0].dims) == [4] and bad.output[0].data_type == pb.TYPE_FP32


def test_it_says_which_configurations_it_completes_without_the_model(tmp_path: Path) -> None:
    """What the lifecycle's read-ahead asks before preparing a configuration: complete ones
    (and any under --strict-model-config, which auto-completes nothing) need no model file;
    one with something to fill in does."""
    complete, _ = folder(tmp_path / "a", COMPLETE, b"not an onnx model")
    partial, _ = folder(tmp_path / "b", 'name: "m" backend: "onnxruntime"', b"not an onnx model")
    assert ob.BACKEND.completes_without_files(complete, strict=False)
    assert not ob.BACKEND.completes_without_files(partial, strict=False)
    assert ob.BACKEND.completes_without_files(partial, strict=True)


def test_an_instance_serves_then_frees_its_session_on_unload(tmp_path: Path) -> None:
    model = add_constant_onnx(2.0)
    onnx.checker.check_model(model)
    proto, files = folder(tmp_path, COMPLETE, model.SerializeToString())
    config = ModelConfig.from_proto(proto, str(tmp_path / "m" / "config.pbtxt"))
    instance = ob.BACKEND.create_instance(config, files, instance_specs(config)[0])
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    [answer] = instance.execute([InferenceRequest("m", "", [Tensor("INPUT0", DataType.FP32, (1, 4), x)])])
    assert not isinstance(answer, Exception)
    np.testing.assert_array_equal(answer.outputs[0].data, x + 2.0)
    instance.unload()
    assert not hasattr(instance, "_session")
    instance.unload()  # twice: nothing left to free, no error


def test_a_missing_model_file_and_a_broken_one_are_told_apart(tmp_path: Path) -> None:
    """The file is looked for only when ONNX Runtime could not open it: a missing one is
    INVALID_ARG naming the file, one that is not a model is ONNX Runtime's own error."""
    proto, files = folder(tmp_path, COMPLETE, b"not a model")
    config = ModelConfig.from_proto(proto, str(tmp_path / "m" / "config.pbtxt"))
    with pytest.raises(InternalError, match=r"model 'm': onnxruntime could not load .*model\.onnx"):
        ob.BACKEND.create_instance(config, files, instance_specs(config)[0])
    (tmp_path / "m" / "1" / "model.onnx").unlink()
    with pytest.raises(InvalidArgumentError, match=r"model 'm' version 1: model file .*model\.onnx does not exist"):
        ob.BACKEND.create_instance(config, files, instance_specs(config)[0])


def test_a_configuration_is_checked_against_its_model_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lifecycle prepares a configuration once per version of a model's files and hands
    the same object to every load of them: its tensors are checked against the session at the
    first load of each model file, not again; another configuration object (files changed:
    prepared anew) is checked, and one that does not match fails every time."""
    proto, files = folder(tmp_path, COMPLETE, add_constant_onnx(2.0).SerializeToString())
    config = ModelConfig.from_proto(proto, str(tmp_path / "m" / "config.pbtxt"))
    checked: list[int] = []
    real = ob._check_io

    def counting(config: ModelConfig, session: object) -> None:
        checked.append(id(config))
        real(config, session)  # type: ignore[arg-type]

    monkeypatch.setattr(ob, "_check_io", counting)
    spec = instance_specs(config)[0]
    for _ in range(3):
        ob.BACKEND.create_instance(config, files, spec).unload()
    assert checked == [id(config)]
    (tmp_path / "m" / "2").mkdir()
    (tmp_path / "m" / "2" / "model.onnx").write_bytes(add_constant_onnx(3.0).SerializeToString())
    ob.BACKEND.create_instance(config, ModelFiles(tmp_path, tmp_path / "m", 2), spec).unload()
    assert len(checked) == 2  # another model file
    again = ModelConfig.from_proto(proto, str(tmp_path / "m" / "config.pbtxt"))
    ob.BACKEND.create_instance(again, files, spec).unload()
    assert len(checked) == 3  # another configuration
    wrong = pb.ModelConfig()
    wrong.CopyFrom(proto)
    wrong.input[0].data_type = pb.TYPE_INT32
    bad = ModelConfig.from_proto(wrong, str(tmp_path / "m" / "config.pbtxt"))
    for _ in range(2):
        with pytest.raises(ConfigError, match="TYPE_INT32 in the configuration but TYPE_FP32 in the model"):
            ob.BACKEND.create_instance(bad, files, spec)
