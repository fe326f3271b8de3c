"""A frontend worker process (``--frontend-workers N``): the protocol work of requests on a
core of its own, the model side's work in the one model-side process.

The model side (:mod:`quiver.frontends.workers`) starts it as ``python -m
quiver.frontends.frontend_worker`` with one end of a socket pair
(:mod:`quiver.frontends.worker_link`) and, when HTTP is on, the HTTP listening socket as
inherited file descriptors, and the SageMaker listening socket when SageMaker is on. The
model side sends its setup first (the gRPC setup, SageMaker's settings). The worker serves
HTTP (:mod:`quiver.frontends.http_worker`), Triton's gRPC service on the gRPC port
(:mod:`quiver.frontends.grpc_worker`) and the SageMaker routes
(:mod:`quiver.frontends.sagemaker_worker`), all over one
:class:`~quiver.frontends.remote_service.RemoteService`.

When the model side goes away (its socket closes), requests waiting for it are answered
UNAVAILABLE (HTTP 503) and the worker exits 1. SIGTERM stops taking connections and lets the
requests in flight finish (each server's graceful stop), then the worker exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from quiver import profiling
from quiver.frontends.asgi import AsgiServer, serve
from quiver.frontends.grpc_worker import GrpcWorkerSetup, WorkerGrpcFrontend
from quiver.frontends.http_worker import WorkerFrontend
from quiver.frontends.remote_service import GONE, RemoteService
from quiver.frontends.restrictions import Restrictions
from quiver.frontends.sagemaker import SageMakerSettings
from quiver.frontends.sagemaker_worker import WorkerSageMakerFrontend
from quiver.frontends.worker_link import Link

logger = logging.getLogger("quiver.frontends.frontend_worker")


async def run(
    listen_fd: int | None,
    link_fd: int,
    max_input_size: int,
    restricted: list[str],
    graceful: float,
    header_forward_pattern: str | None = None,
    sagemaker_fd: int | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    remote = RemoteService()
    setup: asyncio.Future[dict[str, Any]] = loop.create_future()

    def on_message(message: tuple[Any, ...]) -> None:
        if message[0] == "setup":
            if not setup.done():
                setup.set_result(message[1])
        else:
            remote.on_message(message)

    link_socket = socket.socket(fileno=link_fd)
    _, link = await loop.create_unix_connection(lambda: Link(on_message, remote.on_lost), sock=link_socket)
    remote.link = link
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # What the model side sends first: the gRPC setup (None: no gRPC) and SageMaker's settings.
    gone_early: asyncio.Future[Any] = asyncio.ensure_future(remote.gone.wait())
    await asyncio.wait({setup, gone_early}, return_when=asyncio.FIRST_COMPLETED)
    gone_early.cancel()
    if not setup.done():
        logger.error("frontend worker %d: %s before sending its setup; exiting", os.getpid(), GONE)
        return 1
    grpc_setup: GrpcWorkerSetup | None = setup.result()["grpc"]
    sagemaker: SageMakerSettings | None = setup.result()["sagemaker"]
    waits: set[asyncio.Future[Any]] = set()
    servers: list[AsgiServer] = []
    if listen_fd is not None:
        frontend = WorkerFrontend(
            remote,
            max_input_size=max_input_size,
            restrictions=Restrictions(restricted),
            header_forward_pattern=header_forward_pattern,
        )
        listener = socket.socket(fileno=listen_fd)
        listener.setblocking(False)
        http_server, serving = await serve(frontend.app(), listener, graceful_seconds=graceful)
        servers.append(http_server)
        waits.add(serving)
    if sagemaker_fd is not None and sagemaker is not None:
        routes = WorkerSageMakerFrontend(remote, sagemaker, max_input_size=max_input_size)
        listener = socket.socket(fileno=sagemaker_fd)
        listener.setblocking(False)
        sagemaker_server, serving = await serve(routes, listener, graceful_seconds=graceful)
        servers.append(sagemaker_server)
        waits.add(serving)
    grpc_frontend: WorkerGrpcFrontend | None = None
    if grpc_setup is not None:
        grpc_frontend = WorkerGrpcFrontend(remote, grpc_setup)
        await grpc_frontend.start(grpc_setup.address, grpc_setup.port)
        await grpc_frontend.set_serving(True)
    link.send(("ready", os.getpid()))
    gone = asyncio.ensure_future(remote.gone.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({gone, stopped, *waits}, return_when=asyncio.FIRST_COMPLETED)
    lost = remote.gone.is_set() and not stop.is_set()
    if lost:
        logger.error("frontend worker %d: %s; exiting", os.getpid(), GONE)
    if grpc_frontend is not None:
        await grpc_frontend.begin_shutdown()  # health NOT_SERVING before anything closes
    draining: list[asyncio.Future[Any]] = list(waits)
    for server in servers:
        server.should_exit = True
        server.force_exit = lost
    if grpc_frontend is not None:
        # Waiting requests were answered UNAVAILABLE when the model side went: nothing to drain.
        draining.append(asyncio.ensure_future(grpc_frontend.stop(grace=0 if lost else graceful)))
    for drained in draining:
        with contextlib.suppress(Exception):
            await drained
    for task in (gone, stopped):
        task.cancel()
    link.close()
    return 1 if lost else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quiver.frontends.frontend_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen-fd", type=int, default=None, help="the HTTP listening socket (none: no HTTP)")
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--sagemaker-fd", type=int, default=None, help="the SageMaker listening socket (none: no SageMaker)")
    parser.add_argument("--max-input-size", type=int, required=True)
    parser.add_argument("--restricted-api", default="[]", help="a JSON list of --http-restricted-api values")
    parser.add_argument("--graceful-seconds", type=float, default=30.0)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--http-header-forward-pattern", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.log_verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    profiling.start("frontend")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    code: int = runner(
        run(
            args.listen_fd,
            args.link_fd,
            args.max_input_size,
            json.loads(args.restricted_api),
            args.graceful_seconds,
            args.http_header_forward_pattern,
            args.sagemaker_fd,
        )
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
