"""The model side of ``--frontend-workers N``: N frontend worker processes
(:mod:`quiver.frontends.frontend_worker`) accept on the HTTP and SageMaker listening sockets
this process bound and on the gRPC port this process holds
(:func:`quiver.frontends.grpc_worker.reserve_port`); each hands decoded inference requests to
this process over its link (:mod:`quiver.frontends.worker_link`), where they go through
``InferenceService.infer`` (or ``open_stream``, for ``ModelStreamInfer``) as any request does,
every other HTTP request to the v2 or SageMaker application here and every other gRPC call to
the gRPC servicer here (:mod:`quiver.frontends.grpc_relay`).

A worker that dies is started again (its clients' connections break, as with any crashed
server; the others are untouched); one that keeps dying right after its start is retried at
most every few seconds. Stopping: SIGTERM to every worker, each stops accepting and finishes
its requests in flight, then this side stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from quiver import eager
from quiver.errors import ErrorCode, QuiverError
from quiver.frontends.grpc import InferenceServicer
from quiver.frontends.grpc_relay import answer_rpc
from quiver.frontends.grpc_worker import GrpcWorkerSetup
from quiver.frontends.link_codec import pack_response, unpack_request
from quiver.frontends.remote_service import capacity_index
from quiver.frontends.sagemaker import SageMakerFrontend
from quiver.frontends.status import grpc_error, http_error
from quiver.frontends.worker_link import Link
from quiver.service import DECOUPLED_ERROR, InferenceService
from quiver.types import InferenceRequest

logger = logging.getLogger(__name__)

#: A worker is not restarted more often than this (seconds), so one that cannot start does
#: not spin.
RESTART_BACKOFF = 2.0
#: How long a worker may take to say it is ready.
READY_TIMEOUT = 60.0


@dataclass
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    link: Link
    ready: asyncio.Future[int]
    started: float
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)


class FrontendWorkers:
    """``count`` worker processes serving HTTP on ``sock`` (if any) for ``service`` and
    ``app`` (the v2 HTTP application of this process, which answers what is not an
    inference), and gRPC as ``grpc`` says (if any) on the port ``grpc_socket`` holds."""

    name = "HTTP"

    def __init__(
        self,
        service: InferenceService,
        app: Any,
        sock: socket.socket | None,
        count: int,
        *,
        grpc: GrpcWorkerSetup | None = None,
        grpc_socket: socket.socket | None = None,
        sagemaker: SageMakerFrontend | None = None,
        sagemaker_socket: socket.socket | None = None,
        max_input_size: int,
        restricted_api: list[str],
        graceful_seconds: float = 30.0,
        log_verbose: int = 0,
        header_forward_pattern: str | None = None,
    ) -> None:
        self.service = service
        #: Told of every message a worker sends (a request, or about one): the idle detector.
        self._request_came = service.request_came
        self.app = app
        self.socket = sock
        self.count = count
        self.max_input_size = max_input_size
        self.restricted_api = restricted_api
        self.graceful_seconds = graceful_seconds
        self.log_verbose = log_verbose
        self.header_forward_pattern = header_forward_pattern
        self.grpc = grpc
        self.grpc_socket = grpc_socket
        self.servicer = InferenceServicer(service) if grpc is not None else None
        self.sagemaker = sagemaker
        self.sagemaker_socket = sagemaker_socket
        self.workers: dict[int, _Worker] = {}
        self._stopping = False
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers.values()]

    async def start(self) -> None:
        """Start every worker and wait until each accepts connections."""
        for index in range(self.count):
            await self._spawn(index)
        try:
            await asyncio.wait_for(asyncio.gather(*(w.ready for w in self.workers.values())), READY_TIMEOUT)
        except (TimeoutError, OSError) as exc:
            raise OSError(f"the frontend workers did not start: {exc or 'timed out'}") from None

    async def _spawn(self, index: int) -> _Worker:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        listening = [sock for sock in (self.socket, self.sagemaker_socket) if sock is not None]
        fds = (theirs.fileno(), *(sock.fileno() for sock in listening))
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "quiver.frontends.frontend_worker",
                *(("--listen-fd", str(self.socket.fileno())) if self.socket is not None else ()),
                *(("--sagemaker-fd", str(self.sagemaker_socket.fileno())) if self.sagemaker_socket is not None else ()),
                "--link-fd", str(theirs.fileno()),
                "--max-input-size", str(self.max_input_size),
                "--restricted-api", json.dumps(self.restricted_api),
                "--graceful-seconds", str(self.graceful_seconds),
                "--log-verbose", str(self.log_verbose),
                *(("--http-header-forward-pattern", self.header_forward_pattern) if self.header_forward_pattern else ()),
                pass_fds=fds,
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        ready: asyncio.Future[int] = loop.create_future()
        holder: list[_Worker] = []
        _, link = await loop.create_unix_connection(
            lambda: Link(lambda m: self._on_message(holder[0], m), lambda: self._on_lost(holder[0])), sock=ours
        )
        worker = _Worker(index, process, link, ready, time.monotonic())
        holder.append(worker)
        sagemaker = self.sagemaker.settings if self.sagemaker is not None and self.sagemaker_socket is not None else None
        link.send(("setup", {"grpc": self.grpc, "sagemaker": sagemaker}))
        self.workers[index] = worker
        watcher = asyncio.create_task(self._watch(worker), name=f"quiver-frontend-worker-{index}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return worker

    async def _watch(self, worker: _Worker) -> None:
        code = await worker.process.wait()
        worker.link.close()
        if not worker.ready.done():
            worker.ready.set_exception(OSError(f"frontend worker {worker.index} exited with {code} at start"))
            worker.ready.exception()  # seen: start() raises it; for a restart this log line says it
        if self._stopping:
            return
        logger.warning("frontend worker %d (pid %d) exited with %s; starting it again", worker.index, worker.process.pid, code)
        started = worker.started
        while not self._stopping:
            wait = started + RESTART_BACKOFF - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._stopping:
                return
            started = time.monotonic()
            try:
                await self._spawn(worker.index)  # its own watcher takes over from here
                return
            except OSError as exc:
                logger.error("frontend worker %d could not be started again: %s; retrying", worker.index, exc)

    # -- the links -------------------------------------------------------------------

    def _on_message(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        self._request_came()  # every request a worker takes comes here, whatever it asks
        kind = message[0]
        if kind == "infer":
            ident = message[1]
            decoupled_error = message[3] if len(message) > 3 and message[3] else DECOUPLED_ERROR
            # Started now, in this turn: a request answered without waiting (a model run
            # inline, an instance free) needs no task; one that waits gets one.
            task = eager.start(self._infer(worker, ident, unpack_request(message[2]), decoupled_error))
            if task is not None:
                worker.tasks[ident] = task
        elif kind == "cancel":
            task = worker.tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "forward":
            ident = message[1]
            app = self.sagemaker if len(message) > 4 and message[4] == "sagemaker" else self.app
            worker.tasks[ident] = asyncio.create_task(self._forward(worker, ident, message[2], message[3], app))
        elif kind == "rpc":
            ident = message[1]
            worker.tasks[ident] = asyncio.create_task(self._rpc(worker, ident, message[2], message[3], message[4]))
        elif kind == "sagemaker-model":
            self._sagemaker_model(worker, message[1], message[2], message[3])
        elif kind == "stream":
            ident = message[1]
            worker.tasks[ident] = asyncio.create_task(self._stream(worker, ident, unpack_request(message[2])))
        elif kind == "ready" and not worker.ready.done():
            worker.ready.set_result(message[1])

    def _on_lost(self, worker: _Worker) -> None:
        for task in worker.tasks.values():
            task.cancel()  # nobody to answer: queued requests leave their queues

    async def _infer(self, worker: _Worker, ident: int, request: InferenceRequest, decoupled_error: str) -> None:
        # Traces are sampled here, where the trace settings live: a worker's request is traced
        # from its arrival on the model side (no HTTP_* timestamps of the worker's).
        trace = self.service.start_trace(request.model_name)
        request.trace = trace
        try:
            response = await self.service.infer(request, decoupled_error=decoupled_error)
            if trace is not None:
                trace.capture("INFER_RESPONSE_COMPLETE")
        except asyncio.CancelledError:
            return
        except Exception as exc:
            code = exc.code if isinstance(exc, QuiverError) else ErrorCode.INTERNAL
            _, message = http_error(exc, model=request.model_name, where=f"inference on model '{request.model_name}'")
            worker.link.send(("error", ident, code.name, message, capacity_index(exc)))
        else:
            queues = self.service.queues(request.model_name, request.model_version)
            worker.link.send(("ok", ident, pack_response(response), queues))
        finally:
            worker.tasks.pop(ident, None)
            if trace is not None:
                trace.release()

    async def _rpc(self, worker: _Worker, ident: int, method: str, data: bytes, metadata: Any) -> None:
        assert self.servicer is not None
        try:
            answer = await answer_rpc(self.servicer, method, data, metadata)
        except asyncio.CancelledError:
            return
        finally:
            worker.tasks.pop(ident, None)
        worker.link.send((answer[0], ident, *answer[1:]))

    async def _stream(self, worker: _Worker, ident: int, request: InferenceRequest) -> None:
        """A ModelStreamInfer request: whether the model is decoupled, then each answer as the
        model gives it, then the end (or the error of the request as a whole)."""
        trace = self.service.start_trace(request.model_name)
        request.trace = trace
        try:
            decoupled, items = await self.service.open_stream(request)
            worker.link.send(("opened", ident, decoupled))
            async with contextlib.aclosing(items):
                async for item in items:
                    error = (item.error.code.name, item.error.message) if item.error is not None else None
                    response = None if item.response is None else pack_response(item.response)
                    worker.link.send(("item", ident, response, error, item.final))
            if trace is not None:
                trace.capture("INFER_RESPONSE_COMPLETE")
            worker.link.send(("end", ident))
        except asyncio.CancelledError:
            return  # the client went away: leaving the stream cancelled the request
        except Exception as exc:
            code = exc.code if isinstance(exc, QuiverError) else ErrorCode.INTERNAL
            _, message = grpc_error(exc, model=request.model_name, where=f"gRPC ModelStreamInfer on model '{request.model_name}'")
            worker.link.send(("error", ident, code.name, message))
        finally:
            worker.tasks.pop(ident, None)
            if trace is not None:
                trace.release()

    def _sagemaker_model(self, worker: _Worker, ident: int, route: str, value: str | None) -> None:
        """The model a worker's SageMaker inference runs on (see ``RemoteService.sagemaker_model``)."""
        assert self.sagemaker is not None
        try:
            if route == "invoke":
                model = self.sagemaker.service.resolve_target(value or "")
            else:
                model = self.sagemaker.invocation_model(value)
        except Exception as exc:  # answered, never raised into the link's reading
            code = exc.code if isinstance(exc, QuiverError) else ErrorCode.INTERNAL
            _, message = http_error(exc, where=f"SageMaker {route}")
            worker.link.send(("error", ident, code.name, message, capacity_index(exc)))
        else:
            worker.link.send(("value", ident, model))

    async def _forward(self, worker: _Worker, ident: int, scope: dict[str, Any], body: bytes, app: Any) -> None:
        """An HTTP request answered by the model side's ``app``. An answer in one piece goes
        back in one message (``http``); one the application sends in parts (``more_body``:
        generate_stream's events) goes back part by part as it comes (``http-start``, then
        ``http-chunk`` each, the last with ``more`` false)."""
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()  # no more body; a disconnect arrives as "cancel"
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        status = 500
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        streaming = ended = False

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers, streaming, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                more = bool(message.get("more_body", False))
                if streaming:
                    worker.link.send(("http-chunk", ident, chunk, more))
                    ended = not more
                elif more:  # the first part of an answer in parts (nothing came before it)
                    streaming = True
                    worker.link.send(("http-start", ident, status, headers, chunk))
                else:
                    chunks.append(chunk)

        try:
            await app(scope, receive, send)
        except asyncio.CancelledError:
            return
        except Exception:  # the application answered it already (its exception handler)
            logger.debug("forwarded %s %s raised after answering", scope.get("method"), scope.get("path"), exc_info=True)
        finally:
            worker.tasks.pop(ident, None)
        if not streaming:
            worker.link.send(("http", ident, status, headers, b"".join(chunks)))
        elif not ended:  # returned mid-answer: the worker closes the connection
            worker.link.send(("http-chunk", ident, None, False))

    # -- stopping ----------------------------------------------------------------------

    async def begin_stop(self) -> None:
        """Every worker stops taking connections and finishes what it has. Once: a worker that
        drained fast may be past its signal handlers when a second SIGTERM comes, which would
        kill it (-15) instead of letting it exit 0."""
        if self._stopping:
            return
        self._stopping = True
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)

    async def close(self) -> None:
        await self.begin_stop()
        processes = [w.process for w in self.workers.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in processes)), self.graceful_seconds + 5)
        except TimeoutError:
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            await asyncio.gather(*(p.wait() for p in processes))
        for worker in self.workers.values():
            if worker.process.returncode != 0:
                logger.warning(
                    "frontend worker %d (pid %d) exited with %s while stopping",
                    worker.index, worker.process.pid, worker.process.returncode,
                )
        for watcher in list(self._watchers):
            watcher.cancel()
        for worker in self.workers.values():
            worker.link.close()
        for sock in (self.socket, self.grpc_socket, self.sagemaker_socket):
            if sock is not None:
                sock.close()


__all__ = ["FrontendWorkers"]
