"""Requests that wait in a Python model's worker process (queued behind the one it runs)
behave as requests waiting in the server's queue, through tritonclient against a real server:
their wait counts as queue time, not compute; one whose client cancels is not run; a request's
``timeout`` runs from when the worker starts it, not while it waits; one that does not fit the
shared-memory pool while others hold it waits for room instead of failing; and a worker that
dies answers every request it held (the one it ran fails naming the model, the others run on
the restarted worker). A dynamic batcher hands the worker requests ahead only where its batches
are single requests and no queue policy acts on them."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.models import write_python
from support.server import QuiverServer

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "PID", data_type: TYPE_INT64, dims: [ 1 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
{batching}
"""

# Sleeps INPUT0[0] seconds (-1: exits at once, -8: exits after half a second) and records each
# execution (request id, start, end, pid) in executions.jsonl next to the model.
MODEL = """
import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = Path(args["model_repository"]) / "executions.jsonl"

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            first = float(data[0])
            start = time.monotonic()
            if first == -1:
                os._exit(1)
            if first == -8:
                time.sleep(0.5)
                os._exit(1)
            time.sleep(max(first, 0.0))
            with self.log.open("a") as file:
                file.write(json.dumps({"id": request.request_id(), "start": start, "end": time.monotonic()}) + "\\n")
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", data[:1].copy()),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
"""

MODELS = {
    name: ""
    for name in ("timing", "cancelled", "timeouts", "pool", "crash", "crashloop", "killed")
} | {
    # a batcher whose batches are one request each and that has no queue policy hands the
    # worker requests ahead as the direct scheduler does; one with a policy keeps them
    "batched_timing": "dynamic_batching { }",
    "batched_cancelled": "dynamic_batching { }",
    "batched_disconnected": "dynamic_batching { }",
    "policy": "dynamic_batching { default_queue_policy { default_timeout_microseconds: 300000 } }",
}

FLAGS = (
    "--exit-on-error=false",
    "--backend-config=python,restart-backoff-seconds=0.2",
    "--backend-config=python,restart-backoff-max-seconds=0.5",
    "--backend-config=python,shm-default-byte-size=1048576",
    "--backend-config=python,shm-growth-byte-size=1048576",
    "--backend-config=python,shm-max-byte-size=4194304",
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("worker_queue")
    for name, batching in MODELS.items():
        write_python(root, name, MODEL, CONFIG.format(name=name, batching=batching))
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[QuiverServer]:
    with QuiverServer(repo, args=FLAGS, timeout=120) as running:
        yield running


def infer(server: QuiverServer, model: str, values: Any, **kwargs: Any) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        data = np.asarray(values, dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data, binary_data=True)
        return client.infer(model, [tensor], **kwargs)
    finally:
        client.close()  # on the thread that made it: gevent's pool cannot be closed from another


def executions(repo: Path, model: str) -> list[dict[str, Any]]:
    path = repo / model / "executions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def statistics(server: QuiverServer, model: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)
    return stats["model_stats"][0]  # type: ignore[no-any-return]


def behind_a_holder(server: QuiverServer, model: str, hold: float, *calls: Any) -> list[Any]:
    """Run ``calls`` (each a function of nothing) while a request holds the model's only
    worker for ``hold`` seconds (they reach the worker while it runs that one); the holder's
    result first, then each call's result or exception."""
    with concurrent.futures.ThreadPoolExecutor(1 + len(calls)) as pool:
        holder = pool.submit(infer, server, model, [hold], request_id="holder")
        time.sleep(min(0.3, hold / 3))  # the worker is inside the holder's execute()
        futures = [pool.submit(call) for call in calls]
        results: list[Any] = [holder.result(120)]
        for future in futures:
            try:
                results.append(future.result(120))
            except Exception as exc:
                results.append(exc)
    return results


@pytest.mark.parametrize("model", ["timing", "batched_timing"])
def test_a_wait_in_the_worker_counts_as_queue_time_not_compute(server: QuiverServer, repo: Path, model: str) -> None:
    before = statistics(server, model)["inference_stats"]
    _, quick = behind_a_holder(server, model, 1.0, lambda: infer(server, model, [0.0], request_id="quick"))
    assert quick.as_numpy("OUTPUT0").tolist() == [0.0]
    after = statistics(server, model)["inference_stats"]
    ran = {e["id"]: e for e in executions(repo, model)}
    assert ran["quick"]["start"] >= ran["holder"]["end"]  # it waited for the holder
    queue_ns = after["queue"]["ns"] - before["queue"]["ns"]
    compute_ns = after["compute_infer"]["ns"] - before["compute_infer"]["ns"]
    # the quick request waited about 0.7 s behind the holder: queue time; the two computed
    # about 1.0 s in all (counting its wait as compute would make it about 1.7 s)
    assert queue_ns >= 0.5e9, (queue_ns, compute_ns)
    assert compute_ns < 1.0e9 + 0.5e9, (queue_ns, compute_ns)
    assert after["success"]["count"] - before["success"]["count"] == 2


@pytest.mark.parametrize("model", ["cancelled", "batched_cancelled"])
def test_a_request_cancelled_while_it_waits_in_the_worker_is_not_run(server: QuiverServer, repo: Path, model: str) -> None:
    def leaver() -> Any:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.array([0.0], dtype=np.float32))
        # the client gives up (gRPC deadline) while its request waits behind the holder
        return client.infer(model, [tensor], request_id="leaver", client_timeout=0.3)

    before = statistics(server, model)["inference_stats"]
    holder, left = behind_a_holder(server, model, 1.25, leaver)
    assert holder.as_numpy("OUTPUT0").tolist() == [1.25]
    assert isinstance(left, InferenceServerException) and "Deadline" in str(left), left
    after_holder = infer(server, model, [0.0], request_id="after")  # the worker serves on
    assert after_holder.as_numpy("OUTPUT0").tolist() == [0.0]
    assert [e["id"] for e in executions(repo, model)] == ["holder", "after"]
    after = statistics(server, model)["inference_stats"]
    assert after["fail"]["count"] - before["fail"]["count"] == 1
    assert after["success"]["count"] - before["success"]["count"] == 2


