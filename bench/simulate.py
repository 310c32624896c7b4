"""A simulator of group formation and consensus beyond one machine: no torch training, no network.

Each simulated unit runs the project's own round engine (its schedule, clock, merge rules, settle-free)
on a small vector instead of a model, in simulated time:

* inner steps: every step (a unit's step time is drawn once from a log-normal around the measured median, and
  jittered per step by ``step_jitter``: the contention of units sharing CPUs), θ ← θ + pull·(target − θ) + noise: all
  units pull toward one common target (the shared signal of their data) and add independent noise (what differs
  between their data); between two steps a unit merges the rounds that ended and begins those due, as a real unit
  does (so a merge reaches the members up to a step apart);
* evaluation runs beside the inner steps (unit/evaluation.py): its cost is in the measured step times, it never
  pauses a unit;
* matchmaking, emulating hivemind 1.1.12's rule (HIVEMIND.md, trap 4): a unit that begins a round waits in its key
  (prefix and group bits: a grid row or column, rounds/grid.py) until its scheduled time; at the earliest scheduled
  time among the waiting units, that unit leads a group of the units then waiting in its key that could have found it,
  earliest scheduled first, up to the group's size: a unit that asks hinted leaders (a grid row's or column's earlier
  units) asks at once, so it needs only to have begun; any other must have waited ``DISCOVERY_S`` (hivemind's minimum
  matchmaking time: a unit must have declared itself and been found). The group's all-reduce ends ``latency_s(size)``
  later with the weighted mean (position in the group, members' periods and probes as the real averager reports
  them). A unit alone at its scheduled time completes the round alone (quorum 1). Each member that could have found
  the leader misses the group with probability ``miss`` and completes its round alone: what the model leaves out
  (matchmaking races lost, late requests, failed all-reduces) in one number;
* fitted to measured swarms: ``step_jitter`` and ``miss`` to one swarm's mean group size and one-model share
  (:func:`fit_meeting`), ``noise`` (relative to the vector's norm) to the 90th percentile of pairwise distance of one
  that had lineages (:func:`fit_noise`);
* churn: ``churn_per_hour`` percent of the units leave per hour and as many join, each downloading a random live
  unit's state.

Measured like the real swarms (bench/scale.py): group sizes per unit and merged round, member drift of groups of two
or more, pairwise relative distances over time (every second, after the median unit's third round) and at the end
(among 64 random units in larger swarms), the share of those seconds at which every unit held one model (one lineage
at 1e-3), the rounds a joiner merged until it was in the largest lineage, and the bytes sent per unit (hivemind's
butterfly all-reduce sends about 2·(k−1)/k of a payload per member of a group of k).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from bench.scale import percentile
from p2p_diloco.config import OuterSection
from p2p_diloco.consensus import lineage_sizes, pairwise_distances
from p2p_diloco.diloco import probe_drift, weighted_average
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome, check_round_request
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.rounds.results import RoundKind, RoundStatus

DIMENSION = 256
SAMPLED_UNITS = 64  # pairwise distances of larger swarms are measured on this many random units
JITTERS = (0.05, 0.1, 0.2, 0.4, 0.8)  # the candidates calibrate() tries
NOISES = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
MISSES = (0.0, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
DISCOVERY_S = 1.5  # OuterAverager's min_matchmaking_time: how long a unit takes to be found by the others
TICK_S = 0.05
PAYLOAD_BYTES = 953_856 * 4 * 2  # the tiny model's φ and m in fp32: what one fp32 round of a real unit carries


@dataclass(frozen=True)
class SimSpec:
    """One simulated swarm. Timings default to the 8-unit runs measured on this machine (bench/scale.py)."""

    units: int
    target_group: int
    schedule: str = "steps"
    duration_s: float = 90.0
    inner_steps: int = 20
    step_time_s: float = 0.45  # median wall seconds per inner step
    step_spread: float = 0.15  # log-normal sigma of the units' step times
    step_jitter: float = 0.1  # log-normal sigma of one step's time around its unit's
    latency_s: float = 1.5  # all-reduce of a group of 2 after its scheduled time
    latency_per_member_s: float = 0.5
    noise: float = 0.02
    pull: float = 0.02
    miss: float = 0.0
    churn_per_hour: float = 0.0  # percent of the units per hour
    seed: int = 0


@dataclass(order=True)
class _Waiting:
    scheduled_at: float
    order: int
    averager: SimAverager = field(compare=False)
    proposal: list[torch.Tensor] = field(compare=False)
    weight: float = field(compare=False)
    outer_round: int = field(compare=False)
    probe: list[float] = field(compare=False)
    period_s: float = field(compare=False)
    begun_at: float = field(compare=False, default=0.0)
    group_size: int = field(compare=False, default=0)  # 0: the matchmaker's target
    hinted: bool = field(compare=False, default=False)  # it asks hinted leaders at once (no DHT lookup to wait for)

    def could_find(self, leader: _Waiting) -> bool:
        """Whether this unit had begun early enough to ask ``leader`` before the leader's group starts."""
        return self.begun_at + (0.0 if self.hinted else DISCOVERY_S) <= leader.scheduled_at


