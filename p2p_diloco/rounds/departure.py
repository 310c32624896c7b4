"""How a learning unit leaves the swarm, in order (:class:`Departure`):

1. it announces that it is finishing (the units finishing at the same time settle with it);
2. when a read of the census shows no unit training on (every unit of the swarm leaves, as when a run ends), it
   leaves *together* with the units finishing: a round in flight at exit merges first, then one final round per
   fragment, every unit finishing in one group at the next boundary of the settle grid (below), so that all of them
   end on one φ; when that round held every unit finishing, carried fp32 proposals and every unit leaving then
   publishes the same φ probe, the exit needs no settle round (step 5 is the fallback);
3. otherwise final rounds hand its last steps to the swarm at the next boundary (bounded by the engine's final-round
   bound; with quorum 1 a round completes alone if nobody joins; a round that does not end in time is dropped and its
   progress stays in the checkpoint's local parameters); the steps made while a round in flight at exit ran go in one
   more final round at the boundary after it;
4. its round averagers shut down (the settle averager takes their place: memory stays flat at exit);
5. settle rounds average the whole φ with the units leaving at the same time (kinds.py ``Settle``), on a grid of
   shared time that every unit computes alike, until one round held every unit finishing with it with their φ
   already within SETTLED_DRIFT; at most ``settle_rounds``, and beyond them, while a unit finishing has not met this
   one yet, as many more as fit in the final rounds' bound (the time that unit may still spend in its own final
   rounds). A unit leaving a swarm that trains on settles once;
6. it announces that it left (the units settling after it no longer wait for it).

The departure talks to the swarm through a :class:`Census` (the unit's progress records) and reports every round to a
:class:`RoundObserver` (the unit). A settle averager that fails to start costs only the settle rounds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from p2p_diloco.diloco import probe_drift
from p2p_diloco.rounds.averager import Averager, GroupRequest
from p2p_diloco.rounds.clock import next_boundary
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.grid import grid_cell
from p2p_diloco.rounds.kinds import Settle
from p2p_diloco.rounds.plan import FINAL_ROUND_SLACK_S, RoundPlan
from p2p_diloco.rounds.results import RoundBegin, RoundEnd, RoundKind, RoundStatus

logger = logging.getLogger(__name__)

Phase = Literal["training", "finishing", "left"]
"""Where a unit is in its life, as its progress record says."""
SETTLED_DRIFT = 1e-6  # every finishing unit in a settle round, this close already: no more settle rounds
FINAL_PASSES = 2  # final rounds, then one more for the steps made while a round in flight at exit ran
CENSUS_READ_INTERVAL_S = 0.25  # between reads of the census while units that got the same stop signal announce it
CENSUS_READ_WINDOWS = 4  # reads go on for this many minimum windows (16 units on 2 cores: all read after 4 to 6 s)
TOGETHER_BITS = "1"  # the group bits of the final round of units leaving together: no row ("0…") or column ("1…") of
# grid.py has a single bit, so a unit that still hands its steps to the swarm (a row at the boundary) never joins it


@dataclass(frozen=True)
class Announcement:
    """A unit's phase as its progress record says, and when it published that record (shared clock)."""

    phase: Phase
    at: float
    probe: tuple[float, ...] = ()  # the unit's φ at the record's probe coordinates when it published (consensus.py)


class Census(Protocol):
    """Where the units of the run say they are (the unit's progress records)."""

    def publish(self, phase: Phase, wait: bool) -> None:
        """Announce this unit's phase; stored before returning (bounded) when ``wait``."""

    def phases(self) -> dict[str, Announcement]:
        """Every unit's announcement by peer id as a read of the records shows it now (possibly incomplete)."""


class RoundObserver(Protocol):
    """Who does the I/O that the rounds at exit call for (the unit: metrics, goodput, probes)."""

    def began(self, begin: RoundBegin) -> None: ...

    def ended(self, end: RoundEnd) -> None: ...


