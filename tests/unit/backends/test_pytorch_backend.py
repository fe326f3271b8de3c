"""The PyTorch backend in-process: naming rules, parameters, IO conversion, weight sharing."""

from __future__ import annotations

import importlib
import logging
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from quiver.backends import base  # noqa: E402
from quiver.backends import pytorch as pt  # noqa: E402
from quiver.backends.base import ModelFiles, instance_specs  # noqa: E402
from quiver.config import ModelConfig, parse_model_config  # noqa: E402
from quiver.errors import (  # noqa: E402
    ConfigError,
    InternalError,
    InvalidArgumentError,
    UnsupportedError,
)
from quiver.types import DataType, InferenceRequest, RequestedOutput, Tensor  # noqa: E402
from support import torch_models as tm  # noqa: E402

# --- naming rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "index"),
    [("INPUT__0", 0), ("OUTPUT__12", 12), ("x__3", 3), ("INPUT0", None), ("INPUT__", None),
     ("INPUT__a", None), ("A__B__1", None), ("INPUT_0", None)],
)
def test_tensor_index(name: str, index: int | None) -> None:
    assert pt.tensor_index(name) == index


TENSORS = [("a", "TensorType"), ("b", "TensorType")]


def test_inputs_bind_to_forward_argument_names_whatever_the_config_order() -> None:
    binding = pt.bind_inputs(["b", "a"], TENSORS, "m", "cfg")
    assert binding.convention == "forward_argument"
    assert binding.positions == {"b": 1, "a": 0}


def test_inputs_bind_by_index_in_their_names() -> None:
    binding = pt.bind_inputs(["INPUT__1", "INPUT__0"], TENSORS, "m", "cfg")
    assert binding.convention == "named_index"
    assert binding.positions == {"INPUT__1": 1, "INPUT__0": 0}


def test_inputs_otherwise_go_in_config_order(caplog: pytest.LogCaptureFixture) -> None:
    binding = pt.bind_inputs(["second", "first"], TENSORS, "m", "cfg")
    assert binding.convention == "config_order"
    assert binding.positions == {"second": 0, "first": 1}
    with caplog.at_level(logging.WARNING):
        pt.bind_inputs(["INPUT__0", "other"], TENSORS, "m", "cfg")
    assert "configuration order" in caplog.text


def test_a_single_dict_argument_takes_every_input() -> None:
    binding = pt.bind_inputs(["x", "y", "z"], [("inputs", "DictType")], "m", "cfg")
    assert binding.convention == "dict"


@pytest.mark.parametrize(
    ("names", "arguments", "message"),
    [
        ([], TENSORS, "declares no input"),
        (["a"], TENSORS, "declares 1 input(s) (a) but forward() takes 2 (a, b)"),
        (["INPUT__0", "INPUT__0x"], TENSORS, None),  # falls back to config order: fine
        (["INPUT__0", "X__0"], TENSORS, "both name position 0"),
        (["INPUT__0", "INPUT__2"], TENSORS, "names position 2 but forward() takes 2"),
        (["a", "b"], [("a", "TensorType"), ("b", "IntType")], "has type IntType"),
        (["a", "b"], [("a", "TensorType"), ("b", "DictType")], "only a single Dict"),
    ],
)
def test_input_binding_errors(
    names: list[str], arguments: list[tuple[str, str]], message: str | None
) -> None:
    if message is None:
        pt.bind_inputs(names, arguments, "m", "cfg")
        return
    with pytest.raises(ConfigError) as info:
        pt.bind_inputs(names, arguments, "m", "models/m/config.pbtxt")
    assert message in str(info.value)
    assert "models/m/config.pbtxt" in str(info.value)


def test_outputs_bind_by_index_else_config_order() -> None:
    assert pt.bind_outputs(["OUTPUT__1", "OUTPUT__0"], "m", "cfg") == (
        "named_index",
        {"OUTPUT__1": 1, "OUTPUT__0": 0},
    )
    assert pt.bind_outputs(["sum", "diff"], "m", "cfg") == ("config_order", {"sum": 0, "diff": 1})
    with pytest.raises(ConfigError, match="declares no output"):
        pt.bind_outputs([], "m", "cfg")
    with pytest.raises(ConfigError, match="both name position 0"):
        pt.bind_outputs(["A__0", "B__0"], "m", "cfg")


# --- parameters -------------------------------------------------------------------------


