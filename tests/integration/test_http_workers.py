"""``--http-workers N``: HTTP served by worker processes over the one model side.

Real servers, real ``tritonclient`` and plain HTTP: what one process answers, the workers
answer the same way (statuses and messages); statistics count every worker's requests in one
place; a model loads once however many workers ask for it; a killed worker is replaced while
the server keeps serving; a killed model side makes the workers answer 503 and exit.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient

from support.server import QuiverServer
from support.worker_models import write_worker_repository
from support.workers import BackgroundCalls, wait_replaced, worker_pids

WORKERS = ("--http-workers", "2")
MAX_INPUT_SIZE = 1 << 16


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_worker_repository(tmp_path_factory.mktemp("workers") / "models")


def _server(repository: Path, *extra: str) -> QuiverServer:
    args = ("--http-max-input-size", str(MAX_INPUT_SIZE), "--model-control-mode=explicit", "--load-model=simple", *extra)
    return QuiverServer(repository, args=args)


def _start(repository: Path, *extra: str) -> QuiverServer:
    return _server(repository, *extra).start()


@pytest.fixture(scope="module")
def single(repository: Path) -> Iterator[QuiverServer]:
    server = _start(repository)
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def workers(repository: Path) -> Iterator[QuiverServer]:
    server = _start(repository, *WORKERS)
    yield server
    assert server.stop() == 0, server.log


def _request(server: QuiverServer, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _infer(url: str, model: str = "simple") -> None:
    client = httpclient.InferenceServerClient(url)
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a, binary_data=True)
        inputs[1].set_data_from_numpy(a, binary_data=False)
        result = client.infer(model, inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a)
    finally:
        client.close()


def test_the_workers_serve_http_and_the_model_side_does_not(workers: QuiverServer) -> None:
    pids = worker_pids(workers)
    assert len(pids) == 2
    assert re.search(r"HTTP and gRPC served by 2 worker processes", workers.log)
    _infer(workers.url)
    status, body = _request(workers, "GET", "/v2/models/simple")
    assert status == 200 and json.loads(body)["name"] == "simple"


BAD_REQUESTS = [
    ("POST", "/v2/models/missing/infer", b'{"inputs": []}', {}),
    ("POST", "/v2/models/simple/infer", b"{not json", {}),
    ("POST", "/v2/models/simple/infer", b'{"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1]}]}', {}),
    ("POST", "/v2/models/simple/infer", b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": ' + json.dumps([1.0] * 16).encode() + b'}, {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": ' + json.dumps([1.0] * 16).encode() + b"}]}", {}),
    ("POST", "/v2/models/simple/infer", b'{"inputs": [{"name": "NOPE", "datatype": "INT32", "shape": [1], "data": [1]}]}', {}),
    ("POST", "/v2/models/simple/infer", b"x" * (MAX_INPUT_SIZE + 1), {}),
    ("POST", "/v2/models/simple/infer", b"{}", {"Content-Encoding": "br"}),
    ("POST", "/v2/models/simple/infer", b"{}", {"Inference-Header-Content-Length": "abc"}),
    ("GET", "/v2/models/missing", b"", {}),
    ("GET", "/v2/models/missing/config", b"", {}),
    ("GET", "/v2/nowhere", b"", {}),
    ("DELETE", "/v2/models/simple", b"", {}),
    ("POST", "/v2/repository/models/missing/load", b"", {}),
    ("POST", "/v2/repository/index", b"[1]", {}),
    ("POST", "/v2/repository/models/simple/unload", b"x" * (MAX_INPUT_SIZE + 1), {}),
]


@pytest.mark.parametrize(("method", "path", "body", "headers"), BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_refusals_are_the_same_through_a_worker(
    single: QuiverServer, workers: QuiverServer, method: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    expected = _request(single, method, path, body, headers)
    assert expected[0] >= 400
    assert _request(workers, method, path, body, headers) == expected


def test_restricted_apis_are_refused_by_the_workers(repository: Path) -> None:
    restricted = ("--http-restricted-api", "model-repository:admin-key=secret")
    with _server(repository, *restricted) as single, _server(repository, *restricted, *WORKERS) as workers:
        for server in (single, workers):
            _infer(server.url)  # inference is not restricted
        path = "/v2/repository/index"
        expected = _request(single, "POST", path)
        assert expected[0] == 403
        assert _request(workers, "POST", path) == expected
        assert _request(workers, "POST", path, headers={"admin-key": "secret"})[0] == 200


def test_statistics_add_up_across_workers(workers: QuiverServer) -> None:
    before = json.loads(_request(workers, "GET", "/v2/models/simple/stats")[1])["model_stats"][0]
    with ThreadPoolExecutor(8) as pool:  # a client each: new connections, both workers take some
        list(pool.map(lambda _: _infer(workers.url), range(40)))
    stats = json.loads(_request(workers, "GET", "/v2/models/simple/stats")[1])["model_stats"][0]
    assert stats["inference_count"] - before["inference_count"] == 40
    assert stats["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 40
    # The one metrics listener (the model side's) counts what every worker handed over.
    with urllib.request.urlopen(workers.metrics_url, timeout=10) as response:
        page = response.read().decode()
    line = re.search(r'^nv_inference_request_success\{model="simple",version="1"\} (\S+)$', page, re.M)
    assert line is not None, page
    assert float(line.group(1)) == stats["inference_stats"]["success"]["count"]


def test_on_demand_loads_a_model_once_however_many_workers_ask(repository: Path) -> None:
    with QuiverServer(repository, args=("--model-control-mode=on_demand", *WORKERS)) as server:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: _infer(server.url, "other"), range(16)))
        assert server.wait_for_log("loaded model 'other' version")  # logged after the answers
        assert len(re.findall(r"loaded model 'other' version", server.log)) == 1, server.log
        stats = json.loads(_request(server, "GET", "/v2/models/other/stats")[1])["model_stats"][0]
        assert stats["inference_count"] == 16


@pytest.mark.parametrize("workers", ["2", "1"])  # through a worker, and in the one process
def test_a_client_that_goes_away_takes_its_queued_request_out_through_a_worker(repository: Path, workers: str) -> None:
    body = json.dumps({"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}).encode()
    with QuiverServer(repository, args=("--model-control-mode=explicit", "--load-model=slow", "--http-workers", workers)) as server:
        # One answer per worker first: a worker learns from it that this model queues.
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: _request(server, "POST", "/v2/models/slow/infer", body)[0], range(4))) == [200] * 4
        before = json.loads(_request(server, "GET", "/v2/models/slow/stats")[1])["model_stats"][0]
        busy = threading.Thread(target=_request, args=(server, "POST", "/v2/models/slow/infer", body))
        busy.start()  # the instance is busy for a second
        time.sleep(0.3)
        # Several clients send a request that must wait, and go away before it runs.
        for _ in range(4):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            connection.request("POST", "/v2/models/slow/infer", body=body)
            time.sleep(0.05)
            connection.close()
        busy.join(30)
        time.sleep(1.5)  # whatever was still queued would have run by now
        stats = json.loads(_request(server, "GET", "/v2/models/slow/stats")[1])["model_stats"][0]
        ran = stats["inference_count"] - before["inference_count"]
        assert ran == 1, stats  # the busy request alone; the abandoned ones never ran


def test_a_killed_worker_is_replaced_and_the_server_keeps_serving(repository: Path) -> None:
    with _server(repository, *WORKERS) as server:
        victim = worker_pids(server)[0]
        # A request the killed worker held fails with a connection error.
        calls = BackgroundCalls(lambda: _infer(server.url)).start()
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        wait_replaced(server, victim)
        before = calls.answered
        deadline = time.monotonic() + 60
        while calls.answered <= before and time.monotonic() < deadline:
            time.sleep(0.1)
        calls.stop()
        pids = worker_pids(server)
        assert len(pids) == 2 and victim not in pids, server.log
        assert calls.answered > before  # served after the kill, through the survivors and the new worker
        assert len(calls.failures) <= 4  # at most what the killed worker held
        assert re.search(rf"frontend worker \d \(pid {victim}\) exited with -9; starting it again", server.log)
        for _ in range(10):
            _infer(server.url)


def test_a_killed_model_side_makes_the_workers_answer_503_and_exit(repository: Path) -> None:
    server = _start(repository, *WORKERS)
    body = json.dumps({"inputs": [
        {"name": name, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))} for name in ("INPUT0", "INPUT1")
    ]}).encode()
    # Refused (OSError) once every worker is gone.
    calls = BackgroundCalls(
        lambda: _request(server, "POST", "/v2/models/simple/infer", body)[0], errors=(OSError,), pause=0.01
    )
    try:
        workers = [psutil.Process(pid) for pid in worker_pids(server)]
        calls.start()
        time.sleep(0.5)
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, "workers still running after the model side died"
        assert not calls.stop(), "a request hung after the model side died"
        statuses, errors = calls.results, calls.failures
        assert set(statuses) <= {200, 503}, statuses
        assert 200 in statuses and errors
        server.wait(30)
        assert "the model side of the server has stopped" in server.log
    finally:
        calls.stop()
        if server.process is not None and server.process.poll() is None:
            server.stop(signal.SIGKILL)


def test_sigterm_drains_every_worker_then_the_server_exits_0(repository: Path) -> None:
    server = _start(repository, *WORKERS)
    workers = [psutil.Process(pid) for pid in worker_pids(server)]
    _infer(server.url)
    assert server.stop(signal.SIGTERM) == 0, server.log
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    assert "while stopping" not in server.log  # each worker exited 0


def test_http_workers_must_not_be_negative(repository: Path) -> None:
    from support.server import run_quiver

    result = run_quiver("serve", "--model-repository", str(repository), "--http-workers", "-1")
    assert result.returncode == 2
    assert "--frontend-workers must be 0 or more, got -1" in result.stderr


def test_requests_through_workers_are_traced_on_the_model_side(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    server = _start(
        repository, *WORKERS, "--trace-config", f"triton,file={trace_file}",
        "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1",
    )  # fmt: skip
    try:
        _infer(server.url)
    finally:
        assert server.stop() == 0, server.log
    traces = json.loads(trace_file.read_text())
    models = [t.get("model_name") for t in traces if "model_name" in t]
    assert models == ["simple"], traces
    names = {ts["name"] for t in traces for ts in t.get("timestamps", [])}
    assert {"REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"} <= names, names
