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
fake-clock unit tests; :class:`SequenceBatcher` owns the waiting, the workers and the tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as pb

from quiver.backends.base import ModelInstance
from quiver.config import ModelConfig
from quiver.errors import (
    ConfigError,
    InternalError,
    InvalidArgumentError,
    QuiverError,
    UnavailableError,
    UnsupportedError,
)
from quiver.metrics.statistics import ModelStatistics
from quiver.types import DataType, InferenceRequest, InferenceResponse, Tensor

logger = logging.getLogger(__name__)

Clock = Callable[[], int]
CorrelationId = int | str

#: Triton's default for ``max_sequence_idle_microseconds``.
DEFAULT_MAX_IDLE_US = 1_000_000

_Kind = pb.ModelSequenceBatching.Control
START = _Kind.CONTROL_SEQUENCE_START
END = _Kind.CONTROL_SEQUENCE_END
READY = _Kind.CONTROL_SEQUENCE_READY
CORRID = _Kind.CONTROL_SEQUENCE_CORRID
_KIND_NAMES = {START: "START", END: "END", READY: "READY", CORRID: "CORRID"}
_CORRID_TYPES = (DataType.UINT64, DataType.INT64, DataType.UINT32, DataType.INT32, DataType.BYTES)


# ----------------------------------------------------------------------- configuration


@dataclass(frozen=True, slots=True)
class ControlSpec:
    """One control input: the tensor ``name`` carries ``kind`` as ``values[False/True]``."""

    name: str
    kind: int
    datatype: DataType
    values: tuple[Any, Any] = (0, 1)


@dataclass(frozen=True, slots=True)
class StateSpec:
    input_name: str
    output_name: str
    datatype: DataType
    dims: tuple[int, ...]
    initial: Any = None  # numpy array (without the batch dimension), or None for zeros


@dataclass(frozen=True, slots=True)
class SequenceSettings:
    """A validated ``sequence_batching`` section."""

    strategy: str = "direct"  # or "oldest"
    max_idle_ns: int = DEFAULT_MAX_IDLE_US * 1000
    max_queue_delay_ns: int = 0
    max_candidate_sequences: int = 0  # oldest; 0: unlimited
    preferred_batch_sizes: tuple[int, ...] = ()
    controls: tuple[ControlSpec, ...] = ()
    states: tuple[StateSpec, ...] = ()

    @property
    def injected_inputs(self) -> dict[str, DataType]:
        """Inputs the batcher adds to every request (the model has them, the config's
        ``input`` list does not)."""
        names = {c.name: c.datatype for c in self.controls}
        names.update({s.input_name: s.datatype for s in self.states})
        return names

    @property
    def state_outputs(self) -> dict[str, StateSpec]:
        return {s.output_name: s for s in self.states}


def _datatype(value: int) -> DataType:
    return DataType.from_config(pb.DataType.Name(value))


