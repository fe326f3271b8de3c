"""One sampled request's trace: the activities Triton records, on the steady clock.

A :class:`TraceGroup` is what one sampled top-level request collects (Triton's
``TraceManager::Trace``): its own :class:`Trace` and those of the requests it spawns (each
step of an ensemble gets a trace of its own, with a new id and the ensemble's id as its
``parent_id``). The frontend records its timestamps (``HTTP_RECV_START`` ...), the service
``REQUEST_START``, ``QUEUE_START`` and ``REQUEST_END``, the scheduler the compute ones;
when the frontend has answered it releases the group, which goes to the sink: the trace
file (``triton`` mode, :meth:`TraceGroup.to_json`) or OpenTelemetry spans.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson

from quiver.tracing.config import LEVEL_TENSORS, LEVEL_TIMESTAMPS
from quiver.types import DataType, Tensor

#: Trace ids, unique in the process, from 1 (Triton's core numbers its traces the same way).
_ids = itertools.count(1)

now = time.monotonic_ns  # Triton's trace timestamps: steady clock nanoseconds


class Trace:
    """One request's activities: (kind, payload) in the order they happened, where kind is
    ``"ts"`` (name, ns), ``"model"`` (name, version, request id) or ``"tensor"`` (activity,
    tensor)."""

    __slots__ = ("children", "events", "group", "id", "model_name", "model_version", "parent_id", "request_id")

    def __init__(self, group: TraceGroup, parent_id: int = 0) -> None:
        self.group = group
        self.id = next(_ids)
        self.parent_id = parent_id
        self.model_name = ""
        self.model_version = -1
        self.request_id = ""
        self.events: list[tuple[str, Any]] = []
        self.children: list[Trace] = []

    # -- recording ------------------------------------------------------------------------

    def capture(self, name: str, ns: int | None = None) -> None:
        """A named timestamp (``ns`` on the steady clock; now if not given)."""
        if self.group.level & LEVEL_TIMESTAMPS:
            self.events.append(("ts", (name, now() if ns is None else ns)))

    def start(self, model: str, version: str, request_id: str, ns: int) -> None:
        """REQUEST_START of a request for ``model`` (``version`` as requested; -1 for the
        policy's choice, as Triton reports it)."""
        self.model_name = model
        self.model_version = int(version) if version.lstrip("-").isdigit() else -1
        self.request_id = request_id
        if self.group.level & LEVEL_TIMESTAMPS:
            self.events.append(("model", None))
            self.events.append(("ts", ("REQUEST_START", ns)))

    def compute(self, start: int, input_ns: int, output_ns: int, end: int, outputs: Iterable[Tensor] = ()) -> None:
        """The execution that answered this request: from ``start`` to ``end``, of which the
        first ``input_ns`` prepared the inputs and the last ``output_ns`` the outputs."""
        group = self.group
        if group.level & LEVEL_TIMESTAMPS:
            input_end = min(start + input_ns, end)
            output_start = max(end - output_ns, input_end)
            self.events.extend(
                (
                    ("ts", ("COMPUTE_START", start)),
                    ("ts", ("COMPUTE_INPUT_END", input_end)),
                    ("ts", ("COMPUTE_OUTPUT_START", output_start)),
                    ("ts", ("COMPUTE_END", end)),
                )
            )
        if group.level & LEVEL_TENSORS:
            self.tensors("TENSOR_BACKEND_OUTPUT", outputs)

    def tensors(self, activity: str, tensors: Iterable[Tensor]) -> None:
        if self.group.level & LEVEL_TENSORS:
            self.events.extend(("tensor", (activity, t)) for t in tensors)

    @property
    def traces_tensors(self) -> bool:
        return bool(self.group.level & LEVEL_TENSORS)

    def spawn(self) -> Trace:
        """The trace of a request this one sends (an ensemble step): a new id, this one's
        id as its parent."""
        child = Trace(self.group, self.id)
        self.children.append(child)
        return child

    def release(self) -> None:
        """The frontend answered the top-level request: the group goes to its sink."""
        self.group.release()

    # -- reading --------------------------------------------------------------------------

    def timestamps(self) -> list[tuple[str, int]]:
        return [payload for kind, payload in self.events if kind == "ts"]

    def walk(self) -> Iterable[Trace]:
        yield self
        for child in self.children:
            yield from child.walk()

    def objects(self) -> list[dict[str, Any]]:
        """Triton's trace file objects for this trace alone, in the order recorded."""
        out: list[dict[str, Any]] = []
        for kind, payload in self.events:
            if kind == "ts":
                name, ns = payload
                out.append({"id": self.id, "timestamps": [{"name": name, "ns": ns}]})
            elif kind == "model":
                info: dict[str, Any] = {
                    "id": self.id,
                    "model_name": self.model_name,
                    "model_version": self.model_version,
                }
                if self.request_id:
                    info["request_id"] = self.request_id
                if self.parent_id:
                    info["parent_id"] = self.parent_id
                out.append(info)
            else:
                activity, tensor = payload
                out.append({"id": self.id, "activity": activity, "tensor": tensor_json(tensor)})
        return out


class TraceGroup:
    """A sampled top-level request's traces, released once to ``sink``."""

    __slots__ = ("carrier", "level", "released", "root", "setting", "sink", "started")

    def __init__(self, level: int, setting: Any, sink: Callable[[TraceGroup], None], carrier: Any = None) -> None:
        self.level = level
        self.setting = setting  # the TraceSetting that sampled it (it collects the result)
        self.sink = sink
        self.carrier = carrier  # OpenTelemetry: the context the client propagated, if any
        self.started = now()
        self.released = False
        self.root = Trace(self)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.sink(self)

    def to_json(self) -> bytes:
        """Every trace of the group as Triton's comma-separated objects, grouped by id."""
        objects = [o for t in sorted(self.root.walk(), key=lambda t: t.id) for o in t.objects()]
        return orjson.dumps(objects)[1:-1]  # the objects without the array's brackets


def tensor_json(tensor: Tensor) -> dict[str, str]:
    """Triton's TENSORS entry: data as comma-separated values (FP16/BF16 left empty, as
    Triton leaves them; BYTES elements quoted), shape and dtype as text."""
    data = tensor.data
    datatype = tensor.datatype
    if datatype in (DataType.FP16, DataType.BF16):
        text = ""
    elif datatype is DataType.BYTES:
        items = []
        for item in np.asarray(data, dtype=object).reshape(-1):
            raw = item if isinstance(item, bytes) else str(item).encode()
            items.append('"' + raw.decode("utf-8", "replace") + '"')
        text = ",".join(items)
    elif datatype is DataType.BOOL:
        text = ",".join("1" if v else "0" for v in np.asarray(data).reshape(-1).tolist())
    elif datatype in (DataType.FP32, DataType.FP64):
        text = ",".join(f"{v:g}" for v in np.asarray(data).reshape(-1).tolist())
    else:
        text = ",".join(str(v) for v in np.asarray(data).reshape(-1).tolist())
    return {
        "name": tensor.name,
        "data": text,
        "shape": ",".join(str(d) for d in tensor.shape),
        "dtype": datatype.value,
    }
