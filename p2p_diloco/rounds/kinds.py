"""The kinds of round: what each hands its averager, and what its outcome does to the outer state (state.py); engine.py
says when each begins and states the contract.

* :class:`FragmentRound`: a fragment's outer round (streaming.py's payloads and merge rule).
* :class:`CorrectionRound`: a round that only pulls φ together, parametrised by what it carries: :class:`Consensus`
  (fragment p's φ_p, flat, fp32), :class:`Mix` (φ_p and m_p, shaped like a fragment round's payload) and
  :class:`Settle` (the whole φ, flat, fp32, at exit). A usable average moves φ and θ by (mean − sent).
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

import torch

from p2p_diloco.diloco import all_finite, distance
from p2p_diloco.fragments import Fragment, assign, copies, views
from p2p_diloco.rounds.averager import Averager, GroupRequest, RoundOutcome
from p2p_diloco.rounds.results import MERGES, RoundBegin, RoundEnd, RoundId, RoundKind, RoundStatus
from p2p_diloco.rounds.state import HeldMerge, OuterState
from p2p_diloco.streaming import SentRound, flatten_pieces, unflatten_pieces
from p2p_diloco.trust import MAX_STEP_RATIO, within

logger = logging.getLogger(__name__)

Tensors = list[torch.Tensor]


class FragmentRound:
    """Fragment p's outer round: its payload (the unit's proposal or pseudo-gradient), then the group's average merged
    into φ_p and m_p, the overlapped steps kept in θ_p (or that merge held back until the fragment's mix round:
    state.py ``HeldMerge``)."""

    def __init__(self, state: OuterState):
        self.state = state

    def begin(
        self, number: int, averager: Averager, window_s: float, period_s: float, group: GroupRequest = GroupRequest()
    ) -> tuple[RoundBegin, SentRound | None]:
        """Hand fragment ``number``'s payload to ``averager`` (asking for ``group``):
        BEGUN (with what was sent), DEFERRED (the averager could not take it) or RESET (θ was non-finite: θ ← φ, every
        fragment starts over)."""
        state, plan = self.state, self.state.plan
        state.apply_held(number)  # the payload starts from the merged φ_p
        rounds = state.fragments[number]
        round_id = RoundId(RoundKind.FRAGMENT, number)
        local_at_send = state.read_local(rounds.fragment)
        if not all_finite(local_at_send):
            # A diverged unit must not send NaN/inf: every group it joined would reject the average.
            logger.error("local parameters are non-finite after %d inner steps: restarting from φ", state.steps)
            state.reset_local()
            return RoundBegin(round_id, RoundStatus.RESET, rounds.outer_round), None
        payload, momentum_proposal, own_step = rounds.payload(state.global_params, state.momentum, local_at_send,
                                                              plan.step.hyper)  # fmt: skip
        weight = max(1, rounds.tokens_since_round)
        begun = averager.begin_round(
            payload, weight=weight, outer_round=rounds.outer_round, window_s=window_s,
            probe=state.probe(rounds.fragment), tag=f"fragment {number}", period_s=period_s, group=group,
            reference=rounds.reference(state.global_params, state.momentum, plan.step.hyper),
        )  # fmt: skip
        if not begun:
            return RoundBegin(round_id, RoundStatus.DEFERRED, rounds.outer_round), None
        # a round of fewer than its H steps (a joiner's first, a staggered fragment's) is measured against a full one's
        trained_steps = rounds.tokens_since_round / max(1, state.step_tokens)
        step_scale = own_step * max(1.0, plan.inner_steps_at(rounds.outer_round) / max(1.0, trained_steps))
        sent = rounds.mark_sent(payload, local_at_send, momentum_proposal, state.steps, step_scale)
        return RoundBegin(round_id, RoundStatus.BEGUN, rounds.outer_round, window_s, weight), sent

    def end(self, number: int, sent: SentRound, outcome: RoundOutcome, hold: bool = False) -> RoundEnd:
        """Merge ``outcome`` into φ_p, m_p and θ_p when it is usable (``hold``: keep that merge in the state until the
        caller applies it); otherwise carry the round's tokens and compute into the fragment's next round."""
        state = self.state
        rounds = state.fragments[number]
        rounds.steps_since_round = 0
        status, error = status_of(outcome, check_tags=False), outcome.error
        if status is RoundStatus.REJECTED:
            logger.error("rejected a non-finite average in outer round %d", rounds.outer_round)
            error = "the average was not finite"
        merged = None
        if status in MERGES:
            assert outcome.averaged is not None
            merged = rounds.merged(outcome.averaged, state.global_params, state.momentum, sent, state.plan.step.hyper)
            step = distance(merged[0], views(state.global_params, rounds.fragment))
            what = f"outer round {rounds.outer_round} of fragment {number}"
            if not plausible_step(what, step, sent.step_scale):
                status, merged = RoundStatus.REJECTED, None
                error = f"the average moves φ more than {MAX_STEP_RATIO:g}× as far as this unit's own step"
        unit_round_before = state.outer_round
        if merged is None:
            rounds.carry(sent)
        else:
            if hold:  # kept past the averager's next round, which overwrites its buffers (RoundOutcome)
                params, momentum = ([tensor.clone() for tensor in part] for part in merged)
                state.held[number] = HeldMerge(params, momentum, sent)
            else:
                state.merge(rounds.fragment, *merged, sent.local_at_send)
            rounds.outer_round = max(rounds.outer_round, outcome.max_member_round) + 1
        useful = (sent.compute_s * rounds.share, round(sent.tokens * rounds.share)) if merged is not None else (0.0, 0)
        return RoundEnd.of_fragment(number, status, outcome, (rounds.outer_round, state.outer_round), error=error,
                                    advanced=state.outer_round > unit_round_before, weight=sent.tokens,
                                    overlap_steps=state.steps - sent.inner_step, useful=useful)  # fmt: skip

    def cancel(self, number: int, sent: SentRound) -> None:
        """A round that was cancelled (at exit): its tokens and compute go into the fragment's next round."""
        self.state.fragments[number].carry(sent)


