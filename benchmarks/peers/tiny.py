"""The workload every peer serves: model ``tiny``, input ``INPUT0`` FP32 [1, 16], output
``OUTPUT0`` FP32 [1, 16] equal to ``INPUT0 * 2``, no batching (Triton ``max_batch_size: 0``),
one CPU instance; as a Triton Python model (:data:`PYTHON_CONFIG`, :data:`PYTHON_MODEL`) and as
an ONNX graph (:func:`onnx_model`)."""

from __future__ import annotations

MODEL = "tiny"
INPUT = "INPUT0"
OUTPUT = "OUTPUT0"
SHAPE = (1, 16)

#: The model as a Triton Python model: the configuration and ``model.py`` that both Triton and
#: Quiver serve, Triton's unchanged (no Quiver-only parameter).
PYTHON_CONFIG = f"""\
name: "{MODEL}"
backend: "python"
max_batch_size: 0
input [
  {{
    name: "{INPUT}"
    data_type: TYPE_FP32
    dims: [ {", ".join(str(d) for d in SHAPE)} ]
  }}
]
output [
  {{
    name: "{OUTPUT}"
    data_type: TYPE_FP32
    dims: [ {", ".join(str(d) for d in SHAPE)} ]
  }}
]
instance_group [
  {{
    count: 1
    kind: KIND_CPU
  }}
]
"""

#: :data:`PYTHON_CONFIG` with Quiver's opt-in for a model run in the server's process
#: (``--backend-config=python,in-process=true``): execute this fast model on the event loop.
#: It changes nothing for a model in a worker process (Quiver's default) or in Triton.
EVENT_LOOP_PYTHON_CONFIG = PYTHON_CONFIG.replace(
    "max_batch_size: 0\n",
    'max_batch_size: 0\nparameters { key: "EXECUTE_ON_EVENT_LOOP" value { string_value: "true" } }\n',
)

PYTHON_MODEL = f'''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "{INPUT}").as_numpy()
            y = pb_utils.Tensor("{OUTPUT}", (x * 2).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[y]))
        return responses
'''


def onnx_model() -> bytes:
    """The ``tiny`` model as ONNX: ``OUTPUT0 = INPUT0 * 2``, FP32 [1, 16], opset 17."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", [INPUT, "two"], [OUTPUT])],
        MODEL,
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())
