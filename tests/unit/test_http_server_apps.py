"""Quiver's HTTP/1.1 server (frontends/http_server.py) with small ASGI apps, on a real socket:
what it does when an app fails, streams, or sends a header that would split the response, and
how it stops. The v2 app on it is tested end to end in tests/integration/test_http_server.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from quiver.frontends.asgi import serve

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


async def _started(app: App, grace: float = 5.0) -> tuple[Any, asyncio.Task[None], int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    server, task = await serve(app, sock, graceful_seconds=grace)
    return server, task, sock.getsockname()[1]


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


GET = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def _body(receive: Any) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _stop(server: Any, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 30)


@pytest.fixture
def run() -> Callable[[Awaitable[None]], None]:
    def runner(coro: Awaitable[None]) -> None:
        asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]

    return runner


def test_an_app_that_raises_before_answering_gets_a_500(run: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise ValueError("broken route")

    async def main() -> None:
        server, task, port = await _started(app)
        answer = await _exchange(port, GET)
        await _stop(server, task)
        assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert answer.endswith(b"\r\n\r\nInternal Server Error")

    run(main())
    assert "broken route" in caplog.text


def test_an_app_that_returns_without_answering_gets_a_500(run: Any) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        return None

    async def main() -> None:
        server, task, port = await _started(app)
        answer = await _exchange(port, GET)
        await _stop(server, task)
        assert answer.startswith(b"HTTP/1.1 500 ")

    run(main())


def test_a_body_sent_in_parts_without_length_goes_out_chunked(run: Any) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for part in (b"data: one\n\n", b"", b"data: two\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def main() -> None:
        server, task, port = await _started(app)
        answer = await _exchange(port, GET)
        await _stop(server, task)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        assert b"content-length" not in head.lower()
        assert body == b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"

    run(main())


def test_a_whole_answer_gets_a_content_length_and_head_requests_no_body(run: Any) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})

    async def main() -> None:
        server, task, port = await _started(app)
        answer = await _exchange(port, GET)
        head_answer = await _exchange(port, GET.replace(b"GET", b"HEAD"))
        await _stop(server, task)
        for got, body in ((answer, b"hello"), (head_answer, b"")):
            head, _, rest = got.partition(b"\r\n\r\n")
            assert b"\r\ncontent-length: 5\r\n" in head + b"\r\n" and b"\r\nconnection: close" in head
            assert rest == body

    run(main())


def test_a_response_header_with_a_line_break_is_never_sent(run: Any) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-echo", b"a\r\nset-cookie: evil=1")]})
        await send({"type": "http.response.body", "body": b"x"})

    async def main() -> None:
        server, task, port = await _started(app)
        answer = await _exchange(port, GET)
        await _stop(server, task)
        assert b"evil" not in answer
        assert answer.startswith(b"HTTP/1.1 500 ")  # refused before anything was written

    run(main())


def test_a_declared_length_the_body_does_not_match_closes_the_connection(run: Any) -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"short"})

    async def main() -> None:
        server, task, port = await _started(app)
        keep_alive = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        answer = await _exchange(port, keep_alive + keep_alive)  # the second is never answered
        await _stop(server, task)
        assert answer.count(b"HTTP/1.1 ") == 1

    run(main())


def test_stopping_lets_a_request_in_flight_finish_and_refuses_new_connections(run: Any) -> None:
    entered = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _body(receive)
        entered.set()
        await asyncio.sleep(0.5)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"finished"})

    async def main() -> None:
        server, task, port = await _started(app)
        slow = asyncio.create_task(_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        await entered.wait()
        server.should_exit = True
        answer = await asyncio.wait_for(slow, 10)
        assert answer.endswith(b"finished")
        assert b"connection: close" in answer  # answered, then closed: the server is stopping
        assert await asyncio.wait_for(idle_reader.read(), 10) == b""  # the idle one is closed
        idle_writer.close()
        await asyncio.wait_for(task, 10)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(main())


def test_a_request_past_the_grace_period_is_cancelled(run: Any) -> None:
    cancelled = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> None:
        server, task, port = await _started(app, grace=0.3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        await asyncio.sleep(0.2)
        await _stop(server, task)
        assert cancelled.is_set()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()

    run(main())