class CorrectionRound:
    """A round that only pulls φ together (see the module docstring); subclasses say what it carries. Its average is
    used when a group of two or more members that declared the same tag returned a finite mean that moves φ no more
    than MAX_STEP_RATIO times the unit's last own step; otherwise nothing changes."""

    kind: ClassVar[RoundKind]

    def __init__(self, state: OuterState):
        self.state = state

    def fragment(self, number: int) -> Fragment:
        """What the round moves."""
        return self.state.fragments[number].fragment

    def payload(self, number: int) -> Tensors:
        """What the round sends (this unit's φ of the fragment: flat, or shaped like a fragment round's payload)."""
        return [flatten_pieces(self.state.global_params, self.fragment(number))]

    def phi_part(self, number: int, tensors: Tensors) -> Tensors:
        """The φ in a payload (or in the group's average of them), as it was sent."""
        return tensors[:1]

    def pieces(self, number: int, phi: Tensors) -> Tensors:
        """The φ of :meth:`phi_part` shaped like the fragment's pieces."""
        return unflatten_pieces(phi[0], self.fragment(number), self.state.global_params)

    def step_scale(self, number: int) -> float:
        """The unit's last own step on what the round moves (see FragmentRound)."""
        return self.state.fragments[number].last_step_scale

    def tag(self, number: int) -> str:
        return f"fragment {number}"

    def rounds(self, number: int) -> tuple[int, int]:
        """The outer rounds a result of this round reports: the fragment's and the unit's."""
        return self.state.fragments[number].outer_round, self.state.outer_round

    def begin(self, number: int, averager: Averager, window_s: float, weight: float = 1.0,
              group: GroupRequest = GroupRequest()) -> tuple[RoundBegin, Tensors | None]:  # fmt: skip
        """Hand the payload to ``averager`` (asking for ``group``): BEGUN (with what was
        sent) or DEFERRED."""
        payload = self.payload(number)
        outer_round = self.rounds(number)[0]
        round_id = RoundId(self.kind, number)
        begun = averager.begin_round(payload, weight=weight, outer_round=outer_round, window_s=window_s,
                                     probe=self.state.probe(self.fragment(number)), tag=self.tag(number),
                                     group=group)  # fmt: skip
        if not begun:
            return RoundBegin(round_id, RoundStatus.DEFERRED, outer_round), None
        return RoundBegin(round_id, RoundStatus.BEGUN, outer_round, window_s), payload

    def end(self, number: int, sent: Tensors, outcome: RoundOutcome) -> RoundEnd:
        """Move φ and θ by (mean − sent) when the average is usable (see the class docstring)."""
        status = status_of(outcome, check_tags=True)
        if status is RoundStatus.MERGED:
            assert outcome.averaged is not None
            new, old = self.phi_part(number, outcome.averaged), self.phi_part(number, sent)
            what = f"a {self.kind.value} round" + (
                f" of fragment {number}" if self.kind is not RoundKind.SETTLE else ""
            )
            if plausible_step(what, distance(new, old), self.step_scale(number)):
                self.state.shift(self.fragment(number), self.pieces(number, [a - b for a, b in zip(new, old)]))
                self.merged(number, outcome.averaged)
            else:
                status = RoundStatus.REJECTED
        return RoundEnd.of_correction(RoundId(self.kind, number), status, outcome, self.rounds(number))

    def merged(self, number: int, averaged: Tensors) -> None:
        """What else a usable average changes (nothing but φ and θ by default)."""