def config_of(text: str, name: str = "m", source: str = "models/m/config.pbtxt") -> ModelConfig:
    proto = parse_model_config(textwrap.dedent(text), source, name)
    return ModelConfig.from_proto(proto, source)


def params(**values: str) -> ModelConfig:
    body = "\n".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in values.items()
    )
    return config_of(f'backend: "pytorch"\n{body}\n')


def test_default_settings_are_tritons() -> None:
    settings = pt.parse_settings(params())
    assert settings == pt.TorchSettings()
    assert settings.inference_mode and settings.optimized_execution and settings.cudnn
    assert not settings.weight_sharing and not settings.cache_cleaning
    assert settings.global_switches == {}


def test_every_parameter_parses() -> None:
    settings = pt.parse_settings(
        params(
            INFERENCE_MODE="false",
            DISABLE_OPTIMIZED_EXECUTION="True",
            ENABLE_WEIGHT_SHARING="on",
            ENABLE_CACHE_CLEANING="1",
            DISABLE_CUDNN="true",
            ENABLE_NVFUSER="false",
            ENABLE_JIT_EXECUTOR="false",
            ENABLE_JIT_PROFILING="off",
            ENABLE_TENSOR_FUSER="0",
            INTRA_OP_THREAD_COUNT="2",
            INTER_OP_THREAD_COUNT="0",
        )
    )
    assert settings == pt.TorchSettings(
        inference_mode=False,
        optimized_execution=False,
        weight_sharing=True,
        cache_cleaning=True,
        cudnn=False,
        nvfuser=False,
        jit_executor=False,
        jit_profiling=False,
        tensor_fuser=False,
        intra_op_threads=2,
        inter_op_threads=None,  # 0 or less: torch's default, as in Triton
    )
    assert settings.global_switches == {
        "ENABLE_JIT_EXECUTOR": False,
        "ENABLE_JIT_PROFILING": False,
        "ENABLE_TENSOR_FUSER": False,
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [("INFERENCE_MODE", "yes please"), ("ENABLE_WEIGHT_SHARING", ""), ("INTRA_OP_THREAD_COUNT", "two")],
)
def test_invalid_parameter_values_are_config_errors(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        pt.parse_settings(params(**{key: value}))
    message = str(info.value)
    assert "models/m/config.pbtxt" in message
    assert key in message
    assert f"'{value}'" in message


# --- the missing-torch path -----------------------------------------------------------------


def test_a_missing_torch_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> Any:
        if name == "quiver.backends.pytorch":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, package)

    monkeypatch.setattr(base.importlib, "import_module", fake)
    monkeypatch.setattr(base._registry, "loaded", {})
    with pytest.raises(UnsupportedError) as info:
        base.get_backend("pytorch")
    assert "needs the Python package 'torch'" in str(info.value)
    assert "pip install 'quiver[torch]'" in str(info.value)


# --- instances ----------------------------------------------------------------------------


def make(
    tmp_path: Path, module: Any, text: str, name: str = "m"
) -> tuple[ModelConfig, list[pt.TorchInstance]]:
    tm.write_torch(tmp_path, name, module, text)
    config = config_of(text, name, str(tmp_path / name / "config.pbtxt"))
    files = ModelFiles(tmp_path, tmp_path / name, 1)
    instances = [pt.BACKEND.create_instance(config, files, s) for s in instance_specs(config)]
    return config, instances


def request(*tensors: tuple[str, str, Any], outputs: list[str] | None = None) -> InferenceRequest:
    inputs = []
    for name, datatype, data in tensors:
        array = np.asarray(data, dtype=DataType(datatype).numpy_dtype)
        inputs.append(Tensor(name, DataType(datatype), array.shape, array))
    wanted = None if outputs is None else [RequestedOutput(n) for n in outputs]
    return InferenceRequest("m", "", inputs, wanted)


def outputs_of(result: Any) -> dict[str, Any]:
    assert not isinstance(result, Exception), result
    return {t.name: t.data for t in result.outputs}


def release(instances: list[pt.TorchInstance]) -> None:
    for instance in instances:
        instance.unload()


