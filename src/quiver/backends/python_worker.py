"""Python model instances in worker processes of their own (the default; Triton's stub).

:class:`WorkerInstance` is the server's side of one worker (:mod:`quiver.backends.python_stub`
is the other; :mod:`quiver.backends.python_process` starts and stops the process): it sends each
batch as one ``execute`` message whose input tensors are in the worker's shared-memory pool, and
turns the ``response`` messages (tensors in the worker's own pool, copied out and released) into
Quiver responses, checked against the configuration. BLS requests from the model arrive as
``bls`` messages and go through the server's normal inference path.

Faults: a worker that exits or is killed fails the requests it was running with an error naming
the model and the exit cause (exit code or signal), and is started again (at once the first
time, then with a backoff that doubles while it keeps failing); while it cannot start, the
model reports UNAVAILABLE with the reason (``ServerContext.health``) and its requests get that
reason; other models never notice. A batch whose requests carry a ``timeout`` and that the model
does not answer in time fails with a timeout error, and the stuck worker is killed and
restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from functools import partial
from threading import get_ident
from typing import Any

from quiver.backends.base import (
    SERVER,
    ExecuteResult,
    ExecutionTiming,
    InstanceSpec,
    ModelFiles,
    exit_cause,
)
from quiver.backends.python_convert import request_fields
from quiver.backends.python_env import PythonEnv
from quiver.backends.python_outputs import OutputCheck
from quiver.backends.python_process import (
    Batch,
    Worker,
    log_message,
    start_worker,
    uss_bytes,
    wait,
)
from quiver.backends.python_readiness import UserReadiness, WorkerReadiness
from quiver.backends.python_settings import PythonSettings
from quiver.backends.python_worker_spin import AnswerSpin
from quiver.backends.python_worker_streams import BlsStreams, WorkerStreams, WorkerStreamsMixin
from quiver.config import ModelConfig
from quiver.errors import (
    ErrorCode,
    InternalError,
    QuiverError,
    UnavailableError,
    error_for_code,
)
from quiver.ipc import messages as msg
from quiver.ipc import tensors
from quiver.ipc.channel import AsyncChannel, ChannelError, decode_json
from quiver.ipc.shm import PoolFullError
from quiver.streaming import StreamedResponse
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

_DATATYPES = {datatype.value: datatype for datatype in DataType}
#: Executions shorter than this on average let a worker hold ``worker-queue-depth`` requests.
_QUICK_NS = 1_000_000


class WorkerInstance(WorkerStreamsMixin):
    """A :class:`~quiver.backends.base.ModelInstance` whose model runs in a worker process."""

    def __init__(
        self, config: ModelConfig, files: ModelFiles, spec: InstanceSpec, env: PythonEnv, tree: str,
        settings: PythonSettings, init_args: dict[str, str],
    ) -> None:
        self.name = spec.name
        self.timing = ExecutionTiming()
        self._config = config
        self._files = files
        self._env = env
        self._tree = tree
        self._settings = settings
        self._init_args = init_args
        self._model_name = config.name
        self._where = f"model '{config.name}' version {files.version}"
        self._version = str(files.version)  # as responses name it
        self._all_outputs = [tensor.name for tensor in config.outputs]
        self._check_outputs = OutputCheck(config)
        self._worker: Worker | None = None
        #: requests sent and not answered: id -> its batch and index there
        self._pending: dict[str, tuple[Batch, int]] = {}
        self._decoupled = bool(config.proto.model_transaction_policy.decoupled)
        self._cost_ns = 0  # the worker's recent executions, from their start to their done (averaged)
        # A decoupled model's requests stream one at a time, as Triton sends them; others: the
        # queue depth while executions are quick, 2 once they take a millisecond or more (then
        # the loop's delay in sending the next one is small beside them, and a request queued
        # in this worker would wait for it while another instance may be free).
        self._quick_slots = 1 if self._decoupled else settings.worker_queue_depth
        self._slow_slots = min(self._quick_slots, 2)
        #: Requests the direct scheduler may hand this instance at once
        #: (:class:`~quiver.scheduling.core.InstancePool`): the worker runs them one at a time,
        #: and finds the next one waiting when it finishes one.
        self.slots = self._quick_slots
        self._streams = WorkerStreams()  # a decoupled model's open requests
        self._bls_streams = BlsStreams()  # the model's decoupled BLS calls
        self._readiness: UserReadiness | None = None  # the model's own is_ready(), if any
        self._ready_answers = WorkerReadiness()
        self._batches: dict[int, Batch] = {}  # in flight, by number (0: finalize)
        self._batch_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._restarting: asyncio.Task[None] | None = None
        self._down_reason = ""
        self._served = False  # the current worker answered a batch
        self._failures = 0  # starts in a row that failed or died before serving
        self._closed = False
        self._bls_tasks: set[asyncio.Task[None]] = set()
        #: resolved when the batch that waits for room in the worker's pool has it (or gave up)
        self._room: asyncio.Future[None] | None = None
        #: The traces of sampled requests in flight, by the id the worker knows them by.
        self._traces: dict[str, Any] = {}
        #: Waiting for a quick worker's answer without sleeping when the loop is idle
        #: (answer-spin-microseconds).
        self._spin = (
            AnswerSpin(settings.answer_spin_microseconds / 1e6, settings.answer_spin_pressure)
            if settings.answer_spin_microseconds else None
        )

    # ---- start / stop

    def start(self) -> None:
        """Start the worker and wait for its ``ready`` (blocking; on a load thread)."""
        self._worker, ready = start_worker(self._config, self._files, self._env, self._tree, self._settings, self._init_args)
        if ready.get("has_is_ready"):
            self._readiness = UserReadiness(self._ask_ready, self._where)

    @property
    def pid(self) -> int | None:
        worker = self._worker
        return worker.process.pid if worker is not None and worker.process.poll() is None else None

    def process_memory_bytes(self) -> int:
        """The worker's unique set size now (0 while none runs)."""
        pid = self.pid
        return uss_bytes(pid) if pid is not None else 0

    def unload(self) -> None:
        """``finalize()`` in the worker (bounded by stub-timeout-seconds), then the process ends;
        requests still streaming end with an error."""
        self._closed = True
        self._end_streams(UnavailableError(f"{self._where} was unloaded while answering the request"))
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is not None:
                pass  # on the event loop itself: finalize() could not be awaited; just stop it
            elif worker.achannel is None and worker.process.poll() is None:
                worker.channel.send({"op": msg.FINALIZE})
                timeout = self._settings.stub_timeout_seconds
                while (answer := worker.channel.recv(timeout)) is not None and answer["op"] != msg.FINALIZED:
                    if answer["op"] == msg.LOG:
                        log_message(answer)
            elif worker.achannel is not None and SERVER.loop is not None and not SERVER.loop.is_closed():
                asyncio.run_coroutine_threadsafe(self._finalize(worker), SERVER.loop).result(
                    self._settings.stub_timeout_seconds + 1
                )
        except Exception as exc:
            logger.warning("%s: finalize() in its worker did not complete: %s", self._where, exc)
        finally:
            worker.kill()
            worker.close()

    async def _finalize(self, worker: Worker) -> None:
        assert worker.achannel is not None
        done = asyncio.get_running_loop().create_future()
        self._batches[0] = Batch([], done)
        worker.achannel.send({"op": msg.FINALIZE})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done, self._settings.stub_timeout_seconds)

    # ---- execute

    async def run(self, requests: list[InferenceRequest]) -> ExecuteResult:
        home = SERVER.loop
        if home is not None and SERVER.thread == get_ident() and home.is_running():
            # On the server's loop (a thread runs one loop at a time), known without
            # get_running_loop(), which makes a getpid() system call each time on 3.11.
            loop = home
        else:
            loop = asyncio.get_running_loop()
        if home is not None and home is not loop and home.is_running():
            # Another loop (a warmup's, on a load thread): the worker's channel lives on the
            # server's loop, so the batch runs there.
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.run(requests), home))
        while True:
            results = await self._run_once(requests, loop)
            if results is not None:
                return results
            # the worker died before it started this batch (it was queued behind the one that
            # was running): it runs on the restarted worker

    async def _run_once(self, requests: list[InferenceRequest], loop: asyncio.AbstractEventLoop) -> ExecuteResult | None:
        """Run the batch in the worker: its inputs written into the worker's pool (freed once
        it is done with them), one ``execute`` message, one future its task waits on; None if
        the worker died before it started it. As it returns, ``timing.started_ns`` says when
        the worker started it if it waited there behind another (else 0)."""
        holds_room = False  # this batch waits for room in the pool (later ones wait behind it)
        try:
            while True:
                worker = self._worker
                if worker is None or worker.achannel is None or self._restarting is not None or self._closed:
                    ready = await self._ready_worker()
                    if isinstance(ready, QuiverError):
                        self.timing.started_ns = 0
                        return [ready for _ in requests]
                    worker = ready
                if self._room is not None and not holds_room:
                    await asyncio.shield(self._room)
                    continue
                prepared = self._prepare(worker, requests, loop)
                if prepared is not None:
                    break
                # Requests the worker holds have part of the pool: this one waits until they
                # are done with it, as it would wait in the server's queue, and fails only if
                # it cannot fit once the worker holds nothing.
                if not holds_room:
                    holds_room = True
                    self._room = loop.create_future()
                if worker.freed is None:
                    worker.freed = loop.create_future()
                await asyncio.shield(worker.freed)
        finally:
            if holds_room:
                room, self._room = self._room, None
                if room is not None and not room.done():
                    room.set_result(None)
        entry, items, blocks, limit = prepared
        ids, results, done, arena, pending = entry.ids, entry.results, entry.waiter, worker.arena, self._pending
        channel = worker.achannel
        assert channel is not None
        if not items:
            arena.free_many(blocks)
            self.timing.started_ns = 0
            return results  # every one is an error
        batch = next(self._batch_ids)
        self._batches[batch] = entry
        entry.limit = limit
        if worker.inflight:
            entry.queued = True  # it waits in the worker behind another first
        elif limit:
            self._arm(worker, entry)  # it starts now (else when the worker is done with the one before)
        worker.inflight.append(batch)
        worker.holding += 1
        entry.sent = time.monotonic_ns()
        message: dict[str, Any] = {"op": msg.EXECUTE, "batch": batch, "requests": items}
        if worker.releases:
            message["release"], worker.releases = worker.releases, []
        channel.send(message)
        spin = self._spin
        spun = spin.wait(loop, done, len(worker.inflight) == 1) if spin is not None else 0
        try:
            await done  # nothing in between: the answer resumes this task at once
            if entry.missing and not entry.unstarted:
                # A model may answer through its response sender after execute() returned:
                # Batch.answer() wakes this waiter with the last of them.
                entry.waiter = loop.create_future()
                await entry.waiter
        except asyncio.CancelledError:
            # A batch the worker has not started yet is not run (its requests are answered
            # CANCELLED); one it runs sees it in is_cancelled().
            channel.send({"op": msg.CANCEL, "ids": ids})
            if not entry.finished:
                if entry.waiter.done():  # cancelled with this task: wait on a new one
                    entry.waiter = loop.create_future()
                with contextlib.suppress(Exception):
                    await entry.waiter
            raise
        finally:
            self._batches.pop(batch, None)
            if spin is not None:
                spin.finished(entry.sent, spun)
            if entry.finished:  # else the worker still reads them, or is being stopped
                arena.free_many(blocks)
                worker.holding -= 1
                if worker.freed is not None:
                    worker.inputs_freed(0)  # a batch waits for room
            if self._traces:
                for request_id in ids:
                    self._traces.pop(request_id, None)
        if entry.unstarted:
            for request_id in ids:
                pending.pop(request_id, None)
            return None
        self.timing.started_ns = entry.start  # (read by the scheduler as this returns)
        return results  # each one answered

    def _prepare(
        self, worker: Worker, requests: list[InferenceRequest], loop: asyncio.AbstractEventLoop
    ) -> tuple[Batch, list[dict[str, Any]], list[tuple[str, int]], int] | None:
        """The batch's inputs written into the worker's pool and its requests registered: its
        entry, the ``execute`` message's items, the blocks written, the shortest ``timeout``
        (microseconds, 0: none). A request that does not fit gets the pool's error; None (and
        nothing kept) when one does not fit while the worker holds requests ahead of it."""
        arena, pending, request_ids, write = worker.arena, self._pending, self._request_ids, tensors.write
        blocks: list[tuple[str, int]] = []
        items: list[dict[str, Any]] = []
        ids: list[str] = []
        results: list[InferenceResponse | QuiverError | None] = [None] * len(requests)
        entry = Batch(ids, loop.create_future(), results)
        limit = 0
        for index, request in enumerate(requests):
            try:
                # ``_value_``: the datatype's wire name without the enum's property lookup
                descriptors = [write(arena, t.name, t.datatype._value_, t.data, blocks) for t in request.inputs]
            except PoolFullError as exc:
                if worker.holding:  # it waits for room: nothing of it kept
                    arena.free_many(blocks)
                    for request_id in ids:
                        pending.pop(request_id, None)
                        self._traces.pop(request_id, None)
                        self._streams.close(request_id)
                    return None
                results[index] = UnavailableError(f"{self._where}: the request's inputs do not fit its worker's shared-memory pool: {exc}")
                continue
            request_id = str(next(request_ids))
            if self._decoupled:
                results[index] = StreamedResponse("", "", [])  # answered on its stream
                self._streams.open(request_id, request, self._cancel)
            else:
                pending[request_id] = (entry, index)
                entry.missing += 1
                if request.cancellation is not None:  # a caller that leaves cancels it here too
                    request.cancellation.add_callback(partial(self._cancel_pending, loop, request_id))
            item: dict[str, Any] = {"id": request_id, "tensors": descriptors}
            if request.id or request.outputs is not None or request.parameters:
                fields = request_fields(request)
                if fields:
                    item["fields"] = fields
                value = request.parameters.get("timeout")
                if value and str(value).isdigit() and (limit == 0 or int(value) < limit):
                    limit = int(value)
            if request.trace is not None:
                # BLS requests the model passes this request's trace to are traced under it.
                item["traced"] = True
                self._traces[request_id] = request.trace
            items.append(item)
            ids.append(request_id)
        return entry, items, blocks, limit

    def _cancel_pending(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        """A request's caller left (from any thread): the worker does not start it if it has
        not yet (``cancel``), or its model sees it in ``is_cancelled()``."""

        def cancel() -> None:
            worker = self._worker
            if request_id in self._pending and worker is not None and worker.achannel is not None:
                worker.achannel.send({"op": msg.CANCEL, "ids": [request_id]})

        with contextlib.suppress(RuntimeError):  # the loop is gone
            loop.call_soon_threadsafe(cancel)

    def _arm(self, worker: Worker, entry: Batch) -> None:
        """The batch's ``timeout`` runs from now, as the worker starts it."""
        entry.timer = asyncio.get_running_loop().call_later(entry.limit / 1e6, self._timed_out, worker, entry)

    def _timed_out(self, worker: Worker, entry: Batch) -> None:
        entry.timer = None
        if entry.finished:
            return
        self._fail_pending(
            entry.ids,
            UnavailableError(
                f"{self._where}: execute() did not return within the request timeout of "
                f"{entry.limit / 1000:g} ms; its worker is stopped and restarted"
            ),
        )
        if not entry.waiter.done():
            entry.waiter.set_result(None)
        worker.kill()  # the reader sees the end of the channel and restarts it

    async def _ready_worker(self) -> Worker | QuiverError:
        if self._restarting is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._restarting), self._settings.stub_timeout_seconds)
        worker = self._worker
        if worker is None or self._closed:
            return UnavailableError(f"{self._where} is not available: {self._down_reason or 'its worker is not running'}")
        if worker.achannel is None:
            # One joining per worker, shielded: a request cancelled while it waits (a client
            # gone) must not stop it halfway, with one pipe's end owned by a transport and the
            # other not, for the next request to register again (EBADF, then EEXIST).
            if worker.joining is None:
                worker.joining = asyncio.ensure_future(self._join(worker))
            await asyncio.shield(worker.joining)
        return worker

    async def _join(self, worker: Worker) -> None:
        """The worker's pipes joined to the running loop (once: :meth:`_ready_worker`)."""
        try:
            worker.achannel = await AsyncChannel.open(
                worker.channel.fds,
                partial(self._on_message, worker),
                partial(self._on_end, worker),
            )
        except BaseException:
            worker.joining = None  # the next request tries again
            raise

    # ---- messages from the worker

    def _on_message(self, worker: Worker, message: dict[str, Any]) -> None:
        """One message from the worker, on the loop as soon as it is read."""
        op = message["op"]
        if op == msg.DONE:
            for response in message.get("responses", ()):  # the batch's, sent with its done
                self._on_response(worker, response["id"], response, msg.FINAL)
            self._served = True
            self._failures = 0
            if self._spin is not None:
                self._spin.placed(message.get("cpu"))
            batch = int(message["batch"])
            inflight = worker.inflight
            if inflight and inflight[0] == batch:  # the usual: batches finish in order
                inflight.popleft()
                if inflight:  # the worker starts the next one now: its timeout runs from here
                    following = self._batches.get(inflight[0])
                    if following is not None and following.limit and following.timer is None:
                        self._arm(worker, following)
            else:
                with contextlib.suppress(ValueError):
                    inflight.remove(batch)
            entry = self._batches.get(batch)
            if entry is not None:
                if entry.queued:  # its wait in the worker is queue time: from when it started
                    entry.start = message.get("start", 0)
                spent = time.monotonic_ns() - (entry.start or entry.sent)
                cost = self._cost_ns
                cost = self._cost_ns = spent if spent > 8 * cost else (7 * cost + spent) >> 3
                self.slots = self._quick_slots if cost < _QUICK_NS else self._slow_slots
                entry.finish()
        elif op == msg.RESPONSE:
            self._on_response(worker, message["id"], message["response"], message.get("flags", msg.FINAL))
        elif op == msg.BLS:
            task = asyncio.create_task(self._bls(worker, message))
            self._bls_tasks.add(task)
            task.add_done_callback(self._bls_tasks.discard)
        elif op == msg.RELEASE:
            worker.arena.free_many(message["blocks"])
        elif op == msg.IS_READY_RESULT:
            self._ready_answers.answered(message)
        elif op == msg.BLS_CANCEL:
            self._bls_streams.cancel(int(message["id"]))
        elif op == msg.LOG:
            log_message(message)
        elif op == msg.FINALIZED:
            worker.finalized = True
            entry = self._batches.get(0)
            if entry is not None:
                entry.finish()

    def _on_end(self, worker: Worker, error: Exception | None) -> None:
        """The channel ended: the worker exited (or sent something that is not a message, and
        is stopped); unless it was finalized or replaced, its requests fail and it restarts."""
        if error is not None:
            logger.error("%s: its worker sent a malformed message (%s); stopping it", self._where, error)
            worker.kill()
        if worker.finalized or self._closed or worker is not self._worker:
            return
        task = asyncio.get_running_loop().create_task(self._on_exit(worker), name=f"quiver-worker-{self.name}-exit")
        self._bls_tasks.add(task)
        task.add_done_callback(self._bls_tasks.discard)

    def _on_response(self, worker: Worker, request_id: Any, response: dict[str, Any] | None, flags: Any) -> None:
        """One response to request ``request_id`` (``response`` None: a decoupled model's
        flag-only final)."""
        if type(request_id) is not str:
            request_id = str(request_id)
        streamed = self._decoupled and request_id in self._streams  # (only decoupled models stream)
        if response is None:  # a decoupled model's flag-only final
            if streamed:
                self._streams.deliver(request_id, None, bool(int(flags) & msg.FINAL))
            return
        slot = None if streamed else self._pending.pop(request_id, None)
        descriptors = response.get("tensors") or ()
        result: InferenceResponse | QuiverError
        try:
            error = response.get("error")
            if error is not None:
                code, text = error
                result = error_for_code(ErrorCode[code] if code in ErrorCode.__members__ else ErrorCode.INTERNAL, str(text))
            else:
                outputs = []
                read, mapper, datatypes = tensors.read, worker.mapper, _DATATYPES
                for descriptor in descriptors:
                    name, datatype, shape, array = read(mapper, descriptor, copy=True)
                    outputs.append(Tensor(name, datatypes[datatype], shape, array))
                parameters: Any = {}
                text = response.get("parameters")
                if text and text != "{}":  # the standard library's json: integers of any size
                    with contextlib.suppress(ChannelError):
                        parameters = decode_json(text, exact=True)
                wrong = self._check_outputs(outputs)
                if wrong:
                    raise ValueError(wrong)
                result = InferenceResponse(
                    self._model_name, self._version, outputs,
                    parameters=parameters if type(parameters) is dict else {},
                )
        except (ValueError, KeyError) as exc:
            result = InternalError(f"{self._where}: {exc}")
        finally:
            if descriptors:
                worker.release(descriptors)
        if streamed:
            self._streams.deliver(request_id, result, bool(int(flags) & msg.FINAL))
        elif slot is not None:
            slot[0].answer(slot[1], result)

    # ---- faults

    def _fail_pending(self, ids: list[str], error: QuiverError) -> None:
        for request_id in ids:
            slot = self._pending.pop(request_id, None)
            if slot is not None:
                slot[0].answer(slot[1], error)

    async def _on_exit(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        returncode = await loop.run_in_executor(None, wait, worker.process)
        cause = exit_cause(returncode)
        error = InternalError(
            f"{self._where}: its Python worker (pid {worker.process.pid}) {cause} while running the request; "
            "the worker is restarted"
        )
        logger.error("%s: Python worker (pid %d) %s; restarting it", self._where, worker.process.pid, cause)
        # The worker runs its batches in order and says which one it started last: the others it
        # held never started (queued behind it, or sent as it died), and are sent again to the
        # restarted worker rather than failed.
        running = worker.started_batch()
        waiting = [self._batches[batch] for batch in worker.inflight if batch != running and batch in self._batches]
        if self._decoupled:
            waiting = []
        again = set()
        for entry in waiting:
            entry.unstarted = True
            again.update(entry.ids)
        self._fail_pending([request_id for request_id in self._pending if request_id not in again], error)
        worker.inputs_freed(0)  # its pool goes with it: a batch waiting for room looks again
        self._streams.fail_all(error)
        for entry in list(self._batches.values()):
            entry.finish()
        self._worker = None
        self._down_reason = f"its Python worker {cause}"
        if not self._served:
            self._failures += 1
        self._served = False
        # at once, so that a batch sent again waits for the new worker
        self._restarting = asyncio.create_task(self._restart(worker))

    async def _restart(self, old: Worker) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, old.close)
        settings = self._settings
        while not self._closed:
            delay = 0.0 if self._failures == 0 else min(
                settings.restart_backoff_max_seconds, settings.restart_backoff_seconds * 2 ** (self._failures - 1)
            )
            if delay:
                await asyncio.sleep(delay)
            if self._closed:
                return
            try:
                worker, _ = await loop.run_in_executor(
                    None,
                    lambda: start_worker(self._config, self._files, self._env, self._tree, self._settings, self._init_args),
                )
            except QuiverError as exc:
                self._failures += 1
                self._down_reason = exc.message
                logger.error("%s: restarting its Python worker failed: %s", self._where, exc.message)
                _report_health(self._config.name, self._files.version, self.name, exc.message)
                continue
            if self._closed:
                worker.kill()
                await loop.run_in_executor(None, worker.close)
                return
            self._worker = worker
            self._down_reason = ""
            _report_health(self._config.name, self._files.version, self.name, None)
            logger.info("%s: Python worker restarted (pid %d)", self._where, worker.process.pid)
            self._restarting = None
            return


def _report_health(model: str, version: int, instance: str, reason: str | None) -> None:
    report = SERVER.health
    if report is not None:
        try:
            report(model, version, instance, reason)
        except Exception:  # pragma: no cover - defensive
            logger.exception("reporting the health of model '%s'", model)
