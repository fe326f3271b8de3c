"""Models built at test time: ONNX graphs with onnx.helper, config.pbtxt text, model.py files."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from pathlib import Path

import onnx
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 8

#: Triton datatype -> ONNX element type (BF16 is served by the identity backend instead:
#: onnxruntime's Python API cannot take bfloat16 numpy arrays).
ONNX_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def config_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )


def identity_onnx(datatype: str, shape: list[int | str]) -> onnx.ModelProto:
    elem = ONNX_TYPES[datatype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", elem, shape)],
        [helper.make_tensor_value_info("OUTPUT0", elem, shape)],
    )
    return make_model(graph)


def add_constant_onnx(value: float, features: int = 4) -> onnx.ModelProto:
    """FP32[batch, features] -> INPUT0 + value; versions of one model differ by ``value``."""
    const = helper.make_tensor("C", TensorProto.FLOAT, [1], [value])
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "C"], ["OUTPUT0"])],
        "add_constant",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", features])],
        initializer=[const],
    )
    return make_model(graph)


def foldable_onnx(value: float) -> onnx.ModelProto:
    """FP32[batch, 4] -> INPUT0 + value * 2, the product a Mul of two constants: a graph that
    ONNX Runtime's optimizations change (the Mul is folded away)."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["C", "D"], ["CD"]), helper.make_node("Add", ["INPUT0", "CD"], ["OUTPUT0"])],
        "foldable",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])],
        initializer=[
            helper.make_tensor("C", TensorProto.FLOAT, [1], [value]),
            helper.make_tensor("D", TensorProto.FLOAT, [1], [2.0]),
        ],
    )
    return make_model(graph)


def write_onnx(repo: Path, name: str, model: onnx.ModelProto, config: str | None, version: int = 1) -> Path:
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / str(version) / "model.onnx"))
    if config is not None:
        (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    return folder


def write_python(repo: Path, name: str, source: str, config: str, version: int = 1) -> Path:
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / str(version) / "model.py").write_text(textwrap.dedent(source))
    (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    return folder


def write_config(repo: Path, name: str, config: str, versions: tuple[int, ...] = (1,)) -> Path:
    folder = repo / name
    for version in versions:
        (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(config))
    return folder


def write_identities(repo: Path, datatypes: Iterable[str]) -> None:
    """``identity_<type>`` ONNX Identity models of dims [-1] for each datatype, and
    ``identity_bf16`` on the identity backend (onnxruntime has no BF16 Identity on the CPU)."""
    for datatype in datatypes:
        name = f"identity_{datatype.lower()}"
        write_onnx(
            repo,
            name,
            identity_onnx(datatype, [-1]),
            f"""
            name: "{name}"
            platform: "onnxruntime_onnx"
            input [ {{ name: "INPUT0" data_type: {config_type(datatype)} dims: [ -1 ] }} ]
            output [ {{ name: "OUTPUT0" data_type: {config_type(datatype)} dims: [ -1 ] }} ]
            """,
        )
    write_config(
        repo,
        "identity_bf16",
        """
        backend: "identity"
        input [ { name: "INPUT0" data_type: TYPE_BF16 dims: [ -1 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_BF16 dims: [ -1 ] } ]
        """,
    )