class Matchmaker:
    """hivemind's group formation as the module docstring states it, in simulated time."""

    def __init__(self, target_group: int, latency_s: float, latency_per_member_s: float, miss: float,
                 rng: random.Random):  # fmt: skip
        self.target_group, self.latency_s, self.per_member_s = target_group, latency_s, latency_per_member_s
        self.miss, self.rng = miss, rng
        self.now = 0.0
        self.waiting: dict[str, list[_Waiting]] = {}
        self.finishing: list[tuple[float, int, SimAverager, RoundOutcome]] = []
        self.groups: list[int] = []
        self._order = itertools.count()

    def join(self, key: str, entry: _Waiting) -> None:
        self.waiting.setdefault(key, []).append(entry)

    def leave(self, averager: SimAverager) -> None:
        for entries in self.waiting.values():
            entries[:] = [entry for entry in entries if entry.averager is not averager]

    def advance(self, now: float) -> None:
        self.now = now
        for entries in self.waiting.values():
            entries.sort()
            while entries and entries[0].scheduled_at <= now:
                leader = entries[0]
                found = [entry for entry in entries[1:] if entry.could_find(leader)]
                group = [leader, *found[: (leader.group_size or self.target_group) - 1]]
                entries[:] = [entry for entry in entries if entry not in group]
                missed = [entry for entry in group[1:] if self.rng.random() < self.miss]
                for alone in [[entry] for entry in missed] + [[entry for entry in group if entry not in missed]]:
                    self._form(alone)
        while self.finishing and self.finishing[0][0] <= now:
            _, _, averager, outcome = heapq.heappop(self.finishing)
            averager.outcome = outcome

    def _form(self, group: list[_Waiting]) -> None:
        size = len(group)
        started = group[0].scheduled_at
        ends = started + (self.latency_s + self.per_member_s * (size - 2) if size > 1 else 0.0)
        averaged = weighted_average([entry.proposal for entry in group], [entry.weight for entry in group])
        periods = tuple(entry.period_s for entry in group)
        self.groups.append(size)
        for position, entry in enumerate(group):
            outcome = RoundOutcome(
                averaged=[tensor.clone() for tensor in averaged],
                group_size=size,
                max_member_round=max(member.outer_round for member in group),
                total_weight=sum(member.weight for member in group),
                started_at=started,
                finished_at=ends,
                member_drift=probe_drift([member.probe for member in group]),
                member_periods=periods,
                position=position,
            )
            entry.averager.sent_bytes += PAYLOAD_BYTES * 2 * (size - 1) / size
            heapq.heappush(self.finishing, (ends, next(self._order), entry.averager, outcome))


