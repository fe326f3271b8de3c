"""The memory budget's ledger and gate (quiver.lifecycle.budget): pure logic, a fake clock, and
a Hypothesis state machine that drives random interleavings and checks the invariant at every
step."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from lifecycle_fakes import FakeClock

from quiver.errors import UnavailableError
from quiver.lifecycle.budget import Admission, Blocked, BudgetGate, MemoryBudget, OutOfMemoryError
from quiver.lifecycle.eviction import Candidate, GreedyDualSizePolicy, LRUPolicy


def resident(budget: MemoryBudget, **sizes: int) -> None:
    for name, size in sizes.items():
        assert budget.admit(name, size, LRUPolicy(), []) == Admission([])
        budget.commit(name, size)


def cands(budget: MemoryBudget, pinned: set[str] | frozenset[str] = frozenset(), order: str = "") -> list[Candidate]:
    names = order.split() or sorted(budget.resident)
    return [Candidate(n, 0, float(i), n in pinned) for i, n in enumerate(names)]


def test_admit_reserves_what_fits_and_commit_frees_what_was_not_used() -> None:
    budget = MemoryBudget(100)
    assert budget.admit("a", 60, LRUPolicy(), []) == Admission([])
    assert (budget.used, budget.available, budget.reserved) == (60, 40, {"a": 60})
    with pytest.raises(ValueError):
        budget.admit("a", 1, LRUPolicy(), [])  # one load of a model at a time
    budget.commit("a", 45)
    assert (budget.resident, budget.reserved, budget.used) == ({"a": 45}, {}, 45)
    assert budget.release("a") == 45 and budget.used == 0
    with pytest.raises(ValueError):
        MemoryBudget(0)


def test_victims_stay_counted_until_unloaded_then_their_bytes_go_to_the_claimant() -> None:
    budget = MemoryBudget(100)
    resident(budget, a=40, b=40)
    decision = budget.admit("c", 50, LRUPolicy(), cands(budget, order="a b"))
    assert decision == Admission(["a"], 30)  # the 20 free bytes now, 30 from a when it is gone
    assert budget.releasing == {"a"} and budget.claimant("a") == "c"
    assert (budget.used, budget.available, budget.reservation("c"), budget.shortfall("c")) == (100, 0, 20, 30)
    # Another load cannot count on a's bytes: it must claim b for itself.
    assert budget.admit("d", 10, LRUPolicy(), cands(budget, order="a b")) == Admission(["b"], 10)
    assert budget.used == 100
    assert budget.release("a") == 10  # 30 of a's 40 bytes went to c, 10 came free
    assert (budget.reservation("c"), budget.shortfall("c"), budget.used) == (50, 0, 90)
    assert budget.release("b") == 30
    assert (budget.reservation("d"), budget.shortfall("d"), budget.used) == (10, 0, 60)
    budget.commit("c", 50)
    budget.commit("d", 10)
    assert budget.resident == {"c": 50, "d": 10} and budget.peak == 100


def test_a_load_that_commits_keeps_no_claim_on_victims_it_did_not_need() -> None:
    """Found by the state machine below: victims chosen beyond the need (an empty model first
    in LRU order) were still claimed once the load committed, so an eviction in flight would
    unload them for a load that was done."""
    budget = MemoryBudget(100)
    resident(budget, a=0, b=93)
    decision = budget.admit("c", 8, LRUPolicy(), cands(budget, order="a b"))
    assert decision == Admission(["a", "b"], 1)
    budget.release("b")  # covers c's shortfall; a is still unloading
    budget.commit("c", 8)
    assert budget.releasing == frozenset() and budget.claimant("a") is None
    assert budget.resident == {"a": 0, "c": 8}


def test_pinned_models_and_other_loads_block_a_load_a_model_larger_than_the_budget_fails_at_once() -> None:
    budget = MemoryBudget(100)
    resident(budget, a=60)
    blocked = budget.admit("b", 50, LRUPolicy(), cands(budget, pinned={"a"}))
    assert isinstance(blocked, Blocked) and "60 are held by models in use" in blocked.reason
    assert budget.reserved == {} and budget.releasing == frozenset()  # nothing changed
    assert budget.admit("b", 50, LRUPolicy(), cands(budget)) == Admission(["a"], 10)
    with pytest.raises(OutOfMemoryError, match="needs about 101 bytes") as caught:
        budget.admit("huge", 101, LRUPolicy(), cands(budget))
    assert isinstance(caught.value, UnavailableError)
    # A load under way holds its bytes: a third load waits for it rather than fail.
    assert isinstance(budget.admit("c", 60, LRUPolicy(), cands(budget)), Blocked)


def test_cancel_drops_the_reservation_and_the_claims() -> None:
    budget = MemoryBudget(100)
    resident(budget, a=70)
    assert budget.admit("b", 50, LRUPolicy(), cands(budget)) == Admission(["a"], 20)
    assert budget.cancel("b") == 30
    assert budget.releasing == frozenset() and budget.claimant("a") is None
    assert budget.release("a") == 70  # unloaded after all: everything comes free
    assert budget.used == 0


def test_a_model_measured_larger_than_its_reservation_grows_it_first() -> None:
    budget = MemoryBudget(100)
    resident(budget, a=30)
    budget.admit("b", 40, LRUPolicy(), cands(budget))
    with pytest.raises(ValueError, match="grow the reservation first"):
        budget.commit("b", 60)
    assert budget.grow("b", 20, LRUPolicy(), cands(budget)) == Admission([])  # 30 free: fits
    budget.commit("b", 60)
    assert budget.used == 90
    budget.admit("c", 10, LRUPolicy(), cands(budget))
    # 30 more for c: only by evicting a (b is pinned).
    assert budget.grow("c", 30, LRUPolicy(), cands(budget, pinned={"b"})) == Admission(["a"], 30)
    assert budget.used == 100
    budget.release("a")
    budget.commit("c", 40)
    budget.admit("d", 0, LRUPolicy(), [])
    with pytest.raises(OutOfMemoryError):
        budget.grow("d", 101, LRUPolicy(), [])  # it could never fit
    with pytest.raises(ValueError):
        budget.grow("nobody", 1, LRUPolicy(), [])


def test_a_reload_keeps_the_old_bytes_until_the_old_versions_unloaded() -> None:
    budget = MemoryBudget(100)
    resident(budget, m=40)
    assert budget.admit("m", 45, LRUPolicy(), cands(budget)) == Admission([])  # m itself is not a victim
    assert budget.used == 85
    budget.commit("m", 45)
    assert (budget.resident, budget.retiring, budget.used) == ({"m": 45}, {"m": 40}, 85)
    assert budget.retired("m") == 40 and budget.used == 45
    with pytest.raises(OutOfMemoryError, match="while its loaded versions keep their 45 bytes"):
        budget.admit("m", 60, LRUPolicy(), cands(budget))
    budget.admit("m", 30, LRUPolicy(), [])
    assert budget.cancel("m") == 30 and budget.resident == {"m": 45}  # a failed reload


def test_the_listener_hears_every_change_that_may_free_bytes() -> None:
    heard: list[int] = []
    budget = MemoryBudget(100, listener=lambda: heard.append(1))
    budget.admit("a", 10, LRUPolicy(), [])
    assert heard == []  # a reservation frees nothing
    budget.commit("a", 5)
    budget.release("a")
    budget.admit("b", 10, LRUPolicy(), [])
    budget.cancel("b")
    assert len(heard) == 3


def test_gate_waits_for_a_notification_and_fails_at_the_deadline_of_its_clock() -> None:
    clock = FakeClock()
    gate = BudgetGate(clock=clock)
    budget = MemoryBudget(100, listener=gate.notify)  # wired as the manager does
    gate.budget = budget
    resident(budget, a=80)
    pinned = {"a"}

    async def main() -> None:
        waiting = asyncio.ensure_future(
            gate.reserve("b", 50, LRUPolicy(), lambda: cands(budget, pinned), timeout=10)
        )
        await asyncio.sleep(0.01)
        assert not waiting.done() and gate.waiting == 1
        gate.notify()  # something changed, but a is still in use: it waits again
        await asyncio.sleep(0.01)
        assert not waiting.done()
        pinned.clear()
        gate.notify()  # the pin is released
        assert await waiting == Admission(["a"], 30)

        impossible = gate.reserve("c", 500, LRUPolicy(), lambda: [], timeout=10)
        with pytest.raises(OutOfMemoryError, match="needs about 500"):
            await asyncio.wait_for(impossible, 1)  # at once, no waiting

        pinned.add("b")
        budget.release("a")
        budget.commit("b", 50)
        late = asyncio.ensure_future(
            gate.reserve("d", 60, LRUPolicy(), lambda: cands(budget, pinned), timeout=10)
        )
        await asyncio.sleep(0.01)
        clock.advance(9.9)
        await asyncio.sleep(0.01)
        assert not late.done()
        clock.advance(0.2)  # the fake clock passes the deadline: its timer ends the wait
        with pytest.raises(OutOfMemoryError, match="waited 10 s"):
            await late
        assert budget.reserved == {}

    asyncio.run(main())


# -- random interleavings ---------------------------------------------------------------------

LIMIT = 100
NAMES = [f"m{i}" for i in range(6)]


class LedgerMachine(RuleBasedStateMachine):
    """Loads, evictions, unloads, reloads, cancels and overruns in any order, as the manager
    drives them: the committed total never exceeds the limit, bytes are conserved, and a load
    is refused at once only when it could never fit, blocked only when the models not in use
    really cannot cover it."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = MemoryBudget(LIMIT)
        self.policy = LRUPolicy()
        self.pinned: set[str] = set()
        self.clock = 0.0
        self.used_at: dict[str, float] = {}

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(n, 0, self.used_at.get(n, 0.0), n in self.pinned) for n in self.budget.resident
        ]

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 120))
    def admit(self, name: str, size: int) -> None:
        budget = self.budget
        if name in budget.reserved:
            return
        own = (budget.size_of(name) or 0) + budget.retiring.get(name, 0)
        free_before = budget.available
        offered = [
            c for c in self.candidates()
            if c.name not in budget.releasing and c.name not in budget.reserved and c.name != name
        ]
        evictable = sum(budget.size_of(c.name) or 0 for c in offered if not c.pinned)
        try:
            decision = budget.admit(name, size, self.policy, self.candidates())
        except OutOfMemoryError:
            assert size > LIMIT - own
            return
        if isinstance(decision, Blocked):
            assert free_before + evictable < size
            return
        assert not set(decision.victims) & self.pinned
        assert budget.reservation(name) + budget.shortfall(name) == size

    @rule(data=st.data())
    def unload_finished(self, data: st.DataObject) -> None:
        """An unload finished: a victim the claimant evicted, or any model not loading,
        unloaded through the repository API."""
        names = sorted(n for n in self.budget.resident if n not in self.budget.reserved)
        if names:
            name = data.draw(st.sampled_from(names))
            self.budget.release(name)
            self.pinned.discard(name)

    @rule(data=st.data(), overrun=st.integers(-20, 40))
    def load_finished(self, data: st.DataObject, overrun: int) -> None:
        ready = sorted(n for n in self.budget.reserved if not self.budget.shortfall(n))
        if not ready:
            return
        name = data.draw(st.sampled_from(ready))
        granted = self.budget.reservation(name)
        measured = max(0, granted + overrun)
        if measured > granted:
            try:
                decision = self.budget.grow(name, measured - granted, self.policy, self.candidates())
            except OutOfMemoryError:
                decision = Blocked("never")
            if isinstance(decision, Blocked):
                self.budget.cancel(name)  # the manager unloads it and fails the load
                return
            if decision.shortfall:
                return  # its victims unload in a later step
        self.budget.commit(name, measured)
        self.budget.retired(name)
        self.clock += 1
        self.used_at[name] = self.clock

    @rule(data=st.data())
    def load_failed(self, data: st.DataObject) -> None:
        loads = sorted(self.budget.reserved)
        if loads:
            self.budget.cancel(data.draw(st.sampled_from(loads)))

    @rule(name=st.sampled_from(NAMES))
    def pin(self, name: str) -> None:
        self.pinned.add(name)
        self.clock += 1
        self.used_at[name] = self.clock

    @rule(name=st.sampled_from(NAMES))
    def unpin(self, name: str) -> None:
        self.pinned.discard(name)

    @precondition(lambda self: bool(self.budget.releasing))
    @rule()
    def claims_point_at_resident_models_and_live_loads(self) -> None:
        for victim in self.budget.releasing:
            assert victim in self.budget.resident
            assert self.budget.claimant(victim) in self.budget.reserved

    @invariant()
    def never_over_the_limit(self) -> None:
        budget = self.budget
        assert budget.used <= LIMIT and budget.peak <= LIMIT
        assert budget.used == (
            sum(budget.resident.values()) + sum(budget.retiring.values()) + sum(budget.reserved.values())
        )
        assert budget.available >= 0
        for name in budget.reserved:
            assert budget.shortfall(name) >= 0


