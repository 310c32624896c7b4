"""One streaming fragment's outer rounds: what a unit sends for it and how the average comes back (torch only).

Two kinds of payload (:class:`Payload`, chosen by the round plan from the codec, rounds/plan.py):

* with ``fp32``, the *proposal*: the outer step the unit would take alone, ``(φ'_p, m'_p) = OuterOpt(φ_p, m_p, Δ_p)``
  (m'_p only with ``sync_momentum``). Members average proposals, which also averages their φ_p and m_p: every round
  pulls the members' global parameters together (see diloco.py).
* with ``fp16`` / ``int8``, the pseudo-gradient Δ_p, compressed on the wire. Proposals cannot be compressed (φ itself
  would be quantized every round), so each member applies the outer step to the averaged Δ_p with its own φ_p and
  m_p. With error feedback (:class:`ErrorFeedback`), what the codec dropped from a unit's Δ_p is added to its next
  Δ_p. Members' φ_p then drift apart by the codec's error every round (each member adds the reply to its own
  uncompressed part; measured with int8: a relative distance of 2.8e-2 of the update between two members, fp16:
  3.6e-4), and nothing in a Δ round pulls them back (nor after a unit averaged alone), so a consensus round
  re-averages φ_p in fp32 (:func:`flatten_pieces`) every few rounds and after any round whose members' probes of φ_p
  differed by more than a tolerance. The momenta are not re-averaged: their disagreement stays bounded because each
  round multiplies it by μ < 1.

With ``merge = "rda"`` (fp32 only) a proposal payload carries φ_p (and m_p) as they were, each piece's unit direction
of Δ_p and one vector of the pieces' norms (diloco.py: :func:`radial_parts`); each member then takes the outer step
from the group's mean φ_p and m_p on the radial-directional merge of Δ_p. Averaging φ_p and m_p pulls members together
as proposals do; the step equals the proposal average whenever the members' Δ_p are parallel.

Overlap rule (every payload): when fragment p's average arrives τ inner steps after it was sent (τ is whatever the
network took: the inner loop never waits), φ_p ← merged value and θ_p ← φ_p + (θ_p,now − θ_p,sent): the τ overlapped
steps' progress on fragment p is kept; other fragments are untouched.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.diloco import (
    OuterHyperparams,
    distance,
    outer_step,
    pseudo_gradient,
    radial_merge,
    radial_parts,
    step_in_place,
)
from p2p_diloco.fragments import Fragment, copies, first_round_offset, views

Tensors = list[torch.Tensor]
Roundtrip = Callable[[torch.Tensor], torch.Tensor]


class Payload(enum.Enum):
    """What a fragment round averages."""

    PROPOSAL = "proposal"  # fp32 φ'_p; each unit keeps its own m'_p
    PROPOSAL_WITH_MOMENTUM = "proposal-momentum"  # fp32 φ'_p and m'_p
    PSEUDO_GRADIENT = "pseudo-gradient"  # Δ_p through a lossy codec; each member steps with its own φ_p and m_p

    @property
    def copies(self) -> int:
        """How many copies of the fragment's shapes one payload holds."""
        return 2 if self is Payload.PROPOSAL_WITH_MOMENTUM else 1


@dataclass
class SentRound:
    """A fragment round in flight: θ_p when it was sent and what it carries."""

    local_at_send: Tensors
    # proposal payload without sync_momentum: the unit's own m'_p (RDA: m_p before it); empty at μ = 0
    momentum_proposal: Tensors
    tokens: int
    compute_s: float
    inner_step: int
    step_scale: float  # ‖φ'_p − φ_p‖ of the outer step on this unit's own Δ_p alone, scaled up to H inner steps


