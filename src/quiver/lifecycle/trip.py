"""A miss in one trip to a load thread.

A request for a model folder that is not loaded used to go to a load thread twice: once to
find the folder and inspect its files (fingerprint, config, size), back to the event loop to
reserve its predicted size in the memory budget, then again to load it. Each trip costs two
wake-ups across cores (0.1-0.3 ms on a busy virtual machine). :func:`find_and_load` makes it
one when nothing needs the event loop in between: the model is not an ensemble (whose
composing models load first), no GPU limit applies, its framework has been primed, and its
predicted size fits in the budget's free bytes (the ledger is thread-safe: reserving free
bytes is the same decision on any thread). Then the reservation is made and the model loaded
(measured, or shared when its size is known) on the same thread, and the event loop does the
bookkeeping once (:func:`settle_trip`). Otherwise the trip stops after the
inspection and the load goes the usual way (:meth:`AdmissionControl.load`: evictions, waits
for pinned models, priming), with the inspection taken.

Every guarantee holds as on the usual way: the model's lock is held by the caller across the
trip (one load per model), the size is reserved before the load starts and a measurement
above it is covered before the model serves, nothing is evicted in the trip, and the
reservation is given back on the event loop when the load fails or is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quiver.lifecycle.budget import Admission, OutOfMemoryError
from quiver.lifecycle.clock import seconds
from quiver.lifecycle.loader import LoadOutcome
from quiver.lifecycle.memory import ModelIdentity, Prediction
from quiver.repository.local import ModelSource

if TYPE_CHECKING:
    from quiver.lifecycle.admission import AdmissionControl, Inspection, Unloader

__all__ = ["Trip", "find_and_load", "settle_trip", "settle_trip_now"]


@dataclass(slots=True)
class Trip:
    """What one trip did, for the model ``name``: the folder found (``None``: no model folder
    of that name), its files' inspection, whether it went on to load the model (``loads``) and then: the prediction
    reserved (``reserved``: the event loop settles or cancels that reservation), the outcome or
    the load's ``error``, the bytes measured (``how``: "known" when its size was, else how it
    was measured), when the load started and how long it took."""

    name: str = ""
    source: ModelSource | None = None
    inspection: Inspection | None = None
    loads: bool = False
    reserved: bool = False
    error: Exception | None = None
    prediction: Prediction | None = None
    outcome: LoadOutcome | None = None
    measured: int = 0
    how: str = "known"
    started: float = 0.0
    load_seconds: float = 0.0
    #: Settled in the budget as its result arrived (:meth:`ModelLifeCycle._land`): never again.
    settled: bool = False
    #: Installed as its result arrived (:meth:`ModelLifeCycle._land`): the load's failures.
    landed: dict[str, str] | None = None
    #: When it was installed so (the load's time ends there, not after the wait that follows).
    landed_at: float = 0.0


def find_and_load(
    admission: AdmissionControl,
    trip: Trip,
    find: Callable[[], ModelSource | None],
    load_for: Callable[[ModelSource, Inspection], Callable[[], LoadOutcome]],
) -> Trip:
    """Blocking (a load thread): fill ``trip``: ``find()`` the folder, inspect it (or neither,
    when its files are unchanged since they were: :meth:`AdmissionControl.unchanged`), and load
    it when it may be loaded here (see the module notes): ``load_for(source, inspection)()``.
    Exceptions propagate; ``trip`` says whether a reservation was made by then."""
    unchanged = admission.unchanged(trip.name) if trip.name else None
    if unchanged is not None:  # found and inspected before, nothing changed since: no walk
        source, inspection = unchanged
    else:
        found = find()
        if found is None:
            return trip
        source, inspection = found, admission.inspect(found, None)
    trip.source, trip.inspection = source, inspection
    if inspection.composing is not None or admission.gpu is not None:
        return trip
    load = load_for(source, inspection)
    budget = admission.budget
    prediction = None
    if budget is not None:
        if not admission.primed(inspection.backend):
            return trip  # the framework's one-time cost is measured first, on the usual way
        prediction = admission.predictor.predict(
            ModelIdentity(source.name, "", inspection.fingerprint), estimate=inspection.from_files
        )
        if not budget.fits(prediction.bytes):
            return trip  # room must be made: evictions, perhaps waits
        try:
            decision = budget.admit(source.name, prediction.bytes, admission.policy, ())
        except OutOfMemoryError:
            return trip  # the usual way says why
        if not isinstance(decision, Admission):
            return trip  # another load took the free bytes meanwhile
        trip.reserved, trip.prediction = True, prediction
    trip.loads = True
    clock = admission.clock
    trip.started = seconds(clock)
    if prediction is None:
        trip.outcome = load()
    else:
        trip.outcome, trip.measured, trip.how, _ = admission.measure(load, prediction, inspection.backend)
    trip.load_seconds = seconds(clock) - trip.started
    return trip


def settle_trip_now(admission: AdmissionControl, trip: Trip) -> bool:
    """On the event loop, as a trip that loaded models arrives: :func:`settle_trip` without
    awaiting, when that needs no wait (no budget, or the model within its reservation:
    :meth:`AdmissionControl.settle_now`); whether it was settled (else nothing was done)."""
    source, inspection, outcome, prediction = trip.source, trip.inspection, trip.outcome, trip.prediction
    assert source is not None and inspection is not None and outcome is not None
    if prediction is None:  # no budget
        return True
    identity = ModelIdentity(source.name, "", inspection.fingerprint)
    return admission.settle_now(
        source.name, identity, inspection, prediction, outcome, trip.measured, trip.how, trip.load_seconds
    )


async def settle_trip(admission: AdmissionControl, trip: Trip, unloader: Unloader) -> LoadOutcome:
    """On the event loop, after a trip that loaded: the bookkeeping a load under the budget
    does after loading (:meth:`AdmissionControl.settle`)."""
    source, inspection, outcome, prediction = trip.source, trip.inspection, trip.outcome, trip.prediction
    assert source is not None and inspection is not None and outcome is not None
    if prediction is None:  # no budget
        return outcome
    identity = ModelIdentity(source.name, "", inspection.fingerprint)
    return await admission.settle(
        source.name, identity, inspection, prediction, outcome, trip.measured, trip.how, trip.load_seconds, unloader
    )