TestLedgerInterleavings = LedgerMachine.TestCase
TestLedgerInterleavings.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_gds_policy_claims_too() -> None:
    budget = MemoryBudget(100)
    resident(budget, a=50, b=20, c=30)
    decision = budget.admit("d", 40, GreedyDualSizePolicy("uniform"), cands(budget))
    assert isinstance(decision, Admission) and decision.victims == ["a"]  # the largest goes first
    assert decision.shortfall == 40 and budget.used == 100


def test_a_closed_gate_fails_its_waiters_at_once() -> None:
    gate = BudgetGate(MemoryBudget(100))
    assert gate.budget is not None
    resident(gate.budget, a=100)

    async def main() -> None:
        waiting = asyncio.ensure_future(
            gate.reserve("b", 50, LRUPolicy(), lambda: [Candidate("a", 0, 0.0, True)], timeout=60)
        )
        await asyncio.sleep(0.01)
        gate.close()
        with pytest.raises(UnavailableError, match="stopping"):
            await asyncio.wait_for(waiting, 1)

    asyncio.run(main())


def test_without_waiting_a_load_that_does_not_fit_fails_at_once_and_claims_nothing() -> None:
    """--model-eviction-policy=none: no candidates are offered and nobody waits; the load is
    OutOfMemoryError (507 on SageMaker) and the resident models stay."""
    gate = BudgetGate(clock=FakeClock())
    budget = MemoryBudget(100, listener=gate.notify)
    gate.budget = budget
    resident(budget, a=80)

    async def main() -> None:
        with pytest.raises(OutOfMemoryError, match="--model-eviction-policy=none"):
            await asyncio.wait_for(gate.reserve("b", 50, LRUPolicy(), lambda: [], timeout=10, wait=False), 1)
        assert budget.reserved == {} and gate.waiting == 0
        assert await gate.reserve("c", 20, LRUPolicy(), lambda: [], timeout=10, wait=False) == Admission([])

    asyncio.run(main())


def test_victims_are_only_listed_when_the_free_bytes_do_not_suffice() -> None:
    """Listing what is in use walks every loaded model: a decision that fits in the free
    bytes never asks for the candidates."""
    budget = MemoryBudget(100)
    resident(budget, a=50)
    asked: list[int] = []

    def listing() -> list[Candidate]:
        asked.append(1)
        return cands(budget)

    assert budget.admit("b", 40, LRUPolicy(), listing) == Admission([])
    assert asked == []
    assert budget.admit("c", 30, LRUPolicy(), listing) == Admission(["a"], 20)
    assert asked == [1]
    budget.release("a")
    budget.commit("c", 30)
    budget.commit("b", 40)
    assert budget.used == 70 and budget.peak <= 100