@dataclass
class FragmentRounds:
    """Round bookkeeping of one fragment: its outer round, the steps, tokens and compute since its last round, and
    the error-feedback residual (lossy codecs)."""

    fragment: Fragment
    share: float  # the fragment's fraction of all trained elements
    payload_kind: Payload
    error_feedback: ErrorFeedback | None = None  # lossy codecs: what the codec dropped rides on the next Δ_p
    roundtrip: Roundtrip | None = None  # what receivers decode of a sent tensor (needed with error_feedback)
    radial: tuple[bool, ...] | None = None  # RDA (proposal payloads): per piece, merged by norm and direction
    outer_round: int = 0
    steps_since_round: int = 0
    tokens_since_round: int = 0
    compute_since_round: float = 0.0
    last_step_scale: float = 0.0  # the step scale of the last round sent (that of a plausible change of φ_p)

    def restart_schedule(self, count: int, inner_steps: int) -> None:
        """Forget the counters; the first round comes after the fragment's staggered offset."""
        self.steps_since_round = inner_steps - first_round_offset(self.fragment.number, count, inner_steps)
        self.tokens_since_round, self.compute_since_round = 0, 0.0

    def record_step(self, tokens: int, seconds: float) -> None:
        self.steps_since_round += 1
        self.tokens_since_round += tokens
        self.compute_since_round += seconds

    def carry(self, sent: SentRound) -> None:
        """A round that did not merge: its tokens and compute go into the next round of this fragment."""
        self.tokens_since_round += sent.tokens
        self.compute_since_round += sent.compute_s

    def payload(self, global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                local_at_send: Tensors, hyper: OuterHyperparams) -> tuple[Tensors, Tensors, float]:  # fmt: skip
        """The tensors to average for this fragment, the unit's own momentum proposal to keep while the round is in
        flight (proposal payload without sync_momentum; RDA: m_p) and the norm of its own outer step ‖φ'_p − φ_p‖ (on
        its Δ_p alone)."""
        phi, moment = views(global_params, self.fragment), _momentum_copies(momentum, self.fragment)  # φ only read
        delta = pseudo_gradient(phi, local_at_send)
        if self.payload_kind is Payload.PROPOSAL and self.radial is None and not moment and hyper.momentum == 0:
            params_still = step_in_place(phi, delta, hyper.lr)  # Δ_p is of no more use
            return params_still, [], distance(params_still, phi)
        params_proposal, momentum_proposal = outer_step(phi, moment, delta, hyper)
        own_step = distance(params_proposal, phi)
        if self.payload_kind is Payload.PSEUDO_GRADIENT:
            return (self.error_feedback.compensate(delta) if self.error_feedback else delta), [], own_step
        if self._synced:  # m travels in the payload, and the merge takes it from the average
            own_momentum: Tensors = []
        else:
            own_momentum = moment if self.radial is not None else momentum_proposal
        if self.radial is not None:
            directions, norms = radial_parts(delta, self.radial)
            return phi + (moment if self._synced else []) + directions + [norms], own_momentum, own_step
        return params_proposal + (momentum_proposal if self._synced else []), own_momentum, own_step

    def reference(self, global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                  hyper: OuterHyperparams) -> Tensors:  # fmt: skip
        """The payload of a unit that trained nothing since φ_p (Δ_p = 0), from which members' steps are measured:
        zeros for pseudo-gradients; for proposals, the outer step on a zero Δ_p (with RDA, zero directions), which
        without a momentum is φ_p itself (views of it: the averager copies them, and a unit's round peaks one copy of
        its payload lower)."""
        phi, moment = views(global_params, self.fragment), _momentum_copies(momentum, self.fragment)
        if self.payload_kind is Payload.PSEUDO_GRADIENT:
            return [torch.zeros_like(piece) for piece in phi]
        if self.radial is not None:
            return self.mix_payload(phi, moment)
        if not moment:
            return phi
        params_still, momentum_still = outer_step(phi, moment, [torch.zeros_like(piece) for piece in phi], hyper)
        return params_still + (momentum_still if self._synced else [])

    @property
    def _synced(self) -> bool:
        return self.payload_kind is Payload.PROPOSAL_WITH_MOMENTUM

    def mix_payload(self, phi: Tensors, moment: Tensors) -> Tensors:
        """A mix round's payload, shaped like a round's: φ_p (and m_p, when synced; pieces of the fragment), with RDA
        then zeros in the other places."""
        payload = list(phi) + (list(moment) if self._synced else [])
        if self.radial is not None:
            payload += [torch.zeros_like(piece) for piece in phi] + [torch.zeros(len(phi))]
        return payload

    def mix_parts(self, averaged: Tensors) -> tuple[Tensors, Tensors]:
        """φ_p and m_p (empty without momentum sync) of a mix round's average (shaped by :meth:`mix_payload`)."""
        count = len(self.fragment.pieces)
        return averaged[:count], (averaged[count : 2 * count] if self._synced else [])

    def mark_sent(self, payload: Tensors, local_at_send: Tensors, momentum_proposal: Tensors, inner_step: int,
                  step_scale: float) -> SentRound:  # fmt: skip
        """The averager took ``payload`` (from :meth:`payload`): the round is in flight (returned), the counters start
        over, and with error feedback what the codec drops from it becomes the residual. Nothing changes for a payload
        that was not taken, so it is computed again, from the same residual, at the next attempt."""
        if self.error_feedback is not None and self.roundtrip is not None:
            self.error_feedback.update(payload, [self.roundtrip(tensor) for tensor in payload])
        sent = SentRound(local_at_send, momentum_proposal, self.tokens_since_round, self.compute_since_round,
                         inner_step, step_scale)  # fmt: skip
        self.last_step_scale = step_scale
        self.steps_since_round = self.tokens_since_round = 0
        self.compute_since_round = 0.0
        return sent

    def merged(self, averaged: Tensors, global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
               sent: SentRound, hyper: OuterHyperparams) -> tuple[Tensors, Tensors]:  # fmt: skip
        """The fragment's new (φ_p, m_p) from the group's average of the payloads."""
        if self.payload_kind is Payload.PSEUDO_GRADIENT:
            moment = _momentum_copies(momentum, self.fragment)
            return outer_step(views(global_params, self.fragment), moment, averaged, hyper)
        count = len(self.fragment.pieces)
        phi, rest = averaged[:count], averaged[count:]
        moment, rest = (rest[:count], rest[count:]) if self._synced else (sent.momentum_proposal, rest)
        if self.radial is None:
            return phi, moment
        return outer_step(phi, moment, radial_merge(rest[:count], rest[count], self.radial), hyper)


