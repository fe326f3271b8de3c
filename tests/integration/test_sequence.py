"""The sequence batcher through tritonclient (HTTP and gRPC) against a real server: an ONNX
accumulator with implicit state, and a Python model that sees the control inputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from support.models import make_model, write_onnx, write_python
from support.server import QuiverServer


def accumulator_onnx() -> Any:
    """OUTPUT = INPUT + STATE_IN, STATE_OUT = OUTPUT, FP32[batch, 1]."""
    shape = ["batch", 1]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT", "STATE_IN"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        ],
        "accumulator",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, shape),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, shape),
        ],
    )
    return make_model(graph)


ACC_CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 4
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
sequence_batching {{
  {strategy}
  max_sequence_idle_microseconds: {idle}
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state {{ data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zero" }} }} ]
}}
"""

#: Sees START/END/READY/CORRID as inputs and keeps a running sum in the implicit state.
CONTROLS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


def get(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            total = get(request, "STATE_IN") + get(request, "INPUT")
            flags = np.concatenate(
                [get(request, "START"), get(request, "END"), get(request, "READY").astype(np.int32)], axis=1
            ).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", total),
                pb_utils.Tensor("FLAGS", flags),
                pb_utils.Tensor("CORRID_OUT", get(request, "CORRID")),
                pb_utils.Tensor("STATE_OUT", total),
            ]))
        return responses
"""

CONTROLS_CONFIG = """
name: "controls"
backend: "python"
max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "FLAGS" data_type: TYPE_INT32 dims: [ 3 ] },
  { name: "CORRID_OUT" data_type: TYPE_STRING dims: [ 1 ] }
]
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
"""

ACC_MODELS = {
    "acc_direct": ("direct { }", 60_000_000),
    "acc_oldest": ("oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 50000 }", 60_000_000),
    "acc_idle": ("", 200_000),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("sequence")
    for name, (strategy, idle) in ACC_MODELS.items():
        write_onnx(repo, name, accumulator_onnx(), ACC_CONFIG.format(name=name, strategy=strategy, idle=idle))
    write_python(repo, "controls", CONTROLS_MODEL, CONTROLS_CONFIG)
    with QuiverServer(repo) as running:
        yield running


class Client:
    """One protocol's client with a one-value ``infer``."""

    def __init__(self, server: QuiverServer, protocol: str) -> None:
        self.protocol = protocol
        self.module: Any = grpcclient if protocol == "grpc" else httpclient
        url = server.grpc_url if protocol == "grpc" else server.url
        self.client: Any = self.module.InferenceServerClient(url)

    def infer(self, model: str, value: float, sequence_id: Any = 0, **flags: bool) -> Any:
        x = self.module.InferInput("INPUT", [1, 1], "FP32")
        x.set_data_from_numpy(np.array([[value]], np.float32))
        return self.client.infer(model, [x], sequence_id=sequence_id, **flags)

    def total(self, model: str, value: float, sequence_id: Any, **flags: bool) -> float:
        return float(self.infer(model, value, sequence_id, **flags).as_numpy("OUTPUT")[0, 0])

    def invalid(self, error: InferenceServerException) -> bool:
        wanted = "StatusCode.INVALID_ARGUMENT" if self.protocol == "grpc" else "400"
        return str(error.status()) == wanted


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, server: QuiverServer) -> Client:
    return Client(server, request.param)


@pytest.mark.parametrize("model", ["acc_direct", "acc_oldest"])
def test_interleaved_sequences_keep_their_own_state(client: Client, model: str) -> None:
    base = 1000 if client.protocol == "grpc" else 2000  # ids differ per test run
    a, b = base + 1, base + 2
    assert client.total(model, 1, a, sequence_start=True) == 1
    assert client.total(model, 10, b, sequence_start=True) == 10
    assert client.total(model, 2, a) == 3
    assert client.total(model, 5, b) == 15
    assert client.total(model, 3, a, sequence_end=True) == 6
    assert client.total(model, 5, b, sequence_end=True) == 20
    # The state output is the batcher's, not the client's.
    result = client.infer(model, 1, a, sequence_start=True, sequence_end=True)
    assert result.as_numpy("STATE_OUT") is None
    # After END, the sequence is gone: a request without START is refused.
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, 1, a)
    assert client.invalid(info.value)
    assert f"sequence {a} to model '{model}' must specify the START flag" in info.value.message()


