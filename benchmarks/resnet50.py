"""ResNet-50 (v1.5) as an ONNX graph built with ``onnx.helper``: random weights, batch-norm folded.

``resnet50_onnx()`` gives a model with the shape and cost of torchvision's ResNet-50 (25.6 M
parameters, ~4.1 GFLOPs per image): 7x7 stem conv + ReLU, 3x3 max pool, bottleneck stages of
3, 4, 6 and 3 blocks (1x1, 3x3 with the stride, 1x1, projection shortcut on each stage's first
block), global average pool, a 1000-way fully connected layer. Batch norm is folded into the
convolutions (as an exported, optimised model has it), so each conv carries a bias. Opset 17,
IR version 8, input ``INPUT0`` FP32 [batch, 3, 224, 224], output ``OUTPUT0`` FP32 [batch, 1000]
with a dynamic batch dimension. No framework but onnx and numpy is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
INPUT = "INPUT0"
OUTPUT = "OUTPUT0"
IMAGE_SHAPE = (3, 224, 224)
CLASSES = 1000
#: Bottleneck blocks per stage and each stage's width (its output has 4x the channels).
STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}_{self.count}"

    def _weight(self, name: str, array: np.ndarray[Any, Any]) -> str:
        self.initializers.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def conv(self, x: str, cin: int, cout: int, kernel: int, stride: int = 1, relu: bool = True, gain: float = 2.0) -> str:
        name = self._name("conv")
        std = np.sqrt(gain / (cin * kernel * kernel))  # He init keeps activations in range
        w = self._weight(f"{name}.w", self.rng.standard_normal((cout, cin, kernel, kernel), dtype=np.float32) * std)
        b = self._weight(f"{name}.b", self.rng.standard_normal(cout, dtype=np.float32) * 0.01)
        pad = kernel // 2
        out = f"{name}.out"
        self.nodes.append(
            helper.make_node(
                "Conv", [x, w, b], [out], name=name, kernel_shape=[kernel, kernel],
                strides=[stride, stride], pads=[pad] * 4,
            )
        )
        return self.relu(out) if relu else out

    def relu(self, x: str) -> str:
        name = self._name("relu")
        self.nodes.append(helper.make_node("Relu", [x], [f"{name}.out"], name=name))
        return f"{name}.out"

    def bottleneck(self, x: str, cin: int, width: int, stride: int) -> str:
        cout = 4 * width
        y = self.conv(x, cin, width, 1)
        y = self.conv(y, width, width, 3, stride)
        y = self.conv(y, width, cout, 1, relu=False, gain=0.5)  # small last conv: a residual that stays bounded
        shortcut = x if stride == 1 and cin == cout else self.conv(x, cin, cout, 1, stride, relu=False, gain=1.0)
        name = self._name("add")
        self.nodes.append(helper.make_node("Add", [y, shortcut], [f"{name}.out"], name=name))
        return self.relu(f"{name}.out")


def resnet50_onnx(seed: int = 0, batch: str | int = "batch") -> onnx.ModelProto:
    """ResNet-50 with random weights; ``batch`` is the first dimension (a name makes it dynamic)."""
    b = _Builder(seed)
    x = b.conv(INPUT, 3, 64, 7, 2)
    b.nodes.append(
        helper.make_node("MaxPool", [x], ["pool.out"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    )
    x, channels = "pool.out", 64
    for stage, (blocks, width) in enumerate(STAGES):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            x = b.bottleneck(x, channels, width, stride)
            channels = 4 * width
    b.nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap.out"], name="gap"))
    b.nodes.append(helper.make_node("Flatten", ["gap.out"], ["flat.out"], name="flat", axis=1))
    fc_w = b._weight("fc.w", b.rng.standard_normal((CLASSES, channels), dtype=np.float32) * np.sqrt(1.0 / channels))
    fc_b = b._weight("fc.b", np.zeros(CLASSES, dtype=np.float32))
    b.nodes.append(helper.make_node("Gemm", ["flat.out", fc_w, fc_b], [OUTPUT], name="fc", transB=1))
    graph = helper.make_graph(
        b.nodes,
        "resnet50",
        [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, [batch, *IMAGE_SHAPE])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [batch, CLASSES])],
        initializer=b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    model.producer_name = "quiver-benchmarks"
    return model


def parameter_count(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)