class Consensus(CorrectionRound):
    """Lossy codecs: fragment p's φ_p averaged again in fp32 with whichever units are in the same phase."""

    kind = RoundKind.CONSENSUS


class Mix(CorrectionRound):
    """Clock schedule: fragment p's (φ_p, m_p) as its fragment round merged them (the merge held back meanwhile, so
    that φ changes once per period) averaged again among the units of its column (grid.py); the held merge is applied
    whatever the outcome, then a usable average moves φ_p and θ_p to the mean and m_p becomes the mean's."""

    kind = RoundKind.MIX

    def payload(self, number: int) -> Tensors:
        state = self.state
        fragment, held = self.fragment(number), state.held.get(number)
        if held is not None:
            return state.fragments[number].mix_payload(held.params, held.momentum)
        return state.fragments[number].mix_payload(
            copies(state.global_params, fragment), copies(state.momentum, fragment) if state.momentum else []
        )

    def end(self, number: int, sent: Tensors, outcome: RoundOutcome) -> RoundEnd:
        self.state.apply_held(number)
        return super().end(number, sent, outcome)

    def phi_part(self, number: int, tensors: Tensors) -> Tensors:
        return self.state.fragments[number].mix_parts(tensors)[0]

    def pieces(self, number: int, phi: Tensors) -> Tensors:
        return phi

    def tag(self, number: int) -> str:
        return "mix"

    def merged(self, number: int, averaged: Tensors) -> None:
        moment = self.state.fragments[number].mix_parts(averaged)[1]
        if moment:
            assign(self.state.momentum, self.fragment(number), moment)


class Settle(CorrectionRound):
    """At exit: the whole φ (``number`` 0) averaged with the units leaving at the same time, equal weights; a late one
    changes nothing (:meth:`late`). Settle rounds run one at a time once every other round ended, so nothing moves φ
    while one is in flight: the payload is φ's pieces themselves (views, in φ's shapes), and φ is copied only into the
    averager's buffers (a flat copy of the whole model, and the averager process's concatenation of it, had taken the
    memory of a unit's exit over its memory while training)."""

    kind = RoundKind.SETTLE

    def fragment(self, number: int) -> Fragment:
        return self.state.whole

    def payload(self, number: int) -> Tensors:
        return views(self.state.global_params, self.state.whole)

    def template(self) -> Tensors:
        """The shapes of a settle round's payload (on the meta device: no memory), for its averager."""
        return [torch.empty_like(piece, device="meta") for piece in self.payload(0)]

    def phi_part(self, number: int, tensors: Tensors) -> Tensors:
        return list(tensors)

    def pieces(self, number: int, phi: Tensors) -> Tensors:
        return list(phi)

    def step_scale(self, number: int) -> float:
        return math.sqrt(sum(rounds.last_step_scale**2 for rounds in self.state.fragments))

    def tag(self, number: int) -> str:
        return "settle"

    def rounds(self, number: int) -> tuple[int, int]:
        return self.state.outer_round, self.state.outer_round

    def late(self) -> RoundEnd:
        """A settle round that did not end in time: nothing changed."""
        return RoundEnd.of_correction(RoundId(self.kind, 0), RoundStatus.FAILED, None, self.rounds(0),
                                      "the settle round did not end in time")  # fmt: skip


def plausible_step(what: str, step: float, scale: float) -> bool:
    """Whether a round (``what``, for the log) that moves φ_p by ``step`` moves it within MAX_STEP_RATIO times ``scale``
    (this unit's own outer step, see SentRound.step_scale; trust.py ``within``); logs a round it rejects."""
    if within(step, scale, MAX_STEP_RATIO):
        return True
    logger.error("rejected the average of %s: it moves φ %.3g× as far as this unit's own step (bound %g×)", what,
                 step / scale, MAX_STEP_RATIO)  # fmt: skip
    return False


def status_of(outcome: RoundOutcome, check_tags: bool) -> RoundStatus:
    """FAILED without an average; REJECTED for a non-finite one (or, with ``check_tags``, members that averaged
    different things); else ALONE or MERGED by the group's size."""
    if outcome.averaged is None:
        return RoundStatus.FAILED
    if not all_finite(outcome.averaged) or (check_tags and not outcome.tags_agree):
        return RoundStatus.REJECTED
    return RoundStatus.ALONE if outcome.group_size == 1 else RoundStatus.MERGED
