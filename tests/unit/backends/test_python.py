"""The Python backend runs Triton model.py files unchanged, in-process (these tests drive
:class:`PythonInstance` directly; tests/unit/backends/test_python_worker.py covers workers)."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as pb

import triton_python_backend_utils as pb_utils
from quiver.backends.base import SERVER, InstanceSpec, ModelFiles
from quiver.backends.python import BACKEND, PythonInstance
from quiver.config import ModelConfig, parse_model_config
from quiver.errors import (
    ConfigError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    QuiverError,
    UnavailableError,
)
from quiver.types import DataType, InferenceRequest, InferenceResponse, RequestedOutput, Tensor

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model here runs in the test's process (--backend-config=python,in-process=true)."""
    monkeypatch.setattr(SERVER, "backend_config", {"python": {"in-process": "true"}})


FP32_4 = """
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [{ count: 1 kind: KIND_CPU }]  # count: model_config.py HasField bug
"""

# Triton's python_backend examples/add_sub/model.py, in behaviour.
ADD_SUB = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        output0_dtype = self.output0_dtype
        output1_dtype = self.output1_dtype
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(output1_dtype))
            inference_response = pb_utils.InferenceResponse(
                output_tensors=[out_tensor_0, out_tensor_1]
            )
            responses.append(inference_response)
        return responses

    def finalize(self):
        print("Cleaning up...")
"""


def write_model(
    repo: Path, name: str, code: str, config_body: str = FP32_4, version: int = 1
) -> tuple[ModelConfig, ModelFiles]:
    model_dir = repo / name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    text = f'name: "{name}"\nbackend: "python"\n{config_body}'
    (model_dir / "config.pbtxt").write_text(text)
    (model_dir / str(version) / "model.py").write_text(textwrap.dedent(code))
    proto = parse_model_config(text, model_dir / "config.pbtxt", name)
    config = ModelConfig.from_proto(proto, str(model_dir / "config.pbtxt"))
    return config, ModelFiles(repository=repo, model_dir=model_dir, version=version)


def load(repo: Path, name: str, code: str, config_body: str = FP32_4, version: int = 1) -> Any:
    config, files = write_model(repo, name, code, config_body, version)
    spec = InstanceSpec(group=config.instance_groups[0], index=0)
    return BACKEND.create_instance(config, files, spec)


def fp32(name: str, values: list[float]) -> Tensor:
    data = np.array(values, dtype=np.float32)
    return Tensor(name, DataType.FP32, data.shape, data)


def bytes_tensor(name: str, values: list[bytes]) -> Tensor:
    data = np.empty(len(values), dtype=np.object_)
    data[:] = values
    return Tensor(name, DataType.BYTES, data.shape, data)


def add_sub_request(a: list[float], b: list[float], **kwargs: Any) -> InferenceRequest:
    return InferenceRequest(
        model_name="add_sub",
        model_version="",
        inputs=[fp32("INPUT0", a), fp32("INPUT1", b)],
        **kwargs,
    )


def run(instance: Any, requests: list[InferenceRequest]) -> list[Any]:
    return asyncio.run(instance.run(requests))


def output(response: InferenceResponse, name: str) -> Tensor:
    for tensor in response.outputs:
        if tensor.name == name:
            return tensor
    raise AssertionError(f"no output {name!r} in {[t.name for t in response.outputs]}")


# ------------------------------------------------------------------------- add_sub


def test_add_sub_example(tmp_path: Path) -> None:
    instance = load(tmp_path, "add_sub", ADD_SUB)
    try:
        assert instance.name == "add_sub_0_0"
        (response,) = run(instance, [add_sub_request([1, 2, 3, 4], [0.5, 0.5, 1, 2], id="r1")])
        assert isinstance(response, InferenceResponse)
        assert response.model_name == "add_sub"
        assert response.model_version == "1"
        assert response.id == "r1"
        assert [t.name for t in response.outputs] == ["OUTPUT0", "OUTPUT1"]
        out0 = output(response, "OUTPUT0")
        out1 = output(response, "OUTPUT1")
        assert out0.datatype is DataType.FP32 and out0.shape == (4,)
        np.testing.assert_array_equal(out0.data, np.array([1.5, 2.5, 4, 6], dtype=np.float32))
        np.testing.assert_array_equal(out1.data, np.array([0.5, 1.5, 2, 2], dtype=np.float32))
        assert out0.data.dtype == np.float32
    finally:
        instance.unload()


def test_add_sub_batch_of_requests_keeps_order(tmp_path: Path) -> None:
    instance = load(tmp_path, "add_sub", ADD_SUB)
    try:
        requests = [add_sub_request([i] * 4, [1] * 4, id=str(i)) for i in range(5)]
        responses = run(instance, requests)
        assert [r.id for r in responses] == ["0", "1", "2", "3", "4"]
        for i, response in enumerate(responses):
            np.testing.assert_array_equal(output(response, "OUTPUT0").data, [i + 1] * 4)
            np.testing.assert_array_equal(output(response, "OUTPUT1").data, [i - 1] * 4)
    finally:
        instance.unload()


def test_missing_model_file_fails_load(tmp_path: Path) -> None:
    config, files = write_model(tmp_path, "nofile", ADD_SUB)
    (files.version_dir / "model.py").unlink()
    spec = InstanceSpec(group=config.instance_groups[0], index=0)
    with pytest.raises(InternalError, match=r"model 'nofile' version 1: .*not found"):
        BACKEND.create_instance(config, files, spec)


# ------------------------------------------------------------- initialize arguments


ARGS_MODEL = """
import json
import triton_python_backend_utils as pb_utils
import numpy as np

