"""Decoupled models over gRPC streams, with the real tritonclient (sync and asyncio): zero,
one and many responses, sends before and after execute returns, errors mid-stream, the
sender's rules, cancellation, async execute concurrency, decoupled BLS and response
parameters; with Python models in worker processes and in the server's process."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from support.decoupled_models import build_decoupled_repository
from support.server import QuiverServer


@pytest.fixture(scope="module", params=["worker", "in-process", "frontend-workers"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[QuiverServer]:
    """Python models in worker processes (the default), then in the server's process, then
    with gRPC served by frontend worker processes (streams relayed to the model side)."""
    repo = build_decoupled_repository(tmp_path_factory.mktemp("decoupled"))
    args: tuple[str, ...] = ()
    if request.param == "in-process":
        args = ("--backend-config=python,in-process=true",)
    elif request.param == "frontend-workers":
        args = ("--frontend-workers", "2")
    with QuiverServer(repo, args=args) as running:
        yield running


def _count(value: int) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("COUNT", [1], "INT32")
    inp.set_data_from_numpy(np.array([value], dtype=np.int32))
    return [inp]


class Stream:
    """A tritonclient gRPC stream whose callback results are read one by one."""

    def __init__(self, server: QuiverServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, model: str, count: int, mode: str = "inline", request_id: str = "", empty_final: bool = True) -> None:
        self.client.async_stream_infer(
            model, _count(count), request_id=request_id, parameters={"mode": mode},
            enable_empty_final_response=empty_final,
        )

    def next(self, timeout: float = 30) -> tuple[Any, Any]:
        return self.results.get(timeout=timeout)

    def until_final(self, timeout: float = 30) -> list[tuple[Any, Any]]:
        """Results up to and with the first whose triton_final_response is true."""
        got = []
        while True:
            result, error = self.next(timeout)
            got.append((result, error))
            if result is not None and _final(result):
                return got

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def _out(result: Any) -> int | None:
    value = result.as_numpy("OUT")
    return None if value is None else int(value[0])


@pytest.fixture
def stream(server: QuiverServer) -> Iterator[Stream]:
    opened = Stream(server)
    yield opened
    opened.close()


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_many_responses_in_order_then_an_empty_final(stream: Stream, mode: str) -> None:
    stream.send("streamer", 4, mode, request_id="r1")
    got = stream.until_final()
    assert [error for _, error in got] == [None] * 5
    results = [result for result, _ in got]
    assert [_out(r) for r in results[:4]] == [0, 1, 2, 3]
    assert [_final(r) for r in results] == [False, False, False, False, True]
    empty = results[4].get_response()
    assert (empty.id, empty.model_name, len(empty.outputs)) == ("r1", "streamer", 0)
    params = results[2].get_response().parameters
    assert params["index"].int64_param == 2 and params["model"].string_param == "streamer"
    assert results[0].get_response().id == "r1"


def test_a_decoupled_model_with_warmup_loads_and_streams(stream: Stream) -> None:
    assert stream.client.is_model_ready("warm_streamer")  # its warmup's responses went nowhere
    stream.send("warm_streamer", 2)
    assert [_out(r) for r, _ in stream.until_final()] == [0, 1, None]


def test_zero_responses_is_just_the_final_flag(stream: Stream) -> None:
    stream.send("streamer", 0)
    (result, error), = stream.until_final()
    assert error is None and _final(result) and not result.get_response().outputs


def test_final_flag_on_the_last_response_itself(stream: Stream) -> None:
    stream.send("streamer", 2, "final_with")
    got = stream.until_final()
    assert [(_out(r), _final(r)) for r, _ in got] == [(0, False), (1, True)]
    stream.send("streamer", 1)  # no empty final was owed: the next answers are the next request's
    assert [_out(r) for r, _ in stream.until_final()] == [0, None]


def test_no_empty_final_unless_asked(stream: Stream) -> None:
    stream.send("streamer", 2, empty_final=False)
    stream.send("streamer", 1, "final_with", empty_final=False)
    got = [stream.next() for _ in range(3)]
    assert [(_out(r), _final(r)) for r, _ in got] == [(0, False), (1, False), (0, True)]
    with pytest.raises(queue.Empty):
        stream.next(timeout=0.5)


def test_an_error_response_mid_stream_does_not_end_the_stream(stream: Stream) -> None:
    stream.send("streamer", 3, "error_mid")
    first, failed, third, last = (stream.next() for _ in range(4))
    assert _out(first[0]) == 0 and _out(third[0]) == 2 and _final(last[0])
    assert failed[0] is None and "token 1 failed" in str(failed[1])
    stream.send("streamer", 1)
    assert [_out(r) for r, _ in stream.until_final()] == [0, None]


def test_triton_grpc_error_ends_the_stream_with_the_first_errors_status(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers={"triton_grpc_error": "true"})
    try:
        client.async_stream_infer("streamer", _count(3), parameters={"mode": "error_mid"})
        first, failed = results.get(timeout=30), results.get(timeout=30)
        assert first[1] is None and _out(first[0]) == 0
        assert failed[0] is None and failed[1].status() == "StatusCode.INVALID_ARGUMENT"
        assert "token 1 failed" in failed[1].message()
    finally:
        client.stop_stream()
        client.close()


def test_a_model_that_raises_mid_stream_ends_that_request_with_the_error(stream: Stream) -> None:
    stream.send("streamer", 2, "raise_mid")
    got = [stream.next() for _ in range(3)]
    assert [_out(r) for r, _ in got[:2]] == [0, 1]
    assert got[2][0] is None and "the model broke mid-stream" in str(got[2][1])
    stream.send("streamer", 1)  # the stream and the model go on
    assert [_out(r) for r, _ in stream.until_final()] == [0, None]


def test_decoupled_execute_must_return_none(stream: Stream) -> None:
    stream.send("streamer", 1, "return_list")
    result, error = stream.next()
    assert result is None
    assert "is using the decoupled mode and the execute function must return None" in str(error)


def test_sending_after_the_final_flag_is_refused(stream: Stream) -> None:
    stream.send("streamer", 1, "after_final")
    assert [(_out(r), _final(r)) for r, _ in stream.until_final()] == [(0, True)]
    stream.send("streamer", 1, "report")
    (result, _), = stream.until_final()
    assert result.as_numpy("TEXT")[0] == b"Unable to send response. Response sender has been closed."


def test_cancelling_the_stream_reaches_the_model(server: QuiverServer) -> None:
    cancelled = Stream(server)
    cancelled.send("streamer", 1, "wait_cancel")
    result, error = cancelled.next()
    assert error is None and _out(result) == 0
    cancelled.client.stop_stream(cancel_requests=True)
    cancelled.client.close()
    reporter = Stream(server)
    try:
        deadline = time.monotonic() + 30
        seen = 0
        while time.monotonic() < deadline and not seen:
            reporter.send("streamer", 1, "report")
            (report, _), = reporter.until_final()
            seen = _out(report) or 0
            time.sleep(0.05)
        assert seen == 1, "the model never saw is_cancelled() after the client cancelled"
    finally:
        reporter.close()


def test_requests_to_other_models_share_the_stream(stream: Stream) -> None:
    stream.send("sender_plain", 0, "sender")
    stream.send("sender_plain", 0, "returned")
    first, second = stream.next(), stream.next()
    assert first[0].as_numpy("TEXT")[0] == b"sent" and _final(first[0])
    assert second[0].as_numpy("TEXT")[0] == b"returned" and _final(second[0])
    assert first[0].get_response().parameters["via"].string_param == "sender"


def test_sender_rules_for_a_model_that_is_not_decoupled(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    early = client.infer("sender_plain", _count(0), parameters={"mode": "early_final"})
    assert early.as_numpy("TEXT")[0] == (
        b"Unable to send response. Non-decoupled model cannot send complete final before sending a response."
    )
    twice = client.infer("sender_plain", _count(0), parameters={"mode": "twice"})
    assert twice.as_numpy("TEXT")[0] == b"first"
    report = client.infer("sender_plain", _count(0), parameters={"mode": "report"})
    assert report.as_numpy("TEXT")[0] == (
        b"Unable to send response. Non-decoupled model cannot send more than one response."
    )


def test_cancelling_a_unary_call_reaches_the_model(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue[Any] = queue.Queue()
    call = client.async_infer(
        "sender_plain", _count(0), callback=lambda result, error: done.put(error), parameters={"mode": "wait_cancel"}
    )
    time.sleep(0.5)  # the model is waiting in execute
    call.cancel()
    assert "CANCELLED" in str(done.get(timeout=30))
    deadline = time.monotonic() + 30
    remembered = b""
    while time.monotonic() < deadline and remembered != b"cancelled":
        report = client.infer("sender_plain", _count(0), parameters={"mode": "report"})
        remembered = report.as_numpy("TEXT")[0]
        time.sleep(0.05)
    assert remembered == b"cancelled"


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("bad_key", "Expect parameters keys to have type str, found type int"),
        ("bad_value", "Expect parameters values to have type bool/int/str, found type float"),
    ],
)
def test_response_parameters_are_checked_as_triton_does(server: QuiverServer, mode: str, message: str) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match=message):
        client.infer("sender_plain", _count(0), parameters={"mode": mode})
    ok = client.infer("sender_plain", _count(0), parameters={"mode": "returned"})
    assert ok.get_response().parameters["via"].string_param == "sender"


def test_model_infer_refuses_a_decoupled_model(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="ModelInfer RPC doesn't support models with decoupled"):
        client.infer("streamer", _count(1))
    assert client.is_model_ready("streamer")


def test_async_execute_runs_requests_of_one_instance_at_once(stream: Stream) -> None:
    for _ in range(3):
        stream.client.async_stream_infer("async_streamer", _count(400))
    most = [_out(stream.next()[0]) for _ in range(3)]
    assert max(v or 0 for v in most) >= 2, most


def test_bls_from_a_decoupled_async_execute(stream: Stream) -> None:
    stream.client.async_stream_infer("async_streamer", _count(-1))
    result, error = stream.next()
    assert error is None and _out(result) == len(b"returned")


def test_decoupled_bls_collects_every_response(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    result = client.infer("bls_stream", _count(3), parameters={"mode": "collect"})
    assert result.as_numpy("OUT").tolist() == [0, 1, 2, -1]  # the flag-only final: empty
    result = client.infer("bls_stream", _count(2), parameters={"mode": "async"})
    assert result.as_numpy("OUT").tolist() == [0, 1, -1, 0, 1, -1]


def test_decoupled_bls_cancel_reaches_the_called_model(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    result = client.infer("bls_stream", _count(1), parameters={"mode": "cancel"})
    assert result.as_numpy("TEXT")[0] == b"ok"
    assert result.as_numpy("OUT").tolist() == [2]  # the first response, then the final
    report = Stream(server)
    try:
        report.send("streamer", 1, "report")
        (answer, _), = report.until_final()
        assert _out(answer) == 1
    finally:
        report.close()


def test_bls_exec_without_decoupled_on_a_decoupled_model(server: QuiverServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    result = client.infer("bls_stream", _count(1), parameters={"mode": "not_decoupled"})
    assert result.as_numpy("TEXT")[0].decode().startswith(
        "Model streamer is using the decoupled. The current BLS request call doesn't support"
    )


def test_asyncio_client_stream(server: QuiverServer) -> None:
    async def run() -> list[tuple[int | None, bool]]:
        client = grpcaio.InferenceServerClient(server.grpc_url)

        async def requests() -> Any:
            for count in (3, 1):
                yield {"model_name": "streamer", "inputs": _count(count), "parameters": {"mode": "final_with"}}
            yield {"model_name": "sender_plain", "inputs": _count(0), "parameters": {"mode": "sender"}}

        seen: list[tuple[int | None, bool]] = []
        try:
            async for result, error in client.stream_infer(requests()):
                assert error is None
                seen.append((_out(result) if result.get_output("OUT") else -1, _final(result)))
        finally:
            await client.close()
        return seen

    seen = asyncio.run(run())
    # Every answer arrives; the stream ends when the client's requests are all answered.
    assert sorted(seen, key=str) == sorted(
        [(0, False), (1, False), (2, True), (0, True), (-1, True)], key=str
    )
    assert [s for s in seen if s[0] in (1, 2)] == [(1, False), (2, True)]  # in order within a request


@pytest.mark.parametrize("where", ["worker", "in-process"])
def test_unloading_a_model_ends_its_open_streams_with_an_error(tmp_path: Path, where: str) -> None:
    repo = build_decoupled_repository(tmp_path)
    args = ["--model-control-mode=explicit", "--load-model=streamer"]
    if where == "in-process":
        args.append("--backend-config=python,in-process=true")
    with QuiverServer(repo, args=tuple(args)) as running:
        stream = Stream(running)
        try:
            stream.send("streamer", 1, "wait_cancel")
            result, error = stream.next()
            assert error is None and _out(result) == 0
            stream.client.unload_model("streamer")
            result, error = stream.next()
            assert result is None and "was unloaded while answering the request" in str(error)
        finally:
            stream.close()
