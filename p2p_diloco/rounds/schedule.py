"""When a unit's rounds are due. A schedule says which rounds are due now and with which matchmaking window; it never
begins one (the engine does, and tells it which began and which ended).

* :class:`StepSchedule` (``schedule = "steps"``): a fragment's round H of the unit's own inner steps after its
  previous one (fragments staggered by H/P steps; units' phases then drift apart with their speeds).
* :class:`ClockSchedule` (``schedule = "clock"``): at the boundaries of shared time of clock.py, so that every
  reachable unit meets at every boundary, in the groups of grid.py's layout; and, while the mix stage runs, a
  fragment's mix round half a period after its round (below).
* :class:`ConsensusQueue` (lossy codecs): the fragments whose φ_p a consensus round should average again.

The mix stage (clock schedule, fp32 proposals, and more live units than ``target_group_size`` in the census the
caller gives): a round's groups are the rows of grid.py's layout, so a swarm larger than the target ends a round as
several row means. Half a period after each fragment round, a mix round averages the fragment's (φ_p, m_p) as the
row merged them again among the units of the same column of that layout, each carrying its share of its row's total
weight: every unit then ends the period on the weighted mean of all proposals, synchronous DiLoCo's φ, when every row
and column met whole (grid.py). The row's merge is held back until then (engine.py; state.py ``HeldMerge``), so φ
changes once per period, at the same moment on every unit; a mix round that fails, or is no longer due, applies it
as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from p2p_diloco.fragments import due_fragments
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome
from p2p_diloco.rounds.clock import LATE_S, RoundClock
from p2p_diloco.rounds.grid import GridCell, grid_cell
from p2p_diloco.rounds.plan import FINAL_ROUND_SLACK_S, RoundPlan
from p2p_diloco.rounds.results import RoundId, RoundKind
from p2p_diloco.streaming import FragmentRounds

BUSY_DECAY = 0.1  # how fast the measured busy time of a round comes down again


@dataclass(frozen=True)
class Due:
    """A round to begin now: with matchmaking window ``window_s``, for ``boundary``, asking for ``group``, at ``cell``
    of the round's layout (a fragment round on the clock) and carrying ``weight`` (a mix round)."""

    id: RoundId
    window_s: float
    boundary: float = 0.0
    group: GroupRequest = GroupRequest()
    weight: float = 0.0
    cell: GridCell | None = None


class Schedule(Protocol):
    """What the engine asks a schedule (see the module docstring)."""

    @property
    def period_s(self) -> float | None:
        """The round period the unit follows (None: no clock)."""

    @property
    def desired_period_s(self) -> float:
        """The period this unit wants, shared with its groups (0: no clock)."""

    def mixes_due(self, busy: set[int], step_time_s: float | None, now: float) -> list[Due]:
        """The mix rounds to begin now (fragments in ``busy`` have a round in flight)."""

    def fragments_due(self, fragments: list[FragmentRounds], busy: set[int], free: int, step_time_s: float | None,
                      now: float, census: dict[str, float]) -> list[Due]:  # fmt: skip
        """At most ``free`` fragment rounds to begin now (fragments in ``busy`` have a round in flight; ``census``:
        the live units the caller knows of, and the period each wants)."""

    def began(self, due: Due) -> None:
        """``due`` began (it was not deferred)."""

    def fragment_ended(self, number: int, merged: RoundOutcome | None) -> None:
        """Fragment ``number``'s round ended; ``merged``: its outcome, when it merged."""

    def forget_mixes(self) -> None:
        """No mix round is due any more (at exit)."""

    def mix_pending(self, number: int) -> bool:
        """Whether fragment ``number``'s mix round is due (not begun yet)."""

    def window_s(self, number: int, step_time_s: float | None, now: float) -> float:
        """The matchmaking window of a round of fragment ``number`` outside the schedule (consensus, final and settle
        rounds)."""

    def final_round_bound_s(self, step_time_s: float | None) -> float:
        """The longest a unit's rounds at exit may take."""


