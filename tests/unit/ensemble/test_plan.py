"""Ensemble validation: each mistake is an error naming the step and the tensor."""

from __future__ import annotations

import pytest

from quiver.config import ModelConfig, parse_model_config
from quiver.ensemble.plan import build_plan
from quiver.errors import ConfigError


def config(text: str, name: str) -> ModelConfig:
    return ModelConfig.from_proto(parse_model_config(text, f"repo/{name}/config.pbtxt", name), f"repo/{name}/config.pbtxt")


PRE = config(
    """
    backend: "python"
    max_batch_size: 8
    input [ { name: "RAW" data_type: TYPE_STRING dims: [ 1 ] } ]
    output [ { name: "PIXELS" data_type: TYPE_FP32 dims: [ 3, 4, 4 ] } ]
    """,
    "pre",
)
NET = config(
    """
    backend: "onnxruntime"
    max_batch_size: 8
    input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 3, 4, 4 ] } ]
    output [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
    """,
    "net",
)
MODELS = {"pre": PRE, "net": NET}

ENSEMBLE = """
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "SCORES" data_type: TYPE_FP32 dims: [ 10 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "{pre}" model_version: -1 input_map {{ key: "RAW" value: "{image}" }} output_map {{ key: "PIXELS" value: "pixels" }} }},
  {{ model_name: "net" model_version: -1 input_map {{ key: "{net_in}" value: "{pixels}" }} output_map {{ key: "{logits}" value: "SCORES" }} }}
] }}
"""


def ensemble(**overrides: str) -> ModelConfig:
    values = {"pre": "pre", "image": "IMAGE", "net_in": "INPUT", "pixels": "pixels", "logits": "LOGITS"}
    values.update(overrides)
    return config(ENSEMBLE.format(**values), "pipeline")


def test_a_valid_plan() -> None:
    plan = build_plan(ensemble(), MODELS)
    assert plan.composing_models == ["net", "pre"]
    assert plan.downstream == {0: (1,), 1: ()}
    assert plan.steps[1].input_map == (("INPUT", "pixels"),)


