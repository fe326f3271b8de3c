from __future__ import annotations

import pytest

from quiver.config import ModelConfig, VersionPolicy, parse_model_config
from quiver.errors import ConfigError
from quiver.types import DataType

GOOD = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { specific: { versions: [ 1, 3 ] } }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 3, -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 2 ] label_filename: "labels.txt" } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters: { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def build(text: str, name: str = "m") -> ModelConfig:
    return ModelConfig.from_proto(parse_model_config(text, "repo/m/config.pbtxt", name), "repo/m/config.pbtxt")


def test_parses_into_typed_objects() -> None:
    config = build(GOOD)
    assert config.backend == "onnxruntime"  # resolved from the platform
    assert config.max_batch_size == 8
    assert config.inputs[0].datatype is DataType.FP32
    assert config.inputs[0].dims == (3, -1)
    assert config.inputs[0].full_shape(8) == [-1, 3, -1]
    assert config.outputs[0].datatype is DataType.BYTES
    assert config.outputs[0].label_filename == "labels.txt"
    assert config.instance_groups[0].count == 2 and config.instance_groups[0].kind == "KIND_CPU"
    assert config.version_policy == VersionPolicy(kind="specific", versions=(1, 3))
    assert config.parameters == {"intra_op_thread_count": "1"}


def test_json_form_matches_tritons() -> None:
    data = build(GOOD).to_json()
    assert data["input"][0]["dims"] == [3, -1]
    assert data["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert data["instance_group"][0]["count"] == 2
    assert data["parameters"] == {"intra_op_thread_count": {"string_value": "1"}}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('name: "m"\nbogus_field: 1', 'no field named "bogus_field"'),
        ('input [ { name: "x" data_type: TYPE_FOO dims: [1] } ]', "TYPE_FOO"),
        ('name: "other"\nbackend: "onnxruntime"', "field 'name'"),
        ('backend: "onnxruntime"\nmax_batch_size: -1', "'max_batch_size' must be >= 0"),
        ('backend: "onnxruntime"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [0] } ]', "input 'x': field 'dims'"),
        ('backend: "onnxruntime"\ninput [ { name: "x" dims: [1] } ]', "input 'x': field 'data_type'"),
        ('backend: "onnxruntime"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [1] }, { name: "x" data_type: TYPE_FP32 dims: [1] } ]', "input 'x' is declared twice"),
        ('backend: "onnxruntime"\ninstance_group [ { count: -2 } ]', "instance_group[0].count"),
        ('backend: "onnxruntime"\nversion_policy: { latest: { num_versions: 0 } }', "num_versions"),
        ('platform: "caffe2_netdef"', "unsupported platform 'caffe2_netdef'"),
        ('max_batch_size: 1', "sets neither 'backend' nor 'platform'"),
    ],
)
def test_errors_name_the_file_and_field(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(text)
    assert "repo/m/config.pbtxt" in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("policy", "available", "expected"),
    [
        (VersionPolicy(), [1, 2, 3], [3]),
        (VersionPolicy(num_versions=2), [3, 1, 2], [2, 3]),
        (VersionPolicy(num_versions=5), [1, 2], [1, 2]),
        (VersionPolicy(kind="all"), [2, 1], [1, 2]),
        (VersionPolicy(kind="specific", versions=(1, 4)), [1, 2, 3], [1]),
    ],
)
def test_version_policy_selects(policy: VersionPolicy, available: list[int], expected: list[int]) -> None:
    assert policy.select(available) == expected


def test_default_instance_group_is_one_cpu_instance() -> None:
    config = build('backend: "python"')
    assert [(g.count, g.kind) for g in config.instance_groups] == [(1, "KIND_CPU")]


@pytest.mark.parametrize(
    ("text", "backend", "platform", "filename"),
    [
        ('platform: "tensorrt_plan"', "tensorrt", "tensorrt_plan", "model.plan"),
        ('backend: "tensorrt"', "tensorrt", "tensorrt_plan", "model.plan"),
        ('backend: "dali"', "dali", "", "model.dali"),
        ('platform: "tensorflow_graphdef"', "tensorflow", "tensorflow_graphdef", "model.graphdef"),
        ('platform: "tensorflow_savedmodel"', "tensorflow", "tensorflow_savedmodel", "model.savedmodel"),
    ],
)
def test_backend_platform_and_default_file(text: str, backend: str, platform: str, filename: str) -> None:
    config = build(text)
    assert (config.backend, config.platform, config.default_model_filename) == (backend, platform, filename)
