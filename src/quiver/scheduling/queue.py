"""The dynamic batcher's queue and batch-forming rules, as pure logic.

No event loop and no clock here: every method takes ``now`` (nanoseconds, monotonic), so
unit tests drive it with a fake clock. The :class:`~quiver.scheduling.dynamic.DynamicBatcher`
owns the waiting and the instances.

Rules, as Triton's dynamic batcher applies them:

- Requests wait in one FIFO per priority level (level 1 is served first); a request whose
  queue timeout passes is rejected (``REJECT``) or moved behind every level (``DELAY``).
- A batch starts at the oldest request of the best level and takes, in priority then arrival
  order, further requests with the same *signature* (input names, datatypes and non-batch
  shapes: such requests can be concatenated) while the rows fit ``max_batch_size``. Requests
  of another signature stay queued for a later batch.
- The batch goes at once when it is full, or as the largest preferred batch size its
  requests can make; otherwise it waits for more requests until the oldest request has
  waited ``max_queue_delay_microseconds``, then goes as it is.
- A request whose caller went away (its future is done) is dropped without compute.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from quiver.errors import UnavailableError
from quiver.types import InferenceRequest, InferenceResponse


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Triton's ``ModelQueuePolicy``; timeouts in nanoseconds, 0 meaning none."""

    max_queue_size: int = 0
    default_timeout_ns: int = 0
    allow_timeout_override: bool = False
    delay_on_timeout: bool = False  # timeout_action DELAY (else REJECT)


@dataclass(slots=True)
class PendingRequest:
    request: InferenceRequest
    future: asyncio.Future[InferenceResponse]
    rows: int
    signature: tuple[Any, ...]
    enqueued_ns: int
    deadline_ns: int = 0  # 0: no queue timeout
    level: int = 0  # index into the queue's levels; 0 is the highest priority
    delayed: bool = False
    dispatched_ns: int = 0

    @property
    def gone(self) -> bool:
        """The caller stopped waiting (cancelled) or it was already answered."""
        return self.future.done()


