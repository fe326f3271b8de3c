"""What the gRPC server's connection cap costs: the bookkeeping every call pays (a connection
going busy and idle again: a dict pop and insert) and what a newcomer at the cap costs, when
it takes the place of the connection idle the longest and when every connection is busy and it
is refused. In-process: the real ``GrpcServer`` and its ``Http2Connection``s on an in-memory
transport (tests/support/h2pair.py), no sockets.

Run: ``.venv/bin/python -m benchmarks.grpc_connection_cap`` from the repository root (hold
the benchmark lock: ``flock /work/wt/bench.lock ...``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from quiver.frontends.grpc_server import GrpcServer  # noqa: E402
from support.h2pair import Transport  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0))


def _server(cap: int) -> GrpcServer:
    return GrpcServer({}, max_receive_message_size=1 << 20, max_send_message_size=1 << 20, max_connections=cap)


def _connect(server: GrpcServer) -> Any:
    connection = server._connection()
    connection.connection_made(Transport(connection))
    connection.data_received(PREFACE)  # handshaken: a graceful GOAWAY when asked to go
    return connection


def _per_op(run: Any, count: int) -> float:
    started = time.perf_counter_ns()
    run(count)
    return (time.perf_counter_ns() - started) / count / 1000.0


async def measure(cap: int, count: int) -> list[tuple[str, float]]:
    rows = []
    roomy = _server(cap + count)

    def setup(n: int) -> None:
        for _ in range(n):
            _connect(roomy)

    rows.append(("a newcomer under the cap (its own setup: SETTINGS, the preface read)", _per_op(setup, min(count, cap // 2))))
    for connection in list(roomy.connections):
        connection.abort()
    server = _server(cap)
    connections = [_connect(server) for _ in range(cap)]
    one = connections[cap // 2]

    def toggle(n: int) -> None:
        busy, idle = server.connection_busy, server.connection_idle
        for _ in range(n):
            busy(one)
            idle(one)

    rows.append((f"a call's busy + idle bookkeeping ({cap:,} idle connections)", _per_op(toggle, count)))

    def newcomers(n: int) -> None:
        for _ in range(n):
            _connect(server)  # takes the place of the longest idle
            server._leaving.clear()  # (as if each had closed: the bound on those leaving is not measured)

    rows.append((f"a newcomer at the cap, the longest idle asked to go ({cap:,} connections), setup included", _per_op(newcomers, min(count, cap // 2))))
    for connection in list(server.connections):
        connection.streams[1] = object()  # every connection busy
        server.connection_busy(connection)

    def refused(n: int) -> None:
        for _ in range(n):
            server._connection()

    rows.append((f"a newcomer at the cap, every connection busy: refused ({cap:,})", _per_op(refused, count)))
    for connection in list(server.connections):
        connection.streams.clear()
        connection.abort()
    await asyncio.sleep(0)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=int, default=10_000)
    parser.add_argument("--count", type=int, default=100_000)
    args = parser.parse_args(argv)
    rows = asyncio.run(measure(args.cap, args.count))
    width = max(len(name) for name, _ in rows)
    print(f"| {'what':<{width}} | us each |")
    print(f"|{'-' * (width + 2)}|--------:|")
    for name, micros in rows:
        print(f"| {name:<{width}} | {micros:7.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
