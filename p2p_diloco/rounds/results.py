"""What the round engine returns: which round (:class:`RoundId`), what became of it (:class:`RoundStatus`), and the
typed results of beginning and ending one.

Failure contract (what each outcome does to φ_p, m_p and θ_p of fragment p; streaming.py says what the payloads
are, kinds.py what each round sends):

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
* At exit, the engine's ``drain`` waits a bounded time; a round still running is cancelled and carried like a
  failed one (its progress stays in θ and in the checkpoint).
* A settle round (``SETTLE``, at exit, after the final rounds: departure.py) averages the whole φ in fp32, with equal
  weights, among the units leaving at the same boundary, through an averager of its own whose groups are as large as
  hivemind allows (the settle key of plan.py's ``KeySchema``): a group of two or more adds (mean − sent) to φ and θ,
  like a consensus round; otherwise nothing changes. Units that leave together thereby leave as one model even when
  the rounds' groups are smaller than the swarm; m and the round numbers are unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from p2p_diloco.rounds.averager import RoundOutcome
from p2p_diloco.rounds.grid import GridCell


class RoundKind(enum.Enum):
    FRAGMENT = "fragment"  # a fragment's outer round: its average becomes φ_p and m_p (kinds.py FragmentRound)
    CONSENSUS = "consensus"  # lossy codecs: φ_p averaged again in fp32 (kinds.py, as every correction round)
    SETTLE = "settle"  # at exit: the whole φ averaged with the units leaving together
    MIX = "mix"  # clock schedule: φ_p and m_p averaged again across the groups of a fragment round


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
class RoundId:
    """Which round: its kind and its fragment (0 for a settle round, which carries the whole model)."""

    kind: RoundKind
    fragment: int


@dataclass(frozen=True)
class _OfRound:
    """A result about one round (:class:`RoundId`)."""

    id: RoundId

    @property
    def kind(self) -> RoundKind:
        return self.id.kind

    @property
    def fragment(self) -> int:
        return self.id.fragment


@dataclass(frozen=True)
class RoundBegin(_OfRound):
    """A round that was due: ``BEGUN`` (in flight now), ``DEFERRED`` or ``RESET`` (every fragment starts over)."""

    status: RoundStatus
    outer_round: int  # the fragment's round
    window_s: float = 0.0  # BEGUN: its matchmaking window
    weight: int = 0  # BEGUN fragment round: the tokens it carries
    cell: GridCell | None = None  # BEGUN fragment round on the clock: the unit's place in the round's layout


@dataclass(frozen=True)
class RoundEnd(_OfRound):
    """A round that ended: ``MERGED``, ``ALONE``, ``FAILED`` or ``REJECTED``. Built by :meth:`of_fragment` or
    :meth:`of_correction`."""

    status: RoundStatus
    outer_round: int  # the fragment's round after it
    unit_outer_round: int  # the unit's (its smallest fragment round) after it
    group_size: int
    member_drift: float
    seconds: float
    error: str | None
    advanced: bool = False  # the unit's outer round went up: the time for its once-per-period I/O
    weight: int = 0  # fragment round: the tokens it carried
    overlap_steps: int = 0  # fragment round: inner steps taken while it was in flight
    useful_compute_s: float = 0.0  # merged fragment round: compute of the steps it merged (the fragment's share)
    useful_tokens: int = 0

    @property
    def merged(self) -> bool:
        return self.status in MERGES

    @classmethod
    def of_fragment(
        cls,
        number: int,
        status: RoundStatus,
        outcome: RoundOutcome,
        rounds: tuple[int, int],
        *,
        error: str | None,
        advanced: bool,
        weight: int,
        overlap_steps: int,
        useful: tuple[float, int],
    ) -> RoundEnd:
        """Fragment ``number``'s round: ``rounds`` are the fragment's and the unit's outer rounds after it, ``error``
        why it changed nothing, ``useful`` the compute and tokens it made useful."""
        seconds = outcome.finished_at - outcome.started_at
        return cls(RoundId(RoundKind.FRAGMENT, number), status, *rounds, outcome.group_size, outcome.member_drift,
                   seconds, error, advanced, weight, overlap_steps, *useful)  # fmt: skip

    @classmethod
    def of_correction(
        cls, id: RoundId, status: RoundStatus, outcome: RoundOutcome | None, rounds: tuple[int, int], error: str = ""
    ) -> RoundEnd:
        """A consensus, mix or settle round (``rounds``: the fragment's and the unit's outer rounds); ``outcome`` None
        when it did not end in time (``error`` says so)."""
        if outcome is None:
            return cls(id, status, *rounds, 0, 0.0, 0.0, error)
        seconds = outcome.finished_at - outcome.started_at
        return cls(id, status, *rounds, outcome.group_size, outcome.member_drift, seconds, outcome.error)
