"""Build the example model repository that ``make serve`` serves.

Everything is generated offline: ONNX graphs with ``onnx.helper``, Python models written as
files. Run: ``python examples/build_repository.py [OUTPUT_DIR]`` (default:
``examples/model_repository``). The output is rebuilt, never committed.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # what onnxruntime releases of the last years all read


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def simple_onnx(batch: bool = True) -> onnx.ModelProto:
    """Triton's classic ``simple`` model: INT32[16] x2 -> sum and difference."""
    lead: list[int | str] = ["batch"] if batch else []
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [
            helper.make_tensor_value_info("INPUT0", TensorProto.INT32, [*lead, 16]),
            helper.make_tensor_value_info("INPUT1", TensorProto.INT32, [*lead, 16]),
        ],
        [
            helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, [*lead, 16]),
            helper.make_tensor_value_info("OUTPUT1", TensorProto.INT32, [*lead, 16]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def classifier_onnx(features: int = 8, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """A small linear classifier with softmax: FP32[features] -> FP32[classes]."""
    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((features, classes)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "B")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["INPUT", "W"], ["logits_raw"]),
            helper.make_node("Add", ["logits_raw", "B"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["OUTPUT"], axis=-1),
        ],
        "classifier",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", classes])],
        initializer=[weight, bias],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


SIMPLE_CONFIG = """\
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

CLASSIFIER_CONFIG = """\
name: "classifier"
backend: "onnxruntime"
max_batch_size: 16
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
"""

LABELS = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

ADD_SUB_CONFIG = """\
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [ { kind: KIND_CPU } ]
"""

ADD_SUB_MODEL = '''\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's add_sub example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""

    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1]))
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

STRING_CONFIG = """\
name: "string_upper"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

STRING_MODEL = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Upper-cases each UTF-8 string of TEXT."""

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([s.decode("utf-8").upper().encode("utf-8") for s in text.reshape(-1)], dtype=object)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper.reshape(text.shape))])
            )
        return responses
'''

IDENTITY_CONFIG = """\
name: "identity_fp32"
backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def build(root: Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)

    _save(simple_onnx(), root / "simple" / "1" / "model.onnx")
    (root / "simple" / "config.pbtxt").write_text(SIMPLE_CONFIG)

    _save(classifier_onnx(), root / "classifier" / "1" / "model.onnx")
    (root / "classifier" / "config.pbtxt").write_text(CLASSIFIER_CONFIG)
    (root / "classifier" / "labels.txt").write_text("\n".join(LABELS) + "\n")

    # No config.pbtxt: Quiver auto-completes it from the ONNX model, as Triton does.
    _save(simple_onnx(), root / "simple_autocomplete" / "1" / "model.onnx")

    for name, config, model in (
        ("add_sub", ADD_SUB_CONFIG, ADD_SUB_MODEL),
        ("string_upper", STRING_CONFIG, STRING_MODEL),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(textwrap.dedent(model))

    (root / "identity_fp32" / "1").mkdir(parents=True)
    (root / "identity_fp32" / "config.pbtxt").write_text(IDENTITY_CONFIG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "output",
        nargs="?",
        type=Path,
        default=Path(__file__).resolve().parent / "model_repository",
        help="where to write the repository (replaced if it exists)",
    )
    args = parser.parse_args()
    build(args.output)
    print(f"example model repository written to {args.output}")


if __name__ == "__main__":
    main()
