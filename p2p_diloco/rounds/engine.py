"""The engine that runs a unit's outer rounds (:class:`RoundEngine`) by its plan (plan.py: :class:`RoundPlan`, derived
once from ``[outer]``, and the key schema of where units meet), and the typed results it returns.

The engine owns φ, the outer momentum m (none at all at momentum 0: it would never be read), every fragment's round
bookkeeping, the in-flight bound, the consensus queue and the matchmaking window. It never does I/O and never waits
(but in :meth:`RoundEngine.drain`, bounded, at exit): it returns typed results, and the learning unit does the I/O
they call for. The calling loop::

    engine = RoundEngine(plan, averagers, consensus_averagers, local=trainer.params)
    while training:
        stats = trainer.train_step(batches)
        engine.record_step(stats.tokens, stats.seconds)
        for end in engine.poll():                         # rounds that ended, already merged into φ, m and θ
            ...                                           # metrics, goodput; when end.advanced: publish, eval, ...
        for begin in engine.begin_due(step_time_s, now):  # rounds that became due (now: the DHT's clock)
            ...                                           # RESET: θ was reset to φ, reset the inner optimizer
    engine.begin_final(step_time_s, now); engine.drain(engine.final_round_bound_s(step_time_s))
    for _ in range(plan.settle_rounds):                   # with the averager of the run's settle key
        engine.begin_settle(settle_averager, window_s); engine.end_settle(settle_averager.finish_round(...))

When rounds are due: with ``schedule = "clock"`` at the boundaries of shared time of clock.py (every reachable unit
meets at every boundary), with ``"steps"`` H of the unit's own inner steps after its previous round (fragments
staggered by H/P steps; units' phases then drift apart with their speeds).

The mix stage (clock schedule, fp32 proposals, and more live units than ``target_group_size``: the caller sets
:attr:`RoundEngine.swarm_size`): a round's groups hold at most ``target_group_size`` members, so a swarm larger than
that ends a round as several group means. Half a period after each fragment round, a mix round
averages the fragment's (φ_p, m_p) again, weighted by the first group's total weight, among the units that had the
same position in their first group (hivemind's group bits: ``subgroup`` = the position in binary). Each mix group
then holds one member of every first group, so with groups of equal size and at most ``target_group_size`` of them
(N ≤ target²) every unit ends the period on the exact weighted mean of all proposals: synchronous DiLoCo's φ. With
unequal groups it is close to it; a unit alone in the first round (position 0) meets the others' first members.

Failure contract (what each outcome does to φ_p, m_p and θ_p of fragment p; see streaming.py for the payloads):

* ``MERGED`` / ``ALONE``: the group's average (alone, with quorum 1: the unit's own payload) becomes φ_p and m_p,
  θ_p ← φ_p + (θ_p,now − θ_p,sent) keeps the steps taken while the round was in flight, however late it arrived; the
  fragment's round becomes max(members' rounds) + 1 and its next round is due H inner steps later. A partial average
  (a member died mid all-reduce, HIVEMIND.md trap 2) merges like any other: the following rounds average it out.
* ``FAILED`` (no group of ``quorum`` members, a network error, a stuck averager replaced) and ``REJECTED`` (a non-finite
  average, or one that would move φ_p more than MAX_STEP_RATIO times as far as the unit's own outer step on its own
  Δ_p, scaled to H steps: a member that scaled its payload; mix, consensus and settle rounds are bounded the same way
  by the last own step): φ_p, m_p, θ_p and the round are unchanged; the round's tokens and compute go into the
  fragment's next round, whose pseudo-gradient still holds its progress, so nothing is lost.
* ``DEFERRED``: the averager could not take the round yet (its tensors are held); nothing changed, the round stays due.
* ``RESET``: θ was non-finite when a round was due: nothing is sent, θ ← φ, every fragment's schedule restarts and the
  caller resets its inner optimizer; the steps since the last merge are lost.
* A consensus round (lossy codecs) adds (group mean − sent φ_p) to φ_p and θ_p when a group of two or more members
  agreeing on the fragment returned a finite mean (``MERGED``); otherwise it changes nothing. A mix round (``MIX``)
  does the same with φ_p, and m_p becomes the mean's; the round number stays.
* At exit, :meth:`RoundEngine.drain` waits a bounded time; a round still running is cancelled and carried like a
  failed one (its progress stays in θ and in the checkpoint).
* A settle round (``SETTLE``, at exit, after the final rounds) averages the whole φ in fp32, with equal weights, among
  the units leaving at the same boundary, through an averager of its own whose groups are as large as hivemind allows
  (the settle key of :class:`KeySchema`): a group of two or more adds (mean − sent) to φ and θ, like a consensus
  round; otherwise nothing changes. Units that leave together thereby leave as one model even when the rounds'
  groups are smaller than the swarm; m and the round numbers are unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from p2p_diloco.diloco import (
    all_finite,
    consensus_probe,
    consensus_probe_indices,
    distance,
    merge_local_progress,
)
from p2p_diloco.fragments import Fragment, assign, copies, due_fragments, partition, views
from p2p_diloco.rounds.averager import Averager, RoundOutcome
from p2p_diloco.rounds.clock import next_boundary
from p2p_diloco.rounds.plan import FINAL_ROUND_SLACK_S, RoundPlan
from p2p_diloco.rounds.results import MERGES, RoundBegin, RoundEnd, RoundKind, RoundStatus
from p2p_diloco.streaming import (
    ErrorFeedback,
    FragmentRounds,
    Roundtrip,
    SentRound,
    consensus_correction,
    consensus_payload,
)

logger = logging.getLogger(__name__)

Tensors = list[torch.Tensor]
BUSY_DECAY = 0.1  # how fast the measured busy time of a round comes down again
# A round's average may move φ_p at most this many times as far as the unit's own outer step would have: honest
# groups moved it 0.8× at the median and 11.4× at most (a SmolLM2 joiner's first round: one inner step, in warm-up,
# while its downloaded φ_p lagged a round); a member sending 1000 × its proposal moved it 244× to 2,330× (see the
# module docstring's REJECTED).
MAX_STEP_RATIO = 30.0


@dataclass(frozen=True)
class MixDue:
    """A fragment's mix round to begin: at ``boundary``, in ``subgroup``, carrying ``weight``."""

    boundary: float
    subgroup: str
    weight: float


