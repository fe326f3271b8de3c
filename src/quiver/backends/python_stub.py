"""The worker process of one Python model instance (Triton's "stub"): ``python -m`` free.

Started by :mod:`quiver.backends.python_worker` with the model's Python (the server's, or the
one of the model's ``EXECUTION_ENV_PATH``), it imports only the standard library, numpy and
Quiver's worker-safe modules. It reads ``init`` from the control channel (a pair of pipes, in
``QUIVER_WORKER_FDS``), imports ``model.py``, runs ``auto_complete_config`` or ``initialize`` and
answers ``ready``; then it runs each ``execute`` message's batch on its main thread and answers
one ``response`` per request and a ``done``. There is no reader thread: the thread that waits for
a message reads the channel (:class:`~quiver.ipc.inbox.Inbox`), so the main thread reads its
own batches (spinning for ``spin-microseconds`` before it sleeps), a thread waiting for a BLS
answer reads while the main thread runs a batch, and ``is_cancelled()`` reads the cancellations
that arrived.

It never outlives the server: ``PR_SET_PDEATHSIG`` kills it with SIGKILL when the server's
thread that started it ends (the server exits, however it exits), and the thread that reads the
channel's end exits the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils
from quiver import profiling
from quiver.backends.python_convert import _error_code, _json_ready
from quiver.backends.python_loading import _import_model_file, _model_class
from quiver.backends.python_readiness import call_is_ready
from quiver.backends.python_sender import BackgroundLoop
from quiver.backends.python_stub_bls import WorkerBls
from quiver.backends.python_stub_senders import WorkerSenders
from quiver.backends.python_stub_wire import requests_from, response_message, tensor_wire
from quiver.errors import format_exception
from quiver.ipc import messages as msg
from quiver.ipc import tensors
from quiver.ipc.channel import Channel
from quiver.ipc.inbox import Inbox, current_cpu, spare_core
from quiver.ipc.shm import Arena, Mapper, PoolFullError

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class _Files:
    model_dir: Path
    version: int

    @property
    def version_dir(self) -> Path:
        return self.model_dir / str(self.version)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the server goes; and leave now if it is gone already."""
    try:  # (an environment's Python may lack ctypes: a build without libffi)
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (ImportError, OSError, AttributeError):  # pragma: no cover - the EOF watchdog remains
        pass
    if os.getppid() != parent:
        os._exit(1)


