"""Triton's trace extension end to end: the settings API (global and per model) through
tritonclient HTTP and gRPC, the ``triton`` trace file of requests through a model and an
ensemble, log frequency and trace count files, and the ``--trace-config`` flags."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from support.models import write_config, write_python
from support.server import QuiverServer

IDENTITY = """
name: "simple"
backend: "identity"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

BATCHED = """
name: "batched"
backend: "identity"
max_batch_size: 8
dynamic_batching { }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

ENSEMBLE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" model_version: -1
    input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "MID" } },
  { model_name: "batched" model_version: -1
    input_map { key: "INPUT0" value: "MID" } output_map { key: "OUTPUT0" value: "OUT" } }
] }
"""

BLS_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            traced = pb_utils.InferenceRequest(
                model_name="simple", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", data)], trace=request.trace(),
            )
            untraced = pb_utils.InferenceRequest(
                model_name="batched", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", data)],
            )
            answer = await traced.async_exec()
            await untraced.async_exec()
            output = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", output)]))
        return responses
"""

BLS_CONFIG = """
name: "bls"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

INITIAL = {
    "trace_file": "",  # filled in per server
    "trace_level": ["TIMESTAMPS"],
    "trace_rate": "1",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_mode": "triton",
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("trace_repo")
    write_config(repo, "simple", IDENTITY)
    write_config(repo, "batched", BATCHED)
    write_config(repo, "pipeline", ENSEMBLE)
    write_python(repo, "bls", BLS_MODEL, BLS_CONFIG)
    return repo


def _serve(repository: Path, trace_file: Path, *flags: str) -> QuiverServer:
    return QuiverServer(
        repository,
        args=("--trace-config", f"triton,file={trace_file}", *flags),
    )


@pytest.fixture
def traced(repository: Path, tmp_path: Path) -> Iterator[tuple[QuiverServer, Path]]:
    trace_file = tmp_path / "trace.json"
    with _serve(repository, trace_file, "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1") as server:
        yield server, trace_file


def _infer_http(server: QuiverServer, model: str = "simple", name: str = "INPUT0") -> None:
    with httpclient.InferenceServerClient(server.url) as client:
        tensor = httpclient.InferInput(name, [1, 4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        client.infer(model, [tensor], request_id="req-1")


def _infer_grpc(server: QuiverServer, model: str = "simple", name: str = "INPUT0") -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        tensor = grpcclient.InferInput(name, [1, 4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
        client.infer(model, [tensor])


def _traces(path: Path) -> dict[int, dict[str, object]]:
    """The trace file as Triton's trace_summary.py reads it: id -> info and timestamps."""
    traces: dict[int, dict[str, object]] = {}
    for entry in json.loads(path.read_text()):
        trace = traces.setdefault(entry["id"], {"timestamps": {}})
        if "timestamps" in entry:
            for stamp in entry["timestamps"]:
                trace["timestamps"][stamp["name"]] = stamp["ns"]  # type: ignore[index]
        else:
            trace.update({k: v for k, v in entry.items() if k != "id"})
    return traces


def test_settings_http_get_update_and_clear(traced: tuple[QuiverServer, Path]) -> None:
    server, trace_file = traced
    initial = dict(INITIAL, trace_file=str(trace_file))
    with httpclient.InferenceServerClient(server.url) as client:
        assert client.get_trace_settings() == initial
        assert client.get_trace_settings(model_name="simple") == initial
        with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
            client.get_trace_settings(model_name="nope")
        with pytest.raises(
            InferenceServerException, match="trace file location can not be updated through network protocol"
        ):
            client.update_trace_settings(model_name="simple", settings={"trace_file": "model.log"})
        assert client.get_trace_settings(model_name="simple") == initial
        # A model's settings follow every global value they do not name.
        client.update_trace_settings(model_name="simple", settings={"trace_rate": "12", "log_frequency": "34"})
        updated = client.update_trace_settings(
            settings={"trace_rate": "56", "trace_count": "78", "trace_level": ["OFF"]}
        )
        assert updated == dict(initial, trace_rate="56", trace_count="78", trace_level=["OFF"])
        assert client.get_trace_settings(model_name="simple") == dict(
            initial, trace_rate="12", trace_count="78", trace_level=["OFF"], log_frequency="34"
        )
        # Clearing a global value restores the one the server started with.
        cleared = client.update_trace_settings(settings={"trace_rate": None, "trace_count": None})
        assert cleared == dict(initial, trace_level=["OFF"])
        assert client.get_trace_settings(model_name="simple") == dict(
            initial, trace_rate="12", trace_level=["OFF"], log_frequency="34"
        )
        model = client.update_trace_settings(model_name="simple", settings={"trace_rate": None, "trace_level": None})
        assert model == dict(initial, trace_level=["OFF"], log_frequency="34")
        assert client.get_trace_settings() == dict(initial, trace_level=["OFF"])
        for key in ("trace_count", "trace_rate", "log_frequency"):
            with pytest.raises(InferenceServerException, match=f"Unable to parse '{key}'"):
                client.update_trace_settings(model_name="simple", settings={key: "10000000000"})
        with pytest.raises(InferenceServerException, match="Expect only one trace level 'OFF' is specified"):
            client.update_trace_settings(settings={"trace_level": ["OFF", "TIMESTAMPS"]})
    # Plain HTTP: Triton's status codes.
    response = requests.post(f"{server.http}/v2/trace/setting", json={"trace_rate": "abc"}, timeout=10)
    assert response.status_code == 400
    assert response.json() == {"error": "Unable to parse 'trace_rate', got: abc"}
    response = requests.post(f"{server.http}/v2/models/simple/trace/setting", json={"trace_file": "x"}, timeout=10)
    assert response.status_code == 501


def test_settings_grpc_get_update_and_clear(traced: tuple[QuiverServer, Path]) -> None:
    server, trace_file = traced

    def expected(**values: object) -> object:
        settings = dict(INITIAL, trace_file=str(trace_file), **values)
        message = grpcclient.service_pb2.TraceSettingResponse()
        json_format.ParseDict(
            {"settings": {k: {"value": v if isinstance(v, list) else [v]} for k, v in settings.items()}}, message
        )
        return message

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.get_trace_settings() == expected()
        assert client.get_trace_settings(model_name="simple") == expected()
        with pytest.raises(InferenceServerException, match="Request for unknown model : nope"):
            client.get_trace_settings(model_name="nope")
        assert client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS", "TENSORS"]}) == expected(
            trace_level=["TIMESTAMPS", "TENSORS"]
        )
        assert client.get_trace_settings(model_name="simple") == expected(trace_level=["TIMESTAMPS", "TENSORS"])
        client.update_trace_settings(model_name="simple", settings={"trace_rate": "12", "log_frequency": "34"})
        client.update_trace_settings(settings={"trace_rate": "56", "trace_count": "78", "trace_level": ["OFF"]})
        assert client.update_trace_settings(settings={"trace_rate": None, "trace_count": None}) == expected(
            trace_level=["OFF"]
        )
        assert client.get_trace_settings(model_name="simple") == expected(
            trace_rate="12", trace_level=["OFF"], log_frequency="34"
        )
        with pytest.raises(InferenceServerException, match="trace file location can not be updated"):
            client.update_trace_settings(settings={"trace_file": "x"})


def test_trace_file_http_grpc_and_ensemble(traced: tuple[QuiverServer, Path]) -> None:
    server, trace_file = traced
    _infer_http(server)
    _infer_grpc(server)
    _infer_http(server, "pipeline", "IN")
    server.stop()
    traces = _traces(trace_file)
    assert len(traces) == 5  # simple twice; the ensemble and its two steps
    http_trace, grpc_trace, ensemble = (traces[i] for i in sorted(traces)[:3])
    compute = ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
    assert http_trace["model_name"] == "simple"
    assert http_trace["model_version"] == -1
    assert http_trace["request_id"] == "req-1"
    stamps = http_trace["timestamps"]
    order = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", *compute,
             "REQUEST_END", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START", "HTTP_SEND_END"]  # fmt: skip
    assert list(stamps) == order  # type: ignore[call-overload]
    assert [stamps[n] for n in order] == sorted(stamps[n] for n in order)  # type: ignore[index]
    assert {"GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END", *compute} <= set(
        grpc_trace["timestamps"]  # type: ignore[arg-type]
    )
    assert ensemble["model_name"] == "pipeline" and "parent_id" not in ensemble
    # The ensemble itself does not compute; its steps do, each with the ensemble as parent.
    assert not set(compute) & set(ensemble["timestamps"])  # type: ignore[arg-type]
    steps = [t for t in traces.values() if t.get("parent_id") == sorted(traces)[2]]
    assert sorted(t["model_name"] for t in steps) == ["batched", "simple"]  # type: ignore[type-var]
    for step in steps:
        assert set(compute) <= set(step["timestamps"])  # type: ignore[arg-type]


def test_log_frequency_and_count_write_indexed_files(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with _serve(
        repository, trace_file, "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=2",
        "--trace-config", "triton,log-frequency=2",
    ) as server:  # fmt: skip
        for _ in range(10):  # 5 traced: files .0 and .1 with 2 each, the last one at stop
            _infer_http(server)
        with httpclient.InferenceServerClient(server.url) as client:
            settings = client.get_trace_settings()
            assert settings["trace_rate"] == "2" and settings["log_frequency"] == "2"
    assert not trace_file.exists()
    counts = [len(_traces(Path(f"{trace_file}.{i}"))) for i in range(3)]
    assert counts == [2, 2, 1]
    assert not Path(f"{trace_file}.3").exists()

    count_file = tmp_path / "count.json"
    with _serve(repository, count_file, "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1") as server:
        for _ in range(3):
            _infer_grpc(server)
        with httpclient.InferenceServerClient(server.url) as client:
            client.update_trace_settings(settings={"trace_count": "2"})
            for _ in range(4):
                _infer_http(server)
            assert client.get_trace_settings()["trace_count"] == "0"
    assert len(_traces(count_file)) == 3  # before the count was set
    assert len(_traces(Path(f"{count_file}.0"))) == 2  # the counted ones, once the count ran out


def test_model_setting_traces_only_that_model(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with _serve(repository, trace_file, "--trace-level=TIMESTAMPS", "--trace-rate=1") as server:
        with httpclient.InferenceServerClient(server.url) as client:
            client.update_trace_settings(model_name="simple", settings={"trace_level": ["OFF"]})
        _infer_http(server)
        _infer_http(server, "batched")
    traces = _traces(trace_file)
    assert [t["model_name"] for t in traces.values()] == ["batched"]
    assert "deprecated" in server.log


def test_tensors_level(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with _serve(
        repository, trace_file, "--trace-config", "level=TIMESTAMPS", "--trace-config", "level=TENSORS",
        "--trace-config", "rate=1",
    ) as server:  # fmt: skip
        with httpclient.InferenceServerClient(server.url) as client:
            assert client.get_trace_settings()["trace_level"] == ["TIMESTAMPS", "TENSORS"]
        _infer_http(server)
    entries = [e for e in json.loads(trace_file.read_text()) if "activity" in e]
    assert [(e["activity"], e["tensor"]["name"]) for e in entries] == [
        ("TENSOR_QUEUE_INPUT", "INPUT0"),
        ("TENSOR_BACKEND_OUTPUT", "OUTPUT0"),
    ]
    assert entries[0]["tensor"] == {"name": "INPUT0", "data": "0,1,2,3", "shape": "1,4", "dtype": "FP32"}


def test_trace_flags_are_checked(repository: Path) -> None:
    for flags, message in (
        (("--trace-config", "level=LOUD"), "invalid value for trace level option: LOUD"),
        (("--trace-config", "mode=zipkin"), "invalid value for trace mode option: zipkin"),
        (("--trace-config", "rate"), "--trace-config option format is"),
        (("--trace-config", "rate=x"), 'Bad option: "--trace-config rate"'),
        (("--trace-config", "triton,file=/no/such/folder/t.json"), "the folder /no/such/folder does not exist"),
    ):
        server = QuiverServer(repository, args=flags)
        with pytest.raises(RuntimeError, match="exited with 2") as failed:
            server.start()
        assert message in str(failed.value)


def test_bls_requests_given_the_trace_are_traced(traced: tuple[QuiverServer, Path]) -> None:
    server, trace_file = traced
    _infer_http(server, "bls")
    server.stop()
    traces = _traces(trace_file)
    # The BLS model, and the BLS request it passed trace=request.trace() to; not the other.
    assert sorted(t["model_name"] for t in traces.values()) == ["bls", "simple"]  # type: ignore[type-var]
    bls_id = next(i for i, t in traces.items() if t["model_name"] == "bls")
    step = next(t for t in traces.values() if t["model_name"] == "simple")
    assert step["parent_id"] == bls_id
    assert "COMPUTE_START" in step["timestamps"]  # type: ignore[operator]


def test_sagemaker_invocations_are_traced(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with QuiverServer(
        repository,
        args=("--trace-config", f"triton,file={trace_file}", "--trace-config", "level=TIMESTAMPS",
              "--trace-config", "rate=1"),
        env={"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "simple"},
    ) as server:  # fmt: skip
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
        response = requests.post(f"{server.sagemaker_url}/invocations", json=body, timeout=10)
        assert response.status_code == 200, response.text
    (trace,) = _traces(trace_file).values()
    assert trace["model_name"] == "simple"
    assert {"HTTP_RECV_START", "HTTP_RECV_END", "COMPUTE_START", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_END"} <= set(
        trace["timestamps"]  # type: ignore[arg-type]
    )


def test_settings_through_the_asyncio_clients(traced: tuple[QuiverServer, Path]) -> None:
    import asyncio

    import tritonclient.grpc.aio as grpcaio
    import tritonclient.http.aio as httpaio

    server, trace_file = traced

    async def scenario() -> None:
        http = httpaio.InferenceServerClient(server.url)
        grpc = grpcaio.InferenceServerClient(server.grpc_url)
        try:
            updated = await http.update_trace_settings(model_name="simple", settings={"trace_rate": "3"})
            assert updated == dict(INITIAL, trace_file=str(trace_file), trace_rate="3")
            settings = await grpc.get_trace_settings(model_name="simple", as_json=True)
            assert settings["settings"]["trace_rate"] == {"value": ["3"]}
            cleared = await grpc.update_trace_settings(model_name="simple", settings={"trace_rate": None}, as_json=True)
            assert cleared["settings"]["trace_rate"] == {"value": ["1"]}
            assert (await http.get_trace_settings())["trace_rate"] == "1"
        finally:
            await http.close()
            await grpc.close()

    asyncio.run(scenario())