def sequence_settings(config: ModelConfig, version_dir: Path | None = None) -> SequenceSettings:
    """Validate the ``sequence_batching`` section; errors name the model and the field.

    ``version_dir`` is where ``initial_state { data_file }`` files are read from (its
    ``initial_state`` folder, as in Triton); without it such files are not read.
    """
    proto = config.proto.sequence_batching
    model = config.name
    where = f"model '{model}': sequence_batching"
    if proto.iterative_sequence:
        raise UnsupportedError(f"{where}.iterative_sequence is not supported")
    which = proto.WhichOneof("strategy_choice")
    strategy = which or "direct"
    idle_us = int(proto.max_sequence_idle_microseconds) or DEFAULT_MAX_IDLE_US
    delay_ns = 0
    candidates = 0
    preferred: tuple[int, ...] = ()
    if which == "direct":
        delay_ns = int(proto.direct.max_queue_delay_microseconds) * 1000
    elif which == "oldest":
        oldest = proto.oldest
        delay_ns = int(oldest.max_queue_delay_microseconds) * 1000
        candidates = int(oldest.max_candidate_sequences)
        if candidates < 0:
            raise ConfigError(f"{where}.oldest.max_candidate_sequences must be >= 0, got {candidates}")
        limit = max(config.max_batch_size, 1)
        for size in oldest.preferred_batch_size:
            if not 1 <= size <= limit:
                raise ConfigError(
                    f"{where}.oldest.preferred_batch_size {size} must be in 1..max_batch_size ({limit})"
                )
        preferred = tuple(sorted(set(oldest.preferred_batch_size)))

    taken: set[str] = set()

    def claim(name: str, field_name: str) -> None:
        if not name:
            raise ConfigError(f"{where}.{field_name}: 'name' is missing")
        if name in config.input_map:
            raise ConfigError(
                f"{where}.{field_name}: '{name}' is also a model input; control and state "
                "inputs must not be listed in 'input'"
            )
        if name in taken:
            raise ConfigError(f"{where}.{field_name}: tensor '{name}' is used twice")
        taken.add(name)

    controls: list[ControlSpec] = []
    kinds_seen: set[int] = set()
    for index, entry in enumerate(proto.control_input):
        field_name = f"control_input[{index}]"
        claim(entry.name, field_name)
        if len(entry.control) != 1:
            raise ConfigError(
                f"{where}.{field_name} ('{entry.name}') must have exactly one 'control', "
                f"has {len(entry.control)}"
            )
        control = entry.control[0]
        kind = int(control.kind)
        if kind not in _KIND_NAMES:
            raise ConfigError(f"{where}.{field_name}.control: unknown control kind {kind}")
        if kind in kinds_seen:
            raise ConfigError(
                f"{where}.{field_name}: control CONTROL_SEQUENCE_{_KIND_NAMES[kind]} is given twice"
            )
        kinds_seen.add(kind)
        if kind == CORRID:
            if control.data_type == pb.TYPE_INVALID:
                raise ConfigError(
                    f"{where}.{field_name}.control: CONTROL_SEQUENCE_CORRID needs a 'data_type'"
                )
            datatype = _datatype(control.data_type)
            if datatype not in _CORRID_TYPES:
                raise ConfigError(
                    f"{where}.{field_name}.control: CONTROL_SEQUENCE_CORRID 'data_type' must be "
                    f"TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING, got "
                    f"{datatype.config_name}"
                )
            controls.append(ControlSpec(entry.name, kind, datatype))
            continue
        given = [
            (label, values, datatype)
            for label, values, datatype in (
                ("int32_false_true", tuple(control.int32_false_true), DataType.INT32),
                ("fp32_false_true", tuple(control.fp32_false_true), DataType.FP32),
                ("bool_false_true", tuple(control.bool_false_true), DataType.BOOL),
            )
            if values
        ]
        name = f"CONTROL_SEQUENCE_{_KIND_NAMES[kind]}"
        if len(given) != 1:
            raise ConfigError(
                f"{where}.{field_name}.control: {name} needs exactly one of int32_false_true, "
                "fp32_false_true or bool_false_true (the data type comes from it)"
            )
        label, values, datatype = given[0]
        if len(values) != 2:
            raise ConfigError(
                f"{where}.{field_name}.control: {label} must have 2 values (false, true), "
                f"has {len(values)}"
            )
        controls.append(ControlSpec(entry.name, kind, datatype, (values[0], values[1])))

    states: list[StateSpec] = []
    outputs_seen: set[str] = set()
    for index, entry in enumerate(proto.state):
        field_name = f"state[{index}]"
        claim(entry.input_name, f"{field_name}.input_name")
        if not entry.output_name:
            raise ConfigError(f"{where}.{field_name}: 'output_name' is missing")
        if entry.output_name in outputs_seen or entry.output_name in config.input_map:
            raise ConfigError(f"{where}.{field_name}.output_name: '{entry.output_name}' is used twice")
        outputs_seen.add(entry.output_name)
        if entry.data_type == pb.TYPE_INVALID:
            raise ConfigError(
                f"{where}.{field_name} ('{entry.input_name}'): 'data_type' is missing"
            )
        datatype = _datatype(entry.data_type)
        dims = tuple(int(d) for d in entry.dims)
        if not dims or any(d == 0 or d < -1 for d in dims):
            raise ConfigError(
                f"{where}.{field_name} ('{entry.input_name}'): 'dims' {list(dims)} must be "
                "non-empty, each dimension >= 1 or -1"
            )
        initial = None
        if entry.initial_state:
            if len(entry.initial_state) > 1:
                raise ConfigError(
                    f"{where}.{field_name}.initial_state: only one initial state is supported"
                )
            initial = _initial_state(
                entry.initial_state[0], datatype, dims, f"{where}.{field_name}.initial_state", version_dir
            )
        states.append(StateSpec(entry.input_name, entry.output_name, datatype, dims, initial))
    return SequenceSettings(
        strategy=strategy,
        max_idle_ns=idle_us * 1000,
        max_queue_delay_ns=delay_ns,
        max_candidate_sequences=candidates,
        preferred_batch_sizes=preferred,
        controls=tuple(controls),
        states=tuple(states),
    )


