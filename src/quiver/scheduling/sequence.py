"""Triton's sequence batcher: stateful models (``sequence_batching`` in config.pbtxt).

A client marks the requests of one *sequence* with a correlation id (request parameter
``sequence_id``, a uint64 or a string) and the flags ``sequence_start`` / ``sequence_end``.
The batcher

- keeps the requests of a sequence in order, one at a time (never two in one batch or on two
  instances at once);
- gives each live sequence a *slot*: with the ``direct`` strategy (the default) a batch slot of
  one instance, held for the sequence's lifetime, and batches the sequences of one instance
  together; with ``oldest`` a candidate place (``max_candidate_sequences``), batching the
  oldest ready requests of different sequences on any free instance, as the dynamic batcher
  does (``preferred_batch_size``, ``max_queue_delay_microseconds``). Sequences that find no
  slot wait in a backlog until one is freed;
- injects *control inputs* (START, END, READY, CORRID) and *implicit state* (the previous
  response's output state, or the initial state on START) as input tensors of each request,
  and takes the output state out of each response;
- releases a sequence at its END, or when it stayed idle longer than
  ``max_sequence_idle_microseconds`` (1 s by default), with a timer, never by polling.

:class:`SequenceTable` is the bookkeeping as pure logic (every method takes ``now``), for
fake-clock unit tests; :class:`SequenceBatcher` owns the routing and the tensors, on a
:class:`~quiver.scheduling.core.SchedulerCore` that runs its workers and its idle timer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quiver.backends.base import ModelInstance
from quiver.clock import SYSTEM_CLOCK, Clock
from quiver.config import ModelConfig
from quiver.config.sequence import (
    CORRID,
    DEFAULT_MAX_IDLE_US,
    END,
    READY,
    START,
    SequenceSettings,
    sequence_settings,
    zeros,
)
from quiver.errors import InternalError, InvalidArgumentError, QuiverError
from quiver.metrics.statistics import ModelStatistics
from quiver.scheduling.core import CoreScheduler, ErrorFactory, Execution, SchedulerCore
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

CorrelationId = int | str

# ------------------------------------------------------------------------- bookkeeping


@dataclass(slots=True)
class SequenceItem:
    """One request of a sequence, waiting or running."""

    request: InferenceRequest
    future: asyncio.Future[InferenceResponse]
    enqueued_ns: int
    start: bool = False
    end: bool = False
    signature: tuple[Any, ...] = ()


#: A slot: (instance index, slot index) with ``direct``; (-1, n) with ``oldest``.
Slot = tuple[int, int]


@dataclass(slots=True)
class Sequence:
    correlation_id: CorrelationId
    last_active_ns: int
    slot: Slot | None = None
    queue: deque[SequenceItem] = field(default_factory=deque)
    busy: bool = False  # one of its requests is executing
    open: bool = True  # its last admitted request was not END
    state: dict[str, Any] = field(default_factory=dict)  # state input name -> numpy array


@dataclass(slots=True)
class SequenceTable:
    """Sequences, their slots, the backlog and batch forming, as pure logic.

    ``instances`` x ``slots_per_instance`` slots with ``direct``; ``capacity`` candidate
    places with ``oldest`` (0: unlimited).
    """

    model: str
    strategy: str = "direct"
    instances: int = 1
    slots_per_instance: int = 1
    capacity: int = 0
    max_batch_size: int = 0
    max_idle_ns: int = DEFAULT_MAX_IDLE_US * 1000
    max_queue_delay_ns: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    sequences: dict[CorrelationId, Sequence] = field(default_factory=dict)
    backlog: deque[Sequence] = field(default_factory=deque)
    free: list[Slot] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.strategy == "direct":
            self.free = [
                (instance, slot)
                for slot in range(self.slots_per_instance)
                for instance in range(self.instances)
            ]
        else:
            self.free = [(-1, n) for n in range(self.capacity)]

    # -- admission -----------------------------------------------------------------------

    def admit(self, cid: CorrelationId, item: SequenceItem, now: int) -> Sequence:
        """Queue ``item`` on its sequence; a START begins (or restarts) it.

        Raises INVALID_ARG for a request without START for a sequence not in flight.
        """
        sequence = self.sequences.get(cid)
        if item.start:
            if sequence is None:
                sequence = Sequence(cid, now)
                self.sequences[cid] = sequence
                self._place(sequence)
        elif sequence is None or not sequence.open:
            raise InvalidArgumentError(
                f"inference request for sequence {cid} to model '{self.model}' must specify the "
                "START flag on the first request of the sequence"
            )
        sequence.open = not item.end
        sequence.queue.append(item)
        sequence.last_active_ns = now
        return sequence

    def _place(self, sequence: Sequence) -> None:
        if self.strategy == "oldest" and not self.capacity:
            sequence.slot = (-1, 0)  # unlimited candidates
            return
        if not self.free:
            self.backlog.append(sequence)
            return
        if self.strategy == "direct":
            # The least loaded instance, then the lowest slot.
            load = [0] * self.instances
            for other in self.sequences.values():
                if other.slot is not None:
                    load[other.slot[0]] += 1
            best = min(self.free, key=lambda s: (load[s[0]], s[1], s[0]))
            self.free.remove(best)
        else:
            best = self.free.pop(0)
        sequence.slot = best

    def release(self, sequence: Sequence) -> list[Sequence]:
        """Forget ``sequence`` and free its slot; returns backlog sequences that got one."""
        if self.sequences.get(sequence.correlation_id) is sequence:
            del self.sequences[sequence.correlation_id]
        if sequence in self.backlog:
            self.backlog.remove(sequence)
        slot, sequence.slot = sequence.slot, None
        sequence.state.clear()
        placed: list[Sequence] = []
        if slot is None or (slot[0] == -1 and not self.capacity):
            return placed
        self.free.append(slot)
        while self.backlog and self.free:
            waiting = self.backlog.popleft()
            self._place(waiting)
            placed.append(waiting)
        return placed

    # -- idle expiry ---------------------------------------------------------------------

    def _idle(self, sequence: Sequence) -> bool:
        return sequence.slot is not None and not sequence.busy and not sequence.queue

    def expire(self, now: int) -> list[Sequence]:
        """Release sequences idle for ``max_idle_ns`` or longer; returns them."""
        expired = [
            s
            for s in self.sequences.values()
            if self._idle(s) and now - s.last_active_ns >= self.max_idle_ns
        ]
        for sequence in expired:
            self.release(sequence)
        return expired

    def next_expiry(self) -> int:
        """When the next idle sequence expires (0: none idle)."""
        times = [s.last_active_ns + self.max_idle_ns for s in self.sequences.values() if self._idle(s)]
        return min(times) if times else 0

    # -- batch forming -------------------------------------------------------------------

    def form(self, instance: int, now: int) -> tuple[list[tuple[Sequence, SequenceItem]] | None, int]:
        """The batch for a free ``instance`` to run now, or ``(None, wake_at)`` (0: on news).

        Taken items leave their queues and their sequences become busy until :meth:`done`.
        """
        if self.strategy == "direct":
            return self._form_direct(instance, now)
        return self._form_oldest(now)

    def _ready(self, sequence: Sequence) -> bool:
        return sequence.slot is not None and not sequence.busy and bool(sequence.queue)

    def _form_direct(self, instance: int, now: int) -> tuple[list[tuple[Sequence, SequenceItem]] | None, int]:
        mine = [s for s in self.sequences.values() if s.slot is not None and s.slot[0] == instance]
        ready = sorted((s for s in mine if self._ready(s)), key=lambda s: s.slot or (0, 0))
        if not ready:
            return None, 0
        if self.max_queue_delay_ns and len(ready) < len(mine):
            oldest = min(s.queue[0].enqueued_ns for s in ready)
            ready_at = oldest + self.max_queue_delay_ns
            if now < ready_at:
                return None, ready_at
        return self._take(ready), 0

    def _form_oldest(self, now: int) -> tuple[list[tuple[Sequence, SequenceItem]] | None, int]:
        ready = sorted(
            (s for s in self.sequences.values() if self._ready(s)), key=lambda s: s.queue[0].enqueued_ns
        )
        if not ready:
            return None, 0
        limit = max(self.max_batch_size, 1)
        head = ready[0].queue[0]
        alike = [s for s in ready if s.queue[0].signature == head.signature]
        chosen = alike[:limit]
        if len(chosen) == limit:
            return self._take(chosen), 0
        best = max((p for p in self.preferred_batch_sizes if p <= len(chosen)), default=0)
        if best:
            return self._take(chosen[:best]), 0
        if self.max_queue_delay_ns:
            ready_at = head.enqueued_ns + self.max_queue_delay_ns
            if now < ready_at:
                return None, ready_at
        return self._take(chosen), 0

    @staticmethod
    def _take(sequences: list[Sequence]) -> list[tuple[Sequence, SequenceItem]]:
        batch = []
        for sequence in sequences:
            sequence.busy = True
            batch.append((sequence, sequence.queue.popleft()))
        return batch

    def done(self, sequence: Sequence, item: SequenceItem, now: int) -> list[Sequence]:
        """``item`` of ``sequence`` finished; an END with nothing after it releases the
        sequence. Returns backlog sequences that got a slot."""
        sequence.busy = False
        sequence.last_active_ns = now
        if item.end and not sequence.queue:
            return self.release(sequence)
        return []

    def drain(self) -> list[SequenceItem]:
        """Every queued item (for failing them when the model stops); sequences released."""
        left = [item for s in self.sequences.values() for item in s.queue]
        for sequence in self.sequences.values():
            sequence.queue.clear()
            sequence.state.clear()
        self.sequences.clear()
        self.backlog.clear()
        return left


# ------------------------------------------------------------------------- the batcher


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1")
    return bool(value)


def correlation_id(params: dict[str, Any]) -> CorrelationId | None:
    """The request's ``sequence_id``; None when absent, 0 or empty (Triton: no id)."""
    value = params.get("sequence_id")
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value & 0xFFFF_FFFF_FFFF_FFFF or None
    if isinstance(value, str):
        return value or None
    if isinstance(value, float) and value.is_integer():
        return int(value) or None
    return None


