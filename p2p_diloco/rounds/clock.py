"""The swarm clock: when a unit's rounds begin, keyed to shared time (the DHT's clock) rather than to the unit's own
step count, so that units of different speeds keep meeting (torch-free, no I/O).

Rounds keyed to a unit's own steps (a round H steps after the previous one ended) drift apart: each unit's phase moves
with its speed, and after a few rounds fewer and fewer units share a matchmaking window (measured: 8 units' mean group
fell from 5.5 to 2.6 over a 180 s run). Here every round begins at a *boundary* of shared time instead:

* a unit's round period T is the power of two (in seconds) nearest H × its measured inner-step time, with hysteresis,
  and at least what one round keeps the unit busy (the time from a boundary until the unit could begin its next
  round: all-reduce, merge; and the minimum window before the next), twice that with a mix round per period; a round
  that ended in an error counts at most as long as H inner steps take (or the busy time measured before): an
  all-reduce that waited out its timeout for a member that froze or left had doubled the period at every such round
  (8 units went to 64- and 128-s periods and were one model 0% of the time);
  boundaries of fragment p of P are the times n·T + p·T/P (seconds since the epoch, n an integer).
* Every unit due at a boundary schedules its all-reduce at that boundary (plus its place's offset in the round's
  layout, grid.py, which draws the groups anew every round), so every reachable unit meets at every boundary,
  whatever its phase.
* One period for the swarm: every round's members share the period each of them wants (its own, from its step time
  and round latency), and each follows the largest wanted by a member of its last ``ADOPT_ROUNDS`` rounds (at most
  ``MAX_ADOPTED`` times its own, and a power of two: with the rows of grid.py drawn anew every round, following only
  the last round's members made units flip between two periods from round to round). Since units keep meeting, the
  swarm converges to the period of its slowest unit, and follows it down again when that unit speeds up or leaves,
  since members share what they want, not what they adopted. Periods are powers of two, so until then the
  boundaries of a slower unit (2T, 4T, ...) are boundaries of the faster ones too (with P = 1; with P > 1 the
  fragment offsets only coincide between units of the same period).
* A unit begins matchmaking ``lead_s`` before its boundary (the minimum window plus two inner steps: it looks between
  steps, and one slow step must not make it miss the boundary), or as late as ``LATE_S`` before it (a unit that was
  busy still joins that boundary's groups: leaders accept members that schedule later than they do), and sends
  whatever steps it made since its last round (weighted by their tokens). Measured before (one step of lead, the
  minimum window at the latest: 8 units on 2 cores): units missed 2 to 4 of 12 boundaries each.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

HYSTERESIS = 0.75  # keep the period while H × step time stays within T·2^(±HYSTERESIS)
MAX_ADOPTED = 8.0  # a unit follows a period at most this many times its own (a stranger cannot stall it)
ADOPT_ROUNDS = 4  # ... wanted by a member of one of its last this many merged rounds
LEAD_STEPS = 2  # inner steps of lead beyond the minimum window
LATE_S = 0.5  # the latest a unit begins a boundary's round (before it)
BUSY_MARGIN = 1.5  # a shorter period is taken only when it holds this many times the rounds' busy time


def power_of_two_period(seconds: float) -> float:
    """The power of two (2^k seconds, k any integer) nearest ``seconds`` on a log scale. Raises ValueError for a
    non-positive or non-finite value."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a period must be positive and finite, got {seconds}")
    return 2.0 ** round(math.log2(seconds))


def next_boundary(now: float, period_s: float, offset_s: float) -> float:
    """The first time ``n · period_s + offset_s`` (n an integer) strictly after ``now``."""
    return (math.floor((now - offset_s) / period_s) + 1) * period_s + offset_s


