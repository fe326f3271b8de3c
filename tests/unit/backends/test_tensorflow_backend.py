"""The TensorFlow backend's pure parts (parameters, Triton's batching hint) and what a server
without TensorFlow says when such a model loads."""

from __future__ import annotations

import sys

import pytest
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends import base
from quiver.errors import ConfigError, QuiverError


def test_without_tensorflow_the_load_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import tensorflow -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "quiver.backends.tensorflow", raising=False)
    monkeypatch.setattr(base, "_registry", base._Registry())
    with pytest.raises(QuiverError) as caught:
        base.get_backend("tensorflow")
    assert "pip install 'quiver[tensorflow]'" in str(caught.value)
    assert "'tensorflow'" in str(caught.value)


tf_backend = pytest.importorskip("quiver.backends.tensorflow", reason="needs quiver[tensorflow]")


def test_parameters_as_triton_names_them() -> None:
    settings = tf_backend.parse_settings(
        {"TF_NUM_INTRA_THREADS": "2", "TF_NUM_INTER_THREADS": "1", "TF_USE_PER_SESSION_THREADS": "On",
         "TF_GRAPH_TAG": "serve1", "TF_SIGNATURE_DEF": "predict", "TF_INIT_OPS_FILE": "init_ops.json"},
        "m", "cfg",
    )
    assert settings == tf_backend.TFSettings(2, 1, True, "serve1", "predict", "init_ops.json")


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        ({"TF_NUM_INTRA_THREADS": "-1"}, "'TF_NUM_INTRA_THREADS' of model 'm' must be a non-negative integer"),
        ({"TF_NUM_INTER_THREADS": "two"}, "'TF_NUM_INTER_THREADS'"),
        ({"TF_INIT_OPS_FILE": "../../etc/init.json"}, "inside the model's folder"),
    ],
)
def test_bad_parameters_name_the_parameter(parameters: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        tf_backend.parse_settings(parameters, "m", "cfg")
    assert fragment in str(caught.value)


def _info(name: str, shape: tuple[int, ...] | None) -> object:
    return tf_backend.TensorInfo(name, f"{name}:0", 1, shape)


def test_batch_hint_follows_triton() -> None:
    inputs, outputs = [_info("x", (-1, 3))], [_info("y", (-1, 2))]
    config = pb.ModelConfig(name="m")
    assert tf_backend._batch_hint(config, inputs, outputs)  # nothing configured: the signature
    config.input.add(name="x", dims=[3])
    assert tf_backend._batch_hint(config, inputs, outputs)  # dims one shorter: batching
    config = pb.ModelConfig(name="m")
    config.input.add(name="x", dims=[-1, 3])
    assert not tf_backend._batch_hint(config, inputs, outputs)  # full rank: no batching
    config.output.add(name="y", dims=[2])
    with pytest.raises(ConfigError, match="contradicting"):
        tf_backend._batch_hint(config, inputs, outputs)