class SimAverager:
    """The ``Averager`` protocol on the :class:`Matchmaker`."""

    def __init__(self, matchmaker: Matchmaker, key: str, template: Sequence[torch.Tensor]):
        self.matchmaker, self.key = matchmaker, key
        self.shapes = [tuple(tensor.shape) for tensor in template]
        self.outcome: RoundOutcome | None = None
        self.in_flight = False
        self.sent_bytes = 0.0

    def begin_round(self, proposal: Sequence[torch.Tensor], weight: float, outer_round: int, window_s: float,
                    probe: Sequence[float] = (), tag: str = "", period_s: float = 0.0,
                    group: GroupRequest = GroupRequest(),
                    reference: Sequence[torch.Tensor] | None = None) -> bool:  # fmt: skip
        check_round_request(self.in_flight, self.shapes, proposal, weight)
        self.in_flight = True
        entry = _Waiting(self.matchmaker.now + window_s, next(self.matchmaker._order), self,
                         [tensor.clone() for tensor in proposal], float(weight), outer_round, list(probe), period_s,
                         self.matchmaker.now, group.size, bool(group.leaders))  # fmt: skip
        self.matchmaker.join(f"{self.key}.0b{group.subgroup}", entry)
        return True

    def poll(self) -> RoundOutcome | None:
        outcome, self.outcome = self.outcome, None
        if outcome is not None:
            self.in_flight = False
        return outcome

    def finish_round(self, timeout_s: float) -> RoundOutcome | None:
        self.matchmaker.leave(self)
        self.in_flight, self.outcome = False, None
        return None

    def shutdown(self) -> None:
        self.matchmaker.leave(self)


@dataclass
class SimUnit:
    engine: RoundEngine
    averager: SimAverager
    step_time_s: float
    next_step_at: float
    joined_at: float
    catching_up: bool = False  # a joiner not yet seen in the largest lineage
    rounds_at_join: int = 0  # its outer round once it loaded its donor's state