class StepSchedule:
    """A fragment's round is due H of the unit's own inner steps after its previous one (see the module docstring)."""

    def __init__(self, plan: RoundPlan):
        self.plan = plan

    @property
    def period_s(self) -> float | None:
        return None

    @property
    def desired_period_s(self) -> float:
        return 0.0

    def mixes_due(self, busy: set[int], step_time_s: float | None, now: float) -> list[Due]:
        return []

    def fragments_due(self, fragments: list[FragmentRounds], busy: set[int], free: int, step_time_s: float | None,
                      now: float, census: dict[str, float]) -> list[Due]:  # fmt: skip
        steps = [rounds.steps_since_round for rounds in fragments]
        due_after = [self.plan.inner_steps_at(rounds.outer_round) for rounds in fragments]
        dues = []
        for number in due_fragments(steps, busy, free, due_after):
            window_s = self.plan.window_s(step_time_s, due_after[number])
            dues.append(Due(RoundId(RoundKind.FRAGMENT, number), window_s, now + window_s))
        return dues

    def began(self, due: Due) -> None:
        pass

    def fragment_ended(self, number: int, merged: RoundOutcome | None) -> None:
        pass

    def forget_mixes(self) -> None:
        pass

    def mix_pending(self, number: int) -> bool:
        return False

    def window_s(self, number: int, step_time_s: float | None, now: float) -> float:
        return self.plan.window_s(step_time_s)

    def final_round_bound_s(self, step_time_s: float | None) -> float:
        """The window, matchmaking's slack and the all-reduce."""
        return self.plan.window_s(step_time_s) + FINAL_ROUND_SLACK_S + self.plan.group.allreduce_timeout_s


@dataclass(frozen=True)
class MixDue:
    """A fragment's mix round to begin: at ``boundary`` (its all-reduce at ``group.scheduled_at``, the boundary plus
    the unit's offset), asking for ``group``, carrying ``weight``."""

    boundary: float
    group: GroupRequest
    weight: float


