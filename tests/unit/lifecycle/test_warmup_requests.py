"""Building Triton's model_warmup samples into requests, and the errors that name sample and input."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from quiver.config import ModelConfig, parse_model_config
from quiver.errors import InvalidArgumentError
from quiver.lifecycle.warmup import build_warmup_samples
from quiver.types import DataType

BATCHING = """
name: "m"
backend: "python"
max_batch_size: 4
input [ {{ name: "IMAGE" data_type: TYPE_FP32 dims: [ 2, -1 ] }},
        {{ name: "TEXT" data_type: TYPE_STRING dims: [ 2 ] }},
        {{ name: "MASK" data_type: TYPE_INT32 dims: [ 3 ] optional: true }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
{warmup}
"""

NOT_BATCHING = """
name: "m"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT64 dims: [ 3 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT64 dims: [ 3 ] }} ]
{warmup}
"""


def config(template: str, warmup: str) -> ModelConfig:
    text = template.format(warmup=warmup)
    return ModelConfig.from_proto(parse_model_config(text, "repo/m/config.pbtxt", "m"), "repo/m/config.pbtxt")


def test_batching_sample_is_one_request_per_row_with_zero_and_random_data(tmp_path: Path) -> None:
    cfg = config(
        BATCHING,
        """model_warmup [ { name: "s" batch_size: 3 count: 2
             inputs { key: "IMAGE" value: { data_type: TYPE_FP32 dims: [ 2, 5 ] random_data: true } }
             inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } } } ]""",
    )
    (sample,) = build_warmup_samples(cfg, tmp_path, seed=1)
    assert sample.name == "s" and sample.count == 2
    assert len(sample.requests) == 3
    for request in sample.requests:
        image, text = request.input("IMAGE"), request.input("TEXT")
        assert image is not None and text is not None
        assert image.shape == (1, 2, 5) and image.data.shape == (1, 2, 5)
        assert image.datatype is DataType.FP32 and image.data.dtype == np.float32
        assert np.all((image.data >= 0) & (image.data < 1))  # random floats stay finite
        assert text.shape == (1, 2) and text.data.tolist() == [[b"", b""]]
        assert request.input("MASK") is None  # optional, not given
        assert request.model_name == "m"


def test_count_defaults_to_one_and_batch_size_zero_has_no_batch_dimension(tmp_path: Path) -> None:
    cfg = config(
        NOT_BATCHING,
        """model_warmup [ { name: "a" batch_size: 0
                            inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] zero_data: true } } },
                          { name: "b" batch_size: 1 count: 4
                            inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] random_data: true } } } ]""",
    )
    a, b = build_warmup_samples(cfg, tmp_path)
    assert (a.count, len(a.requests)) == (1, 1)
    assert a.requests[0].inputs[0].shape == (3,) and a.requests[0].inputs[0].data.tolist() == [0, 0, 0]
    assert (b.count, len(b.requests)) == (4, 1)
    assert b.requests[0].inputs[0].shape == (3,) and b.requests[0].inputs[0].data.dtype == np.int64


def test_input_data_files_from_the_warmup_folder(tmp_path: Path) -> None:
    (tmp_path / "warmup").mkdir()
    values = np.arange(10, dtype=np.float32)
    (tmp_path / "warmup" / "image.bin").write_bytes(values.tobytes() + b"extra")  # longer is fine, as in Triton
    (tmp_path / "warmup" / "text.bin").write_bytes(b"".join(struct.pack("<I", len(s)) + s for s in (b"hi", b"there")))
    cfg = config(
        BATCHING,
        """model_warmup [ { name: "files" batch_size: 2
             inputs { key: "IMAGE" value: { data_type: TYPE_FP32 dims: [ 2, 5 ] input_data_file: "image.bin" } }
             inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "text.bin" } } } ]""",
    )
    (sample,) = build_warmup_samples(cfg, tmp_path)
    assert len(sample.requests) == 2
    image, text = sample.requests[0].input("IMAGE"), sample.requests[0].input("TEXT")
    assert image is not None and text is not None
    np.testing.assert_array_equal(image.data, values.reshape(1, 2, 5))
    assert text.data.tolist() == [[b"hi", b"there"]]


@pytest.mark.parametrize(
    ("template", "warmup", "expected"),
    [
        (
            BATCHING,
            'model_warmup [ { name: "s" batch_size: 1 inputs { key: "NOPE" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } } ]',
            "warmup sample 's': input 'NOPE' is not an input of the model",
        ),
        (
            BATCHING,
            'model_warmup [ { name: "s" batch_size: 1 inputs { key: "IMAGE" value: { data_type: TYPE_INT32 dims: [ 2, 2 ] zero_data: true } }'
            ' inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } } } ]',
            "warmup sample 's': input 'IMAGE' is TYPE_INT32 in the warmup sample but TYPE_FP32",
        ),
        (
            BATCHING,
            'model_warmup [ { name: "s" batch_size: 1 inputs { key: "IMAGE" value: { data_type: TYPE_FP32 dims: [ 3, 2 ] zero_data: true } } } ]',
            "input 'IMAGE': dims [3, 2] do not match the configuration's [2, -1]",
        ),
        (
            BATCHING,
            'model_warmup [ { name: "s" batch_size: 1 inputs { key: "IMAGE" value: { data_type: TYPE_FP32 dims: [ 2, -1 ] zero_data: true } } } ]',
            "input 'IMAGE': dims [2, -1] must all be given",
        ),
        (
            BATCHING,
            'model_warmup [ { name: "s" batch_size: 1 inputs { key: "IMAGE" value: { data_type: TYPE_FP32 dims: [ 2, 2 ] zero_data: true } } } ]',
            "warmup sample 's': gives no data for input(s) TEXT",
        ),
        (
            BATCHING,
            'model_warmup [ { name: "big" batch_size: 5 inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } } } ]',
            "warmup sample 'big': batch_size 5 is larger than the model's max_batch_size 4",
        ),
        (
            NOT_BATCHING,
            'model_warmup [ { name: "s" batch_size: 2 inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] zero_data: true } } } ]',
            "batch_size 2 needs a model that batches",
        ),
        (
            NOT_BATCHING,
            'model_warmup [ { name: "s" inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] } } } ]',
            "input 'X' sets none of zero_data, random_data, input_data_file",
        ),
        (
            NOT_BATCHING,
            'model_warmup [ { name: "s" inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] input_data_file: "missing.bin" } } } ]',
            "warmup sample 's': input 'X': cannot read input_data_file",
        ),
        (
            NOT_BATCHING,
            'model_warmup [ { name: "s" inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] input_data_file: "../../escape" } } } ]',
            "must name a file inside",
        ),
    ],
)
def test_invalid_samples_name_model_sample_and_input(tmp_path: Path, template: str, warmup: str, expected: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        build_warmup_samples(config(template, warmup), tmp_path)
    assert "model 'm': " in str(info.value)
    assert expected in str(info.value)


def test_files_of_the_wrong_size(tmp_path: Path) -> None:
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "short.bin").write_bytes(b"\0" * 23)  # 3 INT64 need 24
    (tmp_path / "warmup" / "strings.bin").write_bytes(struct.pack("<I", 2) + b"ab")  # 1 element, 3 needed
    short = config(
        NOT_BATCHING,
        'model_warmup [ { name: "s" inputs { key: "X" value: { data_type: TYPE_INT64 dims: [ 3 ] input_data_file: "short.bin" } } } ]',
    )
    with pytest.raises(InvalidArgumentError, match=r"sample 's': input 'X': input_data_file .*short.bin has 23 bytes, but 3 INT64 element\(s\) need 24"):
        build_warmup_samples(short, tmp_path)
    strings = config(
        BATCHING,
        'model_warmup [ { name: "t" batch_size: 1 inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 3 ] input_data_file: "strings.bin" } } } ]',
    )
    # dims [3] do not match the configured [2]: the shape is checked first
    with pytest.raises(InvalidArgumentError, match="dims"):
        build_warmup_samples(strings, tmp_path)
    strings = config(
        BATCHING,
        'model_warmup [ { name: "t" batch_size: 1 inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "strings.bin" } } } ]',
    )
    with pytest.raises(InvalidArgumentError, match=r"sample 't': input_data_file .*strings.bin does not hold 2 BYTES element\(s\): input 'TEXT'"):
        build_warmup_samples(strings, tmp_path)


def test_no_warmup_no_samples(tmp_path: Path) -> None:
    assert build_warmup_samples(config(NOT_BATCHING, ""), tmp_path) == []