class Simulation:
    """A swarm of :class:`SimUnit` (see the module docstring); :meth:`run` returns its figures."""

    def __init__(self, spec: SimSpec):
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.generator = torch.Generator().manual_seed(spec.seed)
        outer = OuterSection(inner_steps=spec.inner_steps, target_group_size=max(2, spec.target_group),
                             schedule=spec.schedule, settle_rounds=0)  # fmt: skip
        self.plan = RoundPlan.from_config(outer, [(DIMENSION,)])
        self.matchmaker = Matchmaker(spec.target_group, spec.latency_s, spec.latency_per_member_s, spec.miss,
                                     random.Random(spec.seed + 1))  # fmt: skip
        self.target = torch.randn(DIMENSION, generator=self.generator)
        self.start = torch.randn(DIMENSION, generator=self.generator)
        self.units: list[SimUnit] = []
        self.left_bytes = 0.0
        self.catch_up_rounds: list[int] = []  # per joiner: its merged rounds until it was in the largest lineage
        self.joined = 0  # units created so far (each unit's peer id is its number)
        for _ in range(spec.units):
            self.units.append(self._new_unit(0.0, None))

    def _new_unit(self, now: float, donor: SimUnit | None) -> SimUnit:
        local = [(donor.engine.state.global_params[0] if donor else self.start).clone()]
        averager = SimAverager(self.matchmaker, "round", self.plan.round_templates(local)[0])
        self.joined += 1
        engine = RoundEngine(self.plan, [averager], local=local, peer_id=f"unit{self.joined}")
        if donor is not None:
            donor_state = donor.engine.state
            engine.state.load_state(donor_state.global_params, donor_state.momentum, donor_state.fragment_rounds())
        step = self.spec.step_time_s * math.exp(self.rng.gauss(0.0, self.spec.step_spread))
        return SimUnit(engine, averager, step, now + self.rng.uniform(0, step), now, donor is not None,
                       engine.outer_round)  # fmt: skip

    def _inner_step(self, unit: SimUnit) -> None:
        theta = unit.engine.state.local[0]
        scale = self.spec.noise * float(self.target.norm()) / math.sqrt(DIMENSION)
        noise = torch.randn(DIMENSION, generator=self.generator) * scale
        theta.add_(self.spec.pull * (self.target - theta) + noise)
        unit.engine.record_step(512, unit.step_time_s)

    @property
    def leave_probability(self) -> float:
        """The chance that a unit leaves (and one joins) in one tick."""
        return self.spec.churn_per_hour / 100.0 * len(self.units) * TICK_S / 3600.0

    def _churn(self, now: float) -> None:
        if self.units and self.rng.random() < self.leave_probability:
            leaving = self.units.pop(self.rng.randrange(len(self.units)))
            leaving.averager.shutdown()
            self.left_bytes += leaving.averager.sent_bytes
            donor = self.rng.choice(self.units) if self.units else None
            self.units.append(self._new_unit(now, donor))

    def run(self) -> dict[str, Any]:
        spec, now = self.spec, 0.0
        samples: list[tuple[float, list[float]]] = []
        one_model: list[tuple[float, bool]] = []
        sizes: Counter[int] = Counter()
        drifts: list[float] = []
        third_round: list[float] = []
        next_sample = 0.0
        while now < spec.duration_s:
            now += TICK_S
            self.matchmaker.advance(now)
            self._churn(now)
            census = {unit.engine.peer_id: unit.engine.schedule.desired_period_s for unit in self.units}  # the records
            for unit in self.units:
                unit.engine.census = census
                self._tick(unit, now, sizes, drifts, third_round)
            if now >= next_sample:
                phis = self._sampled_phis()
                distances = pairwise_distances(phis)
                lineages = lineage_sizes(len(phis), distances)
                self._catch_up(phis, lineages)
                samples.append((now, distances))
                one_model.append((now, len(lineages) == 1))
                next_sample += 1.0
        settled = statistics.median(third_round) if third_round else 0.0
        during = [d for t, distances in samples if t >= settled for d in distances]
        after = [held for t, held in one_model if t >= settled]
        final = pairwise_distances(self._sampled_phis())
        sent = [unit.averager.sent_bytes for unit in self.units]
        return {
            "spec": spec.__dict__,
            "group_sizes": dict(sorted(sizes.items())),
            "mean_group": sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values())),
            "member_drift": {"p50": percentile(drifts, 0.5), "p90": percentile(drifts, 0.9)},
            "distance_during": {"p50": percentile(during, 0.5), "p90": percentile(during, 0.9)},
            "one_model_share": sum(after) / len(after) if after else None,
            "catch_up_rounds": {
                "joins": sum(unit.catching_up for unit in self.units) + len(self.catch_up_rounds),
                "p50": percentile(self.catch_up_rounds, 0.5),
                "max": max(self.catch_up_rounds, default=None),
                "never": sum(unit.catching_up for unit in self.units),
            },
            "final_max_distance": max(final, default=0.0),
            "bytes_sent_per_unit_per_hour": statistics.median(sent) * 3600.0 / spec.duration_s if sent else 0.0,
        }

    def _catch_up(self, phis: list[torch.Tensor], lineages: list[int]) -> None:
        """A joiner still catching up is done once it stands in the largest lineage of the sampled units (``phis``,
        whose lineages are ``lineages``) and itself."""
        for unit in self.units:
            if unit.catching_up:
                own = unit.engine.state.global_params[0]
                if lineage_sizes(len(phis) + 1, pairwise_distances([own, *phis]))[0] > lineages[0]:
                    unit.catching_up = False
                    self.catch_up_rounds.append(unit.engine.outer_round - unit.rounds_at_join)

    def _sampled_phis(self) -> list[torch.Tensor]:
        """φ of every unit, or of SAMPLED_UNITS random ones in a larger swarm (the pairwise measures' sample)."""
        units = self.units if len(self.units) <= SAMPLED_UNITS else self.rng.sample(self.units, SAMPLED_UNITS)
        return [unit.engine.state.global_params[0] for unit in units]

    def _tick(self, unit: SimUnit, now: float, sizes: Counter[int], drifts: list[float], third: list[float]) -> None:
        if now < unit.next_step_at:
            return
        engine = unit.engine
        self._inner_step(unit)
        for end in engine.poll():
            if end.kind is RoundKind.FRAGMENT and end.merged:
                sizes[end.group_size] += 1
                if end.group_size > 1:
                    drifts.append(end.member_drift)
                if engine.outer_round == 3:
                    third.append(now)
        unit.next_step_at = now + unit.step_time_s * math.exp(self.rng.gauss(0.0, self.spec.step_jitter))
        for begin in engine.begin_due(unit.step_time_s, now):
            assert begin.status is not RoundStatus.RESET