class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)

    def execute(self, requests):
        text = json.dumps(self.args)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("ARGS", np.array([text], dtype=object))])
            for _ in requests
        ]
"""

ARGS_CONFIG = """
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [{ count: 2 kind: KIND_CPU }]
"""


def test_initialize_gets_tritons_args(tmp_path: Path) -> None:
    config, files = write_model(tmp_path, "args", ARGS_MODEL, ARGS_CONFIG, version=3)
    spec = InstanceSpec(group=config.instance_groups[0], index=1)
    instance = BACKEND.create_instance(config, files, spec)
    try:
        data = np.array([[1, 2]], dtype=np.int32)
        request = InferenceRequest("args", "", [Tensor("IN", DataType.INT32, (1, 2), data)])
        (response,) = run(instance, [request])
        args_out = output(response, "ARGS")
        assert args_out.datatype is DataType.BYTES
        args = json.loads(args_out.data[0].decode())
    finally:
        instance.unload()
    assert args["model_name"] == "args"
    assert args["model_version"] == "3"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] == "args_0_1"
    assert args["model_instance_device_id"] == "0"
    assert args["model_repository"] == str(tmp_path / "args")
    model_config = json.loads(args["model_config"])
    assert model_config["name"] == "args"
    assert model_config["backend"] == "python"
    assert model_config["max_batch_size"] == 8
    # Triton's JSON form: proto field names, enum names, int64 as numbers.
    (input_config,) = model_config["input"]
    assert input_config["name"] == "IN"
    assert input_config["data_type"] == "TYPE_INT32"
    assert input_config["dims"] == [-1]
    assert pb_utils.get_output_config_by_name(model_config, "ARGS")["data_type"] == "TYPE_STRING"
    assert pb_utils.get_input_config_by_name(model_config, "NOPE") is None


# ------------------------------------------------------------------ request view


REQUEST_VIEW = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                request.get_response_sender()
                sender = "no error"
            except pb_utils.TritonModelException as exc:
                sender = str(exc)
            view = {
                "request_id": request.request_id(),
                "correlation_id": request.correlation_id(),
                "flags": request.flags(),
                "timeout": request.timeout(),
                "parameters": request.parameters(),
                "requested": sorted(request.requested_output_names()),
                "cancelled": request.is_cancelled(),
                "inputs": [[t.name(), t.triton_dtype(), t.shape(), t.is_cpu()]
                           for t in request.inputs()],
                "sender": sender,
            }
            out = pb_utils.Tensor("VIEW", np.array([json.dumps(view).encode()], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out], parameters={"seen": True}))
        return responses
"""

REQUEST_VIEW_CONFIG = """
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2, 2 ] } ]
output [
  { name: "VIEW" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "OTHER" data_type: TYPE_FP32 dims: [ 1 ] }
]
"""


def _view(response: InferenceResponse) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(output(response, "VIEW").data[0])
    return result


def test_request_as_the_model_sees_it(tmp_path: Path) -> None:
    instance = load(tmp_path, "view", REQUEST_VIEW, REQUEST_VIEW_CONFIG)
    data = np.arange(4, dtype=np.float32).reshape(2, 2)
    plain = InferenceRequest("view", "", [Tensor("IN", DataType.FP32, (2, 2), data)], id="a")
    sequence = InferenceRequest(
        "view",
        "",
        [Tensor("IN", DataType.FP32, (2, 2), data)],
        outputs=[RequestedOutput("VIEW")],
        id="b",
        parameters={
            "sequence_id": 42,
            "sequence_start": True,
            "sequence_end": True,
            "timeout": 5000,
            "priority": 1,
            "custom": "x",
            "n": 3,
        },
    )
    try:
        first, second = run(instance, [plain, sequence])
    finally:
        instance.unload()
    a = _view(first)
    assert a["request_id"] == "a"
    assert a["correlation_id"] == 0
    assert a["flags"] == 0
    assert a["timeout"] == 0
    assert json.loads(a["parameters"]) == {}
    assert a["requested"] == ["OTHER", "VIEW"]  # none asked for: all of them
    assert a["cancelled"] is False
    assert a["inputs"] == [["IN", 11, [2, 2], True]]
    assert a["sender"] == "no error"  # Triton 24.06+: models that are not decoupled have one too
    assert first.parameters == {"seen": True}

    b = _view(second)
    assert b["request_id"] == "b"
    assert b["correlation_id"] == 42
    assert b["flags"] == (
        pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        | pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    )
    assert b["timeout"] == 5000
    assert json.loads(b["parameters"]) == {"custom": "x", "n": 3}
    assert b["requested"] == ["VIEW"]


def test_inputs_are_not_copied(tmp_path: Path) -> None:
    code = """
    import triton_python_backend_utils as pb_utils
    SEEN = []
    class TritonPythonModel:
        def execute(self, requests):
            SEEN.extend(t.as_numpy() for r in requests for t in r.inputs())
            return [pb_utils.InferenceResponse([]) for _ in requests]
    """
    instance = load(tmp_path, "nocopy", code)
    try:
        request = add_sub_request([1, 2, 3, 4], [5, 6, 7, 8])
        run(instance, [request])
        seen = instance._loaded.module.SEEN
        assert seen[0] is request.inputs[0].data
        assert seen[1] is request.inputs[1].data
    finally:
        instance.unload()


