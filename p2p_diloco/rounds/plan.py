"""The plan of a unit's outer rounds (:class:`RoundPlan`, derived once from ``[outer]``: its only reader) and where
units meet and share state (:class:`KeySchema`). The round engine (engine.py) runs the plan."""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.config import Codec, ConfigError, OuterSection, Schedule
from p2p_diloco.diloco import OuterHyperparams
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
class RoundPlan:
    """How a unit's outer rounds are laid out, derived once by :meth:`from_config`: the only reader of ``[outer]``."""

    fragments: tuple[Fragment, ...]
    payload: Payload
    codec: Codec
    error_feedback: bool
    consensus_every_rounds: int  # 0: no consensus rounds (always 0 for proposal payloads)
    consensus_tolerance: float
    hyper: OuterHyperparams
    inner_steps: int
    schedule: Schedule
    settle_rounds: int
    max_in_flight: int
    window_fraction: float
    min_window_s: float
    max_window_s: float
    quorum: int
    target_group_size: int
    allreduce_timeout_s: float
    mean_merged: frozenset[int] | None = None  # RDA: the tensors merged by their mean (embeddings); None: mean merge

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
        return cls(
            fragments=fragments,
            payload=payload,
            codec=outer.codec,
            error_feedback=lossy and outer.error_feedback,
            consensus_every_rounds=outer.consensus_every_rounds if lossy else 0,
            consensus_tolerance=outer.consensus_tolerance,
            hyper=OuterHyperparams(outer.outer_lr, outer.outer_momentum, outer.nesterov),
            inner_steps=outer.inner_steps,
            schedule=outer.schedule,
            settle_rounds=outer.settle_rounds,
            max_in_flight=outer.max_in_flight,
            window_fraction=outer.window_fraction,
            min_window_s=outer.min_window_s,
            max_window_s=outer.max_window_s,
            quorum=outer.quorum,
            target_group_size=outer.target_group_size,
            allreduce_timeout_s=outer.allreduce_timeout_s,
            mean_merged=frozenset(embeddings) if outer.merge == "rda" else None,
        )

    @property
    def consensus(self) -> bool:
        """Whether consensus rounds run (one more averager per fragment)."""
        return self.consensus_every_rounds > 0

    @property
    def keeps_momentum(self) -> bool:
        """Whether units keep an outer momentum m: at momentum 0 it would never be read, so none exists."""
        return self.hyper.momentum > 0

    @property
    def mixes(self) -> bool:
        """Whether a mix round follows each fragment round (clock schedule, fp32 proposals; schedule.py)."""
        return self.schedule == "clock" and self.payload is not Payload.PSEUDO_GRADIENT

    def keys(self, run_id: str, fingerprint: str) -> KeySchema:
        """Where this plan's units meet and share state (see :class:`KeySchema`)."""
        carried = f"payload={self.payload.value};codec={self.codec}"
        step = f"lr={self.hyper.lr!r};momentum={self.hyper.momentum!r};nesterov={self.hyper.nesterov}"
        step += "" if self.mean_merged is None else ";merge=rda"
        digest = hashlib.blake2b(f"{carried};{step}".encode(), digest_size=5).hexdigest()
        return KeySchema(run_id, fingerprint, len(self.fragments), digest)

    def radial(self, fragment: Fragment) -> tuple[bool, ...] | None:
        """RDA: per piece of ``fragment``, whether it is merged by norm and direction (not an embedding); None for
        the mean merge."""
        if self.mean_merged is None:
            return None
        return tuple(piece.index not in self.mean_merged for piece in fragment.pieces)

    def round_templates(self, trained: Sequence[torch.Tensor]) -> list[Tensors]:
        """Per fragment, tensors shaped like one round's payload (its pieces, once or twice; with RDA, then the
        pieces' directions and one vector of their norms)."""
        templates = []
        for fragment in self.fragments:
            pieces = views(trained, fragment)
            extra = [] if self.mean_merged is None else [*pieces, torch.zeros(len(pieces))]
            templates.append(pieces * self.payload.copies + extra)
        return templates

    def consensus_templates(self) -> list[Tensors]:
        """Per fragment, a tensor shaped like one consensus round's payload (φ_p flat)."""
        return [[torch.zeros(fragment.numel)] for fragment in self.fragments]

    def window_s(self, step_time_s: float | None) -> float:
        """The matchmaking window: how long a round recruits members, ``window_fraction`` × H measured wall times per
        inner step, clamped to [min_window_s, max_window_s] (the minimum before any step was measured).

        With a window of half a round period, two units meet whatever their phase; units that averaged together end
        the round together and stay in phase afterwards."""
        if step_time_s is None:
            return self.min_window_s
        window = self.window_fraction * self.inner_steps * step_time_s
        return min(self.max_window_s, max(self.min_window_s, window))

    def clock(self) -> RoundClock | None:
        """A new round clock for the ``clock`` schedule (None for ``steps``): the period holds at least two minimum
        windows, so that a round's matchmaking and all-reduce end before its fragment's next boundary."""
        if self.schedule != "clock":
            return None
        return RoundClock(self.inner_steps, len(self.fragments), self.min_window_s, min_period_s=2 * self.min_window_s,
                          rounds_per_period=2 if self.mixes else 1)  # fmt: skip
