"""``--frontend-workers N`` over gRPC: Triton's service served by the worker processes over
the one model side.

Real servers, real ``tritonclient`` gRPC and raw grpc calls: inferences through the workers
are answered right and counted in one place; every other RPC answers exactly as one process
does (replies and refusals: status code and message); restrictions, message limits and
compression apply in the workers; the model side never accepts a gRPC connection; a killed
worker is replaced while the server keeps serving; SIGTERM lets in-flight calls finish; a
killed model side makes the workers exit. Streams through the workers: test_decoupled_grpc.py
runs its whole suite against a server with workers too.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from support.server import QuiverServer
from support.worker_models import write_worker_repository
from support.workers import BackgroundCalls, wait_replaced, worker_pids

WORKERS = ("--frontend-workers", "2")
MAX_MESSAGE_SIZE = 1 << 16


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_worker_repository(tmp_path_factory.mktemp("grpc_workers") / "models")


def _server(repository: Path, *extra: str) -> QuiverServer:
    args = ("--grpc-max-message-size", str(MAX_MESSAGE_SIZE), "--model-control-mode=explicit", "--load-model=simple", *extra)
    return QuiverServer(repository, args=args)


@pytest.fixture(scope="module")
def single(repository: Path) -> Iterator[QuiverServer]:
    server = _server(repository).start()
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def workers(repository: Path) -> Iterator[QuiverServer]:
    server = _server(repository, *WORKERS).start()
    yield server
    assert server.stop() == 0, server.log


def _listens_on(pid: int, port: int) -> bool:
    return any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        for c in psutil.Process(pid).net_connections("tcp")
    )


def _inputs(a: np.ndarray, datatype: str = "INT32", shape: list[int] | None = None) -> list[grpcclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, shape or list(a.shape), datatype)
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    return inputs


def _infer(url: str, model: str = "simple", compression: str | None = None) -> None:
    client = grpcclient.InferenceServerClient(url)
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16) + np.random.randint(0, 100)
        result = client.infer(model, _inputs(a), compression_algorithm=compression)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a)
    finally:
        client.close()


def _stub(server: QuiverServer) -> tuple[grpc.Channel, Any]:
    from tritonclient.grpc import service_pb2_grpc

    channel = grpc.insecure_channel(server.grpc_url)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_the_workers_serve_grpc_and_the_model_side_does_not_accept(workers: QuiverServer) -> None:
    pids = worker_pids(workers)
    assert len(pids) == 2
    assert re.search(r"HTTP and gRPC served by 2 worker processes", workers.log)
    assert workers.process is not None and workers.grpc_port
    assert not _listens_on(workers.process.pid, workers.grpc_port)  # held, never listened on
    assert all(_listens_on(pid, workers.grpc_port) for pid in pids)
    with ThreadPoolExecutor(8) as pool:  # a client (a connection) each
        list(pool.map(lambda _: _infer(workers.grpc_url), range(32)))


def test_the_grpc_port_cannot_be_taken_by_another_server(workers: QuiverServer) -> None:
    import socket

    other = socket.socket()
    try:
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", workers.grpc_port))
    finally:
        other.close()


def _compare_replies(single: QuiverServer, workers: QuiverServer, call: Callable[[Any], Any]) -> None:
    answers = []
    for server in (single, workers):
        channel, stub = _stub(server)
        try:
            answers.append(call(stub))
        finally:
            channel.close()
    assert answers[0] == answers[1]


RPCS: list[tuple[str, Callable[[Any], Any]]] = [
    ("ServerLive", lambda s: s.ServerLive(pb.ServerLiveRequest())),
    ("ServerReady", lambda s: s.ServerReady(pb.ServerReadyRequest())),
    ("ServerMetadata", lambda s: s.ServerMetadata(pb.ServerMetadataRequest())),
    ("ModelReady", lambda s: s.ModelReady(pb.ModelReadyRequest(name="simple"))),
    ("ModelReady-missing", lambda s: s.ModelReady(pb.ModelReadyRequest(name="missing"))),
    ("ModelMetadata", lambda s: s.ModelMetadata(pb.ModelMetadataRequest(name="simple"))),
    ("ModelConfig", lambda s: s.ModelConfig(pb.ModelConfigRequest(name="simple"))),
    ("RepositoryIndex", lambda s: s.RepositoryIndex(pb.RepositoryIndexRequest())),
    ("SystemSharedMemoryStatus", lambda s: s.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())),
    ("LogSettings", lambda s: s.LogSettings(pb.LogSettingsRequest())),
    ("TraceSetting", lambda s: s.TraceSetting(pb.TraceSettingRequest())),
]


@pytest.mark.parametrize("call", [c for _, c in RPCS], ids=[n for n, _ in RPCS])
def test_rpcs_answer_the_same_through_a_worker(single: QuiverServer, workers: QuiverServer, call: Callable[[Any], Any]) -> None:
    _compare_replies(single, workers, call)


def _status(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error: Any = caught.value
    return error.code(), error.details()


def _infer_request(model: str, datatype: str, shape: list[int], contents: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if datatype == "INT32":
            tensor.contents.int_contents.extend(range(contents))
        else:
            tensor.contents.fp32_contents.extend(float(i) for i in range(contents))
    return request


REFUSALS: list[tuple[str, str, bytes]] = [
    ("ModelInfer", "unknown model", _infer_request("missing", "INT32", [1, 16], 16).SerializeToString()),
    ("ModelInfer", "wrong shape", _infer_request("simple", "INT32", [1, 8], 8).SerializeToString()),
    ("ModelInfer", "wrong datatype", _infer_request("simple", "FP32", [1, 16], 16).SerializeToString()),
    ("ModelInfer", "too few values", _infer_request("simple", "INT32", [1, 16], 3).SerializeToString()),
    ("ModelInfer", "too large", _infer_request("simple", "INT32", [1, 16], MAX_MESSAGE_SIZE).SerializeToString()),
    ("ModelInfer", "malformed", b"\xff\xff\xff"),
    ("ModelMetadata", "unknown model", pb.ModelMetadataRequest(name="missing").SerializeToString()),
    ("ModelMetadata", "bad version", pb.ModelMetadataRequest(name="simple", version="x").SerializeToString()),
    ("ModelConfig", "unknown model", pb.ModelConfigRequest(name="missing").SerializeToString()),
    ("ModelStatistics", "unknown model", pb.ModelStatisticsRequest(name="missing").SerializeToString()),
    ("RepositoryModelLoad", "unknown model", pb.RepositoryModelLoadRequest(model_name="missing").SerializeToString()),
    ("RepositoryModelUnload", "bad parameter", pb.RepositoryModelUnloadRequest(
        model_name="simple", parameters={"unload_dependents": pb.ModelRepositoryParameter(string_param="yes")},
    ).SerializeToString()),
    ("ModelMetadata", "malformed", b"\xff\xff\xff"),
    ("SystemSharedMemoryStatus", "unknown region", pb.SystemSharedMemoryStatusRequest(name="nope").SerializeToString()),
    ("CudaSharedMemoryRegister", "no GPU", pb.CudaSharedMemoryRegisterRequest(name="r").SerializeToString()),
    ("NoSuchMethod", "unimplemented", b""),
]


@pytest.mark.parametrize(("method", "data"), [(m, d) for m, _, d in REFUSALS], ids=[f"{m}-{w}" for m, w, _ in REFUSALS])
def test_refusals_are_the_same_through_a_worker(single: QuiverServer, workers: QuiverServer, method: str, data: bytes) -> None:
    answers = []
    for server in (single, workers):
        with grpc.insecure_channel(server.grpc_url) as channel:
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            answers.append(_status(lambda call=call: call(data, timeout=30)))
    assert answers[0][0] != grpc.StatusCode.OK
    assert answers[1] == answers[0]


def test_restricted_protocols_are_refused_by_the_workers(repository: Path) -> None:
    restricted = ("--grpc-restricted-protocol", "model-repository:admin-key=secret")
    with _server(repository, *restricted) as single, _server(repository, *restricted, *WORKERS) as workers:
        answers = []
        for server in (single, workers):
            _infer(server.grpc_url)  # inference is not restricted
            channel, stub = _stub(server)
            with channel:
                answers.append(_status(lambda stub=stub: stub.RepositoryIndex(pb.RepositoryIndexRequest())))
        assert answers[0][0] == grpc.StatusCode.PERMISSION_DENIED
        assert answers[1] == answers[0]
        channel, stub = _stub(workers)
        with channel:
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=(("admin-key", "secret"),))
        assert {model.name for model in index.models} == {"simple", "other", "slow"}


def test_statistics_add_up_across_workers(workers: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(workers.grpc_url)
    try:
        before = client.get_inference_statistics("simple").model_stats[0]
        with ThreadPoolExecutor(8) as pool:  # a client each: new connections, both workers take some
            list(pool.map(lambda _: _infer(workers.grpc_url), range(40)))
        after = client.get_inference_statistics("simple").model_stats[0]
    finally:
        client.close()
    assert after.inference_count - before.inference_count == 40
    assert after.inference_stats.success.count - before.inference_stats.success.count == 40


def test_repository_load_and_unload_through_a_worker(workers: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(workers.grpc_url)
    try:
        client.load_model("other")
        assert client.is_model_ready("other")
        _infer(workers.grpc_url, "other")
        client.unload_model("other")
        deadline = time.monotonic() + 30
        while client.is_model_ready("other") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.is_model_ready("other")
        with pytest.raises(InferenceServerException, match="'other'"):
            _infer(workers.grpc_url, "other")
    finally:
        client.close()


def test_on_demand_loads_a_model_once_however_many_workers_ask(repository: Path) -> None:
    with QuiverServer(repository, args=("--model-control-mode=on_demand", *WORKERS)) as server:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: _infer(server.grpc_url, "other"), range(16)))
        assert server.wait_for_log("loaded model 'other' version")  # logged after the answers
        assert len(re.findall(r"loaded model 'other' version", server.log)) == 1, server.log
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            assert client.get_inference_statistics("other").model_stats[0].inference_count == 16
        finally:
            client.close()


def test_compression_both_ways_through_a_worker(repository: Path) -> None:
    with _server(repository, *WORKERS, "--grpc-infer-response-compression-level", "high") as server:
        _infer(server.grpc_url, compression="gzip")  # a gzip request, a compressed answer
        _infer(server.grpc_url)


def test_a_killed_worker_is_replaced_and_grpc_keeps_serving(repository: Path) -> None:
    with _server(repository, *WORKERS) as server:
        victim = worker_pids(server)[0]
        # The calls the killed worker holds fail (InferenceServerException).
        calls = BackgroundCalls(lambda: _infer(server.grpc_url), errors=(InferenceServerException,)).start()
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        wait_replaced(server, victim)
        before = calls.answered
        deadline = time.monotonic() + 60
        while calls.answered <= before + 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        calls.stop()
        failures = calls.failures
        pids = worker_pids(server)
        assert len(pids) == 2 and victim not in pids, server.log
        assert calls.answered > before + 10  # served after the kill
        # Calls the killed worker held, and calls a client made on its broken connection before
        # grpc noticed (channels to one target share connections), fail as from any crashed
        # server: UNAVAILABLE, never a wrong answer.
        assert all("UNAVAILABLE" in str(failure) for failure in failures), failures
        deadline = time.monotonic() + 30  # the new worker serves gRPC too, once started
        while not all(_listens_on(pid, server.grpc_port) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_listens_on(pid, server.grpc_port) for pid in pids), server.log
        with ThreadPoolExecutor(4) as pool:  # then every call succeeds, on any worker
            list(pool.map(lambda _: _infer(server.grpc_url), range(20)))


def test_sigterm_lets_in_flight_calls_finish_then_every_worker_exits(repository: Path) -> None:
    server = _server(repository, *WORKERS, "--load-model=slow").start()
    workers = [psutil.Process(pid) for pid in worker_pids(server)]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[7.0]], dtype=np.float32))
    answers: list[Any] = []
    call = threading.Thread(target=lambda: answers.append(client.infer("slow", [tensor]).as_numpy("OUT")))
    try:
        call.start()
        time.sleep(0.4)  # the call is in the model (a second)
        assert server.stop(signal.SIGTERM) == 0, server.log
        call.join(30)
        assert answers and answers[0].tolist() == [[7.0]]
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert "while stopping" not in server.log  # each worker exited 0
    finally:
        client.close()


def test_a_killed_model_side_makes_the_workers_answer_unavailable_and_exit(repository: Path) -> None:
    server = _server(repository, *WORKERS).start()
    calls = BackgroundCalls(lambda: _infer(server.grpc_url), errors=(InferenceServerException,), pause=0.01)
    try:
        workers = [psutil.Process(pid) for pid in worker_pids(server)]
        calls.start()
        time.sleep(0.5)
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, "workers still running after the model side died"
        assert not calls.stop(), "a call hung after the model side died"
        errors = [str(failure) for failure in calls.failures]
        assert calls.answered and errors
        assert all("UNAVAILABLE" in error for error in errors), errors
        server.wait(30)
        assert "the model side of the server has stopped" in server.log
    finally:
        calls.stop()
        if server.process is not None and server.process.poll() is None:
            server.stop(signal.SIGKILL)


def test_grpc_alone_through_workers(repository: Path) -> None:
    with _server(repository, *WORKERS, "--allow-http=false") as server:
        assert re.search(r"gRPC served by 2 worker processes", server.log)
        _infer(server.grpc_url)


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_grpc_on_a_wildcard_address_through_workers(repository: Path, address: str) -> None:
    import socket

    with _server(repository, *WORKERS, f"--grpc-address={address}") as server:
        _infer(server.grpc_url)
        other = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        try:
            with pytest.raises(OSError):  # held: another server cannot take the port
                other.bind((address, server.grpc_port))
        finally:
            other.close()


def test_sigterm_lets_an_in_flight_stream_request_finish(repository: Path) -> None:
    import queue

    server = _server(repository, *WORKERS, "--load-model=slow").start()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    tensor = grpcclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[3.0]], dtype=np.float32))
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("slow", [tensor])
        time.sleep(0.4)  # the request is in the model (a second)
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        result, error = results.get(timeout=30)
        assert error is None and result.as_numpy("OUT").tolist() == [[3.0]]
        client.stop_stream()
        assert server.wait(30) == 0, server.log
    finally:
        client.close()
        if server.process is not None and server.process.poll() is None:
            server.stop(signal.SIGKILL)