def _initial_state(
    proto: Any, datatype: DataType, dims: tuple[int, ...], where: str, version_dir: Path | None
) -> Any:
    if proto.data_type != pb.TYPE_INVALID and _datatype(proto.data_type) is not datatype:
        raise ConfigError(
            f"{where}: 'data_type' {pb.DataType.Name(proto.data_type)} differs from the "
            f"state's {datatype.config_name}"
        )
    shape = tuple(int(d) for d in proto.dims)
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"{where}: 'dims' {list(shape)} must be fully specified (each >= 1)")
    if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape, strict=True)):
        raise ConfigError(f"{where}: 'dims' {list(shape)} do not fit the state's dims {list(dims)}")
    which = proto.WhichOneof("state_data")
    if which == "data_file":
        if datatype is DataType.BYTES:
            raise ConfigError(f"{where}: 'data_file' for a TYPE_STRING state is not supported")
        if version_dir is None:
            return np.zeros(shape, datatype.numpy_dtype)  # validation only, no files at hand
        folder = (version_dir / "initial_state").resolve()
        path = (folder / proto.data_file).resolve()
        if not path.is_relative_to(folder) or not path.is_file():
            raise ConfigError(f"{where}: 'data_file' {proto.data_file} not found in {folder}")
        raw = path.read_bytes()
        want = math.prod(shape) * datatype.itemsize
        if len(raw) != want:
            raise ConfigError(
                f"{where}: 'data_file' {proto.data_file} has {len(raw)} bytes, the state needs {want}"
            )
        return np.frombuffer(raw, dtype=datatype.numpy_dtype).reshape(shape).copy()
    return _zeros(datatype, shape)


def _zeros(datatype: DataType, shape: tuple[int, ...]) -> Any:
    if datatype is DataType.BYTES:
        array = np.empty(shape, dtype=np.object_)
        array.fill(b"")
        return array
    return np.zeros(shape, datatype.numpy_dtype)


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


