"""Python models in worker processes of their own (the default), through tritonclient: a worker
that exits or segfaults fails only its requests and comes back; one that cannot start makes its
model UNAVAILABLE with the reason; two instances of a CPU-bound model run at once in two
processes; BLS and ``async def execute`` reach back into the server; the memory of a model that
allocates 200 MB is reported and budgeted; wrong answers, hangs and a full shared-memory pool get
clear errors; no worker outlives the server, SIGKILL included."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from support.models import write_python
from support.server import QuiverServer

FP32_IO = """
name: "{name}"
backend: "python"
max_batch_size: 0
{extra}
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "PID", data_type: TYPE_INT64, dims: [ 1 ] }} ]
"""

# Echoes INPUT0 (and its pid); -1 exits, -2 segfaults, -3 hangs, -4 returns no response,
# -5 returns INT32, -6 a PID of the wrong shape, -8 exits after half a second; a marker file makes initialize() exit (a worker that cannot start).
POISON = """
import ctypes
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if os.path.exists(os.path.join(args["model_repository"], "CRASH_ON_START")):
            os._exit(2)

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            first = float(data[0]) if data.size else 0.0
            if first == -1:
                os._exit(1)
            if first == -8:
                time.sleep(0.5)
                os._exit(1)
            if first == -2:
                ctypes.string_at(0)
            if first == -3:
                time.sleep(3600)
            if first == -4:
                return []
            if first == -7:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative sevens are not allowed", pb_utils.TritonError.INVALID_ARG)
                ))
                continue
            out = data.astype(np.int32) if first == -5 else data.copy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", out),
                pb_utils.Tensor("PID", np.array([os.getpid()] * (2 if first == -6 else 1), dtype=np.int64)),
            ]))
        return responses
"""

# Busy for INPUT0[0] million iterations of pure Python; reports when it ran and where.
CPU = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            start = time.monotonic()
            total = 0
            for i in range(int(data[0] * 1_000_000)):
                total += i % 7
            end = time.monotonic()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", np.array([start, end], dtype=np.float32) * 0 + data[:1]),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
                pb_utils.Tensor("SPAN", np.array([start, end], dtype=np.float64)),
            ]))
        return responses
"""
CPU_OUTPUT = 'output [ { name: "SPAN", data_type: TYPE_FP64, dims: [ 2 ] } ]'

# BLS from a worker: exec() from a plain execute, async_exec() from an async one.
BLS_SYNC = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            pb_utils.Logger.log_info("bls-sync-from-worker")
            inner = pb_utils.InferenceRequest(
                model_name="poison", requested_output_names=["OUTPUT0"], inputs=[data]
            ).exec()
            if inner.has_error():
                raise pb_utils.TritonModelException(inner.error().message())
            out = pb_utils.get_output_tensor_by_name(inner, "OUTPUT0").as_numpy() + 1
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", out),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
"""
BLS_ASYNC = """
import asyncio
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            calls = [
                pb_utils.InferenceRequest(
                    model_name=name, requested_output_names=["OUTPUT0"], inputs=[data]
                ).async_exec()
                for name in ("poison", "bls_sync")
            ]
            first, second = await asyncio.gather(*calls)
            missing = pb_utils.InferenceRequest(
                model_name="no_such_model", requested_output_names=["OUTPUT0"], inputs=[data]
            )
            error = (await missing.async_exec()).error()
            assert error is not None and "no_such_model" in error.message(), error
            out = sum(pb_utils.get_output_tensor_by_name(r, "OUTPUT0").as_numpy() for r in (first, second))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", out),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
"""

BIG = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.weights = np.ones(200 * 1024 * 1024, dtype=np.uint8)  # 200 MB, touched

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ])
            for r in requests
        ]
"""

