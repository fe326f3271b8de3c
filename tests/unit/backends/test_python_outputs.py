"""A worker's outputs checked against the model configuration (datatype, shape by its dims)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from quiver.backends.python_outputs import OutputCheck
from quiver.config import ModelConfig, parse_model_config
from quiver.types import DataType, Tensor

CONFIG = """
name: "m"
backend: "python"
max_batch_size: {batch}
output [
  {{ name: "EXACT" data_type: TYPE_FP32 dims: [ 2, 3 ] }},
  {{ name: "ANY" data_type: TYPE_INT32 dims: [ -1, 3 ] }},
  {{ name: "RESHAPED" data_type: TYPE_FP32 dims: [ 6 ] reshape: {{ shape: [ 2, 3 ] }} }}
]
"""


def check(batch: int) -> OutputCheck:
    path = Path("/models/m/config.pbtxt")
    return OutputCheck(ModelConfig.from_proto(parse_model_config(CONFIG.format(batch=batch), path, "m"), str(path)))


def tensor(name: str, datatype: DataType, shape: tuple[int, ...] | list[int]) -> Tensor:
    return Tensor(name, datatype, shape, np.zeros(shape, dtype=datatype.numpy_dtype))  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [0, 4])
def test_outputs_of_the_configured_shapes_pass(batch: int) -> None:
    lead = (3,) if batch else ()
    outputs = [
        tensor("EXACT", DataType.FP32, (*lead, 2, 3)),
        tensor("ANY", DataType.INT32, (*lead, 7, 3)),
        tensor("RESHAPED", DataType.FP32, (*lead, 4)),  # reshaped outputs: datatype only
        tensor("OTHER", DataType.FP64, (1,)),  # not in the configuration: not checked
    ]
    assert check(batch)(outputs) == ""
    # a shape given as a list takes the general way, with the same answer
    assert check(batch)([tensor("EXACT", DataType.FP32, [*lead, 2, 3])]) == ""


@pytest.mark.parametrize(
    ("batch", "output", "error"),
    [
        (0, tensor("EXACT", DataType.FP32, (2, 4)), r"unexpected shape \[2, 4\] for output 'EXACT', the model configuration says \[2, 3\]"),
        (0, tensor("EXACT", DataType.FP32, (1, 2, 3)), r"unexpected shape \[1, 2, 3\] for output 'EXACT'"),
        (4, tensor("EXACT", DataType.FP32, (2, 3)), r"unexpected shape \[2, 3\] for output 'EXACT', the model configuration says \[-1, 2, 3\]"),
        (4, tensor("EXACT", DataType.FP32, ()), r"unexpected shape \[\] for output 'EXACT'"),
        (0, tensor("ANY", DataType.INT32, (7, 4)), r"unexpected shape \[7, 4\] for output 'ANY', the model configuration says \[-1, 3\]"),
        (0, tensor("EXACT", DataType.INT32, (2, 3)), r"unexpected datatype INT32 for output 'EXACT', the model configuration says FP32"),
        (4, tensor("RESHAPED", DataType.INT32, (3, 6)), r"unexpected datatype INT32 for output 'RESHAPED'"),
    ],
)
def test_outputs_that_disagree_with_the_configuration_are_named(batch: int, output: Tensor, error: str) -> None:
    assert re.fullmatch(error + ".*", check(batch)([output]))
