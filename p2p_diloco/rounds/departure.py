"""How a learning unit leaves the swarm, in order (:class:`Departure`):

1. it announces that it is finishing (the units finishing at the same time settle with it);
2. final rounds hand its last steps to the swarm at the next boundary (bounded by the engine's final-round bound; with
   quorum 1 a round completes alone if nobody joins; a round that does not end in time is dropped and its progress
   stays in the checkpoint's local parameters); the steps made while a round in flight at exit ran go in one more
   final round at the boundary after it;
3. its round averagers shut down (the settle averager takes their place: memory stays flat at exit);
4. settle rounds average the whole φ with the units leaving at the same time (kinds.py ``Settle``), on a grid of
   shared time that every unit computes alike, until one round held every unit finishing with it with their φ
   already within SETTLED_DRIFT; at most ``settle_rounds``, and beyond them, while a unit finishing has not met this
   one yet, as many more as fit in the final rounds' bound (the time that unit may still spend in its own final
   rounds). A unit leaving a swarm that trains on settles once;
5. it announces that it left (the units settling after it no longer wait for it).

The departure talks to the swarm through a :class:`Census` (the unit's progress records) and reports every round to a
:class:`RoundObserver` (the unit). A settle averager that fails to start costs only the settle rounds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from p2p_diloco.rounds.averager import Averager
from p2p_diloco.rounds.clock import next_boundary
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.kinds import Settle
from p2p_diloco.rounds.plan import FINAL_ROUND_SLACK_S, RoundPlan
from p2p_diloco.rounds.results import RoundBegin, RoundEnd, RoundStatus

logger = logging.getLogger(__name__)

Phase = Literal["training", "finishing", "left"]
"""Where a unit is in its life, as its progress record says."""
SETTLED_DRIFT = 1e-6  # every finishing unit in a settle round, this close already: no more settle rounds
FINAL_PASSES = 2  # final rounds, then one more for the steps made while a round in flight at exit ran


class Census(Protocol):
    """Where the units of the run say they are (the unit's progress records)."""

    def publish(self, phase: Phase, wait: bool) -> None:
        """Announce this unit's phase; stored before returning (bounded) when ``wait``."""

    def phases(self) -> dict[str, Phase]:
        """Every unit's phase by peer id as a read of the records shows it now (possibly incomplete)."""


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
    _seen_finishing: set[str] = field(default_factory=set, init=False)  # units a read showed finishing

    def leave(self, step_time_s: float | None) -> None:
        """Announce, hand over the last steps, settle, announce the departure (steps 1 to 5 of the module
        docstring)."""
        engine = self.engine
        self.census.publish("finishing", wait=True)  # the units finishing at the same time settle with this one
        bound_s = engine.final_round_bound_s(step_time_s)
        logger.info("finishing the last outer rounds (at most %.0f s each; Ctrl+C again to abort)", bound_s)
        final_boundary = self._final_rounds(step_time_s, bound_s)
        for averager in (*engine.averagers, *engine.consensus_averagers):
            averager.shutdown()  # of no more use: the settle averager takes their place (memory stays flat at exit)
        settle_averager = self._start_settle_averager()
        if settle_averager is not None:
            try:
                self._settle(settle_averager, final_boundary, step_time_s)
            finally:
                settle_averager.shutdown()
        self.census.publish("left", wait=True)  # the units settling after this one no longer wait for it

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
            return make_settle([torch.zeros(self.engine.state.whole.numel)])
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
        phases = self.census.phases()
        seen = self._seen_finishing
        seen.update(peer_id for peer_id, phase in phases.items() if phase == "finishing")
        seen.difference_update(peer_id for peer_id, phase in phases.items() if phase in ("training", "left"))
        finishing = {peer_id for peer_id in seen if not self.refuses(peer_id)} | {self.peer_id}
        if self.peer_id not in phases:
            return max(self.engine.swarm_size, len(finishing))
        return len(finishing)


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