# No inputs or outputs configured: auto_complete_config (run in a short-lived worker) adds them.
AUTO = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]})
        auto_complete_model_config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]})
        auto_complete_model_config.add_output({"name": "PID", "data_type": "TYPE_INT64", "dims": [1]})
        return auto_complete_model_config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 3),
                pb_utils.Tensor("PID", np.array([[os.getpid()]], dtype=np.int64)),
            ])
            for r in requests
        ]
"""

SLOW_INIT = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3600)

    def execute(self, requests):
        return []
"""

RAISING_INIT = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("weights file is corrupt")

    def execute(self, requests):
        return []
"""

FLAGS = (
    "--exit-on-error=false",
    "--backend-config=python,stub-timeout-seconds=15",
    "--backend-config=python,restart-backoff-seconds=0.5",
    "--backend-config=python,restart-backoff-max-seconds=1",
    "--backend-config=python,shm-default-byte-size=1048576",
    "--backend-config=python,shm-growth-byte-size=1048576",
    "--backend-config=python,shm-max-byte-size=4194304",
    "--backend-config=python,shm-region-prefix-name=quiver_test_",
    # the workers spin before they sleep (the other test modules run Python workers with the
    # default: they sleep at once; the idle server spins for a quick worker's answer in all)
    "--backend-config=python,spin-microseconds=200",
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workers")
    write_python(root, "poison", POISON, FP32_IO.format(name="poison", extra=""))
    write_python(root, "echo", POISON, FP32_IO.format(name="echo", extra=""))
    write_python(root, "crashloop", POISON, FP32_IO.format(name="crashloop", extra=""))
    write_python(
        root, "cpu", CPU,
        FP32_IO.format(name="cpu", extra='instance_group [{ count: 2, kind: KIND_CPU }]') + CPU_OUTPUT,
    )  # fmt: skip
    write_python(root, "bls_sync", BLS_SYNC, FP32_IO.format(name="bls_sync", extra=""))
    write_python(root, "bls_async", BLS_ASYNC, FP32_IO.format(name="bls_async", extra=""))
    write_python(root, "auto", AUTO, 'name: "auto"\nbackend: "python"\n')
    write_python(root, "slow_init", SLOW_INIT, FP32_IO.format(name="slow_init", extra=""))
    write_python(root, "raising_init", RAISING_INIT, FP32_IO.format(name="raising_init", extra=""))
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[QuiverServer]:
    with QuiverServer(repo, args=FLAGS, timeout=120) as running:
        yield running


def infer(server: QuiverServer, model: str, values: list[float], **kwargs: object) -> httpclient.InferResult:
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    data = np.array(values, dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor], **kwargs)  # type: ignore[arg-type]


def eventually(check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


def succeeds(server: QuiverServer, model: str) -> bool:
    try:
        return bool(infer(server, model, [1.0, 2.0]).as_numpy("OUTPUT0").tolist() == [1.0, 2.0])
    except InferenceServerException:
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_models_run_in_worker_processes_of_their_own(server: QuiverServer) -> None:
    result = infer(server, "echo", [1.0, 2.0, 3.0])
    assert result.as_numpy("OUTPUT0").tolist() == [1.0, 2.0, 3.0]
    pid = int(result.as_numpy("PID")[0])
    assert pid != server.process.pid  # type: ignore[union-attr]
    assert alive(pid)


@pytest.mark.parametrize(("poison", "cause"), [(-1.0, "exited with code 1"), (-2.0, "killed by SIGSEGV")])
def test_a_worker_that_dies_fails_its_request_and_comes_back(server: QuiverServer, poison: float, cause: str) -> None:
    before = int(infer(server, "poison", [1.0]).as_numpy("PID")[0])
    with pytest.raises(InferenceServerException) as failed:
        infer(server, "poison", [poison, 1.0])
    message = str(failed.value)
    assert "model 'poison' version 1" in message and cause in message, message
    assert succeeds(server, "echo")  # the other models never noticed
    eventually(lambda: succeeds(server, "poison"))
    after = int(infer(server, "poison", [1.0]).as_numpy("PID")[0])
    assert after != before and not alive(before)
    assert server.process is not None and server.process.poll() is None


def test_a_request_queued_behind_a_crash_runs_on_the_restarted_worker(server: QuiverServer) -> None:
    """A worker instance takes a second request while it runs one (its ``slots``); when the
    worker dies running the first, the second, which it never started, is not failed with it
    but sent to the new worker."""
    before = int(infer(server, "poison", [1.0]).as_numpy("PID")[0])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        crash = pool.submit(infer, server, "poison", [-8.0])
        time.sleep(0.2)  # the worker is inside the first request's execute()
        queued = pool.submit(infer, server, "poison", [1.0, 2.0])
        with pytest.raises(InferenceServerException, match="exited with code 1"):
            crash.result(60)
        result = queued.result(60)
    assert result.as_numpy("OUTPUT0").tolist() == [1.0, 2.0]
    after = int(result.as_numpy("PID")[0])
    assert after != before and not alive(before)


def test_a_worker_that_cannot_start_makes_its_model_unavailable_with_the_reason(server: QuiverServer, repo: Path) -> None:
    client = httpclient.InferenceServerClient(server.url)
    marker = repo / "crashloop" / "CRASH_ON_START"
    assert succeeds(server, "crashloop")
    marker.write_text("")
    try:
        with pytest.raises(InferenceServerException, match="exited with code 1"):
            infer(server, "crashloop", [-1.0])

        def unavailable() -> bool:
            states = {m["name"]: m for m in client.get_model_repository_index()}
            return states["crashloop"]["state"] == "UNAVAILABLE"

        eventually(unavailable)
        entry = {m["name"]: m for m in client.get_model_repository_index()}["crashloop"]
        assert "exited with code 2" in entry["reason"], entry
        assert not client.is_model_ready("crashloop")
        with pytest.raises(InferenceServerException, match=r"crashloop.*exited with code 2"):
            infer(server, "crashloop", [1.0])
        assert succeeds(server, "echo")
    finally:
        marker.unlink()
    eventually(lambda: client.is_model_ready("crashloop") and succeeds(server, "crashloop"))


def test_two_instances_of_a_cpu_bound_model_run_at_once_in_two_processes(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: list[grpcclient.InferResult] = []
    errors: list[BaseException] = []
    data = np.array([3.0], dtype=np.float32)
    tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(data)
    done = 0

    def callback(result: grpcclient.InferResult | None, error: BaseException | None) -> None:
        nonlocal done
        if error is not None:
            errors.append(error)
        elif result is not None:
            results.append(result)
        done += 1

    for _ in range(2):
        client.async_infer("cpu", [tensor], callback)
    eventually(lambda: done == 2, timeout=120)
    assert not errors, errors
    spans = [r.as_numpy("SPAN") for r in results]
    pids = {int(r.as_numpy("PID")[0]) for r in results}
    assert len(pids) == 2  # two processes, two interpreters, two GILs
    # Both executions were running at the same moment: each started before the other ended.
    assert max(s[0] for s in spans) < min(s[1] for s in spans), spans


def test_bls_and_async_execute_from_workers(server: QuiverServer) -> None:
    result = infer(server, "bls_sync", [1.0, 2.0])
    assert result.as_numpy("OUTPUT0").tolist() == [2.0, 3.0]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    answer = client.infer("bls_async", [tensor])
    # poison echoes [1, 2]; bls_sync adds one: [2, 3]; the sum is [3, 5]
    assert answer.as_numpy("OUTPUT0").tolist() == [3.0, 5.0]
    eventually(lambda: "bls-sync-from-worker" in server.log, timeout=10)


def test_memory_of_a_model_that_allocates_200_mb_is_reported_and_budgeted(tmp_path: Path) -> None:
    write_python(tmp_path, "big", BIG, FP32_IO.format(name="big", extra=""))
    flags = ("--model-memory-limit=2G", "--model-control-mode=explicit", "--load-model=big")
    with QuiverServer(tmp_path, args=flags, timeout=120) as running:
        pid = int(infer(running, "big", [1.0]).as_numpy("PID")[0])
        metrics = urllib.request.urlopen(running.metrics_url, timeout=30).read().decode()
        lines = metrics.splitlines()
        process = [line for line in lines if line.startswith('quiver_model_process_memory_bytes{model="big"')]
        resident = [line for line in lines if line.startswith('quiver_model_resident_bytes{model="big"')]
        assert process and resident, metrics
        assert float(process[0].split()[-1]) >= 200 * 1024 * 1024  # the worker's own memory
        assert float(resident[0].split()[-1]) >= 200 * 1024 * 1024  # what the budget counts
        client = httpclient.InferenceServerClient(running.url)
        client.unload_model("big")
        eventually(lambda: not alive(pid), timeout=30)  # unloading ends the process
        client.load_model("big")
        assert succeeds(running, "big")


def test_wrong_answers_get_clear_errors(server: QuiverServer) -> None:
    with pytest.raises(InferenceServerException, match=r"model 'poison' version 1: execute\(\) returned 0 responses for 1 requests"):
        infer(server, "poison", [-4.0])
    with pytest.raises(InferenceServerException, match="model 'poison' version 1: unexpected datatype INT32 for output 'OUTPUT0'"):
        infer(server, "poison", [-5.0])
    with pytest.raises(InferenceServerException, match=r"model 'poison' version 1: unexpected shape \[2\] for output 'PID'"):
        infer(server, "poison", [-6.0])
    assert succeeds(server, "poison")


def test_errors_per_request_and_auto_complete_from_workers(server: QuiverServer) -> None:
    with pytest.raises(InferenceServerException, match="negative sevens are not allowed") as refused:
        infer(server, "poison", [-7.0])
    assert "400" in str(refused.value)
    client = httpclient.InferenceServerClient(server.url)
    metadata = client.get_model_metadata("auto")
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT0"]
    assert client.get_model_config("auto")["max_batch_size"] == 4
    tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0, 2.0]], dtype=np.float32))
    assert client.infer("auto", [tensor]).as_numpy("OUTPUT0").tolist() == [[3.0, 6.0]]


def test_a_request_that_never_returns_times_out_and_the_worker_is_replaced(server: QuiverServer) -> None:
    with pytest.raises(InferenceServerException, match=r"model 'echo' version 1: execute\(\) did not return within"):
        infer(server, "echo", [-3.0], timeout=2_000_000)  # microseconds
    eventually(lambda: succeeds(server, "echo"))


def test_a_request_larger_than_the_pool_gets_a_clear_error(server: QuiverServer) -> None:
    with pytest.raises(InferenceServerException, match=r"model 'echo' version 1.*shared-memory pool.*shm-max-byte-size"):
        infer(server, "echo", [1.0] * (2 * 1024 * 1024))  # 8 MB, the pool may hold 4 MB
    assert infer(server, "echo", [1.0] * (512 * 1024)).as_numpy("OUTPUT0").shape == (512 * 1024,)  # grows


def test_failed_starts_name_the_model_and_the_cause(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["slow_init"]["state"] == "UNAVAILABLE"
    assert "slow_init" in index["slow_init"]["reason"] and "stub-timeout-seconds" in index["slow_init"]["reason"]
    assert index["raising_init"]["state"] == "UNAVAILABLE"
    assert "initialize() failed: RuntimeError: weights file is corrupt" in index["raising_init"]["reason"]


def test_no_worker_outlives_a_killed_server(tmp_path: Path) -> None:
    write_python(tmp_path, "echo", POISON, FP32_IO.format(name="echo", extra='instance_group [{ count: 2 }]'))
    running = QuiverServer(tmp_path, timeout=120).start()
    try:
        pid = int(infer(running, "echo", [1.0]).as_numpy("PID")[0])
        assert alive(pid)
    finally:
        running.stop(signal.SIGKILL)
    eventually(lambda: not alive(pid), timeout=30)
