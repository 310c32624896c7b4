"""The averager a round runs through: the :class:`Averager` protocol, the one seam between the round engine and the
network (averaging.py implements it on hivemind; tests/fakes.py and the laboratory have in-memory ones), and
the :class:`RoundOutcome` it returns. torch only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from p2p_diloco.rounds.grid import Leader


@dataclass(frozen=True)
class RoundOutcome:
    """What one outer round produced. ``averaged`` is None when the round failed (see ``error``); it may be the
    averager's own buffers, valid until its next ``begin_round`` (a caller that keeps it longer copies it)."""

    averaged: list[torch.Tensor] | None
    group_size: int
    max_member_round: int
    total_weight: float
    started_at: float
    finished_at: float
    member_drift: float = 0.0  # relative distance between members' global parameters before the round
    error: str | None = None
    member_tags: tuple[str, ...] = ()  # every member's ``tag`` (see ``begin_round``)
    member_periods: tuple[float, ...] = ()  # every member's ``period_s`` (see ``begin_round``)
    position: int = 0  # this unit's place in the group's order (the same order for every member)

    @property
    def tags_agree(self) -> bool:
        """True when more than half of the members (this unit included) declared this unit's tag (e.g. averaged the
        same fragment): one member declaring another tag, or garbage, cannot veto a round of the others; its part was
        bounded like any other's."""
        if not self.member_tags:
            return True
        own = self.member_tags[min(self.position, len(self.member_tags) - 1)]
        return 2 * sum(tag == own for tag in self.member_tags) > len(self.member_tags)


@dataclass(frozen=True)
class GroupRequest:
    """The group a round asks for: hivemind's group key ``prefix.0b<subgroup>`` (only units of the same subgroup
    meet), at most ``size`` members (0: the averager's target; a group that reaches it starts at once), the units
    expected to lead it, asked in that order before hivemind's DHT lookup shows anyone (grid.py ``Leader``), and when
    its all-reduce is scheduled on the shared clock (0: the window from the call; a layout's order of leaders holds
    only if every unit schedules at its boundary and offset exactly, however long it took to begin the round), and
    the layout's groups, which the averager enforces (network/gated.py ``set_layout``)."""

    subgroup: str = ""
    size: int = 0
    leaders: tuple[Leader, ...] = ()
    scheduled_at: float = 0.0
    members: tuple[str, ...] = ()  # the units the round's layout places in this group (grid.py) ...
    placed: tuple[str, ...] = ()  # ... among all it places: a placed unit outside ``members`` is refused; ()s: none


class Averager(Protocol):
    """The network seam of a unit's outer rounds, as the round engine uses it. One round at a time; nothing here may
    block the inner loop (but :meth:`finish_round`, bounded, at exit)."""

    def begin_round(
        self,
        proposal: Sequence[torch.Tensor],
        weight: float,
        outer_round: int,
        window_s: float,
        probe: Sequence[float] = (),
        tag: str = "",
        period_s: float = 0.0,
        group: GroupRequest = GroupRequest(),
        reference: Sequence[torch.Tensor] | None = None,
    ) -> bool:
        """Start averaging ``proposal`` with whichever units of ``group`` meet within ``window_s``; False when it
        cannot be taken now (nothing started). ``probe``, ``tag`` and ``period_s`` are shared with the group;
        ``reference`` (the payload of a unit that trained nothing since φ, shaped like ``proposal``) is what members'
        steps are measured from (an averager may ignore it). Raises RuntimeError with a round in flight, ValueError
        for a malformed request."""
        ...

    def poll(self) -> RoundOutcome | None:
        """The outcome of the round in flight once it ended, else None; never raises for network failures."""
        ...

    def finish_round(self, timeout_s: float) -> RoundOutcome | None:
        """Wait up to ``timeout_s`` for the round in flight; a round still running then is cancelled (None)."""
        ...

    def shutdown(self) -> None:
        """Cancel the round in flight and release what the averager holds; a second call does nothing."""
        ...


def check_round_request(
    in_flight: bool,
    shapes: Sequence[tuple[int, ...]],
    proposal: Sequence[torch.Tensor],
    weight: float,
    reference: Sequence[torch.Tensor] | None = None,
) -> None:
    """The preconditions of ``begin_round``: RuntimeError if a round is in flight, ValueError for a proposal (or a
    reference) of other shapes or a weight that is not positive."""
    if in_flight:
        raise RuntimeError("an outer round is already in flight")
    for what, tensors in (("proposal", proposal), ("the reference", reference)):
        if tensors is not None and [tuple(tensor.shape) for tensor in tensors] != list(shapes):
            raise ValueError(f"{what} does not match the averaged tensors' shapes")
    if not weight > 0:
        raise ValueError(f"weight must be positive, got {weight}")