def _momentum_copies(momentum: Sequence[torch.Tensor], fragment: Fragment) -> Tensors:
    """The fragment's pieces of m, or none when the unit keeps no momentum (μ = 0, rounds/engine.py)."""
    return copies(momentum, fragment) if momentum else []


def flatten_pieces(tensors: Sequence[torch.Tensor], fragment: Fragment) -> torch.Tensor:
    """The fragment's pieces of ``tensors`` in one flat fp32 vector of ``fragment.numel`` elements (a consensus or
    settle round's payload)."""
    return torch.cat([tensor.reshape(-1) for tensor in copies(tensors, fragment)])


def unflatten_pieces(flat: torch.Tensor, fragment: Fragment, template: Sequence[torch.Tensor]) -> Tensors:
    """A vector of :func:`flatten_pieces` back in pieces shaped like the fragment's pieces of ``template``."""
    pieces, offset = [], 0
    for view in views(template, fragment):
        pieces.append(flat[offset : offset + view.numel()].reshape(view.shape).clone())
        offset += view.numel()
    return pieces


class ErrorFeedback:
    """Carries what the codec lost in one round into the next, one fp32 residual r per tensor.

    Each round: send c = compensate(Δ) = Δ + r, then update(c, decoded) sets r = c − decoded. Summed over rounds,
    what was transmitted equals the sum of the Δs minus the current residual, so the codec's error stays that of
    one round instead of growing with the number of rounds. Residuals are created by the first update and live
    on the device of the tensors given; all arithmetic is fp32.
    """

    def __init__(self) -> None:
        self._residuals: list[torch.Tensor] | None = None

    def compensate(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New fp32 tensors ``tensors + residuals`` (copies of ``tensors`` before the first update).

        Raises ValueError if the shapes differ from the residuals'."""
        if self._residuals is None:
            return [tensor.detach().to(torch.float32, copy=True) for tensor in tensors]
        _check_shapes(tensors, self._residuals, "tensors", "residuals")
        return [
            tensor.detach().to(torch.float32) + residual.to(tensor.device)
            for tensor, residual in zip(tensors, self._residuals)
        ]

    def update(self, compensated: Sequence[torch.Tensor], transmitted: Sequence[torch.Tensor]) -> None:
        """residuals ← compensated − transmitted, where ``transmitted`` is what the receivers decoded.

        Raises ValueError (residuals unchanged) if the two lists differ in shapes or from the residuals' shapes."""
        _check_shapes(compensated, transmitted, "compensated", "transmitted")
        if self._residuals is not None:
            _check_shapes(compensated, self._residuals, "compensated", "residuals")
        self._residuals = [
            sent.detach().to(torch.float32) - received.detach().to(device=sent.device, dtype=torch.float32)
            for sent, received in zip(compensated, transmitted)
        ]

    @property
    def residuals(self) -> list[torch.Tensor]:
        """The residuals themselves (none before the first update)."""
        return list(self._residuals or [])

    def reset(self) -> None:
        """Forget the residuals (e.g. after the tensors' shapes changed)."""
        self._residuals = None

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """Copies of the residuals for a checkpoint (an empty list before the first update)."""
        return {"residuals": [residual.clone() for residual in self._residuals or []]}

    def load_state_dict(self, state: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Restore residuals saved by :meth:`state_dict`. Raises ValueError (state unchanged) for a malformed state."""
        residuals = state.get("residuals") if isinstance(state, Mapping) else None
        if not isinstance(residuals, Sequence) or not all(isinstance(item, torch.Tensor) for item in residuals):
            raise ValueError("error feedback state must be {'residuals': [tensor, ...]}")
        self._residuals = [residual.detach().to(torch.float32, copy=True) for residual in residuals] or None


def _check_shapes(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], name1: str, name2: str) -> None:
    first_shapes, second_shapes = [tuple(t.shape) for t in first], [tuple(t.shape) for t in second]
    if first_shapes != second_shapes:
        raise ValueError(f"{name1} shapes {first_shapes} do not match {name2} shapes {second_shapes}")
