"""A Python model in a worker process, driven through WorkerInstance.run(): what the model sees
of a request (the fields cross only when they differ from the defaults), the response's
parameters, a batch cancelled while the worker runs it (the model sees the cancellation, the
worker keeps serving, nothing is left behind, its inputs' shared memory included), and a model
that is not decoupled answering part of a batch through its response senders after execute()
returned."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from quiver.backends.base import SERVER, InstanceSpec, ModelFiles
from quiver.backends.python import BACKEND
from quiver.config import ModelConfig, parse_model_config
from quiver.ipc.shm import ALIGN
from quiver.types import DataType, InferenceRequest, InferenceResponse, RequestedOutput, Tensor

CONFIG = """
name: "seen"
backend: "python"
max_batch_size: 0
input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [{ count: 1 kind: KIND_CPU }]
"""

# Answers what it saw of each request; a negative input waits until the request is cancelled.
MODEL = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.cancelled = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if x[0] < 0:
                deadline = time.monotonic() + 10
                while not request.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.cancelled += int(request.is_cancelled())
            seen = {
                "request_id": request.request_id(),
                "correlation_id": request.correlation_id(),
                "flags": request.flags(),
                "timeout": request.timeout(),
                "parameters": json.loads(request.parameters()),
                "requested": sorted(request.requested_output_names()),
                "cancelled": self.cancelled,
            }
            outputs = [
                pb_utils.Tensor("OUTPUT0", x * 2),
                pb_utils.Tensor("SEEN", np.array([json.dumps(seen).encode()], dtype=np.object_)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs, parameters={"answered": True, "n": 7}))
        return responses
"""


# Not decoupled, and answers late: the first request in the list it returns, every other one
# through its response sender from a thread, after execute() returned.
LATE_MODEL = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        def answer(request, x):
            time.sleep(0.2)
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 3)])
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        returned = []
        for index, request in enumerate(requests):
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if index == 0:
                returned.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
            else:
                request.get_response_sender()  # taken now: the response comes through it
                threading.Thread(target=answer, args=(request, x)).start()
                returned.append(None)
        return returned
"""


def _make(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, config_text: str = CONFIG, **settings: str
) -> Any:
    monkeypatch.setattr(SERVER, "backend_config", {"python": {"in-process": "false", **settings}})
    model_dir = tmp_path / "seen"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config_text)
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(model))
    proto = parse_model_config(config_text, model_dir / "config.pbtxt", "seen")
    config = ModelConfig.from_proto(proto, str(model_dir / "config.pbtxt"))
    files = ModelFiles(repository=tmp_path, model_dir=model_dir, version=1)
    made = BACKEND.create_instance(config, files, InstanceSpec(group=config.instance_groups[0], index=0))
    assert type(made).__name__ == "WorkerInstance"
    return made


@pytest.fixture
def instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made = _make(tmp_path, monkeypatch, MODEL)
    yield made
    made.unload()  # (a no-op once a test unloaded it on its loop)


@pytest.fixture
def late(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made = _make(tmp_path, monkeypatch, LATE_MODEL, CONFIG.replace("max_batch_size: 0", "max_batch_size: 4"))
    yield made
    made.unload()


def _request(value: float, **options: Any) -> InferenceRequest:
    data = np.array([value], dtype=np.float32)
    return InferenceRequest("seen", "", [Tensor("INPUT0", DataType.FP32, (1,), data)], **options)


def _seen(response: Any) -> dict[str, Any]:
    assert isinstance(response, InferenceResponse), response
    outputs = {tensor.name: tensor.data for tensor in response.outputs}
    return json.loads(outputs["SEEN"][0])  # type: ignore[no-any-return]


def test_the_model_sees_each_requests_fields_and_its_defaults(instance: Any) -> None:
    plain = _request(1.5)
    rich = _request(
        2.0,
        id="abc",
        outputs=[RequestedOutput("SEEN")],
        parameters={"sequence_id": 42, "sequence_start": True, "timeout": 5_000_000, "custom": "v", "n": 3},
    )

    async def run() -> list[Any]:
        try:
            return list(await instance.run([plain])) + list(await instance.run([rich]))
        finally:
            instance.unload()  # on the loop its channel lives on

    first, second = asyncio.run(run())
    assert _seen(first) == {
        "request_id": "", "correlation_id": 0, "flags": 0, "timeout": 0, "parameters": {},
        "requested": ["OUTPUT0", "SEEN"], "cancelled": 0,
    }
    assert first.outputs[0].name == "OUTPUT0" and first.outputs[0].data.tolist() == [3.0]
    assert first.parameters == {"answered": True, "n": 7}
    assert _seen(second) == {
        "request_id": "abc", "correlation_id": 42, "flags": 1, "timeout": 5_000_000,
        "parameters": {"custom": "v", "n": 3}, "requested": ["SEEN"], "cancelled": 0,
    }


def test_a_batch_cancelled_while_it_runs_reaches_the_model_and_the_worker_keeps_serving(instance: Any) -> None:
    async def run() -> Any:
        await instance.run([_request(1.0)])  # started and answering
        slow = asyncio.create_task(instance.run([_request(-1.0)]))
        await asyncio.sleep(0.3)
        assert not slow.done()
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(slow, 10)
        answer = await asyncio.wait_for(instance.run([_request(4.0)]), 10)
        assert not instance._batches and not instance._pending  # nothing left behind
        # the cancelled batch's inputs given back: the pool holds only the word the worker
        # writes each batch's number in as it starts it
        assert instance._worker.arena.used_bytes == ALIGN
        instance.unload()  # on the loop its channel lives on
        return answer[0]

    after = asyncio.run(run())
    assert _seen(after)["cancelled"] == 1  # the model saw is_cancelled()
    assert after.outputs[0].data.tolist() == [8.0]


def test_responses_sent_after_execute_returned_complete_their_batch(late: Any) -> None:
    """A batch of three: the model returns the first response and sends the other two through
    their senders from threads, 0.2 s after execute() returned; run() answers all three, in
    order, and leaves nothing behind."""
    requests = [
        InferenceRequest("seen", "", [Tensor("INPUT0", DataType.FP32, (1, 1), np.array([[v]], dtype=np.float32))])
        for v in (1.0, 2.0, 3.0)
    ]

    async def run() -> list[Any]:
        try:
            answers = list(await asyncio.wait_for(late.run(requests), 10))
            assert not late._batches and not late._pending  # nothing left behind
            return answers
        finally:
            late.unload()  # on the loop its channel lives on

    answers = asyncio.run(run())
    assert all(isinstance(answer, InferenceResponse) for answer in answers), answers
    assert [answer.outputs[0].data.tolist() for answer in answers] == [[[2.0]], [[6.0]], [[9.0]]]


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_a_request_cancelled_while_the_worker_joins_the_loop_leaves_it_joinable(instance: Any, turns: int) -> None:
    """The first request joins the worker's pipes to the loop; cancelled partway through that
    (its client gone), the join still completes once, and the next request is answered, not
    refused with EBADF or EEXIST from a pipe half-registered."""

    async def run() -> Any:
        first = asyncio.create_task(instance.run([_request(1.0)]))
        for _ in range(turns):
            await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        try:
            return await asyncio.wait_for(instance.run([_request(4.0)]), 10)
        finally:
            instance.unload()  # on the loop its channel lives on

    answer = asyncio.run(run())
    assert answer[0].outputs[0].data.tolist() == [8.0]


# Takes 5 ms per batch.
SLOW_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.005)
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2),
                pb_utils.Tensor("SEEN", np.array([b"{}"], dtype=np.object_)),
            ])
            for r in requests
        ]
"""