# --------------------------------------------------------------------------- BYTES


STRING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([t.decode("utf-8").upper() for t in text.reshape(-1)], dtype=object)
            lengths = np.array([len(t) for t in text.reshape(-1)], dtype=np.int64)
            unicode = np.array(["é", "ok"])  # numpy str_ array
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("UPPER", upper.reshape(text.shape)),   # str elements
                pb_utils.Tensor("LENGTH", lengths),
                pb_utils.Tensor("UNICODE", unicode),
                pb_utils.Tensor("ECHO", text),                          # bytes elements
            ]))
        return responses
"""

STRING_CONFIG = """
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [
  { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "LENGTH" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "UNICODE" data_type: TYPE_STRING dims: [ 2 ] },
  { name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] }
]
"""


def test_bytes_model(tmp_path: Path) -> None:
    instance = load(tmp_path, "strings", STRING_MODEL, STRING_CONFIG)
    request = InferenceRequest(
        "strings", "", [bytes_tensor("TEXT", [b"hello", "wörld".encode(), b""])]
    )
    try:
        (response,) = run(instance, [request])
    finally:
        instance.unload()
    upper = output(response, "UPPER")
    assert upper.datatype is DataType.BYTES
    assert upper.shape == (3,)
    assert upper.data.dtype == np.object_
    assert list(upper.data) == [b"HELLO", "WÖRLD".encode(), b""]
    assert all(type(item) is bytes for item in upper.data)
    length = output(response, "LENGTH")
    assert length.datatype is DataType.INT64
    assert list(length.data) == [5, 6, 0]
    unicode = output(response, "UNICODE")
    assert unicode.datatype is DataType.BYTES
    assert list(unicode.data) == ["é".encode(), b"ok"]
    echo = output(response, "ECHO")
    assert echo.datatype is DataType.BYTES
    assert list(echo.data) == [b"hello", "wörld".encode(), b""]


# -------------------------------------------------------------------- load failures


def test_initialize_exception_fails_load_with_model_name(tmp_path: Path) -> None:
    code = """
    class TritonPythonModel:
        def initialize(self, args):
            raise ValueError("no weights here")
        def execute(self, requests):
            return []
    """
    with pytest.raises(InternalError) as info:
        load(tmp_path, "bad_init", code)
    assert str(info.value) == (
        "model 'bad_init' version 1: initialize() failed: ValueError: no weights here"
    )


def test_initialize_triton_error_keeps_its_code(tmp_path: Path) -> None:
    code = """
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def initialize(self, args):
            raise pb_utils.TritonError("GPU missing", pb_utils.TritonError.UNAVAILABLE)
    """
    with pytest.raises(UnavailableError, match=r"initialize\(\) failed: .*GPU missing"):
        load(tmp_path, "unavail", code)


def test_import_error_fails_load(tmp_path: Path) -> None:
    code = """
    import numpy as np
    import package_that_does_not_exist
    class TritonPythonModel:
        pass
    """
    with pytest.raises(InternalError) as info:
        load(tmp_path, "bad_import", code)
    message = str(info.value)
    assert message.startswith("model 'bad_import' version 1: importing model.py failed")
    assert "ModuleNotFoundError" in message
    assert "package_that_does_not_exist" in message
    assert not [name for name in sys.modules if "bad_import" in name]


def test_syntax_error_and_missing_class_fail_load(tmp_path: Path) -> None:
    with pytest.raises(InternalError, match=r"importing model\.py failed: SyntaxError"):
        load(tmp_path, "syntax", "def broken(:\n")
    with pytest.raises(InternalError, match="does not define a class 'TritonPythonModel'"):
        load(tmp_path, "noclass", "class SomethingElse:\n    pass\n")


# ---------------------------------------------------------------- execute failures


def test_execute_exception_fails_every_request(tmp_path: Path) -> None:
    code = """
    class TritonPythonModel:
        def execute(self, requests):
            raise ValueError("cannot add these")
    """
    instance = load(tmp_path, "raiser", code)
    try:
        results = run(instance, [add_sub_request([1] * 4, [2] * 4) for _ in range(3)])
        assert len(results) == 3
        for result in results:
            assert isinstance(result, InternalError)
            assert str(result) == (
                "model 'raiser' version 1: execute() raised ValueError: cannot add these"
            )
        # The instance keeps working after a failed batch.
        assert len(run(instance, [add_sub_request([1] * 4, [2] * 4)])) == 1
    finally:
        instance.unload()


def test_execute_raising_triton_errors_maps_codes(tmp_path: Path) -> None:
    code = """
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def execute(self, requests):
            kind = requests[0].request_id()
            if kind == "exception":
                raise pb_utils.TritonModelException("model says no")
            raise pb_utils.TritonError("bad shape", pb_utils.TritonError.INVALID_ARG)
    """
    instance = load(tmp_path, "tritonraise", code)
    try:
        (exc_result,) = run(instance, [add_sub_request([1] * 4, [2] * 4, id="exception")])
        (err_result,) = run(instance, [add_sub_request([1] * 4, [2] * 4, id="error")])
    finally:
        instance.unload()
    assert isinstance(exc_result, InternalError)
    assert "TritonModelException: model says no" in str(exc_result)
    assert isinstance(err_result, InvalidArgumentError)
    assert "bad shape" in str(err_result)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return None", "execute() returned None"),
        (
            "return [pb_utils.InferenceResponse([])]",
            "execute() returned 1 responses for 2 requests",
        ),
        ("return tuple(pb_utils.InferenceResponse([]) for _ in requests)", "returned a tuple"),
    ],
)
def test_execute_wrong_return_fails_every_request(tmp_path: Path, body: str, expected: str) -> None:
    code = f"""
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def execute(self, requests):
            {body}
    """
    instance = load(tmp_path, "wrongcount", code)
    try:
        results = run(instance, [add_sub_request([1] * 4, [2] * 4) for _ in range(2)])
    finally:
        instance.unload()
    assert len(results) == 2
    for result in results:
        assert isinstance(result, InternalError)
        assert result.code is ErrorCode.INTERNAL
        assert str(result).startswith("model 'wrongcount' version 1: ")
        assert expected in str(result)


def test_bad_response_elements_fail_only_their_request(tmp_path: Path) -> None:
    code = """
    import numpy as np
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def execute(self, requests):
            good = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.ones(4, np.float32))])
            smuggled = pb_utils.InferenceResponse([])
            smuggled.output_tensors().append("not a tensor")
            weird = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.ones(4, np.float32))])
            weird.output_tensors()[0]._array = np.ones(4, np.complex64)
            return [good, {"OUTPUT0": 1}, None, smuggled, weird]
    """
    instance = load(tmp_path, "mixed", code)
    try:
        results = run(instance, [add_sub_request([1] * 4, [2] * 4) for _ in range(5)])
    finally:
        instance.unload()
    good, as_dict, none, smuggled, weird = results
    assert isinstance(good, InferenceResponse)
    np.testing.assert_array_equal(output(good, "OUTPUT0").data, np.ones(4, np.float32))
    assert isinstance(as_dict, InternalError)
    assert "model 'mixed' version 1: execute() returned a dict for request 1" in str(as_dict)
    assert isinstance(none, InternalError)
    assert "returned a NoneType for request 2" in str(none)
    assert isinstance(smuggled, InternalError)
    assert "response to request 3: output_tensors contains a str" in str(smuggled)
    assert isinstance(weird, InternalError)
    assert "output 'OUTPUT0' has numpy dtype complex64" in str(weird)


def test_unsupported_output_dtype_is_rejected_by_tensor(tmp_path: Path) -> None:
    code = """
    import numpy as np
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.ones(4, np.complex128))])
                    for _ in requests]
    """
    instance = load(tmp_path, "complex", code)
    try:
        (result,) = run(instance, [add_sub_request([1] * 4, [2] * 4)])
    finally:
        instance.unload()
    assert isinstance(result, InternalError)
    assert "execute() raised TritonModelException" in str(result)
    assert "complex128 is not supported" in str(result)


def test_error_responses_map_to_quiver_errors(tmp_path: Path) -> None:
    code = """
    import numpy as np
    import triton_python_backend_utils as pb_utils
    CODES = {
        "invalid": pb_utils.TritonError.INVALID_ARG,
        "missing": pb_utils.TritonError.NOT_FOUND,
        "busy": pb_utils.TritonError.UNAVAILABLE,
        "nope": pb_utils.TritonError.UNSUPPORTED,
    }
    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                kind = request.request_id()
                if kind == "ok":
                    out = pb_utils.Tensor("OUTPUT0", np.zeros(4, np.float32))
                    responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
                elif kind == "default":
                    responses.append(pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError("plain failure")))
                else:
                    responses.append(pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"{kind} happened", CODES[kind])))
            return responses
    """
    instance = load(tmp_path, "errors", code)
    kinds = ["ok", "default", "invalid", "missing", "busy", "nope"]
    try:
        results = run(instance, [add_sub_request([1] * 4, [2] * 4, id=k) for k in kinds])
    finally:
        instance.unload()
    assert isinstance(results[0], InferenceResponse)
    errors = results[1:]
    assert all(isinstance(e, QuiverError) for e in errors)
    assert [e.code for e in errors] == [
        ErrorCode.INTERNAL,
        ErrorCode.INVALID_ARG,
        ErrorCode.NOT_FOUND,
        ErrorCode.UNAVAILABLE,
        ErrorCode.UNSUPPORTED,
    ]
    assert [str(e) for e in errors] == [
        "plain failure",
        "invalid happened",
        "missing happened",
        "busy happened",
        "nope happened",
    ]


# --------------------------------------------------------------------------- async


ASYNC_MODEL = """
import asyncio
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def initialize(self, args):
        await asyncio.sleep(0)
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.threads = {threading.get_ident()}
        self.calls = 0

    async def execute(self, requests):
        assert asyncio.get_running_loop() is self.loop  # one loop per instance
        self.threads.add(threading.get_ident())
        async with self.lock:
            self.calls += 1
            await asyncio.sleep(0.001)
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", a * b),
                pb_utils.Tensor("CALLS", np.array([self.calls], dtype=np.int32)),
                pb_utils.Tensor("THREADS", np.array([len(self.threads)], dtype=np.int32)),
            ]))
        return responses

    async def finalize(self):
        await asyncio.sleep(0)
        with open(self.marker, "w") as f:
            f.write("finalized")