@dataclass
class RoundClock:
    """The round period of one unit and the boundaries of its fragments' rounds.

    ``min_period_s`` keeps a round's matchmaking and all-reduce inside its period (the period is the power of two at
    or above it when H steps take less); ``min_window_s`` is the shortest matchmaking window."""

    inner_steps: int
    fragments: int
    min_window_s: float
    min_period_s: float
    rounds_per_period: int = 1  # 2 when a mix stage follows each round half a period later (engine.py)
    desired_s: float | None = None  # this unit's own period; None until a step time was measured
    wanted_by_members: deque[float] = field(default_factory=lambda: deque(maxlen=ADOPT_ROUNDS))  # per merged round
    wanted_by_census: float = 0.0  # the longest period a live unit's progress record wants

    @property
    def period_s(self) -> float | None:
        """The period the unit's rounds follow: its own, or the one adopted from its last round if longer."""
        if self.desired_s is None:
            return None
        wanted = max([self.wanted_by_census, *self.wanted_by_members])
        return max(self.desired_s, min(wanted, MAX_ADOPTED * self.desired_s))

    def adopt(self, member_periods: Sequence[float]) -> None:
        """Follow the longest period the members of this unit's last ADOPT_ROUNDS merged rounds want (powers of two, at
        most MAX_ADOPTED times this unit's own; zeros, from members without a clock, are ignored)."""
        wanted = [power_of_two_period(period) for period in member_periods if period > 0 and math.isfinite(period)]
        self.wanted_by_members.append(max(wanted, default=0.0))

    def follow_census(self, periods: Iterable[float]) -> None:
        """Follow the longest period the live units' progress records want (as :meth:`adopt`, bounded alike): rows are
        drawn anew every round, so a unit may go rounds without meeting the slowest one; the census reaches all."""
        wanted = [power_of_two_period(period) for period in periods if period > 0 and math.isfinite(period)]
        self.wanted_by_census = max(wanted, default=0.0)

    def update(self, step_time_s: float, busy_s: float = 0.0) -> float:
        """Adopt the period for a measured inner-step time and the measured time a round keeps the averager busy
        after its boundary; returns it. The period grows at once when a round (and the minimum window before the
        next) no longer fits, and otherwise changes only when H × step time moves more than the hysteresis away from
        it; it comes down only to a period that holds the rounds with BUSY_MARGIN to spare (a busy time near the edge
        of two periods made units flap between them, and units of different periods meet only at the longer one's
        boundaries)."""
        busy = self.rounds_per_period * (busy_s + self.min_window_s)
        floor = _power_of_two_at_least(max(self.min_period_s, busy))
        wanted = max(self.inner_steps * step_time_s, floor)
        current = self.desired_s
        if current is None or floor > current or abs(math.log2(wanted / current)) > HYSTERESIS:
            candidate = max(floor, power_of_two_period(wanted))
            if current is None or candidate > current or candidate >= BUSY_MARGIN * busy:
                self.desired_s = candidate
        period = self.period_s
        assert period is not None
        return period

    def lead_s(self, step_time_s: float) -> float:
        """How long before its boundary a round begins matchmaking (at the earliest)."""
        return self.min_window_s + LEAD_STEPS * step_time_s

    def boundary(self, fragment: int, now: float) -> float:
        """Fragment ``fragment``'s next boundary after ``now``. Raises RuntimeError before :meth:`update`."""
        if self.period_s is None:
            raise RuntimeError("the round clock has no period before a step time was measured")
        return next_boundary(now, self.period_s, self.period_s * fragment / self.fragments)

    def due_boundary(self, fragment: int, now: float, step_time_s: float, after: float) -> float | None:
        """The boundary of fragment ``fragment``'s round when it should begin now: its next boundary at least
        ``LATE_S`` away and later than ``after`` (the boundary of its last round) is at most :meth:`lead_s` away. None
        when it is not due yet."""
        boundary = self.boundary(fragment, now + LATE_S)
        if boundary <= after or boundary - now > self.lead_s(step_time_s):
            return None
        return boundary


def _power_of_two_at_least(seconds: float) -> float:
    return 2.0 ** math.ceil(math.log2(seconds))