class SequenceBatcher(CoreScheduler):
    """The Scheduler for models with ``sequence_batching``: one worker task per instance."""

    queueing = False  # requests of a sequence run even if their client left: state must advance

    def __init__(
        self,
        config: ModelConfig,
        instances: list[ModelInstance],
        stats: ModelStatistics,
        settings: SequenceSettings,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{config.name}' has no instances to schedule on")
        self._model = config.name
        self._settings = settings
        self._batching = config.max_batch_size > 0
        self._declared_outputs = set(config.output_map)
        self._state_outputs = settings.state_outputs
        self.table = SequenceTable(
            config.name,
            strategy=settings.strategy,
            instances=len(instances),
            slots_per_instance=max(config.max_batch_size, 1),
            capacity=settings.max_candidate_sequences,
            max_batch_size=config.max_batch_size,
            max_idle_ns=settings.max_idle_ns,
            max_queue_delay_ns=settings.max_queue_delay_ns,
            preferred_batch_sizes=settings.preferred_batch_sizes,
        )
        self._core = core = SchedulerCore(f"model '{config.name}'", stats, clock)
        core.use_workers(
            instances,
            name=f"quiver-sequence-{config.name}",
            next_batch=self._next_batch,
            execute=self._execute,
            futures=lambda batch: (item.future for _, item in batch),
            fail_queued=self._fail_queued,
            finished=self._finished,
            on_alarm=self._on_alarm,
        )

    # -- requests ------------------------------------------------------------------------

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        core = self._core
        core.open()
        params = request.parameters
        cid = correlation_id(params)
        if cid is None:
            raise core.reject(
                InvalidArgumentError(
                    f"inference request to model '{self._model}' must specify a non-zero or "
                    "non-empty correlation ID"
                )
            )
        inputs = request.inputs
        if self._batching and inputs and inputs[0].shape[0] != 1:
            raise core.reject(
                InvalidArgumentError(
                    f"inference request to model '{self._model}' must specify batch-size 1 due to "
                    "requirements of sequence batcher"
                )
            )
        for control in self._settings.controls:
            if control.kind == CORRID and isinstance(cid, str) and control.datatype is not DataType.BYTES:
                raise core.reject(
                    InvalidArgumentError(
                        f"inference request for sequence {cid} to model '{self._model}': the "
                        f"correlation ID is a string but control input '{control.name}' is "
                        f"{control.datatype.config_name}"
                    )
                )
        now = core.clock.now()
        self._expire(now)
        signature = tuple((t.name, t.datatype, t.shape[1:]) for t in inputs) if self._batching else ()
        future: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()
        item = SequenceItem(
            request,
            future,
            now,
            start=_flag(params.get("sequence_start", False)),
            end=_flag(params.get("sequence_end", False)),
            signature=signature,
        )
        try:
            self.table.admit(cid, item, now)
        except QuiverError as error:
            raise core.reject(error) from None
        # A caller that leaves leaves its item queued: the sequence's state must advance.
        with core.accept(now):
            core.wake_all()
            return await future

    def _expire(self, now: int) -> None:
        for sequence in self.table.expire(now):
            logger.debug(
                "model '%s': sequence %s idle for over %d us, released",
                self._model,
                sequence.correlation_id,
                self._settings.max_idle_ns // 1000,
            )

    def _on_alarm(self) -> None:
        self._expire(self._core.clock.now())
        self._core.wake_all()

    # -- workers -------------------------------------------------------------------------

    async def _next_batch(self, index: int) -> list[tuple[Sequence, SequenceItem]] | None:
        core = self._core
        table = self.table
        while True:
            if core.stopping:
                return None
            now = core.clock.now()
            self._expire(now)
            batch, wake_at = table.form(index, now)
            if batch:
                core.wake_all()  # another instance may find work too
                return batch
            for when in (wake_at, table.next_expiry()):
                if when:
                    core.alarm.at(when)
            await core.wait_for_work()

    def _finished(self, batch: list[tuple[Sequence, SequenceItem]]) -> None:
        now = self._core.clock.now()
        for sequence, item in batch:
            self.table.done(sequence, item, now)
        self._core.wake_all()

    # -- tensors -------------------------------------------------------------------------

    def _shape(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        return (1, *dims) if self._batching else dims

    def _prepare(self, sequence: Sequence, item: SequenceItem) -> InferenceRequest:
        """The request as the model sees it: control and state inputs added."""
        request = item.request
        settings = self._settings
        if not settings.controls and not settings.states:
            return request
        extra: list[Tensor] = []
        shape = self._shape((1,))
        for control in settings.controls:
            if control.kind == CORRID:
                cid = sequence.correlation_id
                if control.datatype is DataType.BYTES:
                    data = np.empty(shape, dtype=np.object_)
                    data.fill(str(cid).encode("utf-8"))
                else:
                    data = np.full(shape, cid, dtype=control.datatype.numpy_dtype)
            else:
                flag = {START: item.start, END: item.end, READY: True}[control.kind]
                data = np.full(shape, control.values[1 if flag else 0], control.datatype.numpy_dtype)
            extra.append(Tensor(control.name, control.datatype, shape, data))
        if item.start:
            sequence.state.clear()
        for state in settings.states:
            array = sequence.state.get(state.input_name)
            if array is None:
                initial = state.initial
                if initial is None:
                    initial = zeros(state.datatype, tuple(1 if d == -1 else d for d in state.dims))
                array = initial.reshape(self._shape(initial.shape))
            extra.append(Tensor(state.input_name, state.datatype, tuple(array.shape), array))
        return dataclasses.replace(request, inputs=[*request.inputs, *extra])

    def _keep_state(self, sequence: Sequence, response: InferenceResponse) -> None:
        """Take the output states out of ``response`` into ``sequence``."""
        if not self._state_outputs:
            return
        kept: list[Tensor] = []
        for tensor in response.outputs:
            state = self._state_outputs.get(tensor.name)
            if state is None:
                kept.append(tensor)
                continue
            data = tensor.data
            if state.datatype is not DataType.BYTES and data.dtype != state.datatype.numpy_dtype:
                data = data.astype(state.datatype.numpy_dtype)
            sequence.state[state.input_name] = np.array(data, copy=True).reshape(tensor.shape)
            if tensor.name in self._declared_outputs:
                kept.append(tensor)  # also a configured output: the client may ask for it
        response.outputs = kept

    async def _execute(self, instance: ModelInstance, batch: list[tuple[Sequence, SequenceItem]]) -> None:
        core = self._core
        dispatched = core.clock.now()
        try:
            requests = [self._prepare(sequence, item) for sequence, item in batch]
        except Exception as exc:
            raise InternalError(f"model '{self._model}': preparing sequence inputs failed: {exc}") from exc
        execution = await Execution.run(instance, requests, len(batch), core.stats, core.clock, dispatched)
        for (sequence, item), result in zip(batch, execution.results, strict=True):
            if not isinstance(result, QuiverError):
                self._keep_state(sequence, result)  # even if its client left: the state advances
            execution.answer(item.future, result, item.enqueued_ns)

    def _fail_queued(self, error: ErrorFactory) -> None:
        now = self._core.clock.now()
        for item in self.table.drain():
            if not item.future.done():
                self._core.stats.record_failure(now - item.enqueued_ns, "REJECTED")
                item.future.set_exception(error())


def create_sequence_batcher(
    config: ModelConfig,
    instances: list[ModelInstance],
    stats: ModelStatistics,
    *,
    version_dir: Path | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> SequenceBatcher:
    return SequenceBatcher(config, instances, stats, sequence_settings(config, version_dir), clock=clock)