@dataclass(slots=True)
class BatchQueue:
    max_batch_size: int  # rows; 0 means the model does not batch (one request per batch)
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    policies: list[QueuePolicy] = field(default_factory=lambda: [QueuePolicy()])
    levels: list[deque[PendingRequest]] = field(default_factory=list)
    delayed: deque[PendingRequest] = field(default_factory=deque)
    size: int = 0

    def __post_init__(self) -> None:
        self.levels = [deque() for _ in self.policies]
        self.preferred_batch_sizes = tuple(
            sorted(p for p in self.preferred_batch_sizes if 0 < p <= max(self.max_batch_size, 1))
        )

    def __len__(self) -> int:
        return self.size

    @property
    def policy_free(self) -> bool:
        """Whether no queue policy acts on a waiting request (one level, no timeout, no
        override, no size limit): then a request may wait elsewhere (in an instance's own
        queue) as well as here. Triton's rule for prefetching requests."""
        return len(self.policies) == 1 and not any(
            p.max_queue_size or p.default_timeout_ns or p.allow_timeout_override for p in self.policies
        )

    # -- adding ------------------------------------------------------------------------

    def push(self, pending: PendingRequest, timeout_us: int | None = None) -> None:
        """Queue a request at its level; raises UNAVAILABLE when that level's queue is full."""
        policy = self.policies[pending.level]
        queue = self.levels[pending.level]
        if policy.max_queue_size and len(queue) >= policy.max_queue_size:
            # Requests whose callers left do not hold places in the queue.
            live = deque(p for p in queue if not p.gone)
            self.size -= len(queue) - len(live)
            self.levels[pending.level] = queue = live
        if policy.max_queue_size and len(queue) >= policy.max_queue_size:
            raise UnavailableError(
                f"model '{pending.request.model_name}': request rejected, the queue of "
                f"priority level {pending.level + 1} is full ({policy.max_queue_size} requests)"
            )
        timeout_ns = policy.default_timeout_ns
        if timeout_us is not None and policy.allow_timeout_override:
            timeout_ns = timeout_us * 1000
        if timeout_ns:
            pending.deadline_ns = pending.enqueued_ns + timeout_ns
        queue.append(pending)
        self.size += 1

    # -- timeouts ----------------------------------------------------------------------

    def expire(self, now: int) -> list[PendingRequest]:
        """Requests whose queue timeout passed with REJECT; DELAY ones move behind every level."""
        rejected: list[PendingRequest] = []
        for index, queue in enumerate(self.levels):
            if not any(p.deadline_ns and p.deadline_ns <= now for p in queue):
                continue
            policy = self.policies[index]
            keep: deque[PendingRequest] = deque()
            for pending in queue:
                if pending.deadline_ns and pending.deadline_ns <= now:
                    if policy.delay_on_timeout:
                        pending.delayed = True
                        pending.deadline_ns = 0
                        self.delayed.append(pending)
                    else:
                        rejected.append(pending)
                        self.size -= 1
                else:
                    keep.append(pending)
            self.levels[index] = keep
        return rejected

    def next_deadline(self) -> int:
        """The earliest queue timeout still pending (0: none)."""
        deadlines = [p.deadline_ns for q in self.levels for p in q if p.deadline_ns]
        return min(deadlines) if deadlines else 0

    # -- forming -----------------------------------------------------------------------

    def _drop_gone(self) -> None:
        for queue in (*self.levels, self.delayed):
            while queue and queue[0].gone:
                queue.popleft()
                self.size -= 1

    def _ordered(self) -> list[deque[PendingRequest]]:
        return [*self.levels, self.delayed]

    def form(self, now: int) -> tuple[list[PendingRequest] | None, int]:
        """The batch to run now, or ``(None, wake_at)``: when to look again (0: on new requests).

        Taken requests leave the queue.
        """
        self._drop_gone()
        queues = self._ordered()
        head = next((q[0] for q in queues if q), None)
        if head is None:
            return None, 0
        if self.max_batch_size <= 0:
            return self._take([head]), 0

        limit = self.max_batch_size
        chosen: list[PendingRequest] = []
        rows = 0
        full = False
        for queue in queues:
            for pending in queue:
                if pending.gone or pending.signature != head.signature:
                    continue
                if rows + pending.rows > limit:
                    full = True
                    break
                chosen.append(pending)
                rows += pending.rows
                if rows == limit:
                    full = True
                    break
            if full:
                break

        if full:
            return self._take(chosen), 0
        if self.preferred_batch_sizes:
            # The largest preferred size that a prefix of the candidates reaches exactly.
            prefix = best = 0
            for index, pending in enumerate(chosen):
                prefix += pending.rows
                if prefix in self.preferred_batch_sizes:
                    best = index + 1
            if best:
                return self._take(chosen[:best]), 0
        if not self.max_queue_delay_ns:
            return self._take(chosen), 0
        ready_at = head.enqueued_ns + self.max_queue_delay_ns
        if now >= ready_at:
            return self._take(chosen), 0
        return None, ready_at

    def _take(self, batch: list[PendingRequest]) -> list[PendingRequest]:
        taken = {id(p) for p in batch}
        for index, queue in enumerate(self.levels):
            if any(id(p) in taken for p in queue):
                self.levels[index] = deque(p for p in queue if id(p) not in taken)
        if any(id(p) in taken for p in self.delayed):
            self.delayed = deque(p for p in self.delayed if id(p) not in taken)
        self.size -= len(batch)
        return batch

    def drain(self) -> list[PendingRequest]:
        """Everything still queued (for failing it when the model stops)."""
        left = [p for q in self._ordered() for p in q]
        for queue in self.levels:
            queue.clear()
        self.delayed.clear()
        self.size = 0
        return left