def test_with_a_batcher_an_http_client_that_disconnects_while_its_request_waits_in_the_worker_costs_no_compute(
    server: QuiverServer, repo: Path
) -> None:
    def leaver() -> None:
        body = json.dumps(
            {"id": "leaver", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [0.0]}]}
        ).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(
                b"POST /v2/models/batched_disconnected/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )
            time.sleep(0.3)  # it waits in the worker behind the holder; then the client hangs up

    holder, _ = behind_a_holder(server, "batched_disconnected", 1.25, leaver)
    assert holder.as_numpy("OUTPUT0").tolist() == [1.25]
    assert infer(server, "batched_disconnected", [0.0], request_id="after").as_numpy("OUTPUT0").tolist() == [0.0]
    assert [e["id"] for e in executions(repo, "batched_disconnected")] == ["holder", "after"]


def test_a_batcher_with_a_queue_policy_keeps_waiting_requests_in_its_queue(server: QuiverServer, repo: Path) -> None:
    holder, late = behind_a_holder(server, "policy", 1.0, lambda: infer(server, "policy", [0.0], request_id="late"))
    assert holder.as_numpy("OUTPUT0").tolist() == [1.0]
    assert isinstance(late, InferenceServerException), late
    assert late.status() == "503" and "timed out in the queue" in str(late), late
    assert [e["id"] for e in executions(repo, "policy")] == ["holder"]


def test_a_timeout_runs_from_the_start_not_while_waiting_in_the_worker(server: QuiverServer, repo: Path) -> None:
    holder, patient = behind_a_holder(
        server, "timeouts", 1.0, lambda: infer(server, "timeouts", [0.0], request_id="patient", timeout=500_000)
    )
    # it waited about 0.7 s, longer than its 0.5 s timeout, but ran in time once started
    assert not isinstance(patient, BaseException), patient
    assert int(patient.as_numpy("PID")[0]) == int(holder.as_numpy("PID")[0])  # the worker was not replaced
    # a request that does not return in time is still stopped, counted from its own start
    _, stuck = behind_a_holder(
        server, "timeouts", 0.6, lambda: infer(server, "timeouts", [5.0], request_id="stuck", timeout=1_000_000)
    )
    assert isinstance(stuck, InferenceServerException), stuck
    assert "model 'timeouts' version 1: execute() did not return within the request timeout of 1000 ms" in str(stuck)


def test_a_request_that_needs_the_pool_others_hold_waits_for_room(server: QuiverServer) -> None:
    def big(sleep: float) -> np.ndarray[Any, Any]:  # 2.5 MiB of the pool's 4 MiB
        data = np.zeros(640 * 1024, dtype=np.float32)
        data[0] = sleep
        return data

    too_big = np.zeros(1280 * 1024, dtype=np.float32)  # 5 MiB: never fits
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        holder = pool.submit(infer, server, "pool", big(0.75), request_id="holder")
        time.sleep(0.25)  # the holder runs, its 2.5 MiB in the pool
        second = pool.submit(infer, server, "pool", big(0.0), request_id="second")
        third = pool.submit(infer, server, "pool", too_big, request_id="too_big")
        assert holder.result(120).as_numpy("OUTPUT0").tolist() == [0.75]
        # it did not fit beside the holder's inputs: it waited for them to leave, then fitted
        assert second.result(120).as_numpy("OUTPUT0").tolist() == [0.0]
        with pytest.raises(InferenceServerException) as failed:
            third.result(120)  # it fits not even alone: the clear error, once nothing else holds the pool
    assert failed.value.status() == "503", failed.value
    assert "model 'pool' version 1" in str(failed.value) and "shm-max-byte-size" in str(failed.value)


def test_requests_queued_behind_a_crash_run_on_the_restarted_worker(server: QuiverServer) -> None:
    crashed, *queued = behind_a_holder_that_crashes(server, "crash", 3)
    assert isinstance(crashed, InferenceServerException)
    assert "model 'crash' version 1" in str(crashed) and "exited with code 1" in str(crashed)
    for index, result in enumerate(queued):
        assert not isinstance(result, BaseException), result
        assert result.as_numpy("OUTPUT0").tolist() == [(index + 1) / 64]


def test_requests_that_come_as_an_idle_worker_dies_wait_for_the_restarted_one(server: QuiverServer) -> None:
    """A worker killed while it holds nothing: requests that come as it dies (before and after
    the server sees its end) were never run by it, and run on the restarted worker."""
    for _ in range(3):
        pid = int(infer(server, "killed", [0.0]).as_numpy("PID")[0])
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            os.kill(pid, signal.SIGKILL)
            calls = [pool.submit(infer, server, "killed", [(i + 1) / 64]) for i in range(4)]
            results = [call.result(120) for call in calls]  # none fails
        for index, result in enumerate(results):
            assert result.as_numpy("OUTPUT0").tolist() == [(index + 1) / 64]
            assert int(result.as_numpy("PID")[0]) != pid


def behind_a_holder_that_crashes(server: QuiverServer, model: str, count: int) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(1 + count) as pool:
        holder = pool.submit(infer, server, model, [-8.0])
        time.sleep(0.2)
        calls = [pool.submit(infer, server, model, [(i + 1) / 64]) for i in range(count)]
        results: list[Any] = []
        for call in (holder, *calls):
            try:
                results.append(call.result(120))
            except Exception as exc:
                results.append(exc)
    return results


def test_a_worker_that_dies_on_every_request_fails_each_with_the_reason(server: QuiverServer) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(infer, server, "crashloop", [-1.0]) for _ in range(4)]
        for call in calls:
            with pytest.raises(InferenceServerException) as failed:
                call.result(120)
            message = str(failed.value)
            assert "model 'crashloop' version 1" in message, message
            assert "exited with code 1" in message or "not available" in message, message
    # it comes back for requests it can serve
    deadline = time.monotonic() + 60
    while True:
        try:
            assert infer(server, "crashloop", [0.0]).as_numpy("OUTPUT0").tolist() == [0.0]
            break
        except InferenceServerException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