class _ChannelLogHandler(logging.Handler):
    """``pb_utils.Logger`` records, sent to the server's log."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):
            self._channel.send({"op": msg.LOG, "level": record.levelno, "message": record.getMessage()})


class Worker:
    def __init__(self, channel: Channel, init: dict[str, Any]) -> None:
        self.channel = channel
        shm = init["shm"]
        self.arena = Arena(shm["prefix"], shm["default"], shm["growth"], shm["max"])
        self.mapper = Mapper(shm["server_prefix"])
        #: where the number of each batch goes as it starts (the server's pool): a server
        #: whose worker died knows which of the batches it held never started
        marker = shm.get("started")
        self.started = self.mapper.view(marker[0], marker[1], 8).cast("q") if marker else None
        self.name: str = init["model_name"]
        self.version = int(init["model_version"])
        self.where = f"model '{self.name}' version {self.version}"
        self.files = _Files(Path(init["model_dir"]), self.version)
        self.filename: str = init["filename"]
        #: The model's outputs: what a request that names none asks for.
        self.outputs: list[str] = list(init.get("outputs") or ())
        self.output_set = set(self.outputs)  # each request gets a copy
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.jobs: deque[dict[str, Any]] = deque()
        self.inbox = Inbox(channel, self.handle, self.channel_ended)
        #: Seconds the main thread reads without sleeping before it blocks for its next batch.
        self.spin = max(0, int(init.get("spin_us", 0))) / 1e6
        #: Whether a batch's ``done`` says which CPU ran it (the server spins for an answer only
        #: from a worker on another CPU than its loop's).
        self.report_cpu = bool(init.get("report_cpu"))
        self.cancelled: set[str] = set()
        self.waiting: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self.bls_ids = itertools.count(1)
        #: Decoupled BLS calls: id -> what receives each (response, final).
        self.bls_sinks: dict[int, Callable[[dict[str, Any] | None, bool], None]] = {}
        self.model: Any = None
        self.model_execute: Callable[[list[Any]], Any] | None = None  # the model's execute()
        self.outbox: list[dict[str, Any]] | None = None  # a batch's responses, sent with its done
        self.start = 0  # when the running batch started (reported with its done)
        config = json.loads((init.get("args") or {}).get("model_config") or "{}")
        self.decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled", False))
        self.background: BackgroundLoop | None = None  # a decoupled model's async execute

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(message)

    # ---- messages from the server

    def handle(self, message: dict[str, Any]) -> None:
        """A message that is not a batch: BLS answers, releases, cancellations."""
        op = message["op"]
        if op == msg.EXECUTE:  # the common one first
            self.jobs.append(message)
        elif op == msg.BLS_RESPONSE:
            number = int(message["id"])
            sink = self.bls_sinks.get(number)
            final = bool(int(message.get("flags", msg.FINAL)) & msg.FINAL)
            if sink is not None:  # a decoupled BLS call: one of many responses
                sink(message["response"], final)
                if not final:
                    return
                del self.bls_sinks[number]
            future = self.waiting.pop(number, None)
            if future is not None:
                future.set_result(message["response"])
        elif op == msg.IS_READY:
            threading.Thread(target=self.is_ready, args=(message["id"],), daemon=True).start()
        elif op == msg.RELEASE:
            self.arena.free_many(message["blocks"])
        elif op == msg.CANCEL:
            self.cancelled.update(str(i) for i in message["ids"])
        elif op == msg.FINALIZE:
            self.jobs.append(message)

    def channel_ended(self) -> None:
        """The server is gone or dropped this worker: the process ends."""
        self.arena.close()
        profiling.dump()
        os._exit(0)

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the server cancelled the request (reading the cancellations that arrived)."""
        self.inbox.drain()
        return request_id in self.cancelled

    def wait_for(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``ready()``, reading the channel meanwhile if no other thread does."""
        return self.inbox.wait(ready, timeout)

    def is_ready(self, number: int) -> None:
        """Answer the server's readiness check with the model's own ``is_ready()``."""
        answer: dict[str, Any] = {"op": msg.IS_READY_RESULT, "id": number}
        try:
            answer["ready"] = call_is_ready(self.model.is_ready, self._run_in_background)
        except Exception as exc:
            answer["ready"] = False
            answer["error"] = format_exception(exc)
        with contextlib.suppress(OSError):
            self.send(answer)

    def _run_in_background(self, coroutine: Any) -> Any:
        if self.background is None:
            self.background = BackgroundLoop(self.name)
        return self.background.run(coroutine)

    # ---- model life

    def load(self, init: dict[str, Any]) -> dict[str, Any]:
        path = self.files.version_dir / self.filename
        loaded = _import_model_file(path, self.files, self.where, self.name)
        cls = _model_class(loaded, path, self.where)
        if init.get("auto_complete") is not None:
            return {"config": self.auto_complete(cls, init["auto_complete"])}
        try:
            self.model = cls()
        except (Exception, SystemExit) as exc:
            raise _Failure(exc, f"{self.where}: creating TritonPythonModel failed: {format_exception(exc)}") from exc
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            try:
                result = initialize(init["args"])
                if inspect.isawaitable(result):
                    self.loop.run_until_complete(result)
            except (Exception, SystemExit) as exc:
                raise _Failure(exc, f"{self.where}: initialize() failed: {format_exception(exc)}") from exc
        self.model_execute = getattr(self.model, "execute", None)  # (looked up once)
        return {}

    def auto_complete(self, cls: Any, config: dict[str, Any]) -> dict[str, Any] | None:
        method = getattr(cls, "auto_complete_config", None)
        if method is None:
            return None
        try:
            result = method(pb_utils.ModelConfig(config))
        except Exception as exc:
            raise _Failure(exc, f"{self.where}: auto_complete_config() failed: {format_exception(exc)}") from exc
        if not isinstance(result, pb_utils.ModelConfig):
            raise _Failure(
                None,
                f"{self.where}: auto_complete_config() must return a pb_utils.ModelConfig object, "
                f"got {type(result).__name__}",
            )
        ready: dict[str, Any] = _json_ready(result.as_dict())
        return ready

    def serve(self) -> None:
        jobs, inbox, buffer, arena, started = self.jobs, self.inbox, self.channel.buffer, self.arena, self.started
        take, drain, execute, now = inbox.take, inbox.drain, self.execute, time.monotonic_ns
        spin, execute_op, finalize_op = self.spin, msg.EXECUTE, msg.FINALIZE

        def waiting() -> bool:
            return bool(jobs)

        while True:
            queued = bool(jobs or buffer)  # the next batch is here already: it waited
            if spin and spare_core():
                if not jobs:
                    inbox.wait(waiting, spin=spin)
                job = jobs.popleft()
            else:  # the usual: the next batch, read here (or queued by a thread that read it)
                job = take(execute_op, jobs)
            if queued or buffer:
                # What came with it or while it waited counts before it starts: a request
                # cancelled meanwhile is not run (the usual, one batch read alone, skips this).
                drain()
            release = job.get("release")
            if release:
                arena.free_many(release)
            if job["op"] == finalize_op:
                profiling.dump()  # now: once FINALIZED is sent, the server may end this process
                self.finalize()
                return
            if started is not None:
                started[0] = job["batch"]
            execute(job, now())

    def finalize(self) -> None:
        if self.background is not None:
            self.background.stop()
        finalize = getattr(self.model, "finalize", None)
        if finalize is not None:
            try:
                result = finalize()
                if inspect.isawaitable(result):
                    self.loop.run_until_complete(result)
            except (Exception, SystemExit) as exc:
                pb_utils.Logger.log_error(f"{self.where}: finalize() failed: {format_exception(exc)}")
        self.channel.send({"op": msg.FINALIZED})

    # ---- execute

    def execute(self, job: dict[str, Any], start: int = 0) -> None:
        """Run one batch; ``start``: when it started (``time.monotonic_ns()``, the server's
        clock too), which its ``done`` reports: the server counts the wait of a batch that
        waited here behind another as queue time, not compute."""
        batch = job["batch"]
        items = job["requests"]
        self.outbox = []
        self.start = start
        if self.cancelled:
            items = self._skip_cancelled(items)
            if not items:
                self._flush(batch)
                return
        # strings, as the server names its requests
        ids = [items[0]["id"]] if len(items) == 1 else [item["id"] for item in items]
        senders = WorkerSenders(self, ids, self.decoupled)
        try:
            requests = requests_from(items, ids, senders, self.mapper, self.output_set, self.name, self.version)
        except Exception as exc:
            self._fail(ids, "INTERNAL", f"{self.where}: reading the requests failed: {format_exception(exc)}")
            self._flush(batch)
            return
        try:
            model_execute = self.model_execute
            if model_execute is None:
                self._fail(ids, "INTERNAL", f"{self.where}: TritonPythonModel does not implement 'execute'")
                return
            try:
                result = model_execute(requests)
                if type(result) is not list and inspect.isawaitable(result):
                    if self.decoupled and inspect.iscoroutine(result):
                        senders.in_background(result)
                        result = None
                    else:
                        result = self.loop.run_until_complete(result)
            except (Exception, SystemExit) as exc:
                message = f"{self.where}: execute() raised {format_exception(exc)}"
                if self.decoupled or senders.used:
                    senders.fail(_error_code(exc).name, message)
                else:
                    self._fail(ids, _error_code(exc).name, message)
                return
            if self.decoupled or senders.used:
                senders.respond(result)
            elif type(result) is list and len(result) == len(ids) and not self.outbox:
                # the usual: one response per request, sent with the batch's done (one write)
                arena, where = self.arena, self.where
                responses = []
                for index, item in enumerate(result):
                    answer = response_message(item, index, arena, where)
                    answer["id"] = ids[index]  # with the done: the response itself, named
                    responses.append(answer)
                self.outbox = None
                done: dict[str, Any] = {"op": msg.DONE, "batch": batch, "responses": responses}
                if start:
                    done["start"] = start
                if self.report_cpu:
                    done["cpu"] = current_cpu()
                self.channel.send(done)
                if self.cancelled:
                    for request_id in ids:
                        self.cancelled.discard(request_id)
                return
            else:
                self._respond(ids, result)
        finally:
            if self.outbox is not None:
                self._flush(batch)
                if self.cancelled and not self.decoupled and not senders.used:
                    for request_id in ids:
                        self.cancelled.discard(request_id)

    def _flush(self, batch: int) -> None:
        """The batch's ``done``, carrying its responses: one message, one write."""
        outbox, self.outbox = self.outbox, None
        done: dict[str, Any] = {"op": msg.DONE, "batch": batch}
        if outbox:
            done["responses"] = outbox
        if self.start:
            done["start"] = self.start
        if self.report_cpu:
            done["cpu"] = current_cpu()
        self.channel.send(done)

    def _skip_cancelled(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The batch's requests not cancelled before it started; each cancelled one is answered
        CANCELLED without running (as a request that leaves the server's queue)."""
        cancelled = self.cancelled
        kept = []
        for item in items:
            request_id = item["id"]
            if request_id in cancelled:
                cancelled.discard(request_id)
                self._send_response(
                    request_id, {"error": ["CANCELLED", f"{self.where}: the request was cancelled before it started"]}
                )
            else:
                kept.append(item)
        return kept

    def _fail(self, ids: list[str], code: str, message: str) -> None:
        for request_id in ids:
            self._send_response(request_id, {"error": [code, message]})

    def _send_response(self, request_id: str, response: dict[str, Any]) -> None:
        """The final response to ``request_id``: with the batch's ``done`` while it runs, else
        a message of its own."""
        if self.outbox is not None:
            response["id"] = request_id  # with the done: the response itself, named
            self.outbox.append(response)
        else:
            self.channel.send({"op": msg.RESPONSE, "id": request_id, "response": response, "flags": msg.FINAL})

    def _respond(self, ids: list[str], result: Any) -> None:
        """What ``execute`` returned, each response on its own (execute() sends the usual
        list of one response per request with the done itself)."""
        count = len(ids)
        expected = (
            f"a model that is not decoupled must return a list with one "
            f"pb_utils.InferenceResponse per request ({count} requests)"
        )
        if result is None:
            self._fail(ids, "INTERNAL", f"{self.where}: execute() returned None; {expected}")
        elif not isinstance(result, list):
            self._fail(ids, "INTERNAL", f"{self.where}: execute() returned a {type(result).__name__}; {expected}")
        elif len(result) != count:
            self._fail(
                ids,
                "INTERNAL",
                f"{self.where}: execute() returned {len(result)} responses for {count} requests; {expected}",
            )
        else:
            for index, (request_id, item) in enumerate(zip(ids, result, strict=True)):
                self._send_response(request_id, self._response(item, index))

    def _response(self, item: Any, index: int) -> dict[str, Any]:
        return response_message(item, index, self.arena, self.where)

    # ---- BLS

    def bls(
        self,
        request: pb_utils.InferenceRequest,
        sink: Callable[[dict[str, Any] | None, bool], None] | None = None,
    ) -> tuple[int, concurrent.futures.Future[dict[str, Any]]]:
        """Send a BLS request; its id and the future its answer completes (or, with ``sink``,
        every response of a decoupled call goes there, the last one final). The future is
        returned, not looked up later: another thread may read the answer, and complete it,
        before this one looks."""
        blocks: list[tuple[str, int]] = []
        descriptors = []
        try:
            for tensor in request.inputs():
                name, datatype, array = tensor_wire(tensor)
                descriptors.append(tensors.write(self.arena, name, datatype, array, blocks))
        except (ValueError, PoolFullError) as exc:
            self.arena.free_many(blocks)
            raise pb_utils.TritonModelException(f"BLS request to model '{request.model_name()}': {exc}") from None
        number = next(self.bls_ids)
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self.waiting[number] = future
        if sink is not None:
            self.bls_sinks[number] = sink

        def free(_: object) -> None:
            self.arena.free_many(blocks)

        future.add_done_callback(free)
        self.channel.send(
            {
                "op": msg.BLS,
                "id": number,
                "request": {
                    "model_name": request.model_name(),
                    "model_version": request.model_version(),
                    "tensors": descriptors,
                    "requested_output_names": sorted(request.requested_output_names()),
                    "request_id": request.request_id(),
                    "correlation_id": request.correlation_id(),
                    "flags": request.flags(),
                    "timeout": request.timeout(),
                    "parameters": request.parameters(),
                    "decoupled": sink is not None,
                    "trace": request.trace()._server,
                },
            }
        )
        return number, future

    def bls_result(self, response: dict[str, Any]) -> pb_utils.InferenceResponse:
        """The server's answer as a pb_utils response; its tensors are copied out of the
        pool and the blocks released at once."""
        error = response.get("error")
        if error is not None:
            code, message = error
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))
            )
        descriptors = response.get("tensors", [])
        outputs = []
        try:
            for descriptor in descriptors:
                name, _, _, array = tensors.read(self.mapper, descriptor, copy=True)
                outputs.append(pb_utils.Tensor(name, array))
        finally:
            blocks = tensors.blocks_of(descriptors)
            if blocks:
                self.channel.send({"op": msg.RELEASE, "blocks": blocks})
        return pb_utils.InferenceResponse(outputs)