@pytest.mark.parametrize(("model", "slots"), [(MODEL, 8), (SLOW_MODEL, 2)])
def test_a_worker_holds_its_queue_depth_while_its_executions_are_quick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, slots: int
) -> None:
    made = _make(tmp_path, monkeypatch, model)
    assert made.slots == 8  # worker-queue-depth's default, before anything is measured

    async def run() -> None:
        # A quick model's average settles under the 1 ms mark; a stall of the machine (the
        # suite shares it) may lift one reading, so it gets up to 100 requests to settle, not
        # the 5 that decide a slow model (whose every execution takes 5 ms).
        try:
            for count in range(100 if slots == 8 else 5):
                await made.run([_request(1.0)])
                if slots == 8 and count >= 4 and made.slots == 8:
                    break
        finally:
            made.unload()

    asyncio.run(run())
    assert made.slots == slots


def _record_dones(made: Any, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The ``done`` messages ``made``'s worker sends, as the server's side handles them."""
    dones: list[dict[str, Any]] = []
    on_message = made._on_message

    def seen(worker: Any, message: dict[str, Any]) -> None:
        if message["op"] == "done":
            dones.append(message)
        on_message(worker, message)

    monkeypatch.setattr(made, "_on_message", seen)
    return dones


@pytest.mark.parametrize("spin", [True, False])
def test_a_worker_names_the_cpu_that_ran_each_batch_only_when_the_server_spins_for_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spin: bool
) -> None:
    made = _make(tmp_path, monkeypatch, MODEL, **({} if spin else {"answer-spin-microseconds": "0"}))
    dones = _record_dones(made, monkeypatch)
    placed: list[Any] = []
    if made._spin is not None:
        spin_class = type(made._spin)
        real = spin_class.placed
        monkeypatch.setattr(spin_class, "placed", lambda self, cpu: (placed.append(cpu), real(self, cpu))[1])

    async def run() -> None:
        try:
            for _ in range(3):
                assert isinstance((await made.run([_request(1.0)]))[0], InferenceResponse)
        finally:
            made.unload()

    asyncio.run(run())
    assert len(dones) == 3
    if spin:
        cpus = [done.get("cpu") for done in dones]
        assert all(type(cpu) is int and cpu in os.sched_getaffinity(0) for cpu in cpus), cpus
        assert placed == cpus
    else:
        assert made._spin is None and all("cpu" not in done for done in dones)


RAISING_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise pb_utils.TritonModelException("no")
"""


def test_a_failed_batchs_done_names_its_cpu_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``done`` of a batch whose execute raised (sent by the worker's flush) names its CPU
    as a served batch's does, so the server's spin rule sees every answer."""
    made = _make(tmp_path, monkeypatch, RAISING_MODEL)
    dones = _record_dones(made, monkeypatch)

    async def run() -> None:
        try:
            await made.run([_request(1.0)])
        finally:
            made.unload()

    asyncio.run(run())
    assert dones and all(type(done.get("cpu")) is int for done in dones), dones
