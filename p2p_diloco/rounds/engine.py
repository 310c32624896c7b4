"""The engine that runs a unit's outer rounds (:class:`RoundEngine`): it asks the schedule (schedule.py) what is due,
asks the kinds of round (kinds.py) to begin or end one, and keeps the rounds in flight. It never does I/O and never
waits (but in :meth:`RoundEngine.drain`, bounded, at exit): it returns typed results (results.py), and the learning
unit does the I/O they call for. The calling loop::

    engine = RoundEngine(plan, averagers, consensus_averagers, local=trainer.params, peer_id=own_id)
    while training:
        engine.census = {peer_id: wanted_period_s, ...}  # now and then: the live units (the clock schedule's groups)
        stats = trainer.train_step(batches)
        engine.record_step(stats.tokens, stats.seconds)
        for end in engine.poll():                         # rounds that ended, merged into φ, m and θ (or held: mix)
            ...                                           # metrics, goodput; when end.advanced: publish, eval, ...
        for begin in engine.begin_due(step_time_s, now):  # rounds that became due (now: the DHT's clock)
            ...                                           # RESET: θ was reset to φ, reset the inner optimizer
    engine.begin_final(step_time_s, now); engine.drain(engine.final_round_bound_s(step_time_s))
    # then settle rounds with the units leaving at the same time (departure.py)

What each outcome does to φ, m and θ: results.py. The mix stage: schedule.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from p2p_diloco.rounds.averager import Averager, GroupRequest, RoundOutcome
from p2p_diloco.rounds.kinds import Consensus, CorrectionRound, FragmentRound, Mix
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.rounds.results import RoundBegin, RoundEnd, RoundId, RoundKind, RoundStatus
from p2p_diloco.rounds.schedule import ConsensusQueue, Due, schedule_of
from p2p_diloco.rounds.state import InPlace, LocalSync, OuterState
from p2p_diloco.streaming import Roundtrip, SentRound

DRAIN_MIN_S = 0.5  # the least a round in flight at exit is waited for (RoundEngine.drain)


@dataclass
class InFlight:
    """A round in flight: the averager running it and what this unit sent."""

    averager: Averager
    sent: SentRound | list[torch.Tensor]


class RoundEngine:
    """Runs one unit's outer rounds (see the module docstring for the loop; results.py for the failure contract).

    ``averagers`` has one averager per fragment of ``plan``; ``consensus_averagers`` one more per fragment exactly when
    ``plan.consensus``. ``local``, ``sync`` and ``roundtrip``: see state.py ``OuterState``. Raises ValueError when the
    averagers do not match the plan, or without ``roundtrip`` for a plan with error feedback. ``peer_id``: this unit's,
    which places it in the clock schedule's groups with the :attr:`census` the caller keeps up to date (grid.py;
    clock.py: the swarm's period).
    """

    def __init__(
        self,
        plan: RoundPlan,
        averagers: Sequence[Averager],
        consensus_averagers: Sequence[Averager] = (),
        *,
        local: Sequence[torch.Tensor],
        sync: LocalSync = InPlace(),
        roundtrip: Roundtrip | None = None,
        peer_id: str = "",
    ):
        count, consensus = len(plan.fragments), plan.consensus is not None
        if len(averagers) != count or len(consensus_averagers) != (count if consensus else 0):
            raise ValueError(f"a plan of {count} fragments (consensus: {consensus}) got {len(averagers)} averagers "
                             f"and {len(consensus_averagers)} consensus averagers")  # fmt: skip
        self.plan = plan
        self.averagers, self.consensus_averagers = list(averagers), list(consensus_averagers)
        self.state = OuterState(plan, local, sync, roundtrip)
        self.peer_id = peer_id
        self.schedule = schedule_of(plan, peer_id)
        self.consensus = ConsensusQueue(plan)
        self.fragment_round = FragmentRound(self.state)
        self.corrections: dict[RoundKind, CorrectionRound] = {
            RoundKind.CONSENSUS: Consensus(self.state), RoundKind.MIX: Mix(self.state)
        }  # fmt: skip
        self.in_flight: dict[RoundId, InFlight] = {}
        self.census: dict[str, float] = {}  # the live units the caller knows of: peer id → the period it wants

    @property
    def swarm_size(self) -> int:
        """The live units of the census, this one included (the mix stage runs beyond the target)."""
        return len(self.census.keys() | {self.peer_id})

    @property
    def outer_round(self) -> int:
        """The outer round every fragment reached (the smallest fragment round)."""
        return self.state.outer_round

    def record_step(self, tokens: int, compute_s: float) -> None:
        """Count one inner step toward every fragment's next round."""
        self.state.record_step(tokens, compute_s)

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """The host tensors the engine holds: φ, m, error-feedback residuals, and its rounds in flight's θ_p at send,
        momentum proposals and payloads."""
        yield from self.state.host_tensors()
        for flight in self.in_flight.values():
            sent = flight.sent
            yield from [*sent.local_at_send, *sent.momentum_proposal] if isinstance(sent, SentRound) else sent

    def _busy(self, *kinds: RoundKind) -> set[int]:
        """The fragments with a round of ``kinds`` in flight."""
        return {round_id.fragment for round_id in self.in_flight if round_id.kind in kinds}

    # ------------------------------------------------------------------------------------------------- begin
    def begin_due(self, step_time_s: float | None, now: float | None = None) -> list[RoundBegin]:
        """Begin the rounds that are due within the in-flight bound (mix rounds, fragment rounds by the schedule,
        then the oldest waiting consensus round); ``now`` is the shared clock (default: this machine's). After a RESET
        nothing else begins."""
        now = time.time() if now is None else now
        schedule, busy = self.schedule, self._busy(RoundKind.FRAGMENT, RoundKind.MIX)
        results = [self._begin_scheduled(due) for due in schedule.mixes_due(busy, step_time_s, now)]
        self._apply_held()  # merges whose mix round is no longer due
        in_flight, free = len(self.in_flight), self.plan.max_in_flight - len(self.in_flight)
        dues = schedule.fragments_due(self.state.fragments, self._busy(RoundKind.FRAGMENT, RoundKind.MIX), free,
                                      step_time_s, now, self.census)  # fmt: skip
        for due in dues:
            results.append(self._begin_scheduled(due))
            if results[-1].status is RoundStatus.RESET:
                return results
        number = self.consensus.next_due(self._busy(RoundKind.CONSENSUS))
        if number is not None and in_flight + len(dues) < self.plan.max_in_flight:
            due = Due(RoundId(RoundKind.CONSENSUS, number), schedule.window_s(number, step_time_s, now), weight=1.0)
            results.append(self._begin(due))
        return results

    def begin_final(
        self, step_time_s: float | None, now: float | None = None, together: GroupRequest | None = None
    ) -> list[RoundBegin]:
        """At exit: cancel the mix rounds (they carry no progress, and hold the averagers the final rounds need), then
        begin every fragment round with tokens to hand over (trained since its last round began) and none in flight,
        whatever the in-flight bound, at the fragment's next boundary (clock schedule) so that units leaving together
        meet. With ``together`` (every unit of the swarm leaves: departure.py), every fragment not in flight asks for
        that group at its scheduled time instead, tokens or not, so that all of them end on one φ. Stops at a RESET:
        nothing finite to hand over."""
        now = time.time() if now is None else now
        self._cancel(RoundKind.MIX)
        results: list[RoundBegin] = []
        busy = self._busy(RoundKind.FRAGMENT)
        for rounds in self.state.fragments:
            number = rounds.fragment.number
            if number in busy or (together is None and rounds.tokens_since_round == 0):
                continue
            if together is None:
                due = Due(RoundId(RoundKind.FRAGMENT, number), self.schedule.window_s(number, step_time_s, now))
            else:
                due = Due(RoundId(RoundKind.FRAGMENT, number), together.scheduled_at - now, group=together)
            results.append(self._begin(due))
            if results[-1].status is RoundStatus.RESET:
                break
        return results

    def _begin_scheduled(self, due: Due) -> RoundBegin:
        """:meth:`_begin`, and the schedule told of a round begun."""
        begin = self._begin(due)
        if begin.status is RoundStatus.BEGUN:
            self.schedule.began(due)
        return begin

    def _begin(self, due: Due) -> RoundBegin:
        """Ask ``due``'s kind to begin it on its averager; a round begun is in flight."""
        round_id, number = due.id, due.id.fragment
        averager = (self.consensus_averagers if round_id.kind is RoundKind.CONSENSUS else self.averagers)[number]
        sent: SentRound | list[torch.Tensor] | None
        if round_id.kind is RoundKind.FRAGMENT:
            begin, sent = self.fragment_round.begin(number, averager, due.window_s, self.schedule.desired_period_s,
                                                    due.group)  # fmt: skip
            begin = replace(begin, cell=due.cell) if sent is not None else begin
        else:
            correction = self.corrections[round_id.kind]
            begin, sent = correction.begin(number, averager, due.window_s, due.weight, due.group)
        if sent is not None:
            self.in_flight[round_id] = InFlight(averager, sent)
            if round_id.kind is RoundKind.CONSENSUS:
                self.consensus.began(number)
        return begin

    # --------------------------------------------------------------------------------------------------- end
    def poll(self) -> list[RoundEnd]:
        """Merge every round that ended (never waits): fragment and mix rounds by fragment, then consensus rounds."""
        ends = []
        for round_id in sorted(self.in_flight, key=_poll_order):
            outcome = self.in_flight[round_id].averager.poll()
            if outcome is not None:
                ends.append(self._end(round_id, outcome))
        return ends

    def drain(self, timeout_s: float) -> list[RoundEnd]:
        """At exit, the one call that waits: cancel the consensus and mix rounds in flight (they carry no progress),
        then wait up to ``timeout_s`` in all for the fragment rounds in flight and merge those that end (at once: no
        mix round follows at exit); the others are cancelled and carried (results.py). Each round gets at least
        DRAIN_MIN_S: a unit stopped past the deadline (SIGSTOP, a swapped-out host) reads the outcome its averager
        process delivered meanwhile instead of dropping it (measured: a unit frozen at exit left one outer step
        apart from the five units it had averaged with)."""
        self._cancel(RoundKind.CONSENSUS, RoundKind.MIX)
        deadline = time.monotonic() + timeout_s
        ends = []
        for round_id in sorted(self.in_flight, key=_poll_order):
            flight = self.in_flight[round_id]
            outcome = flight.averager.finish_round(max(DRAIN_MIN_S, deadline - time.monotonic()))
            if outcome is not None:
                ends.append(self._end(round_id, outcome))
            else:
                del self.in_flight[round_id]
                assert isinstance(flight.sent, SentRound)
                self.fragment_round.cancel(round_id.fragment, flight.sent)
        self._cancel(RoundKind.MIX)  # the mix rounds the fragment rounds queued: their held merges are applied
        return ends

    def _cancel(self, *kinds: RoundKind) -> None:
        """Cancel the correction rounds of ``kinds`` in flight (a mix round no longer due either: the merges held for
        them are applied)."""
        for round_id in [round_id for round_id in self.in_flight if round_id.kind in kinds]:
            self.in_flight.pop(round_id).averager.finish_round(0.0)
        if RoundKind.MIX in kinds:
            self.schedule.forget_mixes()
            self._apply_held()

    def _apply_held(self) -> None:
        """Apply the held merges (state.py ``HeldMerge``) of fragments whose mix round is neither due nor in flight."""
        for number in list(self.state.held):
            if not self.schedule.mix_pending(number) and RoundId(RoundKind.MIX, number) not in self.in_flight:
                self.state.apply_held(number)

    def _end(self, round_id: RoundId, outcome: RoundOutcome) -> RoundEnd:
        """Ask the round's kind to apply ``outcome``; a fragment round's end also goes to the schedule and, merged, to
        the consensus queue."""
        sent = self.in_flight.pop(round_id).sent
        number = round_id.fragment
        if round_id.kind is not RoundKind.FRAGMENT:
            assert isinstance(sent, list)
            return self.corrections[round_id.kind].end(number, sent, outcome)
        assert isinstance(sent, SentRound)
        end = self.fragment_round.end(number, sent, outcome, hold=True)
        if end.merged:
            self.consensus.after_merge(number, end.outer_round, end.member_drift)
        self.schedule.fragment_ended(number, outcome if end.merged else None)
        self._apply_held()  # at once, unless a mix round follows: then φ changes once, at its end
        return end

    # ------------------------------------------------------------------------------------------------ windows
    def window_s(self, number: int, step_time_s: float | None, now: float) -> float:
        """The matchmaking window of a round of fragment ``number`` outside its schedule (consensus, final and settle
        rounds): until the fragment's next boundary at least a minimum window away (clock schedule), else the plan's
        window."""
        return self.schedule.window_s(number, step_time_s, now)

    def final_round_bound_s(self, step_time_s: float | None) -> float:
        """The longest a unit's rounds at exit may take: the window (clock schedule: a period and the minimum
        window), matchmaking's slack and the all-reduce."""
        return self.schedule.final_round_bound_s(step_time_s)


def _poll_order(round_id: RoundId) -> tuple[bool, int]:
    """Fragment and mix rounds (one averager per fragment) by fragment, then consensus rounds."""
    return round_id.kind is RoundKind.CONSENSUS, round_id.fragment