def simulate(spec: SimSpec, repeats: int = 3) -> dict[str, Any]:
    """Median figures over ``repeats`` seeds."""
    runs = [Simulation(replace(spec, seed=spec.seed + repeat)).run() for repeat in range(repeats)]
    first = runs[0]

    def median_of(path: tuple[str, ...]) -> float | None:
        values = []
        for run in runs:
            value: Any = run
            for key in path:
                value = value[key]
            if value is not None:
                values.append(value)
        return statistics.median(values) if values else None

    return {
        "spec": first["spec"],
        "group_sizes": first["group_sizes"],
        "mean_group": median_of(("mean_group",)),
        "member_drift": {"p50": median_of(("member_drift", "p50")), "p90": median_of(("member_drift", "p90"))},
        "distance_during": {
            "p50": median_of(("distance_during", "p50")),
            "p90": median_of(("distance_during", "p90")),
        },
        "one_model_share": median_of(("one_model_share",)),
        "catch_up_rounds": {
            "joins": sum(run["catch_up_rounds"]["joins"] for run in runs),
            "p50": median_of(("catch_up_rounds", "p50")),
            "max": max((run["catch_up_rounds"]["max"] or 0 for run in runs), default=None),
            "never": sum(run["catch_up_rounds"]["never"] for run in runs),
        },
        "final_max_distance": median_of(("final_max_distance",)),
        "bytes_sent_per_unit_per_hour": median_of(("bytes_sent_per_unit_per_hour",)),
    }


# ------------------------------------------------------------------------------------------------- calibration
def fit_meeting(spec: SimSpec, mean_group: float, one_model_share: float) -> SimSpec:
    """``spec`` with the ``step_jitter`` and ``miss`` whose simulated mean group size and one-model share are together
    nearest ``mean_group`` and ``one_model_share`` of a measured swarm (relative errors added)."""

    def error(candidate: tuple[float, float]) -> float:
        jitter, miss = candidate
        figures = simulate(replace(spec, step_jitter=jitter, miss=miss), repeats=2)
        share = figures["one_model_share"] or 0.0
        return abs(figures["mean_group"] / mean_group - 1) + abs(share / max(one_model_share, 1e-9) - 1)

    jitter, miss = min(itertools.product(JITTERS, MISSES), key=error)
    return replace(spec, step_jitter=jitter, miss=miss)


def implied_miss(spec: SimSpec, one_model_share: float) -> float:
    """The ``miss`` (of MISSES) whose simulated one-model share is nearest a measured swarm's, ``spec`` otherwise
    unchanged: how much more the model leaves out in that swarm than in the one it was fitted to."""

    def error(miss: float) -> float:
        return abs((simulate(replace(spec, miss=miss), repeats=2)["one_model_share"] or 0.0) - one_model_share)

    return min(MISSES, key=error)


def fit_noise(spec: SimSpec, distance_p90: float) -> SimSpec:
    """``spec`` with the ``noise`` whose simulated 90th percentile of pairwise distance (after round 3) is nearest
    ``distance_p90`` on a log scale: fitted to a swarm that had lineages (in one that held one model the distance is
    rounding, about 1e-9, whatever the noise)."""

    def error(noise: float) -> float:
        p90 = simulate(replace(spec, noise=noise), repeats=2)["distance_during"]["p90"]
        return abs(math.log(max(p90 or 1e-12, 1e-12) / distance_p90))

    return replace(spec, noise=min(NOISES, key=error))
