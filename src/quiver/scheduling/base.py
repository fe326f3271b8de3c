"""The Scheduler protocol: Triton's three verbs."""

from __future__ import annotations

from typing import Protocol

from quiver.types import InferenceRequest, InferenceResponse


class Scheduler(Protocol):
    #: Whether requests may wait in a queue before they run (frontends then watch for
    #: clients that go away, to take their requests out of the queue).
    queueing: bool

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        """Run ``request`` on some instance; raises a QuiverError on failure."""
        ...

    @property
    def inflight(self) -> int:
        """Requests accepted and not yet answered."""
        ...

    async def stop(self) -> None:
        """Refuse new requests, wait for the accepted ones to finish."""
        ...
