"""``--frontend-workers N`` with SageMaker: the SageMaker routes served by the worker
processes over the one model side.

Real servers and plain HTTP: /invocations and /models/{name}/invoke are decoded in the
workers and answered as one process answers them (JSON and binary+json), every refusal has
the same status and body, inferences are counted in one place, and SageMaker alone (as
Triton's SageMaker container runs) is served by the workers too. The multi-model API through
workers: test_sagemaker.py runs its multi-model suite against a server with workers too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from test_sagemaker import ADD, BINARY_JSON, TARGET, call, invoke, outputs

from support.models import add_constant_onnx, write_onnx
from support.server import QuiverServer
from support.workers import worker_pids

WORKERS = ("--frontend-workers", "2")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("sm_workers")
    write_onnx(repo, "add_two", add_constant_onnx(2.0), ADD.format(name="add_two"))
    return repo


def _server(repo: Path, *extra: str) -> QuiverServer:
    return QuiverServer(repo, args=("--http-max-input-size", "65536", *extra), sagemaker=True)


@pytest.fixture(scope="module")
def single(repo: Path) -> Iterator[QuiverServer]:
    with _server(repo) as server:
        yield server


@pytest.fixture(scope="module")
def workers(repo: Path) -> Iterator[QuiverServer]:
    with _server(repo, *WORKERS) as server:
        yield server


def test_the_workers_serve_sagemaker(workers: QuiverServer) -> None:
    assert re.search(r"HTTP, gRPC and SageMaker served by 2 worker processes", workers.log)
    for pid in worker_pids(workers):
        assert "--sagemaker-fd" in psutil.Process(pid).cmdline()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with ThreadPoolExecutor(8) as pool:  # a connection each: both workers take some
        replies = list(pool.map(lambda _: invoke(workers.sagemaker_url, "/invocations", x, "INPUT0"), range(32)))
    for reply in replies:
        np.testing.assert_array_equal(outputs(reply)["OUTPUT0"], x + 2)
    assert call(workers.sagemaker_url, "GET", "/ping").status == 200


def _binary(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }).encode()
    return header + x.tobytes(), {"Content-Type": BINARY_JSON + str(len(header))}


def test_binary_json_answers_the_same_through_a_worker(single: QuiverServer, workers: QuiverServer) -> None:
    body, headers = _binary(np.ones((3, 4), np.float32))
    answers = [call(server.sagemaker_url, "POST", "/invocations", body, headers) for server in (single, workers)]
    assert answers[0].status == 200
    assert (answers[1].status, answers[1].headers["content-type"], answers[1].body) == (
        answers[0].status, answers[0].headers["content-type"], answers[0].body,
    )


x4 = np.zeros((1, 4), np.float32)
REFUSALS: list[tuple[str, str, bytes | dict[str, Any] | None, dict[str, str]]] = [
    ("POST", "/invocations", {"inputs": [{"name": "NOPE", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}, {}),
    ("POST", "/invocations", {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}, {}),
    ("POST", "/invocations", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [0, 0, 0]}]}, {}),
    ("POST", "/invocations", b"{not json", {"Content-Type": "application/json"}),
    ("POST", "/invocations", b"x" * 70000, {}),
    ("POST", "/invocations", b"{}", {"Content-Type": BINARY_JSON + "99"}),
    ("POST", "/invocations", b"{}", {"Content-Encoding": "br"}),
    ("GET", "/invocations", None, {}),
    ("POST", "/models/missing/invoke", {"inputs": []}, {}),
    ("POST", "/models/add_two/invoke", {"inputs": [{"name": "NOPE", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}, {}),
    ("GET", "/models/missing", None, {}),
    ("DELETE", "/models/missing", None, {}),
    ("POST", "/models", {"model_name": "m"}, {}),
    ("GET", "/nowhere", None, {}),
]


@pytest.mark.parametrize(("method", "path", "body", "headers"), REFUSALS, ids=range(len(REFUSALS)))
def test_refusals_are_the_same_through_a_worker(
    single: QuiverServer, workers: QuiverServer, method: str, path: str, body: Any, headers: dict[str, str]
) -> None:
    expected = call(single.sagemaker_url, method, path, body, headers)
    assert expected.status >= 400
    got = call(workers.sagemaker_url, method, path, body, headers)
    assert (got.status, got.body) == (expected.status, expected.body)


def test_invocations_are_counted_in_one_place(workers: QuiverServer) -> None:
    def count() -> int:
        reply = call(workers.http, "GET", "/v2/models/add_two/stats")
        return int(reply.json()["model_stats"][0]["inference_stats"]["success"]["count"])

    before = count()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: outputs(invoke(workers.sagemaker_url, "/invocations", x4, "INPUT0")), range(40)))
    assert count() - before == 40


def test_multi_model_target_through_a_worker(repo: Path) -> None:
    env = {"SAGEMAKER_MULTI_MODEL": "true"}
    with QuiverServer(repo, args=("--model-control-mode=explicit", *WORKERS), env=env) as server:
        base = server.sagemaker_url
        missing = invoke(base, "/invocations", x4, "INPUT0")
        assert missing.status == 400 and TARGET in missing.json()["error"]
        loaded = call(base, "POST", "/models", {"model_name": "hash-two", "url": str(repo / "add_two")})
        assert loaded.status == 200, loaded.body
        reply = invoke(base, "/invocations", x4, "INPUT0", **{TARGET: "hash-two"})
        np.testing.assert_array_equal(outputs(reply)["OUTPUT0"], x4 + 2)
        np.testing.assert_array_equal(outputs(invoke(base, "/models/hash-two/invoke", x4, "INPUT0"))["OUTPUT0"], x4 + 2)
        deleted = call(base, "DELETE", "/models/hash-two")
        assert deleted.status == 200, deleted.body
        gone = invoke(base, "/models/hash-two/invoke", x4, "INPUT0")
        assert gone.status == 404, gone.body


def test_sagemaker_alone_through_workers(repo: Path) -> None:
    args = ("--allow-sagemaker", "--allow-http=false", "--allow-grpc=false", *WORKERS)
    with QuiverServer(repo, args=args) as server:
        assert re.search(r"SageMaker served by 2 worker processes", server.log)
        np.testing.assert_array_equal(outputs(invoke(server.sagemaker_url, "/invocations", x4, "INPUT0"))["OUTPUT0"], x4 + 2)


def test_a_capacity_error_stays_507_through_a_worker(tmp_path: Path) -> None:
    """An on-demand load that finds the model cache unwritable: 507 (SageMaker's "unload and
    try again") from the worker, as from one process; then the load succeeds."""
    from support.archives import single_archive
    from support.faults import read_only

    repo, cache = tmp_path / "models", tmp_path / "cache"
    repo.mkdir()
    cache.mkdir()
    (repo / "four.tar.gz").write_bytes(single_archive(4.0))
    args = ("--model-control-mode=on_demand", "--model-cache-dir", str(cache), *WORKERS)
    with QuiverServer(repo, args=args, env={"SAGEMAKER_MULTI_MODEL": "true"}) as server:
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [0, 0, 0, 0]}]}
        with read_only(cache):
            refused = call(server.sagemaker_url, "POST", "/invocations", body, {TARGET: "four.tar.gz"})
            assert refused.status == 507 and str(cache) in refused.json()["error"], refused.body
        served = call(server.sagemaker_url, "POST", "/invocations", body, {TARGET: "four.tar.gz"})
        assert served.status == 200 and served.json()["outputs"][0]["data"] == [4.0] * 4
