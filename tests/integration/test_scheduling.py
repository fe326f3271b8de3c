"""Dynamic batching, instance groups and queue policies, through tritonclient against a real server."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from support.models import write_python
from support.server import QuiverServer

#: Records every execution (pid-free: instance name, request ids, start and end) in a file.
RECORDING_MODEL = """
import json, time
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = Path(args["model_repository"]) / "executions.jsonl"
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        start = time.monotonic()
        values = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        delay = float(max(v.max() for v in values))
        time.sleep(delay)
        with self.log.open("a") as f:
            f.write(json.dumps({"instance": self.instance, "ids": [r.request_id() for r in requests],
                                "rows": [int(v.shape[0]) for v in values],
                                "start": start, "end": time.monotonic()}) + "\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", v * 2)]) for v in values]
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
{batching}
"""

MODELS = {
    "batched": (1, "dynamic_batching { max_queue_delay_microseconds: 200000 }"),
    "unbatched": (1, ""),
    "parallel": (2, ""),
    "ordered": (2, "dynamic_batching { preserve_ordering: true }"),
    "unordered": (2, "dynamic_batching { }"),
    "small_queue": (1, "dynamic_batching { default_queue_policy { max_queue_size: 1 } }"),
    "timeouts": (
        1,
        "dynamic_batching { default_queue_policy { default_timeout_microseconds: 100000 "
        "allow_timeout_override: true } }",
    ),
    "priorities": (1, "dynamic_batching { priority_levels: 2 default_priority_level: 2 }"),
    "cancellable": (1, "dynamic_batching { }"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    repo = tmp_path_factory.mktemp("sched")
    for name, (count, batching) in MODELS.items():
        write_python(repo, name, RECORDING_MODEL, CONFIG.format(name=name, count=count, batching=batching))
    with QuiverServer(repo) as running:
        running.repo = repo  # type: ignore[attr-defined]
        yield running


def executions(server: QuiverServer, model: str) -> list[dict[str, object]]:
    path = server.repo / model / "executions.jsonl"  # type: ignore[attr-defined]
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def one(value: float, rows: int = 1) -> list[aiohttpclient.InferInput]:
    inp = aiohttpclient.InferInput("INPUT0", [rows, 1], "FP32")
    inp.set_data_from_numpy(np.full((rows, 1), value, dtype=np.float32))
    return [inp]


def burst(server: QuiverServer, model: str, values: list[float], **kwargs: object) -> list[object]:
    """Send one request per value at once; returns results or exceptions, in order."""

    async def main() -> list[object]:
        async with aiohttpclient.InferenceServerClient(server.url, conn_limit=64) as client:
            calls = [client.infer(model, one(v), request_id=str(i), **kwargs) for i, v in enumerate(values)]
            return list(await asyncio.gather(*calls, return_exceptions=True))

    return asyncio.run(main())


def test_a_concurrent_burst_is_batched(server: QuiverServer) -> None:
    results = burst(server, "batched", [0.01] * 16)
    for result in results:
        assert not isinstance(result, BaseException), result
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), [[0.02]], rtol=1e-6)  # type: ignore[attr-defined]
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics("batched")["model_stats"][0]
    assert stats["inference_count"] == 16
    assert stats["execution_count"] < 16
    assert max(len(e["ids"]) for e in executions(server, "batched")) > 1  # type: ignore[arg-type]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"]) == 16
    # Without a batcher every request runs alone.
    burst(server, "unbatched", [0.01] * 4)
    assert all(len(e["ids"]) == 1 for e in executions(server, "unbatched"))  # type: ignore[arg-type]


def test_instance_count_gives_real_parallelism(server: QuiverServer) -> None:
    burst(server, "parallel", [0.4, 0.4])
    first, second = executions(server, "parallel")
    assert {first["instance"], second["instance"]} == {"parallel_0_0", "parallel_0_1"}
    assert first["start"] < second["end"] and second["start"] < first["end"]  # they overlapped


def test_preserve_ordering(server: QuiverServer) -> None:
    async def completion_order(model: str) -> list[str]:
        order: list[str] = []
        async with aiohttpclient.InferenceServerClient(server.url) as client:

            async def call(name: str, value: float, after: float) -> None:
                await asyncio.sleep(after)
                await client.infer(model, one(value), request_id=name)
                order.append(name)

            await asyncio.gather(call("slow", 0.5, 0), call("fast", 0.0, 0.1))
        return order

    assert asyncio.run(completion_order("unordered")) == ["fast", "slow"]
    assert asyncio.run(completion_order("ordered")) == ["slow", "fast"]


def test_full_queue_is_unavailable(server: QuiverServer) -> None:
    results = burst(server, "small_queue", [0.3] * 4)
    rejected = [r for r in results if isinstance(r, InferenceServerException)]
    assert rejected, "a queue of one should have turned some requests away"
    for error in rejected:
        assert error.status() == "503" and "is full" in error.message()
    assert any(not isinstance(r, BaseException) for r in results)


def test_queue_timeout_and_override(server: QuiverServer) -> None:
    async def main(timeout: int | None) -> object:
        async with aiohttpclient.InferenceServerClient(server.url) as client:
            # The first request holds the only instance for 0.5 s; the second waits behind it.
            holder = asyncio.ensure_future(client.infer("timeouts", one(0.5)))
            await asyncio.sleep(0.1)
            try:
                return await client.infer("timeouts", one(0.0), timeout=timeout)
            except InferenceServerException as exc:
                return exc
            finally:
                await holder

    timed_out = asyncio.run(main(None))  # the policy's 0.1 s
    assert isinstance(timed_out, InferenceServerException)
    assert timed_out.status() == "503" and "timed out in the queue" in timed_out.message()
    # With a longer timeout asked for (the policy allows overrides), it waits its turn.
    assert not isinstance(asyncio.run(main(2_000_000)), BaseException)


def test_priority_out_of_range_is_invalid(server: QuiverServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("priorities", one(0.0), priority=3)
    assert info.value.status() == "400" and "priority 3 is out of range" in info.value.message()
    assert client.infer("priorities", one(0.0), priority=1).as_numpy("OUTPUT0") is not None


def test_a_client_that_leaves_costs_no_compute(server: QuiverServer) -> None:
    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(server.url) as client:
            holder = asyncio.ensure_future(client.infer("cancellable", one(0.6), request_id="holder"))
            await asyncio.sleep(0.15)
            # A raw client sends a request and hangs up while it waits in the queue.
            body = json.dumps(
                {"id": "leaver", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}]}
            ).encode()
            with socket.create_connection(("127.0.0.1", server.port)) as raw:
                raw.sendall(
                    b"POST /v2/models/cancellable/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await asyncio.sleep(0.1)
            await holder

    asyncio.run(main())
    time.sleep(0.2)
    ran = [i for e in executions(server, "cancellable") for i in e["ids"]]  # type: ignore[attr-defined]
    assert ran == ["holder"]
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics("cancellable")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == 1