def test_string_correlation_ids_and_restart(client: Client) -> None:
    cid = f"session-{client.protocol}"
    assert client.total("acc_direct", 4, cid, sequence_start=True) == 4
    assert client.total("acc_direct", 4, cid) == 8
    assert client.total("acc_direct", 1, cid, sequence_start=True) == 1  # START restarts
    assert client.total("acc_direct", 1, cid, sequence_end=True) == 2


def test_missing_correlation_id_and_missing_start_are_invalid(client: Client) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("acc_direct", 1)
    assert client.invalid(info.value) and "model 'acc_direct'" in info.value.message()
    assert "correlation ID" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("acc_oldest", 1, 424242)
    assert client.invalid(info.value)
    assert (
        "inference request for sequence 424242 to model 'acc_oldest' must specify the START flag "
        "on the first request of the sequence"
    ) in info.value.message()


def test_idle_sequences_are_released(server: QuiverServer) -> None:
    clients = {77: Client(server, "grpc"), 78: Client(server, "http")}
    for cid, client in clients.items():
        assert client.total("acc_idle", 1, cid, sequence_start=True) == 1
        assert client.total("acc_idle", 1, cid) == 2  # within 200 ms: still alive
    time.sleep(0.25)  # one wait for both protocols
    for cid, client in clients.items():
        with pytest.raises(InferenceServerException) as info:
            client.infer("acc_idle", 1, cid)
        assert client.invalid(info.value) and f"sequence {cid}" in info.value.message()
        assert "START" in info.value.message()


def test_python_model_sees_control_inputs_and_state(client: Client) -> None:
    cid = 500 if client.protocol == "grpc" else 600
    first = client.infer("controls", 2, cid, sequence_start=True)
    assert first.as_numpy("FLAGS").tolist() == [[1, 0, 1]]
    assert first.as_numpy("CORRID_OUT").tolist() == [[str(cid).encode()]]
    assert first.as_numpy("OUTPUT").tolist() == [[2.0]]
    middle = client.infer("controls", 3, cid)
    assert middle.as_numpy("FLAGS").tolist() == [[0, 0, 1]]
    assert middle.as_numpy("OUTPUT").tolist() == [[5.0]]
    last = client.infer("controls", 1, f"{cid}-s", sequence_start=True, sequence_end=True)
    assert last.as_numpy("FLAGS").tolist() == [[1, 1, 1]]
    assert last.as_numpy("CORRID_OUT").tolist() == [[f"{cid}-s".encode()]]
    end = client.infer("controls", 1, cid, sequence_end=True)
    assert end.as_numpy("FLAGS").tolist() == [[0, 1, 1]]
    assert end.as_numpy("OUTPUT").tolist() == [[6.0]]


def test_oldest_batches_different_sequences(server: QuiverServer) -> None:
    async def main() -> list[float]:
        async with aiohttpclient.InferenceServerClient(server.url) as aio:

            async def one(cid: int) -> float:
                x = aiohttpclient.InferInput("INPUT", [1, 1], "FP32")
                x.set_data_from_numpy(np.array([[cid]], np.float32))
                result = await aio.infer("acc_oldest", [x], sequence_id=cid, sequence_start=True, sequence_end=True)
                return float(result.as_numpy("OUTPUT")[0, 0])

            return list(await asyncio.gather(*(one(c) for c in (31, 32, 33))))

    stats_client = httpclient.InferenceServerClient(server.url)
    before = stats_client.get_inference_statistics("acc_oldest")["model_stats"][0]
    assert asyncio.run(main()) == [31.0, 32.0, 33.0]
    after = stats_client.get_inference_statistics("acc_oldest")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 3
    assert after["execution_count"] - before["execution_count"] < 3  # batched within the delay