@dataclass
class Departure:
    """The exit protocol of one unit (see the module docstring). ``settle_averager`` makes the averager of the settle
    rounds for a payload template (None: no settle rounds); ``refuses`` says whom it refuses (suspects are not waited
    for); ``peer_id`` is this unit's; ``swarm_size`` the last census of live units while training; ``now`` the shared
    clock (the DHT's)."""

    engine: RoundEngine
    census: Census
    observer: RoundObserver
    peer_id: str
    now: Callable[[], float]
    settle_averager: Callable[[list[torch.Tensor]], Averager] | None = None
    refuses: Callable[[str], bool] = lambda _peer_id: False
    _seen_finishing: dict[str, float] = field(default_factory=dict, init=False)  # units a read showed finishing: when

    def leave(self, step_time_s: float | None) -> None:
        """Announce, hand over the last steps, settle if need be, announce the departure (steps 1 to 6 of the module
        docstring)."""
        engine = self.engine
        self.census.publish("finishing", wait=True)  # the units finishing at the same time settle with this one
        bound_s = engine.final_round_bound_s(step_time_s)
        leaving = self._leaving_together()
        logger.info("finishing the last outer rounds (%s; at most %.0f s each; Ctrl+C again to abort)",
                    "the whole swarm leaves" if leaving else "the swarm trains on", bound_s)  # fmt: skip
        if leaving:
            final_boundary, whole = self._final_round_together(step_time_s, bound_s, leaving)
            settled = whole and self._agree(leaving)
        else:
            final_boundary, settled = self._final_rounds(step_time_s, bound_s), False
        for averager in (*engine.averagers, *engine.consensus_averagers):
            averager.shutdown()  # of no more use: the settle averager takes their place (memory stays flat at exit)
        settle_averager = None if settled else self._start_settle_averager()
        if settled:
            logger.info("the final round held all %d units leaving: one model, no settle round", len(leaving))
        if settle_averager is not None:
            try:
                self._settle(settle_averager, final_boundary, step_time_s)
            finally:
                settle_averager.shutdown()
        self.census.publish("left", wait=True)  # the units settling after this one no longer wait for it

    def _leaving_together(self) -> list[str]:
        """The units leaving with this one (itself included) when the reads of the census showed every live unit of
        the last census while training (the engine's) finishing or gone, and the last read shows none training on
        (suspects aside); else []. Units that got the same stop signal announce it within a few steps, so the census
        is read again for CENSUS_READ_WINDOWS minimum windows; a read without this unit's own record is incomplete and
        never counts, and a live unit whose record no read shows (a read that missed it, or a unit that crashed) keeps
        this one on the final rounds toward the swarm."""
        live = {peer_id for peer_id in self.engine.census if not self.refuses(peer_id)}
        gone: set[str] = set()

        def together(announced: dict[str, Announcement]) -> bool:
            self._note(announced)
            gone.update(peer_id for peer_id, announcement in announced.items() if announcement.phase == "left")
            trains_on = any(a.phase == "training" and not self.refuses(peer_id) for peer_id, a in announced.items())
            return self.peer_id in announced and not trains_on and live <= self._finishing_units() | gone

        return sorted(self._finishing_units()) if self._read_census_until(together) else []

    def _final_round_together(
        self, step_time_s: float | None, bound_s: float, leaving: list[str]
    ) -> tuple[float, bool]:
        """Step 2: a round in flight merges first (bounded by ``bound_s``; one that fails is not tried again), then
        every fragment's final round asks for one group of all of ``leaving`` at the boundary of the settle grid that
        every one of them derives alike from their announcements (:func:`together_boundary`; the units asked to lead
        in the same order by every unit: grid.py), and starts as soon as all of them joined. Returns that boundary and
        whether the rounds made every unit leaving one model (each merged with all of them, fp32 proposals)."""
        engine, plan = self.engine, self.engine.plan
        announced_at = [self._seen_finishing.get(peer_id, self.now()) for peer_id in leaving]
        alone = len(leaving) == 1  # nobody to wait for: its round completes alone after a minimum window
        boundary = self.now() + plan.window.min_s if alone else together_boundary(plan, announced_at)
        in_flight = [round_id for round_id in engine.in_flight if round_id.kind is RoundKind.FRAGMENT]
        if sum(end.merged for end in self._drain(bound_s)) < len(in_flight):
            return boundary, False  # a round that failed is not tried again: the settle rounds follow
        cell = grid_cell(leaving, self.peer_id, "final", len(leaving))
        together = GroupRequest(TOGETHER_BITS, len(leaving), cell.row_leaders, boundary + cell.row_offset_s)
        begins = engine.begin_final(step_time_s, self.now(), together)
        for begin in begins:
            self.observer.began(begin)
        ends = self._drain(bound_s)
        whole = len(ends) == len(begins) == len(plan.fragments) and plan.merges_alike
        return boundary, whole and all(end.merged and end.group_size >= len(leaving) for end in ends)

    def _agree(self, leaving: list[str]) -> bool:
        """Whether every unit of ``leaving`` published the same φ probe as this one after the final round (within
        SETTLED_DRIFT), read for CENSUS_READ_WINDOWS minimum windows: a member whose all-reduce ended with parts
        missing counts the whole group all the same (measured: a unit stopped during the round kept 81% of its own
        values and would have left one outer step apart from the others)."""
        self.census.publish("finishing", wait=True)  # the record now carries φ after the final round

        def same_phi(announced: dict[str, Announcement]) -> bool:
            probes = [announced[peer_id].probe for peer_id in leaving if peer_id in announced]
            alike = len(probes) == len(leaving) and len({len(probe) for probe in probes}) == 1 and all(probes)
            return alike and probe_drift(probes) <= SETTLED_DRIFT

        if self._read_census_until(same_phi):
            return True
        logger.info("the units leaving do not all hold this unit's φ yet: settle rounds follow")
        return False

    def _read_census_until(self, accept: Callable[[dict[str, Announcement]], bool]) -> bool:
        """Read the census every CENSUS_READ_INTERVAL_S until ``accept`` takes a read, for CENSUS_READ_WINDOWS minimum
        windows at most; whether one was taken."""
        deadline = time.monotonic() + CENSUS_READ_WINDOWS * self.engine.plan.window.min_s
        while not accept(self.census.phases()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(CENSUS_READ_INTERVAL_S)
        return True

    def _drain(self, bound_s: float) -> list[RoundEnd]:
        """The rounds in flight merged (or dropped) within ``bound_s``, each reported."""
        ends = self.engine.drain(bound_s) if self.engine.in_flight else []
        for end in ends:
            self.observer.ended(end)
        return ends

    def _final_rounds(self, step_time_s: float | None, bound_s: float) -> float:
        """Step 2: a final round for every fragment with steps to hand over, then wait for the fragment rounds in flight
        (each bounded by ``bound_s``). A fragment whose round was in flight at exit hands over the steps it made since
        in one more final round at the boundary after, if a round merged (FINAL_PASSES). Returns the boundary of the
        last final rounds begun (the settle rounds come after it)."""
        engine, boundary = self.engine, self.now()
        for number in range(FINAL_PASSES):
            now = self.now()
            begins = engine.begin_final(step_time_s, now)
            if number == 0 or begins:
                boundary = now + engine.window_s(0, step_time_s, now)  # the same for every unit leaving now
            for begin in begins:
                self.observer.began(begin)
            if not engine.in_flight:
                break
            ends = engine.drain(bound_s)
            for end in ends:
                self.observer.ended(end)
            if not any(end.merged for end in ends) or any(begin.status is RoundStatus.RESET for begin in begins):
                break  # a round that failed is not tried again; a RESET leaves nothing finite to hand over
        return boundary

    def _start_settle_averager(self) -> Averager | None:
        """The averager of the settle rounds; None without settle rounds, or when it fails to start (logged: the unit
        leaves without settling rather than lose its final evaluation, checkpoint and export)."""
        make_settle = self.settle_averager if self.engine.plan.settle_rounds else None
        if make_settle is None:
            return None
        try:
            return make_settle(Settle(self.engine.state).template())
        except Exception:  # hivemind raises whatever its averager process raised while starting
            logger.exception("the settle averager did not start: leaving without settle rounds")
            return None

    def _settle(self, averager: Averager, not_before: float, step_time_s: float | None) -> None:
        """Settle rounds, the first after ``not_before`` (the boundary of the final rounds, whether this unit had one in
        flight or began one). Units whose final rounds end at different times may settle among themselves first, and a
        contended matchmaking may leave a unit out of a round, so the rounds go on until one held every unit
        finishing at the time (:meth:`_finishing`) with their φ already within SETTLED_DRIFT (see the module
        docstring for the bounds)."""
        plan, settle = self.engine.plan, Settle(self.engine.state)
        last = plan.settle_rounds + settle_patience(self.engine, step_time_s)
        for number in range(1, last + 1):
            self.census.publish("finishing", wait=False)  # it may have expired in a long final round
            window_s = settle_window_s(plan, self.now(), not_before)
            _, sent = settle.begin(0, averager, window_s)
            if sent is None:
                return
            outcome = averager.finish_round(window_s + FINAL_ROUND_SLACK_S + plan.group.allreduce_timeout_s)
            end = settle.late() if outcome is None else settle.end(0, sent, outcome)
            self.observer.ended(end)
            close = end.member_drift <= SETTLED_DRIFT
            if number < plan.settle_rounds and not close:
                continue  # another round is due whoever finishes: no census read
            everyone = end.group_size >= self._finishing()
            if everyone and (close or number >= plan.settle_rounds):
                return

    def _finishing(self) -> int:
        """How many units are finishing now that this one would settle with, this one included: those a read at exit
        showed finishing until one shows them in another phase, as a unit's record may expire while its final rounds
        run (it refreshes it at each settle round). A read without this unit's own record (stored before its final
        rounds) is incomplete, as reads of a loaded DHT can be: then at least the last census of live units."""
        announced = self.census.phases()
        self._note(announced)
        finishing = self._finishing_units()
        if self.peer_id not in announced:
            return max(self.engine.swarm_size, len(finishing))
        return len(finishing)

    def _note(self, announced: dict[str, Announcement]) -> None:
        """Remember the units a read shows finishing (and when they announced it), and forget those it shows in another
        phase."""
        seen = self._seen_finishing
        for peer_id, announcement in announced.items():
            if announcement.phase == "finishing":
                seen[peer_id] = announcement.at
            else:
                seen.pop(peer_id, None)

    def _finishing_units(self) -> set[str]:
        """The units seen finishing that this one does not refuse, itself included."""
        return {peer_id for peer_id in self._seen_finishing if not self.refuses(peer_id)} | {self.peer_id}


def together_boundary(plan: RoundPlan, announced_at: list[float]) -> float:
    """The boundary of the settle grid of the final round of units leaving together, from the times they announced
    it (every unit reading the same announcements derives the same): the first at least the census reads' deadline
    and a settle period after the last, as a unit may read the last announcement only that late and a round in flight
    at exit merges first (16 units on 2 cores: a boundary one settle period after the last announcement came 1.5 s
    after the units read it, and they missed it). The group starts as soon as every unit leaving joined, so the margin
    costs time only when one is missing."""
    margin_s = CENSUS_READ_WINDOWS * plan.window.min_s + settle_period_s(plan)
    return next_boundary(max(announced_at) + margin_s, settle_period_s(plan), 0.0)


def settle_period_s(plan: RoundPlan) -> float:
    """The grid of the settle rounds' boundaries, shared by every unit whatever its period or schedule: two minimum
    windows (a settle round after another begins one period later)."""
    return 2 * plan.window.min_s


def settle_window_s(plan: RoundPlan, now: float, not_before: float = 0.0) -> float:
    """A settle round's matchmaking window: until the first boundary of the settle grid at least a minimum window after
    ``now`` and ``not_before``."""
    return next_boundary(max(now, not_before) + plan.window.min_s, settle_period_s(plan), 0.0) - now


def settle_patience(engine: RoundEngine, step_time_s: float | None) -> int:
    """Settle rounds a unit goes on with beyond the plan's while a unit finishing with it has not met it yet: as many
    as fit in the final rounds' bound, which that unit may still be waiting out."""
    return math.ceil(engine.final_round_bound_s(step_time_s) / settle_period_s(engine.plan))
