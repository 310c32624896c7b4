"""What the round engine returns: the kinds of round, what became of each (:class:`RoundStatus`; the engine's module
docstring says what each does to φ, m and θ), and the typed results of beginning and ending a round. torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RoundKind(enum.Enum):
    FRAGMENT = "fragment"
    CONSENSUS = "consensus"
    SETTLE = "settle"
    MIX = "mix"


class RoundStatus(enum.Enum):
    """What became of a round (the module docstring says what each does to φ, m and θ)."""

    BEGUN = "begun"
    DEFERRED = "deferred"
    RESET = "reset"
    MERGED = "merged"
    ALONE = "alone"
    FAILED = "failed"
    REJECTED = "rejected"


MERGES = (RoundStatus.MERGED, RoundStatus.ALONE)  # the outcomes that changed φ


@dataclass(frozen=True)
class RoundBegin:
    """A round that was due: ``BEGUN`` (in flight now), ``DEFERRED`` or ``RESET`` (every fragment starts over)."""

    kind: RoundKind
    fragment: int
    status: RoundStatus
    outer_round: int  # the fragment's round
    window_s: float = 0.0  # BEGUN: its matchmaking window
    weight: int = 0  # BEGUN fragment round: the tokens it carries


@dataclass(frozen=True)
class RoundEnd:
    """A round that ended: ``MERGED``, ``ALONE``, ``FAILED`` or ``REJECTED``."""

    kind: RoundKind
    fragment: int
    status: RoundStatus
    outer_round: int  # the fragment's round after it
    unit_outer_round: int  # the unit's (its smallest fragment round) after it
    advanced: bool  # the unit's outer round went up: the time for its once-per-period I/O
    group_size: int
    member_drift: float
    seconds: float
    weight: int  # fragment round: the tokens it carried
    overlap_steps: int  # inner steps taken while it was in flight
    useful_compute_s: float  # merged fragment round: compute of the steps it merged (the fragment's share)
    useful_tokens: int
    error: str | None

    @property
    def merged(self) -> bool:
        return self.status in MERGES