"""


def test_async_initialize_execute_finalize(tmp_path: Path) -> None:
    instance = load(tmp_path, "asyncmodel", ASYNC_MODEL)
    marker = tmp_path / "finalized.txt"
    instance._model.marker = str(marker)
    try:
        (first,) = run(instance, [add_sub_request([1, 2, 3, 4], [2, 2, 2, 2])])
        (second,) = run(instance, [add_sub_request([1, 1, 1, 1], [3, 3, 3, 3])])
    finally:
        instance.unload()
    np.testing.assert_array_equal(output(first, "OUTPUT0").data, [2, 4, 6, 8])
    np.testing.assert_array_equal(output(second, "OUTPUT0").data, [3, 3, 3, 3])
    assert output(second, "CALLS").data[0] == 2
    # initialize and execute ran on the same (instance) thread.
    assert output(second, "THREADS").data[0] == 1
    assert marker.read_text() == "finalized"


def test_async_execute_exception(tmp_path: Path) -> None:
    code = """
    import asyncio
    class TritonPythonModel:
        async def execute(self, requests):
            await asyncio.sleep(0)
            raise RuntimeError("async trouble")
    """
    instance = load(tmp_path, "asyncraise", code)
    try:
        (result,) = run(instance, [add_sub_request([1] * 4, [2] * 4)])
    finally:
        instance.unload()
    assert isinstance(result, InternalError)
    assert (
        str(result) == "model 'asyncraise' version 1: execute() raised RuntimeError: async trouble"
    )


# ------------------------------------------------------------------------ finalize


def test_finalize_is_called_and_its_errors_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    code = """
    class TritonPythonModel:
        def initialize(self, args):
            self.marker = args["model_repository"] + "/finalized"
        def execute(self, requests):
            return []
        def finalize(self):
            open(self.marker, "w").close()
            raise RuntimeError("finalize trouble")
    """
    instance = load(tmp_path, "fin", code)
    package = instance._loaded.package
    assert package in sys.modules
    with caplog.at_level("ERROR", logger="quiver.backends.python"):
        instance.unload()  # does not raise
    assert (tmp_path / "fin" / "finalized").exists()
    assert "model 'fin' version 1: finalize() failed: RuntimeError: finalize trouble" in caplog.text
    assert not [name for name in sys.modules if name.startswith(package)]


# ------------------------------------------------------------- side-by-side modules


def _helper_model(tag: str) -> str:
    return f"""
    import numpy as np
    import triton_python_backend_utils as pb_utils
    import helpers            # a sibling module in the version folder
    from . import relhelper   # and a relative import

    STATE = []

    class TritonPythonModel:
        def execute(self, requests):
            STATE.append("{tag}")
            responses = []
            for request in requests:
                a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT0", helpers.apply(a)),
                    pb_utils.Tensor("OUTPUT1", relhelper.apply(a)),
                    pb_utils.Tensor("TAG", np.array([",".join(STATE)], dtype=object)),
                ]))
            return responses
    """


def test_two_models_named_model_py_side_by_side(tmp_path: Path) -> None:
    cfg_doubler, files_doubler = write_model(tmp_path, "doubler", _helper_model("d"))
    cfg_negator, files_negator = write_model(tmp_path, "negator", _helper_model("n"))
    (files_doubler.version_dir / "helpers.py").write_text("def apply(a):\n    return a * 2\n")
    (files_doubler.version_dir / "relhelper.py").write_text("def apply(a):\n    return a + 100\n")
    (files_negator.version_dir / "helpers.py").write_text("def apply(a):\n    return -a\n")
    (files_negator.version_dir / "relhelper.py").write_text("def apply(a):\n    return a - 100\n")
    path_before = list(sys.path)
    doubler = BACKEND.create_instance(
        cfg_doubler, files_doubler, InstanceSpec(cfg_doubler.instance_groups[0], 0)
    )
    negator = BACKEND.create_instance(
        cfg_negator, files_negator, InstanceSpec(cfg_negator.instance_groups[0], 0)
    )
    doubler2 = BACKEND.create_instance(
        cfg_doubler, files_doubler, InstanceSpec(cfg_doubler.instance_groups[0], 1)
    )
    try:
        assert sys.path == path_before  # version folders only on sys.path while importing
        assert "helpers" not in sys.modules
        request = add_sub_request([1, 2, 3, 4], [0, 0, 0, 0])
        (d,) = run(doubler, [request])
        (n,) = run(negator, [request])
        (d_again,) = run(doubler, [request])
        (d2,) = run(doubler2, [request])
    finally:
        doubler.unload()
        negator.unload()
        doubler2.unload()
    np.testing.assert_array_equal(output(d, "OUTPUT0").data, [2, 4, 6, 8])
    np.testing.assert_array_equal(output(d, "OUTPUT1").data, [101, 102, 103, 104])
    np.testing.assert_array_equal(output(n, "OUTPUT0").data, [-1, -2, -3, -4])
    np.testing.assert_array_equal(output(n, "OUTPUT1").data, [-99, -98, -97, -96])
    assert output(n, "TAG").data[0] == b"n"
    assert output(d_again, "TAG").data[0] == b"d,d"
    # Each instance has its own module object: module-level state is not shared.
    assert output(d2, "TAG").data[0] == b"d"


def test_two_versions_of_one_model(tmp_path: Path) -> None:
    template = """
    import numpy as np
    import triton_python_backend_utils as pb_utils
    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", np.full(4, VERSION, np.float32))]) for _ in requests]
    """
    cfg1, files1 = write_model(tmp_path, "versioned", "VERSION = 1\n" + textwrap.dedent(template))
    cfg2, files2 = write_model(
        tmp_path, "versioned", "VERSION = 2\n" + textwrap.dedent(template), version=2
    )
    v1 = BACKEND.create_instance(cfg1, files1, InstanceSpec(cfg1.instance_groups[0], 0))
    v2 = BACKEND.create_instance(cfg2, files2, InstanceSpec(cfg2.instance_groups[0], 0))
    try:
        (r1,) = run(v1, [add_sub_request([0] * 4, [0] * 4)])
        (r2,) = run(v2, [add_sub_request([0] * 4, [0] * 4)])
    finally:
        v1.unload()
        v2.unload()
    assert r1.model_version == "1" and r2.model_version == "2"
    np.testing.assert_array_equal(output(r1, "OUTPUT0").data, [1] * 4)
    np.testing.assert_array_equal(output(r2, "OUTPUT0").data, [2] * 4)


# ------------------------------------------------------------------ auto-complete


AUTO_COMPLETE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                  {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4], "optional": True}]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for input in inputs:
            if input["name"] not in input_names:
                auto_complete_model_config.add_input(input)
        for output in outputs:
            if output["name"] not in output_names:
                auto_complete_model_config.add_output(output)
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


def _proto_for(tmp_path: Path, name: str, code: str, body: str) -> tuple[Any, ModelFiles]:
    _, files = write_model(tmp_path, name, code, body)
    text = (files.model_dir / "config.pbtxt").read_text()
    proto = parse_model_config(text, files.model_dir / "config.pbtxt", name)
    return proto, files


def test_auto_complete_fills_a_minimal_config(tmp_path: Path) -> None:
    proto, files = _proto_for(tmp_path, "auto", AUTO_COMPLETE, "")
    BACKEND.auto_complete(proto, files, strict=False)
    assert proto.name == "auto"
    assert proto.backend == "python"
    assert proto.max_batch_size == 8
    assert proto.HasField("dynamic_batching")
    assert [i.name for i in proto.input] == ["INPUT0", "INPUT1"]
    assert list(proto.input[0].dims) == [4]
    assert proto.input[1].optional is True
    assert [o.name for o in proto.output] == ["OUTPUT0"]
    config = ModelConfig.from_proto(proto)
    assert config.input("INPUT0") is not None
    assert config.input("INPUT0").datatype is DataType.FP32
    assert not [name for name in sys.modules if "_quiver_python_model_auto_" in name]


def test_auto_complete_keeps_configured_tensors(tmp_path: Path) -> None:
    body = """
    max_batch_size: 4
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "EXTRA" data_type: TYPE_INT8 dims: [ 1 ] } ]
    parameters { key: "k" value: { string_value: "v" } }
    """
    proto, files = _proto_for(tmp_path, "auto2", AUTO_COMPLETE, body)
    BACKEND.auto_complete(proto, files, strict=False)
    assert proto.max_batch_size == 8  # raised from 4, as Triton allows
    assert [i.name for i in proto.input] == ["INPUT0", "INPUT1"]
    assert [o.name for o in proto.output] == ["EXTRA", "OUTPUT0"]
    assert proto.output[0].data_type == pb.TYPE_INT8
    assert proto.parameters["k"].string_value == "v"


def test_auto_complete_max_batch_size_cannot_shrink(tmp_path: Path) -> None:
    body = "max_batch_size: 16\n"
    proto, files = _proto_for(tmp_path, "auto3", AUTO_COMPLETE, body)
    # Triton: a configured max_batch_size larger than the model's is an error.
    with pytest.raises(InternalError, match=r"max_batch_size 16, .*specified max_batch_size 8"):
        BACKEND.auto_complete(proto, files, strict=False)


def test_auto_complete_skipped_when_strict(tmp_path: Path) -> None:
    proto, files = _proto_for(tmp_path, "strict", AUTO_COMPLETE, "")
    before = proto.SerializeToString()
    BACKEND.auto_complete(proto, files, strict=True)
    assert proto.SerializeToString() == before


def test_auto_complete_without_the_method_changes_nothing(tmp_path: Path) -> None:
    proto, files = _proto_for(tmp_path, "plain", ADD_SUB, FP32_4)
    before = proto.SerializeToString()
    BACKEND.auto_complete(proto, files, strict=False)
    assert proto.SerializeToString() == before


def test_auto_complete_conflicting_dims_and_bad_return(tmp_path: Path) -> None:
    body = 'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 3 ] } ]\n'
    code = """
    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            auto_complete_model_config.add_input(
                {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
            return auto_complete_model_config
    """
    proto, files = _proto_for(tmp_path, "conflict", code, body)
    with pytest.raises(InternalError) as info:
        BACKEND.auto_complete(proto, files, strict=False)
    assert "model 'conflict' version 1: auto_complete_config() failed: ValueError" in str(
        info.value
    )
    assert "the model expects dims [4] but the model configuration specifies dims [3]" in str(
        info.value
    )

    code = """
    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            auto_complete_model_config.set_max_batch_size(4)
    """
    proto, files = _proto_for(tmp_path, "noreturn", code, "")
    with pytest.raises(
        InternalError, match=r"must return a pb_utils\.ModelConfig object, got NoneType"
    ):
        BACKEND.auto_complete(proto, files, strict=False)

    code = """
    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(auto_complete_model_config):
            auto_complete_model_config.as_dict()["max_batch_size"] = "lots"
            return auto_complete_model_config
    """
    proto, files = _proto_for(tmp_path, "garbage", code, "")
    with pytest.raises(ConfigError, match="returned an invalid configuration"):
        BACKEND.auto_complete(proto, files, strict=False)


# ------------------------------------------------------------------ pb_utils itself


def test_pb_utils_dtype_helpers() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool
    assert pb_utils.triton_to_numpy_type(11) is np.float32
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.triton_to_numpy_type(99) is None
    assert pb_utils.numpy_to_triton_type(np.float32) == 11
    assert pb_utils.numpy_to_triton_type(np.dtype(np.int64)) == 9
    assert pb_utils.numpy_to_triton_type(np.object_) == 13
    assert pb_utils.numpy_to_triton_type(np.bytes_) == 13
    assert pb_utils.numpy_to_triton_type(np.complex64) is None
    assert pb_utils.numpy_to_pb_dtype(np.float16) == "TYPE_FP16"
    assert pb_utils.numpy_to_pb_dtype(np.object_) == "TYPE_STRING"


def test_pb_utils_bytes_serialization_round_trip() -> None:
    tensor = np.array([[b"ab", "é"], [b"", 7]], dtype=np.object_)
    encoded = pb_utils.serialize_byte_tensor(tensor)
    assert encoded == (
        b"\x02\x00\x00\x00ab" + b"\x02\x00\x00\x00" + "é".encode() + b"\x00\x00\x00\x00"
        b"\x01\x00\x00\x007"
    )
    decoded = pb_utils.deserialize_bytes_tensor(encoded)
    assert decoded.dtype == np.object_
    assert list(decoded) == [b"ab", "é".encode(), b"", b"7"]
    assert pb_utils.serialize_byte_tensor(np.zeros(3, np.float32)) is None
    with pytest.raises(pb_utils.TritonModelException, match="beyond buffer"):
        pb_utils.deserialize_bytes_tensor(b"\x05\x00\x00\x00ab")


def test_pb_utils_tensor_and_dlpack() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("X", array)
    assert tensor.name() == "X"
    assert tensor.triton_dtype() == 11
    assert tensor.shape() == [2, 3]
    assert tensor.is_cpu() is True
    assert tensor.as_numpy() is array
    back = pb_utils.Tensor.from_dlpack("Y", tensor.to_dlpack())
    assert back.name() == "Y"
    np.testing.assert_array_equal(back.as_numpy(), array)
    assert np.shares_memory(back.as_numpy(), array)
    via_protocol = pb_utils.Tensor.from_dlpack("Z", tensor)  # has __dlpack__
    assert np.shares_memory(via_protocol.as_numpy(), array)
    assert np.shares_memory(np.from_dlpack(tensor), array)

    strings = pb_utils.Tensor("S", np.array([b"a"], dtype=np.object_))
    assert strings.triton_dtype() == 13
    with pytest.raises(pb_utils.TritonModelException, match="string tensors"):
        strings.to_dlpack()
    with pytest.raises(pb_utils.TritonModelException, match="empty string"):
        pb_utils.Tensor("", array)
    with pytest.raises(pb_utils.TritonModelException, match="not supported"):
        pb_utils.Tensor("C", np.ones(2, np.complex64))
    transposed = pb_utils.Tensor("T", array.T)
    assert transposed.as_numpy().flags.c_contiguous
    np.testing.assert_array_equal(transposed.as_numpy(), array.T)


def test_pb_utils_errors_and_responses() -> None:
    error = pb_utils.TritonError("oops")
    assert error.message() == "oops"
    assert error.code() == pb_utils.TritonError.INTERNAL
    codes = [
        pb_utils.TritonError.UNKNOWN,
        pb_utils.TritonError.INTERNAL,
        pb_utils.TritonError.NOT_FOUND,
        pb_utils.TritonError.INVALID_ARG,
        pb_utils.TritonError.UNAVAILABLE,
        pb_utils.TritonError.UNSUPPORTED,
        pb_utils.TritonError.ALREADY_EXISTS,
        pb_utils.TritonError.CANCELLED,
    ]
    assert [int(c) for c in codes] == list(range(8))
    assert pb_utils.TritonError("x", pb_utils.TritonError.CANCELLED).code().name == "CANCELLED"

    out = pb_utils.Tensor("OUT", np.zeros(1, np.int8))
    response = pb_utils.InferenceResponse(output_tensors=[out], parameters={"a": 1, "b": "c"})
    assert not response.has_error()
    assert response.error() is None
    assert pb_utils.get_output_tensor_by_name(response, "OUT") is out
    assert pb_utils.get_output_tensor_by_name(response, "NONE") is None
    assert json.loads(response.parameters()) == {"a": 1, "b": "c"}
    failed = pb_utils.InferenceResponse(error=error)
    assert failed.has_error() and failed.error() is error and failed.output_tensors() == []
    with pytest.raises(pb_utils.TritonModelException, match="bool/int/str"):
        pb_utils.InferenceResponse([], parameters={"f": 1.5})
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(out)


def test_pb_utils_bls_request_constructor() -> None:
    tensor = pb_utils.Tensor("IN", np.zeros(2, np.float32))
    request = pb_utils.InferenceRequest(
        model_name="other",
        requested_output_names=["OUT"],
        inputs=[tensor],
        request_id="7",
        correlation_id="seq-1",
        flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        parameters={"k": "v"},
    )
    assert request.inputs() == [tensor]
    assert request.request_id() == "7"
    assert request.correlation_id() == "seq-1"
    assert request.flags() == 1
    assert request.requested_output_names() == {"OUT"}
    assert json.loads(request.parameters()) == {"k": "v"}
    assert pb_utils.get_input_tensor_by_name(request, "IN") is tensor
    assert request.model_name() == "other"
    # exec() needs a running server (the integration tests run BLS end to end).
    with pytest.raises(pb_utils.TritonModelException, match="inside a running Quiver server"):
        request.exec()
    with pytest.raises(TypeError, match="model_name"):
        pb_utils.InferenceRequest(inputs=[], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException, match="Correlation ID"):
        pb_utils.InferenceRequest(
            inputs=[],
            requested_output_names=[],
            model_name="m",
            correlation_id=1.5,
        )


def test_pb_utils_model_config_editing() -> None:
    config = pb_utils.ModelConfig(
        json.dumps(
            {
                "name": "m",
                "max_batch_size": 0,
                "input": [
                    {"name": "A", "data_type": "TYPE_INVALID", "dims": [], "optional": False}
                ],
                "output": [],
            }
        )
    )
    config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [2]})
    config.add_input({"name": "B", "data_type": "TYPE_FP32", "dims": [-1], "optional": True})
    config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [1]})
    config.add_output({"name": "C", "data_type": "TYPE_FP32", "dims": [1]})  # same: fine
    data = config.as_dict()
    assert data["input"][0] == {
        "name": "A",
        "data_type": "TYPE_INT32",
        "dims": [2],
        "optional": False,
    }
    assert data["input"][1]["optional"] is True
    assert len(data["output"]) == 1
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32"):
        config.add_output({"name": "C", "data_type": "TYPE_INT8", "dims": [1]})
    with pytest.raises(ValueError, match="expects dims \\[3\\]"):
        config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [3]})
    with pytest.raises(ValueError, match="expects optional False"):
        config.add_input({"name": "B", "data_type": "TYPE_FP32", "dims": [-1], "optional": False})
    with pytest.raises(ValueError, match="contains property 'reshape'"):
        config.add_input({"name": "D", "data_type": "TYPE_FP32", "dims": [1], "reshape": {}})
    with pytest.raises(ValueError, match="contains property 'optional'"):
        config.add_output({"name": "E", "data_type": "TYPE_FP32", "dims": [1], "optional": True})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "F", "data_type": "TYPE_FP32"})
    config.set_max_batch_size(4)
    with pytest.raises(ValueError, match="max_batch_size 4"):
        config.set_max_batch_size(2)
    config.set_dynamic_batching()
    assert config.as_dict()["dynamic_batching"] == {}
    config.set_model_transaction_policy({"decoupled": False})
    assert pb_utils.using_decoupled_model_transaction_policy(config.as_dict()) is False
    with pytest.raises(ValueError, match="trying to change decoupled"):
        config.set_model_transaction_policy({"decoupled": True})
    with pytest.raises(ValueError, match="other than 'decoupled'"):
        config.set_model_transaction_policy({"batching": True})

    sequence = pb_utils.ModelConfig({"name": "s", "sequence_batching": {}})
    with pytest.raises(ValueError, match="sequence_batching"):
        sequence.set_dynamic_batching()
    assert not hasattr(pb_utils.ModelConfig, "add_instance_group")  # Triton has none


def test_pb_utils_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="quiver.python_model"):
        pb_utils.Logger.log_info("info line")
        pb_utils.Logger.log_warn("warn line")
        pb_utils.Logger.log_error("error line")
        pb_utils.Logger.log_verbose("verbose line")
        pb_utils.Logger.log("explicit", pb_utils.Logger.ERROR)
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        ("INFO", "info line"),
        ("WARNING", "warn line"),
        ("ERROR", "error line"),
        ("DEBUG", "verbose line"),
        ("ERROR", "explicit"),
    ]


def test_concurrent_loads_keep_models_apart(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    models = []
    for i in range(6):
        config, files = write_model(tmp_path, f"par{i}", _helper_model(str(i)))
        (files.version_dir / "helpers.py").write_text(f"def apply(a):\n    return a * {i}\n")
        (files.version_dir / "relhelper.py").write_text(f"def apply(a):\n    return a + {i}\n")
        models.append((config, files))

    def create(item: tuple[ModelConfig, ModelFiles]) -> Any:
        config, files = item
        return BACKEND.create_instance(config, files, InstanceSpec(config.instance_groups[0], 0))

    with ThreadPoolExecutor(max_workers=6) as pool:
        instances = list(pool.map(create, models))
    try:
        for i, instance in enumerate(instances):
            (response,) = run(instance, [add_sub_request([1, 2, 3, 4], [0] * 4)])
            np.testing.assert_array_equal(
                output(response, "OUTPUT0").data, [i, 2 * i, 3 * i, 4 * i]
            )
            np.testing.assert_array_equal(
                output(response, "OUTPUT1").data, [1 + i, 2 + i, 3 + i, 4 + i]
            )
    finally:
        for instance in instances:
            instance.unload()


def test_pb_utils_tables_are_quivers() -> None:
    from tritonclient.grpc import model_config_pb2

    from quiver.errors import ErrorCode
    from quiver.types import DataType

    assert [(c.name, c.value) for c in pb_utils.TritonError.UNKNOWN.__class__] == [
        (code.name, number) for number, code in enumerate(ErrorCode)
    ]
    for datatype in DataType:
        assert model_config_pb2.DataType.Value(datatype.config_name) == datatype.triton_value
        assert getattr(pb_utils, "TYPE_" + ("BYTES" if datatype is DataType.BYTES else datatype.value)) == (
            datatype.triton_value
        )
        assert DataType.from_triton_value(datatype.triton_value) is datatype


def test_a_python_instance_never_answers_at_once() -> None:
    # an inline execute() may move to the thread mid-way (and await there)
    assert PythonInstance.answers_at_once.fget(None) is False  # type: ignore[attr-defined]