class _Failure(Exception):
    """A load failure to report: the Triton error code of ``cause`` and a message."""

    def __init__(self, cause: BaseException | None, message: str) -> None:
        super().__init__(message)
        self.code = _error_code(cause).name if cause is not None else "INTERNAL"
        self.message = message


def main() -> None:
    parent = int(os.environ["QUIVER_WORKER_PARENT"])
    _die_with_parent(parent)
    # Ctrl-C and a SIGTERM to the process group are the server's to handle: it finalizes its
    # workers as it stops (and PR_SET_PDEATHSIG ends them if it cannot)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    read_fd, write_fd = (int(fd) for fd in os.environ["QUIVER_WORKER_FDS"].split(","))
    for fd in (read_fd, write_fd):  # not for processes the model starts: they would keep them open
        os.set_inheritable(fd, False)
    channel = Channel((read_fd, write_fd), buffered=True)
    profiling.start("python-model")
    init = channel.recv()
    if init is None:
        return
    handler = _ChannelLogHandler(channel)
    model_logger = logging.getLogger("quiver.python_model")
    model_logger.addHandler(handler)
    model_logger.setLevel(logging.DEBUG)
    model_logger.propagate = False
    worker = Worker(channel, init)
    pb_utils._set_bls_executor(WorkerBls(worker))
    try:
        extra = worker.load(init)
    except _Failure as exc:
        channel.send({"op": msg.INIT_ERROR, "code": exc.code, "message": exc.message})
        return
    except Exception as exc:  # the model import's own errors (QuiverError from the loader)
        code = getattr(getattr(exc, "code", None), "name", "INTERNAL")
        channel.send({"op": msg.INIT_ERROR, "code": code, "message": str(exc)})
        return
    has_is_ready = callable(getattr(worker.model, "is_ready", None))
    channel.send({"op": msg.READY, "pid": os.getpid(), "has_is_ready": has_is_ready, **extra})
    if init.get("auto_complete") is not None:
        return
    with contextlib.suppress(EOFError):  # channel_ended() exits first
        worker.serve()
    sys.stdout.flush()
    sys.stderr.flush()
    worker.arena.close()
    profiling.dump()
    os._exit(0)


if __name__ == "__main__":
    main()