class SequenceBatcher:
    """The Scheduler for models with ``sequence_batching``: one worker task per instance."""

    queueing = False  # requests of a sequence run even if their client left: state must advance

    def __init__(
        self,
        config: ModelConfig,
        instances: list[ModelInstance],
        stats: ModelStatistics,
        settings: SequenceSettings,
        *,
        clock: Clock = time.monotonic_ns,
    ) -> None:
        if not instances:
            raise InternalError(f"model '{config.name}' has no instances to schedule on")
        self._model = config.name
        self._instances = instances
        self._stats = stats
        self._settings = settings
        self._batching = config.max_batch_size > 0
        self._declared_outputs = set(config.output_map)
        self._state_outputs = settings.state_outputs
        self._clock = clock
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
        self._inflight = 0
        self._stopping = False
        self._idle_workers: deque[asyncio.Future[None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._workers: list[asyncio.Task[None]] = []
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def inflight(self) -> int:
        return self._inflight

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._workers = [
            loop.create_task(self._work(index, instance), name=f"quiver-sequence-{self._model}-{index}")
            for index, instance in enumerate(self._instances)
        ]
        return loop

    # -- requests ------------------------------------------------------------------------

    def _reject(self, message: str) -> InvalidArgumentError:
        self._stats.record_failure(0, "REJECTED")
        return InvalidArgumentError(message)

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        if self._stopping:
            self._stats.record_failure(0, "REJECTED")
            raise UnavailableError(f"model '{self._model}' is unloading")
        loop = self._loop or self._start()
        params = request.parameters
        cid = correlation_id(params)
        if cid is None:
            raise self._reject(
                f"inference request to model '{self._model}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        inputs = request.inputs
        if self._batching and inputs and inputs[0].shape[0] != 1:
            raise self._reject(
                f"inference request to model '{self._model}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )
        for control in self._settings.controls:
            if control.kind == CORRID and isinstance(cid, str) and control.datatype is not DataType.BYTES:
                raise self._reject(
                    f"inference request for sequence {cid} to model '{self._model}': the "
                    f"correlation ID is a string but control input '{control.name}' is "
                    f"{control.datatype.config_name}"
                )
        now = self._clock()
        self._expire(now)
        signature = tuple((t.name, t.datatype, t.shape[1:]) for t in inputs) if self._batching else ()
        future: asyncio.Future[InferenceResponse] = loop.create_future()
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
        except QuiverError:
            self._stats.record_failure(0, "REJECTED")
            raise
        self._inflight += 1
        self._stats.pending += 1
        self._wake_all()
        try:
            return await future
        except asyncio.CancelledError:
            # The item stays queued: the sequence's state must still advance through it.
            self._stats.record_failure(self._clock() - now, "CANCELED")
            raise
        finally:
            self._inflight -= 1
            self._stats.pending -= 1
            if self._inflight == 0 and self._idle is not None:
                self._idle.set()

    def _expire(self, now: int) -> None:
        for sequence in self.table.expire(now):
            logger.debug(
                "model '%s': sequence %s idle for over %d us, released",
                self._model,
                sequence.correlation_id,
                self._settings.max_idle_ns // 1000,
            )

    # -- waking --------------------------------------------------------------------------

    def _wake_all(self) -> None:
        while self._idle_workers:
            waiter = self._idle_workers.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake_at(self, when: int) -> None:
        if self._timer is not None and self._timer_at <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = when
        self._timer = self._loop.call_later(max(0.0, (when - self._clock()) / 1e9), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = 0
        self._expire(self._clock())
        self._wake_all()

    # -- workers -------------------------------------------------------------------------

    async def _next_batch(self, index: int) -> list[tuple[Sequence, SequenceItem]] | None:
        loop = asyncio.get_running_loop()
        table = self.table
        while True:
            if self._stopping:
                return None
            now = self._clock()
            self._expire(now)
            batch, wake_at = table.form(index, now)
            if batch:
                self._wake_all()  # another instance may find work too
                return batch
            for when in (wake_at, table.next_expiry()):
                if when:
                    self._wake_at(when)
            waiter: asyncio.Future[None] = loop.create_future()
            self._idle_workers.append(waiter)
            await waiter

    async def _work(self, index: int, instance: ModelInstance) -> None:
        while True:
            batch = await self._next_batch(index)
            if batch is None:
                return
            try:
                await self._execute(instance, batch)
            except Exception:  # a bug here must not kill the worker and strand the queue
                logger.exception("model '%s': sequence batch execution failed", self._model)
                for _, item in batch:
                    if not item.future.done():
                        item.future.set_exception(
                            InternalError(f"model '{self._model}': batch execution failed")
                        )
            finally:
                now = self._clock()
                for sequence, item in batch:
                    self.table.done(sequence, item, now)
                self._wake_all()

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
                    initial = _zeros(state.datatype, tuple(1 if d == -1 else d for d in state.dims))
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
        clock = self._clock
        stats = self._stats
        dispatched = clock()
        try:
            requests = [self._prepare(sequence, item) for sequence, item in batch]
        except Exception as exc:
            raise InternalError(f"model '{self._model}': preparing sequence inputs failed: {exc}") from exc
        results = await instance.run(requests)
        done = clock()
        timing = instance.timing
        input_ns, infer_ns, output_ns = timing.input_ns, timing.infer_ns, timing.output_ns
        if not (input_ns or infer_ns or output_ns):
            infer_ns = done - dispatched
        stats.record_execution(len(batch), input_ns, infer_ns, output_ns)
        for (sequence, item), result in zip(batch, results, strict=True):
            if isinstance(result, QuiverError):
                if not item.future.done():
                    stats.record_failure(done - item.enqueued_ns, "BACKEND")
                    item.future.set_exception(result)
                continue
            self._keep_state(sequence, result)
            if item.future.done():
                continue  # its client left; the state advanced all the same
            stats.record_success(
                done - item.enqueued_ns,
                dispatched - item.enqueued_ns,
                input_ns,
                infer_ns,
                output_ns,
                1,
            )
            item.future.set_result(result)

    # -- stopping ------------------------------------------------------------------------

    async def stop(self) -> None:
        """Refuse new requests, fail the queued ones, let running executions finish."""
        self._stopping = True
        now = self._clock()
        for item in self.table.drain():
            if not item.future.done():
                self._stats.record_failure(now - item.enqueued_ns, "REJECTED")
                item.future.set_exception(UnavailableError(f"model '{self._model}' is unloading"))
        self._wake_all()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.table.drain()
        if self._inflight:
            self._idle = asyncio.Event()
            await self._idle.wait()


def create_sequence_batcher(
    config: ModelConfig,
    instances: list[ModelInstance],
    stats: ModelStatistics,
    *,
    version_dir: Path | None = None,
    clock: Clock = time.monotonic_ns,
) -> SequenceBatcher:
    return SequenceBatcher(config, instances, stats, sequence_settings(config, version_dir), clock=clock)