@pytest.mark.parametrize(
    ("overrides", "models", "message"),
    [
        ({"pre": "missing"}, MODELS, "step 0 (model 'missing'): unknown model 'missing'"),
        ({"net_in": "NOPE"}, MODELS, "step 1 (model 'net'): input_map names input 'NOPE'"),
        ({"logits": "NOPE"}, MODELS, "step 1 (model 'net'): output_map names output 'NOPE'"),
        ({"pixels": "ghost"}, MODELS, "step 1 (model 'net'): consumes tensor 'ghost', which no step produces"),
        ({"image": "OTHER"}, MODELS, "consumes tensor 'OTHER'"),
    ],
)
def test_mistakes_name_the_step_and_tensor(overrides: dict[str, str], models: dict[str, ModelConfig], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_plan(ensemble(**overrides), models)
    assert message in str(info.value)
    assert "ensemble 'pipeline'" in str(info.value)


def test_output_never_produced() -> None:
    text = ENSEMBLE.replace('output [ {{ name: "SCORES"', 'output [ {{ name: "EXTRA" data_type: TYPE_FP32 dims: [ 1 ] }}, {{ name: "SCORES"')
    with pytest.raises(ConfigError, match="ensemble output 'EXTRA' is produced by no step"):
        build_plan(config(text.format(pre="pre", image="IMAGE", net_in="INPUT", pixels="pixels", logits="LOGITS"), "pipeline"), MODELS)


def test_datatype_mismatch_between_steps() -> None:
    net = config(
        """
        backend: "onnxruntime"
        max_batch_size: 8
        input [ { name: "INPUT" data_type: TYPE_FP16 dims: [ 3, 4, 4 ] } ]
        output [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
        """,
        "net",
    )
    with pytest.raises(
        ConfigError,
        match=r"step 1 \(model 'net'\): input 'INPUT' and tensor 'pixels' \(from step 0 \(model 'pre'\)\): "
        r"ensemble tensor 'pixels': inconsistent data type: TYPE_FP32 is inferred from model pre while "
        r"TYPE_FP16 is inferred from model net",
    ):
        build_plan(ensemble(), {"pre": PRE, "net": net})


def test_shape_mismatch_between_steps() -> None:
    net = config(
        """
        backend: "onnxruntime"
        max_batch_size: 8
        input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 3, 8, 8 ] } ]
        output [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
        """,
        "net",
    )
    with pytest.raises(
        ConfigError,
        match=r"input 'INPUT' and tensor 'pixels' \(from step 0 \(model 'pre'\)\): ensemble tensor 'pixels': "
        r"inconsistent shape: \[-1,3,4,4\] is inferred from model pre while \[-1,3,8,8\] is inferred "
        r"from model net",
    ):
        build_plan(ensemble(), {"pre": PRE, "net": net})


def test_cycle() -> None:
    loop_model = config(
        """
        backend: "python"
        input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "B" data_type: TYPE_FP32 dims: [ 1 ] } ]
        """,
        "loop",
    )
    text = """
    platform: "ensemble"
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
    ensemble_scheduling { step [
      { model_name: "loop" input_map { key: "A" value: "y" } output_map { key: "B" value: "x" } },
      { model_name: "loop" input_map { key: "A" value: "x" } output_map { key: "B" value: "y" } },
      { model_name: "loop" input_map { key: "A" value: "IN" } output_map { key: "B" value: "OUT" } }
    ] }
    """
    with pytest.raises(ConfigError, match="the steps form a cycle"):
        build_plan(config(text, "cyclic"), {"loop": loop_model})


def test_tensor_produced_twice() -> None:
    text = ENSEMBLE.replace('output_map {{ key: "{logits}" value: "SCORES" }}', 'output_map {{ key: "{logits}" value: "pixels" }}')
    with pytest.raises(ConfigError, match="tensor 'pixels' is already produced by step 0"):
        build_plan(config(text.format(pre="pre", image="IMAGE", net_in="INPUT", pixels="pixels", logits="LOGITS"), "pipeline"), MODELS)


BATCHING_IDENTITY = config(
    """
    backend: "identity"
    max_batch_size: 8
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """,
    "batcher",
)


def test_a_non_batching_ensemble_over_batching_models() -> None:
    """Triton's rule: dims match ([16] and [-1]), so the full dims ([16] and [-1, -1]) need not."""
    text = """
    platform: "ensemble"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16 ] } ]
    ensemble_scheduling { step [
      { model_name: "batcher" input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
      { model_name: "batcher" input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } }
    ] }
    """
    plan = build_plan(config(text, "flat"), {"batcher": BATCHING_IDENTITY})
    assert plan.steps[0].batching and plan.steps[0].input_dims == (("INPUT0", (-1,)),)
    assert plan.output_dims == ((16,),)


def test_ensemble_output_shapes_are_checked_too() -> None:
    text = """
    platform: "ensemble"
    max_batch_size: 0
    input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2, 2, 4 ] } ]
    ensemble_scheduling { step [
      { model_name: "batcher" input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } }
    ] }
    """
    with pytest.raises(ConfigError, match=r"inconsistent shape: \[2,2,4\] is inferred from model flat while \[-1,-1\]"):
        build_plan(config(text, "flat"), {"batcher": BATCHING_IDENTITY})
    reshaped = text.replace("dims: [ 2, 2, 4 ] }", "dims: [ 2, 2, 4 ] reshape: { shape: [ 16 ] } }")
    build_plan(config(reshaped, "flat"), {"batcher": BATCHING_IDENTITY})  # the reshape is what counts


def test_a_composing_model_may_not_batch_less_than_the_ensemble() -> None:
    text = ENSEMBLE.format(pre="pre", image="IMAGE", net_in="INPUT", pixels="pixels", logits="LOGITS")
    with pytest.raises(
        ConfigError,
        match="ensemble pipeline allows maximum batch size 16, but it contains model pre which only "
        "allows maximum batch size to be 8",
    ):
        build_plan(config(text.replace("max_batch_size: 8", "max_batch_size: 16"), "pipeline"), MODELS)


def test_convert_shape_between_batching_and_non_batching_sides() -> None:
    from quiver.ensemble.scheduler import convert_shape

    # a non-batched tensor to a batching model: a batch of 1 first, when it matches the dims
    assert convert_shape((-1,), True, 0, (16,)) == (1, 16)
    assert convert_shape((4,), True, 0, (2, 4)) == (2, 4)  # already batched: as it is
    # a batched tensor to a non-batching side: the batch dim goes when it is 1 and does not fit
    assert convert_shape((16,), False, 1, (1, 16)) == (16,)
    assert convert_shape((-1, 16), False, 1, (1, 16)) == (1, 16)  # it fits: as it is
    assert convert_shape((16,), False, 2, (2, 16)) == (2, 16)
    # both sides agree: nothing to do
    assert convert_shape((16,), True, 3, (3, 16)) == (3, 16)
    assert convert_shape((16,), False, 0, (16,)) == (16,)