ADD_SUB = """
name: "m"
backend: "pytorch"
max_batch_size: 4
input [ { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 2 ] },
        { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 2 ] },
         { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def test_batch_is_concatenated_and_split_per_request(tmp_path: Path) -> None:
    _, [instance] = make(tmp_path, tm.script(tm.AddSub()), ADD_SUB)
    try:
        one = request(("INPUT__0", "FP32", [[1, 2]]), ("INPUT__1", "FP32", [[10, 20]]))
        two = request(
            ("INPUT__0", "FP32", [[3, 4], [5, 6]]),
            ("INPUT__1", "FP32", [[1, 1], [2, 2]]),
            outputs=["OUTPUT__1"],
        )
        first, second = instance.execute([one, two])
        assert set(outputs_of(first)) == {"OUTPUT__0", "OUTPUT__1"}
        np.testing.assert_array_equal(outputs_of(first)["OUTPUT__0"], [[11, 22]])
        np.testing.assert_array_equal(outputs_of(first)["OUTPUT__1"], [[-9, -18]])
        np.testing.assert_array_equal(outputs_of(second)["OUTPUT__1"], [[2, 3], [3, 4]])
        timing = instance.timing
        assert timing.input_ns > 0 and timing.infer_ns > 0 and timing.output_ns > 0
    finally:
        release([instance])


def test_named_arguments_and_config_ordered_outputs(tmp_path: Path) -> None:
    text = """
    name: "m"
    backend: "pytorch"
    input [ { name: "values" data_type: TYPE_FP64 dims: [ 3 ] },
            { name: "scale" data_type: TYPE_FP64 dims: [ 1 ] },
            { name: "shift" data_type: TYPE_FP64 dims: [ 1 ] } ]
    output [ { name: "result" data_type: TYPE_FP64 dims: [ 3 ] } ]
    """
    _, [instance] = make(tmp_path, tm.script(tm.ScaleShift()), text)
    try:
        [result] = instance.execute(
            [request(("values", "FP64", [1, 2, 3]), ("scale", "FP64", [10]), ("shift", "FP64", [1]))]
        )
        np.testing.assert_array_equal(outputs_of(result)["result"], [11, 21, 31])
    finally:
        release([instance])


@pytest.mark.parametrize("datatype", ["FP16", "BF16", "INT8", "INT16", "INT32", "INT64", "UINT8",
                                      "FP32", "FP64"])
def test_datatypes_round_trip(tmp_path: Path, datatype: str) -> None:
    text = f"""
    name: "m"
    backend: "pytorch"
    max_batch_size: 2
    input [ {{ name: "INPUT__0" data_type: TYPE_{datatype} dims: [ 3 ] }} ]
    output [ {{ name: "OUTPUT__0" data_type: TYPE_{datatype} dims: [ 3 ] }} ]
    """
    _, [instance] = make(tmp_path, tm.script(tm.Affine()), text)
    try:
        data = np.array([[1, 2, 3]], dtype=DataType(datatype).numpy_dtype)
        [result] = instance.execute([request(("INPUT__0", datatype, data))])
        got = outputs_of(result)["OUTPUT__0"]
        assert got.dtype == DataType(datatype).numpy_dtype
        np.testing.assert_array_equal(got.astype(np.float64), [[3, 5, 7]])
    finally:
        release([instance])


def test_bytes_are_lists_of_strings(tmp_path: Path) -> None:
    text = """
    name: "m"
    backend: "pytorch"
    input [ { name: "words" data_type: TYPE_STRING dims: [ -1 ] },
            { name: "x" data_type: TYPE_INT32 dims: [ 2 ] } ]
    output [ { name: "UPPER__0" data_type: TYPE_STRING dims: [ -1 ] },
             { name: "DOUBLE__1" data_type: TYPE_INT32 dims: [ 2 ] } ]
    """
    _, [instance] = make(tmp_path, tm.script(tm.Upper()), text)
    try:
        words = np.array([b"hello", "ünï".encode()], dtype=np.object_)
        req = InferenceRequest(
            "m", "", [Tensor("words", DataType.BYTES, (2,), words),
                      Tensor("x", DataType.INT32, (2,), np.array([1, 2], dtype=np.int32))]
        )
        [result] = instance.execute([req])
        out = outputs_of(result)
        # TorchScript's str.upper() is ASCII only; the UTF-8 text comes back intact.
        assert list(out["UPPER__0"]) == [b"HELLO", "üNï".encode()]
        np.testing.assert_array_equal(out["DOUBLE__1"], [2, 4])
        bad = InferenceRequest(
            "m", "", [Tensor("words", DataType.BYTES, (1,), np.array([b"\xff"], dtype=np.object_)),
                      Tensor("x", DataType.INT32, (2,), np.array([1, 2], dtype=np.int32))]
        )
        [error] = instance.execute([bad])
        assert isinstance(error, InvalidArgumentError) and "not UTF-8" in str(error)
    finally:
        release([instance])


def test_dict_and_list_results_and_a_dict_argument(tmp_path: Path) -> None:
    one = """
    name: "m"
    backend: "pytorch"
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "square" data_type: TYPE_FP32 dims: [ 2 ] },
             { name: "double" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """
    _, [by_key] = make(tmp_path, tm.script(tm.DictOut()), one, "m")
    two = one.replace('"square"', '"OUT__1"').replace('"double"', '"OUT__0"').replace('"m"', '"n"')
    _, [by_list] = make(tmp_path, tm.script(tm.ListOut()), two, "n")
    three = """
    name: "d"
    backend: "pytorch"
    input [ { name: "b" data_type: TYPE_FP32 dims: [ 2 ] },
            { name: "a" data_type: TYPE_FP32 dims: [ 2 ] } ]
    output [ { name: "diff" data_type: TYPE_FP32 dims: [ 2 ] } ]
    """
    _, [by_dict] = make(tmp_path, tm.script(tm.DictIn()), three, "d")
    try:
        [result] = by_key.execute([request(("x", "FP32", [3, 4]))])
        assert {k: v.tolist() for k, v in outputs_of(result).items()} == {
            "square": [9, 16], "double": [6, 8]
        }
        [result] = by_list.execute([request(("x", "FP32", [3, 4]))])
        assert {k: v.tolist() for k, v in outputs_of(result).items()} == {
            "OUT__1": [5, 6], "OUT__0": [4, 5]
        }
        [result] = by_dict.execute([request(("a", "FP32", [3, 4]), ("b", "FP32", [1, 1]))])
        assert outputs_of(result)["diff"].tolist() == [2, 3]
    finally:
        release([by_key, by_list, by_dict])


@pytest.mark.parametrize(
    ("module", "inputs", "outputs", "message"),
    [
        (tm.ReturnsInt, "x", "y", "forward() returns int"),
        (tm.AddSub, "INPUT__0 INPUT__1", "OUTPUT__2", "output 'OUTPUT__2' is result 2"),
        (tm.Affine, "x", "", "declares no output"),
        (tm.Affine, "a b", "y", "declares 2 input(s)"),
        (tm.Upper, "words:TYPE_FP32 x", "y", "BYTES inputs must be List[str]"),
    ],
)
def test_load_time_checks(
    tmp_path: Path, module: type, inputs: str, outputs: str, message: str
) -> None:
    def entries(spec: str) -> str:
        parts = []
        for item in spec.split():
            name, _, dtype = item.partition(":")
            parts.append(f'{{ name: "{name}" data_type: {dtype or "TYPE_FP32"} dims: [ -1 ] }}')
        return ", ".join(parts)

    text = f"""
    name: "m"
    backend: "pytorch"
    input [ {entries(inputs)} ]
    output [ {entries(outputs)} ]
    """
    with pytest.raises(ConfigError) as info:
        make(tmp_path, tm.script(module()), text)
    assert message in str(info.value)
    assert "config.pbtxt" in str(info.value)


def test_errors_in_forward_name_the_model(tmp_path: Path) -> None:
    text = """
    name: "m"
    backend: "pytorch"
    input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """
    _, [raising] = make(tmp_path, tm.script(tm.Raises()), text)
    _, [linear] = make(tmp_path, tm.traced_linear(3, 2), text.replace('"m"', '"lin"'), "lin")
    try:
        [error] = raising.execute([request(("x", "FP32", [-1, -2]))])
        assert isinstance(error, InternalError)
        assert "model 'm'" in str(error) and "negative input is not allowed" in str(error)
        [ok] = raising.execute([request(("x", "FP32", [1, 2]))])
        assert outputs_of(ok)["y"].tolist() == [1, 2]
        [error] = linear.execute([request(("x", "FP32", [1, 2, 3, 4]))])
        assert isinstance(error, InvalidArgumentError), error
        assert "model 'lin'" in str(error)
    finally:
        release([raising, linear])


def test_a_wrong_output_datatype_is_an_internal_error(tmp_path: Path) -> None:
    text = """
    name: "m"
    backend: "pytorch"
    input [ { name: "x" data_type: TYPE_INT32 dims: [ -1 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """
    _, [instance] = make(tmp_path, tm.script(tm.Affine()), text)
    try:
        [error] = instance.execute([request(("x", "INT32", [1]))])
        assert isinstance(error, InternalError)
        assert "expects datatype TYPE_FP32 for output 'y'" in str(error)
    finally:
        release([instance])


COUNTER = """
name: "m"
backend: "pytorch"
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 3 kind: KIND_CPU } ]
"""
SHARING = 'parameters { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } }\n'


def test_weight_sharing_loads_one_module_for_every_instance(tmp_path: Path) -> None:
    _, shared = make(tmp_path, tm.script(tm.Counter()), COUNTER + SHARING)
    _, separate = make(tmp_path, tm.script(tm.Counter()), COUNTER.replace('"m"', '"n"'), "n")
    try:
        assert shared[0].module is shared[1].module is shared[2].module
        assert separate[0].module is not separate[1].module
        counts = [outputs_of(i.execute([request(("x", "FP32", [0]))])[0])["y"][0] for i in shared]
        assert counts == [1, 2, 3]  # one count: one module
        counts = [outputs_of(i.execute([request(("x", "FP32", [0]))])[0])["y"][0] for i in separate]
        assert counts == [1, 1, 1]
        assert len(pt._SHARED) == 1
    finally:
        release(shared + separate)
    assert len(pt._SHARED) == 0


def test_no_effect_parameters_warn_once_at_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = COUNTER + "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "true" }} }}\n'
        for k in ("ENABLE_NVFUSER", "ENABLE_CACHE_CLEANING")
    )
    with caplog.at_level(logging.WARNING, logger="quiver.backends.pytorch"):
        _, instances = make(tmp_path, tm.script(tm.Counter()), text)
    release(instances)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("ENABLE_NVFUSER has no effect" in line and "'m'" in line for line in lines) == 1
    assert sum("ENABLE_CACHE_CLEANING has no effect" in line for line in lines) == 1


def test_models_that_disagree_on_a_process_wide_switch_are_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fuser = 'parameters {{ key: "ENABLE_TENSOR_FUSER" value {{ string_value: "{}" }} }}\n'
    before = torch._C._jit_texpr_fuser_enabled()
    with caplog.at_level(logging.WARNING, logger="quiver.backends.pytorch"):
        _, first = make(tmp_path, tm.script(tm.Affine()), COUNTER + fuser.format("false"))
        _, second = make(
            tmp_path, tm.script(tm.Affine()), COUNTER.replace('"m"', '"n"') + fuser.format("true"), "n"
        )
    try:
        assert "model 'n' sets ENABLE_TENSOR_FUSER=true but loaded model 'm'" in caplog.text
        first[0].execute([request(("x", "FP32", [1]))])
        assert torch._C._jit_texpr_fuser_enabled() is False  # set before each execution
        second[0].execute([request(("x", "FP32", [1]))])
        assert torch._C._jit_texpr_fuser_enabled() is True
    finally:
        release(first + second)
        torch._C._jit_set_texpr_fuser_enabled(before)
    assert not pt._GLOBAL.switches


def test_inference_mode_and_optimized_execution_are_per_call(tmp_path: Path) -> None:
    text = COUNTER.replace("count: 3", "count: 1") + "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
        for k, v in (("INFERENCE_MODE", "false"), ("DISABLE_OPTIMIZED_EXECUTION", "true"))
    )
    _, [instance] = make(tmp_path, tm.script(tm.Affine()), text)
    try:
        seen: list[tuple[bool, bool, bool]] = []
        real = instance.module

        class Probe:
            def __call__(self, *args: Any) -> Any:
                seen.append(
                    (
                        torch.is_inference_mode_enabled(),
                        torch.is_grad_enabled(),
                        torch._C._get_graph_executor_optimize(),
                    )
                )
                return real(*args)

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        instance.module = Probe()
        instance.execute([request(("x", "FP32", [1]))])
        assert seen == [(False, False, False)]  # no_grad, not inference mode, not optimized
        assert torch._C._get_graph_executor_optimize() is True  # restored after the call
        instance.module = real
    finally:
        release([instance])


def test_a_missing_model_file_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"model 'm' version 1: model file .*model.pt"):
        make(tmp_path, None, COUNTER)