class LocalSync(Protocol):
    """Where the trained θ lives when the engine's ``local`` is a copy of it (rank 0 of a unit of several ranks:
    ranks.py). Both calls raise when the other ranks are lost."""

    def fetch(self, indices: Sequence[int]) -> None:
        """Bring ``local[i]`` up to date for each ``i`` in ``indices`` before the engine reads it."""

    def store(self, indices: Sequence[int]) -> None:
        """Carry ``local[i]``, which the engine just wrote, for each ``i`` in ``indices`` to where θ is trained."""


class _InPlace:
    """``local`` is θ itself: nothing to fetch or store."""

    def fetch(self, indices: Sequence[int]) -> None:
        pass

    def store(self, indices: Sequence[int]) -> None:
        pass


# ----------------------------------------------------------------------------------------------------- engine
class RoundEngine:
    """Runs one unit's outer rounds (see the module docstring for the loop and the failure contract).

    ``averagers`` has one averager per fragment of ``plan``; ``consensus_averagers`` one more per fragment exactly
    when ``plan.consensus``. ``local`` are the trained tensors θ: read when a round is sent, written when it merges
    (``sync`` is told before each read and after each write, when ``local`` is a copy of θ kept elsewhere).
    ``roundtrip`` is what the receivers decode of a tensor the fragment averagers send (their codec's round trip),
    needed for error feedback. φ starts as a copy of θ and m at zero (or as none, at momentum 0). Raises ValueError
    when the averagers do not match the plan, or without ``roundtrip`` for a plan with error feedback.
    """

    def __init__(
        self,
        plan: RoundPlan,
        averagers: Sequence[Averager],
        consensus_averagers: Sequence[Averager] = (),
        *,
        local: Sequence[torch.Tensor],
        sync: LocalSync = _InPlace(),
        roundtrip: Roundtrip | None = None,
    ):
        count = len(plan.fragments)
        if len(averagers) != count or len(consensus_averagers) != (count if plan.consensus else 0):
            raise ValueError(f"a plan of {count} fragments (consensus: {plan.consensus}) got {len(averagers)} "
                             f"averagers and {len(consensus_averagers)} consensus averagers")  # fmt: skip
        if plan.error_feedback and roundtrip is None:
            raise ValueError("error feedback needs the codec's round trip")
        self.plan, self.roundtrip = plan, roundtrip
        self.averagers, self.consensus_averagers = list(averagers), list(consensus_averagers)
        self.local, self.sync = list(local), sync
        self.global_params: Tensors = [tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
                                       for tensor in self.local]  # fmt: skip
        self.momentum: Tensors = self._kept_momentum(())
        total = sum(fragment.numel for fragment in plan.fragments)
        self.fragments = [self._fragment_rounds(fragment, fragment.numel / total) for fragment in plan.fragments]
        self.probe_indices = [consensus_probe_indices(views(self.global_params, f)) for f in plan.fragments]
        self.consensus_due: list[int] = []  # fragments waiting for a consensus round, oldest first
        self.consensus_sent: dict[int, torch.Tensor] = {}  # fragment → payload of its consensus round in flight
        self.settle_sent: torch.Tensor | None = None  # φ flat, of the settle round in flight
        self.whole = partition([tensor.shape for tensor in self.global_params], 1)[0]  # the model as one fragment
        self.settle_probe_indices = consensus_probe_indices(self.global_params)
        self.steps = 0  # inner steps recorded (the clock of overlaps)
        self.step_tokens = 0  # tokens of the last inner step (how many steps a round's tokens stand for)
        self.clock = plan.clock()
        self.last_boundary = [-math.inf] * count  # clock schedule: per fragment, the boundary of its last round
        self.swarm_size = 1  # live units the caller knows of, itself included (the mix stage runs beyond the target)
        self.mix_due: dict[int, MixDue] = {}  # fragment → its mix round to begin
        self.mix_sent: dict[int, Tensors] = {}  # fragment → (φ_p, m_p) of its mix round in flight
        self.busy_s: float | None = None  # clock schedule: how long after its boundary a round kept the unit
        self._ended_since_look: set[int] = set()  # fragments whose round ended since the last begin_due
        self._restart_schedules()

    def _fragment_rounds(self, fragment: Fragment, share: float) -> FragmentRounds:
        feedback = self.plan.error_feedback
        return FragmentRounds(
            fragment,
            share,
            self.plan.payload,
            error_feedback=ErrorFeedback() if feedback else None,
            roundtrip=self.roundtrip if feedback else None,
            radial=self.plan.radial(fragment),
        )

    def _restart_schedules(self) -> None:
        for rounds in self.fragments:
            rounds.restart_schedule(len(self.fragments), self.plan.inner_steps)

    # -------------------------------------------------------------------------------------------- state
    @property
    def outer_round(self) -> int:
        """The outer round every fragment reached (the smallest fragment round)."""
        return min(rounds.outer_round for rounds in self.fragments)

    def fragment_rounds(self) -> list[int]:
        return [rounds.outer_round for rounds in self.fragments]

    def probe(self) -> list[float]:
        """φ at the first fragment's probe coordinates (those of φ_0): what units compare to measure how far apart
        their models are."""
        return consensus_probe(views(self.global_params, self.plan.fragments[0]), self.probe_indices[0])

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """The host tensors the engine holds: φ, m, and its rounds' θ_p at send, momentum proposals and error-feedback
        residuals."""
        yield from self.global_params
        yield from self.momentum
        for rounds in self.fragments:
            if rounds.sent is not None:
                yield from rounds.sent.local_at_send
                yield from rounds.sent.momentum_proposal
            if rounds.error_feedback is not None:
                yield from rounds.error_feedback.residuals

    def load_state(self, global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                   fragment_rounds: Sequence[int]) -> None:  # fmt: skip
        """Adopt φ, m and per-fragment rounds (a downloaded state or a checkpoint; θ is the caller's). A list of
        rounds for another number of fragments sets every fragment to its smallest value."""
        self.global_params = [tensor.detach().to(device="cpu", dtype=torch.float32) for tensor in global_params]
        self.momentum = self._kept_momentum(momentum)
        if len(fragment_rounds) != len(self.fragments):
            fragment_rounds = [min(fragment_rounds, default=0)] * len(self.fragments)
        for rounds, value in zip(self.fragments, fragment_rounds):
            rounds.outer_round = int(value)

    def _kept_momentum(self, momentum: Sequence[torch.Tensor]) -> Tensors:
        """m as the engine keeps it: none at momentum 0 (a given m is dropped), else ``momentum`` on the host in fp32,
        or zeros when none is given (a state or checkpoint of a unit at momentum 0)."""
        if not self.plan.keeps_momentum:
            return []
        if not momentum:
            return [torch.zeros_like(tensor) for tensor in self.global_params]
        return [tensor.detach().to(device="cpu", dtype=torch.float32) for tensor in momentum]

    def record_step(self, tokens: int, compute_s: float) -> None:
        """Count one inner step toward every fragment's next round."""
        self.steps += 1
        self.step_tokens = tokens
        for rounds in self.fragments:
            rounds.record_step(tokens, compute_s)

    def fragments_in_flight(self) -> list[int]:
        """The fragments whose round is in flight."""
        return [rounds.fragment.number for rounds in self.fragments if rounds.sent is not None]

    def in_flight(self) -> set[int]:
        """Rounds in flight: fragment numbers p (fragment and mix rounds), and P + p for fragment p's consensus
        round."""
        consensus = {len(self.fragments) + number for number in self.consensus_sent}
        return set(self.fragments_in_flight()) | set(self.mix_sent) | consensus

    # ------------------------------------------------------------------------------------------- begin
    def begin_due(self, step_time_s: float | None, now: float | None = None) -> list[RoundBegin]:
        """Begin the rounds that are due within the in-flight bound (fragment rounds by the plan's schedule, then the
        oldest waiting consensus round); ``now`` is the shared clock (default: this machine's). After a RESET nothing
        else begins."""
        now = time.time() if now is None else now
        results = self._begin_mixes(step_time_s, now)
        in_flight = self.in_flight()
        windows = self._due_windows(step_time_s, now, in_flight)
        for number, (window_s, boundary) in windows.items():
            results.append(self._begin(self.fragments[number], window_s))
            if results[-1].status is RoundStatus.RESET:
                return results
            if results[-1].status is RoundStatus.BEGUN:
                self.last_boundary[number] = boundary
        ready = [number for number in self.consensus_due if number not in self.consensus_sent]
        if ready and len(in_flight) + len(windows) < self.plan.max_in_flight:
            results.append(self._begin_consensus(ready[0], self.boundary_window_s(ready[0], step_time_s, now)))
        return results

    def _due_windows(
        self, step_time_s: float | None, now: float, in_flight: set[int]
    ) -> dict[int, tuple[float, float]]:
        """The fragment rounds due now, with their matchmaking windows and boundaries, within the in-flight bound."""
        if self.clock is None or step_time_s is None:  # the clock needs a step time: H own steps until then
            steps = [rounds.steps_since_round for rounds in self.fragments]
            due = due_fragments(steps, in_flight, self.plan.inner_steps, self.plan.max_in_flight)
            window_s = self.plan.window_s(step_time_s)
            return {number: (window_s, now + window_s) for number in due}
        for number in self._ended_since_look:
            if math.isfinite(self.last_boundary[number]):
                busy = max(0.0, now - self.last_boundary[number])
                decayed = busy if self.busy_s is None else self.busy_s + BUSY_DECAY * (busy - self.busy_s)
                self.busy_s = max(busy, decayed)  # up at once, down slowly: the period does not flap
        self._ended_since_look.clear()
        self.clock.rounds_per_period = 2 if self.mixing else 1
        self.clock.update(step_time_s, self.busy_s or 0.0)
        free = self.plan.max_in_flight - len(in_flight)
        windows: dict[int, tuple[float, float]] = {}
        for rounds in self.fragments:
            number = rounds.fragment.number
            if len(windows) >= free or number in in_flight or rounds.steps_since_round == 0:
                continue
            window = self.clock.due_window(number, now, step_time_s, after=self.last_boundary[number])
            if window is not None:
                self.mix_due.pop(number, None)  # a mix not begun by the next round is stale
                windows[number] = (window, self.clock.boundary(number, now + self.plan.min_window_s))
        return windows

    def _begin_mixes(self, step_time_s: float | None, now: float) -> list[RoundBegin]:
        """Begin the mix rounds whose boundary is within the lead (those too close to begin are dropped)."""
        results = []
        for number, due in list(self.mix_due.items()):
            window_s = due.boundary - now
            if self.clock is None or step_time_s is None or window_s < self.plan.min_window_s:
                del self.mix_due[number]
            elif number not in self.in_flight() and window_s <= self.clock.lead_s(step_time_s):
                results.append(self._begin_mix(number, due, window_s + self.clock.jitter_s()))
        return results

    def _begin_mix(self, number: int, due: MixDue, window_s: float) -> RoundBegin:
        rounds = self.fragments[number]
        payload = rounds.mix_payload(self.global_params, self.momentum)
        probe = consensus_probe(views(self.global_params, rounds.fragment), self.probe_indices[number])
        begun = self.averagers[number].begin_round(
            payload, weight=due.weight, outer_round=rounds.outer_round, window_s=window_s, probe=probe, tag="mix",
            subgroup=due.subgroup,
        )  # fmt: skip
        if not begun:
            return RoundBegin(RoundKind.MIX, number, RoundStatus.DEFERRED, rounds.outer_round)
        del self.mix_due[number]
        self.mix_sent[number] = payload
        return RoundBegin(RoundKind.MIX, number, RoundStatus.BEGUN, rounds.outer_round, window_s)

    def boundary_window_s(self, number: int, step_time_s: float | None, now: float) -> float:
        """The matchmaking window of a round of fragment ``number`` outside its schedule (consensus, final and settle
        rounds): until the fragment's next boundary at least a minimum window away (clock schedule), else the plan's
        window."""
        if self.clock is None or self.clock.period_s is None:
            return self.plan.window_s(step_time_s)
        return max(self.plan.min_window_s, self.clock.boundary(number, now + self.plan.min_window_s) - now)

    def final_round_bound_s(self, step_time_s: float | None) -> float:
        """The longest a unit's rounds at exit may take: the window (clock schedule: a period and the minimum
        window), matchmaking's slack and the all-reduce."""
        period = self.clock.period_s if self.clock is not None else None
        window_s = self.plan.window_s(step_time_s) if period is None else period + self.plan.min_window_s
        return window_s + FINAL_ROUND_SLACK_S + self.plan.allreduce_timeout_s

    def begin_final(self, step_time_s: float | None, now: float | None = None) -> list[RoundBegin]:
        """At exit: begin every fragment round with steps to hand over and none in flight, whatever the in-flight
        bound, at the fragment's next boundary (clock schedule) so that units leaving together meet (stops at a
        RESET: nothing finite to hand over)."""
        now = time.time() if now is None else now
        self._cancel_mixes()  # they carry no progress, and they hold the averagers the final rounds need
        results = []
        for rounds in self.fragments:
            if rounds.sent is None and rounds.steps_since_round > 0:
                results.append(self._begin(rounds, self.boundary_window_s(rounds.fragment.number, step_time_s, now)))
                if results[-1].status is RoundStatus.RESET:
                    break
        return results

    def _begin(self, rounds: FragmentRounds, window_s: float) -> RoundBegin:
        number = rounds.fragment.number
        local_at_send = self._read_local(rounds.fragment)
        if not all_finite(local_at_send):
            # A diverged unit must not send NaN/inf: every group it joined would reject the average.
            logger.error("local parameters are non-finite after %d inner steps: restarting from φ", self.steps)
            with torch.no_grad():
                for tensor, value in zip(self.local, self.global_params):
                    tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
            self.sync.store(range(len(self.local)))
            self._restart_schedules()
            return RoundBegin(RoundKind.FRAGMENT, number, RoundStatus.RESET, rounds.outer_round)
        payload, momentum_proposal, own_step = rounds.payload(self.global_params, self.momentum, local_at_send,
                                                              self.plan.hyper)  # fmt: skip
        weight = max(1, rounds.tokens_since_round)
        probe = consensus_probe(views(self.global_params, rounds.fragment), self.probe_indices[number])
        tag = f"fragment {number}"
        period_s = (self.clock.desired_s or 0.0) if self.clock is not None else 0.0  # shared with the group
        begun = self.averagers[number].begin_round(
            payload, weight=weight, outer_round=rounds.outer_round, window_s=window_s, probe=probe, tag=tag,
            period_s=period_s,
        )  # fmt: skip
        if not begun:
            return RoundBegin(RoundKind.FRAGMENT, number, RoundStatus.DEFERRED, rounds.outer_round)
        # a round of fewer than H steps (a joiner's first, a staggered fragment's) is measured against a full one's
        trained_steps = rounds.tokens_since_round / max(1, self.step_tokens)
        step_scale = own_step * max(1.0, self.plan.inner_steps / max(1.0, trained_steps))
        rounds.mark_sent(payload, local_at_send, momentum_proposal, self.steps, step_scale)
        return RoundBegin(RoundKind.FRAGMENT, number, RoundStatus.BEGUN, rounds.outer_round, window_s, weight)

    def _begin_consensus(self, number: int, window_s: float) -> RoundBegin:
        """Average fragment ``number``'s φ_p in fp32 with whichever units are in the same phase; DEFERRED when its
        averager cannot take the round yet (it stays first in line)."""
        rounds = self.fragments[number]
        payload = consensus_payload(self.global_params, rounds.fragment)
        probe = consensus_probe(views(self.global_params, rounds.fragment), self.probe_indices[number])
        tag = f"fragment {number}"
        begun = self.consensus_averagers[number].begin_round(
            [payload], weight=1.0, outer_round=rounds.outer_round, window_s=window_s, probe=probe, tag=tag
        )
        if not begun:
            return RoundBegin(RoundKind.CONSENSUS, number, RoundStatus.DEFERRED, rounds.outer_round)
        self.consensus_due.remove(number)
        self.consensus_sent[number] = payload
        return RoundBegin(RoundKind.CONSENSUS, number, RoundStatus.BEGUN, rounds.outer_round, window_s)

    def begin_settle(self, averager: Averager, window_s: float) -> bool:
        """At exit, after the final rounds: hand φ (flat, fp32, weight 1) to ``averager`` for a settle round (see the
        module docstring); False when it could not take it."""
        payload = torch.cat([tensor.reshape(-1) for tensor in self.global_params])
        probe = consensus_probe(self.global_params, self.settle_probe_indices)
        if not averager.begin_round([payload], weight=1.0, outer_round=self.outer_round, window_s=window_s,
                                    probe=probe, tag="settle"):  # fmt: skip
            return False
        self.settle_sent = payload
        return True

    def end_settle(self, outcome: RoundOutcome | None) -> RoundEnd:
        """Apply a settle round's outcome (None: it did not end in time, nothing changes)."""
        sent, self.settle_sent = self.settle_sent, None
        assert sent is not None, "a settle outcome arrived without a settle round in flight"
        if outcome is None:
            return RoundEnd(RoundKind.SETTLE, 0, RoundStatus.FAILED, self.outer_round, self.outer_round, False, 0, 0.0,
                            0.0, 0, 0, 0.0, 0, "the settle round did not end in time")  # fmt: skip
        status = _status(outcome, check_tags=True)
        if status is RoundStatus.MERGED:
            assert outcome.averaged is not None
            scale = math.sqrt(sum(rounds.last_step_scale**2 for rounds in self.fragments))
            if not _plausible_step("a settle round", distance(outcome.averaged, [sent]), scale):
                status = RoundStatus.REJECTED
        if status is RoundStatus.MERGED:
            assert outcome.averaged is not None
            self._shift(self.whole, consensus_correction(outcome.averaged[0], sent, self.whole, self.global_params))
        return self._consensus_end(0, RoundKind.SETTLE, status, outcome)

    @property
    def settle_period_s(self) -> float:
        """The grid of the settle rounds' boundaries, shared by every unit whatever its period or schedule: two
        minimum windows (a settle round after another begins one period later)."""
        return 2 * self.plan.min_window_s

    def settle_window_s(self, now: float, not_before: float = 0.0) -> float:
        """A settle round's matchmaking window: until the first boundary of the settle grid at least a minimum window
        after ``now`` and ``not_before``."""
        return next_boundary(max(now, not_before) + self.plan.min_window_s, self.settle_period_s, 0.0) - now

    def settle_patience(self, step_time_s: float | None) -> int:
        """Settle rounds a unit goes on with beyond the plan's while a unit finishing with it has not met it yet: as
        many as fit in the final rounds' bound, which that unit may still be waiting out."""
        return math.ceil(self.final_round_bound_s(step_time_s) / self.settle_period_s)

    def settle_template(self) -> Tensors:
        """A tensor shaped like a settle round's payload (φ flat)."""
        return [torch.zeros(sum(tensor.numel() for tensor in self.global_params))]

    # --------------------------------------------------------------------------------------------- end
    def poll(self) -> list[RoundEnd]:
        """Merge every fragment and consensus round that ended (never waits); their results, in that order."""
        ends = []
        for rounds, averager in zip(self.fragments, self.averagers):
            outcome = averager.poll()
            if outcome is not None and rounds.fragment.number in self.mix_sent:
                ends.append(self._end_mix(rounds, outcome))
            elif outcome is not None:
                ends.append(self._end(rounds, outcome))
        for number, averager in enumerate(self.consensus_averagers):
            outcome = averager.poll()
            if outcome is not None:
                ends.append(self._end_consensus(number, outcome))
        return ends

    def drain(self, timeout_s: float) -> list[RoundEnd]:
        """At exit, the one call that waits but the settle rounds': cancel the consensus rounds in flight (they carry
        no progress), then wait up to ``timeout_s`` in all for the fragment rounds in flight and merge those that
        end; the others are cancelled and carried (see the module docstring)."""
        for number in list(self.consensus_sent):
            self.consensus_averagers[number].finish_round(0.0)
            del self.consensus_sent[number]
        self._cancel_mixes()
        deadline = time.monotonic() + timeout_s
        ends = []
        for rounds, averager in zip(self.fragments, self.averagers):
            if rounds.sent is None:
                continue
            outcome = averager.finish_round(max(0.0, deadline - time.monotonic()))
            if outcome is not None:
                ends.append(self._end(rounds, outcome))
            else:
                rounds.carry(rounds.sent)
                rounds.sent = None
        return ends

    def _cancel_mixes(self) -> None:
        """Cancel the mix rounds in flight and forget those due."""
        for number in list(self.mix_sent):
            self.averagers[number].finish_round(0.0)
            del self.mix_sent[number]
        self.mix_due.clear()

    def _end(self, rounds: FragmentRounds, outcome: RoundOutcome) -> RoundEnd:
        sent, rounds.sent = rounds.sent, None
        assert sent is not None, "an outcome arrived without a round in flight"
        self._ended_since_look.add(rounds.fragment.number)
        rounds.steps_since_round = 0
        status = _status(outcome, check_tags=False)
        if status is RoundStatus.REJECTED:
            logger.error("rejected a non-finite average in outer round %d", rounds.outer_round)
        merged = None
        if status in MERGES:
            assert outcome.averaged is not None
            merged = rounds.merged(outcome.averaged, self.global_params, self.momentum, sent, self.plan.hyper)
            step = distance(merged[0], copies(self.global_params, rounds.fragment))
            what = f"outer round {rounds.outer_round} of fragment {rounds.fragment.number}"
            if not _plausible_step(what, step, sent.step_scale):
                status, merged = RoundStatus.REJECTED, None
        if merged is None:
            rounds.carry(sent)
            return self._fragment_end(rounds, outcome, sent, status, advanced=False)
        unit_round_before = self.outer_round
        self._merge(rounds, merged, sent)
        rounds.outer_round = max(rounds.outer_round, outcome.max_member_round) + 1
        self._maybe_queue_consensus(rounds, outcome.member_drift)
        self._after_clock_round(rounds.fragment.number, outcome)
        return self._fragment_end(rounds, outcome, sent, status, advanced=self.outer_round > unit_round_before)

    def _merge(self, rounds: FragmentRounds, merged: tuple[Tensors, Tensors], sent: SentRound) -> None:
        """φ_p, m_p ← the merged values; θ_p ← φ_p + (θ_p,now − θ_p,sent)."""
        new_params, new_momentum = merged
        assign(self.global_params, rounds.fragment, new_params)
        if new_momentum:
            assign(self.momentum, rounds.fragment, new_momentum)
        merged_local = merge_local_progress(new_params, self._read_local(rounds.fragment), sent.local_at_send)
        self._write_local(rounds.fragment, merged_local)

    @property
    def mixing(self) -> bool:
        """Whether mix rounds follow the fragment rounds now (see the module docstring)."""
        return self.plan.mixes and self.swarm_size > self.plan.target_group_size

    def _after_clock_round(self, number: int, outcome: RoundOutcome) -> None:
        """Clock schedule: follow the members' period, and queue the fragment's mix round half a period after the
        round's boundary, in the subgroup of this unit's position."""
        clock = self.clock
        if clock is None or clock.period_s is None:
            return
        clock.adopt(outcome.member_periods)
        if self.mixing and math.isfinite(self.last_boundary[number]):
            half = clock.period_s / 2
            self.mix_due[number] = MixDue(self.last_boundary[number] + half, format(outcome.position, "b"),
                                          max(outcome.total_weight, 1.0))  # fmt: skip

    def _end_mix(self, rounds: FragmentRounds, outcome: RoundOutcome) -> RoundEnd:
        """φ_p and θ_p move by (mix group's mean − sent φ_p), m_p ← the mean's, when it is usable."""
        number = rounds.fragment.number
        sent = self.mix_sent.pop(number)
        status = _status(outcome, check_tags=True)
        phi, moment = rounds.mix_parts(outcome.averaged) if outcome.averaged is not None else ([], [])
        what, sent_phi = f"a mix round of fragment {number}", rounds.mix_parts(sent)[0]
        if status is RoundStatus.MERGED and not _plausible_step(what, distance(phi, sent_phi), rounds.last_step_scale):
            status = RoundStatus.REJECTED
        if status is RoundStatus.MERGED:
            self._shift(rounds.fragment, [new - old for new, old in zip(phi, sent_phi)])
            if moment:
                assign(self.momentum, rounds.fragment, moment)
        return self._consensus_end(number, RoundKind.MIX, status, outcome)

    def _maybe_queue_consensus(self, rounds: FragmentRounds, member_drift: float) -> None:
        """Queue a consensus round of the fragment every N of its rounds and after one whose members' φ_p differed by
        more than the tolerance (every member saw the same probes, so all decide alike)."""
        plan, number = self.plan, rounds.fragment.number
        periodic = plan.consensus and rounds.outer_round % plan.consensus_every_rounds == 0
        drifted = plan.consensus and member_drift > plan.consensus_tolerance
        if (periodic or drifted) and number not in self.consensus_due:
            self.consensus_due.append(number)

    def _fragment_end(self, rounds: FragmentRounds, outcome: RoundOutcome, sent: SentRound, status: RoundStatus,
                      advanced: bool) -> RoundEnd:  # fmt: skip
        merged = status in MERGES
        return RoundEnd(
            kind=RoundKind.FRAGMENT,
            fragment=rounds.fragment.number,
            status=status,
            outer_round=rounds.outer_round,
            unit_outer_round=self.outer_round,
            advanced=advanced,
            group_size=outcome.group_size,
            member_drift=outcome.member_drift,
            seconds=outcome.finished_at - outcome.started_at,
            weight=sent.tokens,
            overlap_steps=self.steps - sent.inner_step,
            useful_compute_s=sent.compute_s * rounds.share if merged else 0.0,
            useful_tokens=round(sent.tokens * rounds.share) if merged else 0,
            error="the average was not finite" if status is RoundStatus.REJECTED else outcome.error,
        )

    def _end_consensus(self, number: int, outcome: RoundOutcome) -> RoundEnd:
        """Add (group mean − sent) to φ_p and θ_p when the round is usable (see the module docstring)."""
        sent = self.consensus_sent.pop(number)
        status = _status(outcome, check_tags=True)
        rounds = self.fragments[number]
        if status is RoundStatus.MERGED:
            assert outcome.averaged is not None
            step = distance(outcome.averaged, [sent])
            if not _plausible_step(f"a consensus round of fragment {number}", step, rounds.last_step_scale):
                status = RoundStatus.REJECTED
        if status is RoundStatus.MERGED:
            assert outcome.averaged is not None
            fragment = rounds.fragment
            self._shift(fragment, consensus_correction(outcome.averaged[0], sent, fragment, self.global_params))
        return self._consensus_end(number, RoundKind.CONSENSUS, status, outcome)

    def _shift(self, fragment: Fragment, delta: Sequence[torch.Tensor]) -> None:
        """Add ``delta`` (shaped like the fragment's pieces) to φ's and θ's pieces of ``fragment``: a correction
        round moves the unit to its group's mean without undoing what merged meanwhile."""
        assign(
            self.global_params, fragment, [now + step for now, step in zip(copies(self.global_params, fragment), delta)]
        )
        self._write_local(fragment, [now + step for now, step in zip(self._read_local(fragment), delta)])

    def _read_local(self, fragment: Fragment) -> Tensors:
        """θ's pieces of ``fragment`` (copies), fetched first."""
        self.sync.fetch(fragment.tensor_indices)
        return copies(self.local, fragment)

    def _write_local(self, fragment: Fragment, values: Sequence[torch.Tensor]) -> None:
        """``values`` into θ's pieces of ``fragment``, stored after."""
        assign(self.local, fragment, values)
        self.sync.store(fragment.tensor_indices)

    def _consensus_end(self, number: int, kind: RoundKind, status: RoundStatus, outcome: RoundOutcome) -> RoundEnd:
        return RoundEnd(
            kind=kind,
            fragment=number,
            status=status,
            outer_round=self.fragments[number].outer_round,
            unit_outer_round=self.outer_round,
            advanced=False,
            group_size=outcome.group_size,
            member_drift=outcome.member_drift,
            seconds=outcome.finished_at - outcome.started_at,
            weight=0,
            overlap_steps=0,
            useful_compute_s=0.0,
            useful_tokens=0,
            error=outcome.error,
        )


def _plausible_step(what: str, step: float, scale: float) -> bool:
    """Whether a round (``what``, for the log) that moves φ_p by ``step`` moves it at most MAX_STEP_RATIO times
    ``scale`` (this unit's own outer step, see SentRound.step_scale); logs a round it rejects. True while ``scale`` is 0
    (before the unit sent a round)."""
    if scale <= 0 or step <= MAX_STEP_RATIO * scale:
        return True
    logger.error("rejected the average of %s: it moves φ %.3g× as far as this unit's own step (bound %g×)", what,
                 step / scale, MAX_STEP_RATIO)  # fmt: skip
    return False


def _status(outcome: RoundOutcome, check_tags: bool) -> RoundStatus:
    """FAILED without an average; REJECTED for a non-finite one (or, with ``check_tags``, members that averaged
    different things); else ALONE or MERGED by the group's size."""
    if outcome.averaged is None:
        return RoundStatus.FAILED
    if not all_finite(outcome.averaged) or (check_tags and not outcome.tags_agree):
        return RoundStatus.REJECTED
    return RoundStatus.ALONE if outcome.group_size == 1 else RoundStatus.MERGED
