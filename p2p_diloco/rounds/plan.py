"""The plan of a unit's outer rounds (:class:`RoundPlan`, derived once from ``[outer]``: its only reader) and where
units meet and share state (:class:`KeySchema`). The round engine (engine.py) runs the plan."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import Codec, ConfigError, OuterSection, Schedule
from p2p_diloco.diloco import OuterHyperparams, Overlap
from p2p_diloco.fragments import Fragment, partition, views
from p2p_diloco.rounds.clock import RoundClock
from p2p_diloco.streaming import Payload

Tensors = list[torch.Tensor]
FINAL_ROUND_SLACK_S = 1.0  # matchmaking may run this long past the window (averaging.py OuterAverager)


@dataclass(frozen=True)
class KeySchema:
    """The DHT prefixes under which units meet (averagers) and share state (state server), in one place.

    * ``{run}_{model}_p{P}_state``, the state server (φ, m and P fragment rounds): units share state when their run
      id, model fingerprint and number of fragments P match; codec, momentum sync, outer step, consensus rounds,
      quorum, group size, windows and timeouts do not matter.
    * ``{run}_{model}_p{P}_f{p}_r{digest}``, fragment p's rounds: units meet when, beyond run, model and P, what a
      round carries (payload, codec, merge rule) and the outer step (lr, momentum, Nesterov) match; ``digest`` hashes
      those. Units of other round settings never meet, so they never average payloads that mean different things.
    * ``{run}_{model}_p{P}_f{p}_consensus``, fragment p's consensus rounds (fp32 φ_p, lossy codecs only): units of
      any codec and outer step meet, since φ_p means the same for all of them.
    * ``{run}_{model}_p{P}_settle``, the settle rounds at exit (fp32 φ, whole): units of any round settings meet.

    hivemind forbids '.' in a prefix (its group keys are ``prefix.0b…``), hence a digest rather than the values.
    """

    run_id: str
    fingerprint: str
    fragments: int
    round_digest: str

    @property
    def _base(self) -> str:
        return f"{self.run_id}_{self.fingerprint}_p{self.fragments}"

    def state(self) -> str:
        return f"{self._base}_state"

    def fragment_round(self, number: int) -> str:
        return f"{self._base}_f{number}_r{self.round_digest}"

    def consensus_round(self, number: int) -> str:
        return f"{self._base}_f{number}_consensus"

    def settle(self) -> str:
        return f"{self._base}_settle"

    def prefixes(self) -> dict[str, str | list[str]]:
        """Every prefix by what meets under it (the operator's view of the DHT)."""
        numbers = range(self.fragments)
        return {
            "state": self.state(),
            "fragment_rounds": [self.fragment_round(number) for number in numbers],
            "consensus_rounds": [self.consensus_round(number) for number in numbers],
            "settle": self.settle(),
        }


@dataclass(frozen=True)
class OuterStep:
    """What a fragment round carries (the payload, on the wire through the codec, with error feedback for a lossy one)
    and the outer step it takes: the outer SGD step and the merge rule (RDA: the tensors merged by their mean, the
    embeddings; None: every tensor by the mean)."""

    payload: Payload
    codec: Codec
    error_feedback: bool
    hyper: OuterHyperparams
    mean_merged: frozenset[int] | None = None


@dataclass(frozen=True)
class Window:
    """How long a round recruits members: ``fraction`` × H measured wall times per inner step, clamped to
    [``min_s``, ``max_s``]."""

    fraction: float
    min_s: float
    max_s: float


@dataclass(frozen=True)
class Groups:
    """Which groups a round takes: at least ``quorum`` members, recruiting up to ``target_size``, the all-reduce
    bounded by ``allreduce_timeout_s`` once the group formed."""

    quorum: int
    target_size: int
    allreduce_timeout_s: float


@dataclass(frozen=True)
class ConsensusRounds:
    """Lossy codecs: fp32 rounds of a fragment's φ_p every ``every_rounds`` of its rounds, and after one whose members'
    φ_p differed by more than ``tolerance``."""

    every_rounds: int
    tolerance: float


@dataclass(frozen=True)
class RoundPlan:
    """How a unit's outer rounds are laid out, derived once by :meth:`from_config`: the only reader of ``[outer]``.
    When rounds come: every ``inner_steps`` (fewer during the first ``warmup_rounds``) by the ``schedule``, at most
    ``max_in_flight`` at once; what they carry and do (``step``), whom they meet (``window``, ``group``), the
    corrections (``consensus``: None without consensus rounds; ``settle_rounds`` at exit), and what a unit keeps of
    the steps it made while a round was in flight (``overlap``)."""

    fragments: tuple[Fragment, ...]
    inner_steps: int
    schedule: Schedule
    max_in_flight: int
    step: OuterStep
    window: Window
    group: Groups
    consensus: ConsensusRounds | None
    settle_rounds: int
    overlap: Overlap = Overlap()
    warmup_rounds: int = 0

    @classmethod
    def from_config(cls, outer: OuterSection, shapes: Sequence[torch.Size | Sequence[int]],
                    embeddings: Collection[int] = ()) -> RoundPlan:  # fmt: skip
        """The plan of a unit whose trained tensors have ``shapes`` (``embeddings``: the positions of the embedding
        tensors, merged by their mean under RDA). Raises ConfigError when the model cannot be split into
        ``outer.fragments`` fragments."""
        try:
            fragments = tuple(partition(shapes, outer.fragments))
        except ValueError as error:
            raise ConfigError(f"invalid config outer.fragments (--fragments): {error}") from None
        if outer.codec != "fp32":
            payload = Payload.PSEUDO_GRADIENT
        else:
            synced = outer.sync_momentum and outer.outer_momentum > 0  # at momentum 0, m is never used
            payload = Payload.PROPOSAL_WITH_MOMENTUM if synced else Payload.PROPOSAL
        lossy = payload is Payload.PSEUDO_GRADIENT
        hyper = OuterHyperparams(outer.outer_lr, outer.outer_momentum, outer.nesterov)
        mean_merged = frozenset(embeddings) if outer.merge == "rda" else None
        consensus = lossy and outer.consensus_every_rounds > 0  # proposals pull φ together themselves
        return cls(
            fragments, outer.inner_steps, outer.schedule, outer.max_in_flight,
            step=OuterStep(payload, outer.codec, lossy and outer.error_feedback, hyper, mean_merged),
            window=Window(outer.window_fraction, outer.min_window_s, outer.max_window_s),
            group=Groups(outer.quorum, outer.target_group_size, outer.allreduce_timeout_s),
            consensus=ConsensusRounds(outer.consensus_every_rounds, outer.consensus_tolerance) if consensus else None,
            settle_rounds=outer.settle_rounds, overlap=Overlap(outer.overlap_rule, outer.overlap_factor),
            warmup_rounds=outer.warmup_rounds,
        )  # fmt: skip

    def inner_steps_at(self, outer_round: int) -> int:
        """H of the round that follows outer round ``outer_round``: H / 2^(k − outer_round) (at least 1) during the
        ``warmup_rounds`` k, then H. A unit that joins a swarm past the warm-up takes H at once."""
        return max(1, self.inner_steps >> max(0, self.warmup_rounds - outer_round))

    @property
    def keeps_momentum(self) -> bool:
        """Whether units keep an outer momentum m: at momentum 0 it would never be read, so none exists."""
        return self.step.hyper.momentum > 0

    @property
    def merges_alike(self) -> bool:
        """Whether every member of a merged fragment round ends on the same φ_p (fp32 proposals, not a lossy Δ_p)."""
        return self.step.payload is not Payload.PSEUDO_GRADIENT

    @property
    def mixes(self) -> bool:
        """Whether a mix round follows each fragment round (clock schedule, fp32 proposals; schedule.py)."""
        return self.schedule == "clock" and self.merges_alike

    def keys(self, run_id: str, fingerprint: str) -> KeySchema:
        """Where this plan's units meet and share state (see :class:`KeySchema`)."""
        digest = hashlib.blake2b(self._round_digested().encode(), digest_size=5).hexdigest()
        return KeySchema(run_id, fingerprint, len(self.fragments), digest)

    def round_settings(self) -> str:
        """``name=value;...`` of every setting that decides whom this plan's units meet in rounds besides the run and
        the model (the fragments and what the key's digest hashes), for a person to compare (progress records)."""
        return f"fragments={len(self.fragments)};{self._round_digested()}"

    def _round_digested(self) -> str:
        """What a round carries (payload, codec, merge rule) and the outer step, as the key's digest hashes them."""
        step, hyper = self.step, self.step.hyper
        carried = f"payload={step.payload.value};codec={step.codec}"
        outer_step = f"lr={hyper.lr!r};momentum={hyper.momentum!r};nesterov={hyper.nesterov}"
        return carried + ";" + outer_step + ("" if step.mean_merged is None else ";merge=rda")

    def radial(self, fragment: Fragment) -> tuple[bool, ...] | None:
        """RDA: per piece of ``fragment``, whether it is merged by norm and direction (not an embedding); None for
        the mean merge."""
        mean_merged = self.step.mean_merged
        if mean_merged is None:
            return None
        return tuple(piece.index not in mean_merged for piece in fragment.pieces)

    def round_templates(self, trained: Sequence[torch.Tensor]) -> list[Tensors]:
        """Per fragment, tensors shaped like one round's payload (its pieces, once or twice; with RDA, then the
        pieces' directions and one vector of their norms)."""
        templates = []
        for fragment in self.fragments:
            pieces = views(trained, fragment)
            extra = [] if self.step.mean_merged is None else [*pieces, torch.zeros(len(pieces))]
            templates.append(pieces * self.step.payload.copies + extra)
        return templates

    def consensus_templates(self) -> list[Tensors]:
        """Per fragment, a tensor shaped like one consensus round's payload (φ_p flat)."""
        return [[torch.zeros(fragment.numel)] for fragment in self.fragments]

    def window_s(self, step_time_s: float | None, inner_steps: int | None = None) -> float:
        """The matchmaking window of a round of ``inner_steps`` (default H; see :class:`Window`; the minimum before any
        step was measured).

        With a window of half a round period, two units meet whatever their phase; units that averaged together end
        the round together and stay in phase afterwards."""
        window = self.window
        if step_time_s is None:
            return window.min_s
        steps = self.inner_steps if inner_steps is None else inner_steps
        return min(window.max_s, max(window.min_s, window.fraction * steps * step_time_s))

    def clock(self) -> RoundClock | None:
        """A new round clock for the ``clock`` schedule (None for ``steps``): the period holds at least two minimum
        windows, so that a round's matchmaking and all-reduce end before its fragment's next boundary."""
        if self.schedule != "clock":
            return None
        min_window_s = self.window.min_s
        return RoundClock(self.inner_steps, len(self.fragments), min_window_s, min_period_s=2 * min_window_s,
                          rounds_per_period=2 if self.mixes else 1)  # fmt: skip
