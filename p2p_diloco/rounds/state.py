"""The outer state of one learning unit: φ, the outer momentum m (none at all at momentum 0: it would never be read),
every fragment's round bookkeeping (streaming.py ``FragmentRounds``), the merges held back until a mix round, the
inner-step counters, and the link to the trained θ. The round kinds (kinds.py) read and change it; nothing here does
I/O."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from p2p_diloco.diloco import consensus_probe, consensus_probe_indices, merge_local_progress
from p2p_diloco.fragments import Fragment, assign, copies, partition, views
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.streaming import ErrorFeedback, FragmentRounds, Roundtrip, SentRound

Tensors = list[torch.Tensor]


class LocalSync(Protocol):
    """Where the trained θ lives when the state's ``local`` is a copy of it (rank 0 of a unit of several ranks:
    ranks.py). Both calls raise when the other ranks are lost."""

    def fetch(self, indices: Sequence[int]) -> None:
        """Bring ``local[i]`` up to date for each ``i`` in ``indices`` before the state reads it."""

    def store(self, indices: Sequence[int]) -> None:
        """Carry ``local[i]``, which the state just wrote, for each ``i`` in ``indices`` to where θ is trained."""


class InPlace:
    """``local`` is θ itself: nothing to fetch or store."""

    def fetch(self, indices: Sequence[int]) -> None:
        pass

    def store(self, indices: Sequence[int]) -> None:
        pass


@dataclass(frozen=True)
class HeldMerge:
    """A fragment round's merge held back until its mix round (schedule.py): the fragment's new φ_p and m_p (empty:
    m unchanged), and what the round sent."""

    params: Tensors
    momentum: Tensors
    sent: SentRound


class OuterState:
    """φ (starting as a copy of ``local``), m (zeros, or none at momentum 0), the fragments' rounds of ``plan`` and
    the trained tensors θ (``local``: read when a round is sent, written when one merges; ``sync`` is told before each
    read and after each write). ``roundtrip`` is what the receivers decode of a sent tensor, for error feedback.
    Raises ValueError without ``roundtrip`` for a plan with error feedback."""

    def __init__(self, plan: RoundPlan, local: Sequence[torch.Tensor], sync: LocalSync = InPlace(),
                 roundtrip: Roundtrip | None = None):  # fmt: skip
        if plan.step.error_feedback and roundtrip is None:
            raise ValueError("error feedback needs the codec's round trip")
        self.plan, self.local, self.sync = plan, list(local), sync
        self.global_params: Tensors = [tensor.detach().to(device="cpu", dtype=torch.float32, copy=True)
                                       for tensor in self.local]  # fmt: skip
        self.momentum: Tensors = self._kept_momentum(())
        total = sum(fragment.numel for fragment in plan.fragments)
        self.fragments = [
            FragmentRounds(fragment, fragment.numel / total, plan.step.payload,
                           error_feedback=ErrorFeedback() if plan.step.error_feedback else None,
                           roundtrip=roundtrip if plan.step.error_feedback else None, radial=plan.radial(fragment))
            for fragment in plan.fragments
        ]  # fmt: skip
        self.whole = partition([tensor.shape for tensor in self.global_params], 1)[0]  # the model as one fragment
        self._probe_indices = {f: consensus_probe_indices(views(self.global_params, f)) for f in plan.fragments}
        self._probe_indices[self.whole] = consensus_probe_indices(self.global_params)
        self.held: dict[int, HeldMerge] = {}  # fragment → its merge held back until its mix round
        self.steps = 0  # inner steps recorded (the clock of overlaps)
        self.step_tokens = 0  # tokens of the last inner step (how many steps a round's tokens stand for)
        self.restart_schedules()

    @property
    def outer_round(self) -> int:
        """The outer round every fragment reached (the smallest fragment round)."""
        return min(rounds.outer_round for rounds in self.fragments)

    def fragment_rounds(self) -> list[int]:
        return [rounds.outer_round for rounds in self.fragments]

    def probe(self, fragment: Fragment | None = None) -> list[float]:
        """φ at the probe coordinates of ``fragment`` (default: the first fragment's, which units compare to measure
        how far apart their models are; the whole model's for its own fragment)."""
        fragment = fragment or self.plan.fragments[0]
        return consensus_probe(views(self.global_params, fragment), self._probe_indices[fragment])

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """φ, m and the error-feedback residuals (the rounds in flight hold the rest: engine.py)."""
        yield from self.global_params
        yield from self.momentum
        for held in self.held.values():
            yield from [*held.params, *held.momentum]
        for rounds in self.fragments:
            if rounds.error_feedback is not None:
                yield from rounds.error_feedback.residuals

    def load_state(self, global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
                   fragment_rounds: Sequence[int]) -> None:  # fmt: skip
        """Adopt φ, m and per-fragment rounds (a downloaded state or a checkpoint; θ is the caller's). A list of
        rounds for another number of fragments sets every fragment to its smallest value."""
        self.global_params = [tensor.detach().to(device="cpu", dtype=torch.float32) for tensor in global_params]
        self.momentum = self._kept_momentum(momentum)
        self.held.clear()
        if len(fragment_rounds) != len(self.fragments):
            fragment_rounds = [min(fragment_rounds, default=0)] * len(self.fragments)
        for rounds, value in zip(self.fragments, fragment_rounds):
            rounds.outer_round = int(value)

    def _kept_momentum(self, momentum: Sequence[torch.Tensor]) -> Tensors:
        """m as the state keeps it: none at momentum 0 (a given m is dropped), else ``momentum`` on the host in fp32,
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

    def restart_schedules(self) -> None:
        """Every fragment's counters start over (its first round after its staggered offset)."""
        for rounds in self.fragments:
            rounds.restart_schedule(len(self.fragments), self.plan.inner_steps_at(rounds.outer_round))

    def reset_local(self) -> None:
        """θ ← φ (a diverged θ) and every fragment's schedule starts over (a held merge is dropped)."""
        self.held.clear()
        with torch.no_grad():
            for tensor, value in zip(self.local, self.global_params):
                tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
        self.sync.store(range(len(self.local)))
        self.restart_schedules()

    def read_local(self, fragment: Fragment) -> Tensors:
        """θ's pieces of ``fragment`` (copies), fetched first."""
        self.sync.fetch(fragment.tensor_indices)
        return copies(self.local, fragment)

    @contextlib.contextmanager
    def local_pieces(self, fragment: Fragment) -> Iterator[Tensors]:
        """θ's pieces of ``fragment`` to change in place (views, gradients off), fetched first and stored after."""
        self.sync.fetch(fragment.tensor_indices)
        with torch.no_grad():
            yield views(self.local, fragment)
        self.sync.store(fragment.tensor_indices)

    def merge(self, fragment: Fragment, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
              local_at_send: Sequence[torch.Tensor]) -> None:  # fmt: skip
        """φ_p, m_p ← ``params``, ``momentum`` (empty: m unchanged); θ_p ← φ_p and the steps made since the round was
        sent (θ_p,now − ``local_at_send``) as the plan's overlap rule keeps them, piece by piece (the rule is: a round's
        end holds no copy of the fragment's θ)."""
        if self.plan.overlap.rule == "align":  # φ_p before the round, read by that rule alone
            old_global = [[piece] for piece in copies(self.global_params, fragment)]
        else:
            old_global = [[] for _ in params]
        assign(self.global_params, fragment, params)
        if momentum:
            assign(self.momentum, fragment, momentum)
        with self.local_pieces(fragment) as thetas:
            for param, theta, sent, old in zip(params, thetas, local_at_send, old_global):
                (value,) = merge_local_progress([param], [theta], [sent], self.plan.overlap, old)
                theta.copy_(value)

    def apply_held(self, number: int) -> None:
        """Merge fragment ``number``'s held merge (:meth:`merge`), if it has one."""
        held = self.held.pop(number, None)
        if held is not None:
            self.merge(self.fragments[number].fragment, held.params, held.momentum, held.sent.local_at_send)

    def shift(self, fragment: Fragment, delta: Sequence[torch.Tensor]) -> None:
        """Add ``delta`` (shaped like the fragment's pieces) to φ's and θ's pieces of ``fragment``: a correction round
        moves the unit to its group's mean without undoing what merged meanwhile. Piece by piece, in place (a settle
        round shifts the whole model at exit: no copy of it)."""
        with self.local_pieces(fragment) as thetas:
            for phi, theta, step in zip(views(self.global_params, fragment), thetas, delta):
                phi.add_(step.to(phi))  # φ is CPU fp32: no conversion
                theta.copy_(theta.to(device="cpu", dtype=torch.float32) + step)