class ClockSchedule(StepSchedule):
    """Rounds at the boundaries of shared time (clock.py), in the groups of grid.py's layout for unit ``peer_id``
    (the module docstring). Until a step time was measured, the unit counts its own steps."""

    def __init__(self, plan: RoundPlan, clock: RoundClock, peer_id: str):
        super().__init__(plan)
        self.clock, self.peer_id = clock, peer_id
        self.last_boundary = [-math.inf] * len(plan.fragments)  # per fragment, the boundary of its last round
        self.last_cell: list[GridCell | None] = [None] * len(plan.fragments)  # per fragment, its last round's cell
        self.busy_s: float | None = None  # how long after its boundary a round kept the unit
        self.mix_due: dict[int, MixDue] = {}  # fragment → its mix round to begin
        self._ended_since_look: dict[int, bool] = {}  # fragments whose round ended since the last look → without error

    @property
    def period_s(self) -> float | None:
        return self.clock.period_s

    @property
    def desired_period_s(self) -> float:
        return self.clock.desired_s or 0.0

    def mixes_due(self, busy: set[int], step_time_s: float | None, now: float) -> list[Due]:
        """The mix rounds whose boundary is within the lead (those closer than clock.py's LATE_S are dropped)."""
        dues = []
        for number, due in list(self.mix_due.items()):
            window_s = due.boundary - now
            if step_time_s is None or window_s < LATE_S:
                del self.mix_due[number]
            elif number not in busy and window_s <= self.clock.lead_s(step_time_s):
                dues.append(Due(RoundId(RoundKind.MIX, number), due.group.scheduled_at - now, due.boundary, due.group,
                                due.weight))  # fmt: skip
        return dues

    def fragments_due(self, fragments: list[FragmentRounds], busy: set[int], free: int, step_time_s: float | None,
                      now: float, census: dict[str, float]) -> list[Due]:  # fmt: skip
        if step_time_s is None:  # the clock needs a step time: H own steps until then
            return super().fragments_due(fragments, busy, free, step_time_s, now, census)
        for number, clean in self._ended_since_look.items():
            if math.isfinite(self.last_boundary[number]):
                busy_s = max(0.0, now - self.last_boundary[number])
                if not clean:  # a member timed out or failed: that says nothing of how long rounds need
                    busy_s = min(busy_s, max(self.busy_s or 0.0, self.plan.inner_steps * step_time_s))
                decayed = busy_s if self.busy_s is None else self.busy_s + BUSY_DECAY * (busy_s - self.busy_s)
                self.busy_s = max(busy_s, decayed)  # up at once, down slowly: the period does not flap
        self._ended_since_look.clear()
        target = self.plan.group.target_size
        self.clock.rounds_per_period = 2 if self.plan.mixes and len(census.keys() | {self.peer_id}) > target else 1
        outer_round = min((rounds.outer_round for rounds in fragments), default=self.plan.warmup_rounds)
        self.clock.inner_steps = self.plan.inner_steps_at(outer_round)  # the warm-up's H, then H
        self.clock.update(step_time_s, self.busy_s or 0.0)
        self.clock.follow_census(census.values())
        dues: list[Due] = []
        for rounds in fragments:
            number = rounds.fragment.number
            if len(dues) >= free or number in busy or rounds.steps_since_round == 0:
                continue
            boundary = self.clock.due_boundary(number, now, step_time_s, after=self.last_boundary[number])
            if boundary is not None:
                self.mix_due.pop(number, None)  # a mix not begun by the next round is stale
                cell = grid_cell(census, self.peer_id, f"{number}@{boundary:.3f}", target)
                group = GroupRequest(cell.row_bits, leaders=cell.row_leaders, scheduled_at=boundary + cell.row_offset_s,
                                     members=cell.row_members, placed=cell.members)  # fmt: skip
                dues.append(
                    Due(RoundId(RoundKind.FRAGMENT, number), group.scheduled_at - now, boundary, group, cell=cell)
                )
        return dues

    def began(self, due: Due) -> None:
        if due.id.kind is RoundKind.MIX:
            del self.mix_due[due.id.fragment]
        else:
            self.last_boundary[due.id.fragment] = due.boundary
            self.last_cell[due.id.fragment] = due.cell

    def fragment_ended(self, number: int, merged: RoundOutcome | None) -> None:
        """Follow the members' period, and queue the fragment's mix round half a period after the round's boundary,
        in this unit's column of the round's layout, carrying its share of its row's weight."""
        self._ended_since_look[number] = merged is not None and merged.error is None
        if merged is None or self.clock.period_s is None:
            return
        self.clock.adopt(merged.member_periods)
        cell = self.last_cell[number]
        if self.plan.mixes and cell is not None and cell.rows > 1 and math.isfinite(self.last_boundary[number]):
            half, weight = self.clock.period_s / 2, max(merged.total_weight, 1.0) * cell.column_share
            size = max(cell.column_size, self.plan.group.target_size)  # room for units the census missed, as in rows
            boundary = self.last_boundary[number] + half
            group = GroupRequest(cell.column_bits, size, cell.column_leaders, boundary + cell.column_offset_s,
                                 cell.column_members, cell.members)  # fmt: skip
            self.mix_due[number] = MixDue(boundary, group, weight)

    def forget_mixes(self) -> None:
        self.mix_due.clear()

    def mix_pending(self, number: int) -> bool:
        return number in self.mix_due

    def window_s(self, number: int, step_time_s: float | None, now: float) -> float:
        """Until the fragment's next boundary at least a minimum window away (the plan's window before a period)."""
        if self.clock.period_s is None:
            return self.plan.window_s(step_time_s)
        return max(self.plan.window.min_s, self.clock.boundary(number, now + self.plan.window.min_s) - now)

    def final_round_bound_s(self, step_time_s: float | None) -> float:
        """A period and the minimum window (the plan's window before a period), matchmaking's slack and the
        all-reduce."""
        period = self.clock.period_s
        window_s = self.plan.window_s(step_time_s) if period is None else period + self.plan.window.min_s
        return window_s + FINAL_ROUND_SLACK_S + self.plan.group.allreduce_timeout_s


def schedule_of(plan: RoundPlan, peer_id: str) -> Schedule:
    """The schedule of ``plan`` for unit ``peer_id`` (a new round clock for the clock schedule)."""
    clock = plan.clock()
    return StepSchedule(plan) if clock is None else ClockSchedule(plan, clock, peer_id)


class ConsensusQueue:
    """Lossy codecs: the fragments waiting for a consensus round, oldest first, queued by the plan's consensus rule
    (rounds/plan.py ``ConsensusRounds``; every member saw the same probes, so all decide alike)."""

    def __init__(self, plan: RoundPlan):
        self.plan = plan
        self.waiting: list[int] = []

    def after_merge(self, number: int, outer_round: int, member_drift: float) -> None:
        rule = self.plan.consensus
        if rule is None:
            return
        if (outer_round % rule.every_rounds == 0 or member_drift > rule.tolerance) and number not in self.waiting:
            self.waiting.append(number)

    def next_due(self, busy: set[int]) -> int | None:
        """The oldest fragment waiting whose consensus round is not in flight (``busy``)."""
        return next((number for number in self.waiting if number not in busy), None)

    def began(self, number: int) -> None:
        self.waiting.remove(number)
