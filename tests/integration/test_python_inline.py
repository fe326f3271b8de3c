"""Fast Python models that opt in (``EXECUTE_ON_EVENT_LOOP``) move from their own thread to the
event loop, and only models for which that changes nothing: BLS callers (from any thread),
models bound to their thread, and models that raise stay on (or go back to) their thread, and
every answer stays right. Models that do not opt in never move. (In-process only: a worker
process has no event loop of the server's to move to.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from quiver.backends.python import INLINE_AFTER_EXECUTIONS
from support.models import write_python
from support.server import QuiverServer

CONFIG = """
name: "{name}"
backend: "python"
parameters {{ key: "EXECUTE_ON_EVENT_LOOP" value {{ string_value: "{inline}" }} }}
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "THREAD", data_type: TYPE_STRING, dims: [ 1 ] }} ]
"""

# Answers INPUT0 * 2, and the name of the thread execute ran on.
WHERE = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        thread = np.array([threading.current_thread().name.encode()], dtype=object)
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2),
                pb_utils.Tensor("THREAD", thread),
            ])
            for r in requests
        ]
"""

# A connection that only the thread which opened it may use (sqlite3's rule).
SQLITE = """
import sqlite3
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table k (v real)")
        self.db.execute("insert into k values (2.0)")

    def execute(self, requests):
        (factor,) = self.db.execute("select v from k").fetchone()
        thread = np.array([threading.current_thread().name.encode()], dtype=object)
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * factor),
                pb_utils.Tensor("THREAD", thread),
            ])
            for r in requests
        ]
"""

# Calls `where` through BLS every 80th execution only, so it looks inline-able until then.
BLS_LATE = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if self.calls % 80 == 0:
                inner = pb_utils.InferenceRequest(
                    model_name="where", requested_output_names=["OUTPUT0"],
                    inputs=[pb_utils.Tensor("INPUT0", x)],
                ).exec()
                if inner.has_error():
                    raise pb_utils.TritonModelException(inner.error().message())
                out = pb_utils.get_output_tensor_by_name(inner, "OUTPUT0").as_numpy()
            else:
                out = x * 2
            thread = np.array([threading.current_thread().name.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out), pb_utils.Tensor("THREAD", thread)]))
        return responses
"""

# Calls `where` through BLS from a thread of its own every 80th execution.
BLS_FROM_A_THREAD = """
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils


def ask(x):
    inner = pb_utils.InferenceRequest(
        model_name="where", requested_output_names=["OUTPUT0"], inputs=[pb_utils.Tensor("INPUT0", x)],
    ).exec()
    return pb_utils.get_output_tensor_by_name(inner, "OUTPUT0").as_numpy()


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0
        self.pool = ThreadPoolExecutor(1)

    def execute(self, requests):
        self.calls += 1
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out = self.pool.submit(ask, x).result() if self.calls % 80 == 0 else x * 2
            thread = np.array([threading.current_thread().name.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out), pb_utils.Tensor("THREAD", thread)]))
        return responses

    def finalize(self):
        self.pool.shutdown()
"""

# Raises for negative input: an error naming the model, every time, wherever it runs.
PICKY = """
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if (x < 0).any():
                raise ValueError("negative input")
            thread = np.array([threading.current_thread().name.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2), pb_utils.Tensor("THREAD", thread)]))
        return responses
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo: Path = tmp_path_factory.mktemp("inline")
    for name, source in (
        ("where", WHERE), ("sqlite", SQLITE), ("bls_late", BLS_LATE), ("bls_thread", BLS_FROM_A_THREAD),
        ("picky", PICKY),
    ):  # fmt: skip
        write_python(repo, name, source, CONFIG.format(name=name, inline="true"))
    write_python(repo, "stays", WHERE, CONFIG.format(name="stays", inline="false"))
    with QuiverServer(repo, args=("--backend-config=python,in-process=true",)) as running:
        yield running


def infer(server: QuiverServer, model: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    client = httpclient.InferenceServerClient(server.url)
    try:
        tensor = httpclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor])
        return result.as_numpy("OUTPUT0"), result.as_numpy("THREAD")[0].decode()
    finally:
        client.close()


def run_many(server: QuiverServer, model: str, count: int) -> list[str]:
    threads = []
    for i in range(count):
        x = np.full(4, float(i), dtype=np.float32)
        out, thread = infer(server, model, x)
        np.testing.assert_array_equal(out, x * 2)
        threads.append(thread)
    return threads


def test_a_fast_model_moves_to_the_event_loop_after_its_clean_executions(server: QuiverServer) -> None:
    threads = run_many(server, "where", INLINE_AFTER_EXECUTIONS + 20)
    assert all(t.startswith("quiver-") for t in threads[:INLINE_AFTER_EXECUTIONS]), threads[:5]
    assert threads[-1] == "MainThread", threads[-5:]


def test_a_model_that_does_not_opt_in_never_moves(server: QuiverServer) -> None:
    threads = run_many(server, "stays", INLINE_AFTER_EXECUTIONS + 40)
    assert all(t.startswith("quiver-") for t in threads), [t for t in threads if not t.startswith("quiver-")]


def test_a_model_bound_to_its_thread_goes_back_to_it_and_answers_right(server: QuiverServer) -> None:
    threads = run_many(server, "sqlite", INLINE_AFTER_EXECUTIONS + 40)
    assert all(t.startswith("quiver-") for t in threads), [t for t in threads if not t.startswith("quiver-")]
    # It did try the loop once (sqlite refused the other thread), and went back for good.
    assert "model 'sqlite' version 1 runs on its own thread from now on" in server.log


def test_a_model_that_calls_bls_late_is_answered_and_stays_on_its_thread(server: QuiverServer) -> None:
    threads = run_many(server, "bls_late", 170)
    # Executions 65..79 ran on the loop; the 80th called BLS there, ran again on the thread,
    # and every one after it stays there.
    assert "MainThread" in threads[INLINE_AFTER_EXECUTIONS:79], threads[INLINE_AFTER_EXECUTIONS:79]
    assert all(t.startswith("quiver-") for t in threads[80:]), threads[80:]


def test_bls_from_a_thread_the_model_started_does_not_hang_the_server(server: QuiverServer) -> None:
    threads = run_many(server, "bls_thread", 170)  # run_many checks every answer
    assert "MainThread" in threads[INLINE_AFTER_EXECUTIONS:79], threads[INLINE_AFTER_EXECUTIONS:79]
    assert all(t.startswith("quiver-") for t in threads[80:]), threads[80:]


def test_errors_stay_errors_and_the_model_keeps_serving(server: QuiverServer) -> None:
    run_many(server, "picky", INLINE_AFTER_EXECUTIONS + 10)
    for _ in range(3):
        with pytest.raises(InferenceServerException, match="negative input") as info:
            infer(server, "picky", np.full(4, -1.0, dtype=np.float32))
        assert "picky" in str(info.value)
    out, thread = infer(server, "picky", np.ones(4, dtype=np.float32))
    np.testing.assert_array_equal(out, np.full(4, 2.0, dtype=np.float32))
    assert thread.startswith("quiver-")  # it raised on the loop once: back on its thread for good
    assert server.wait_for_log("model 'picky' version 1 runs on its own thread from now on"), server.log
