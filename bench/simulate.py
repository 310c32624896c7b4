"""A simulator of group formation and consensus beyond one machine: no torch training, no network.

Each simulated unit runs the project's own round engine (its schedule, clock, merge rules, settle-free)
on a small vector instead of a model, in simulated time:

* inner steps: every step (a unit's step time is drawn once from a log-normal around the measured median, and
  jittered per step by ``step_jitter``: the contention of units sharing CPUs), θ ← θ + pull·(target − θ) + noise: all
  units pull toward one common target (the shared signal of their data) and add independent noise (what differs
  between their data). ``step_jitter`` and ``noise`` (relative to the vector's norm) are the two parameters fitted to
  one measured swarm (see :func:`calibrate`), to its mean group size and its 90th percentile of pairwise distance;
* after a merged round the unit pauses ``eval_s`` (the blocking eval of a real unit);
* matchmaking, emulating hivemind 1.1.12's rule (HIVEMIND.md, trap 4): a unit that begins a round waits in its key
  (prefix and group bits) until its scheduled time; at the earliest scheduled time among the waiting units, that unit
  leads a group of the units then waiting in its key for at least ``DISCOVERY_S`` (hivemind's minimum matchmaking
  time: a unit must have declared itself and been found), earliest scheduled first, up to ``target_group``; the group's
  all-reduce ends ``latency_s(size)`` later with the weighted mean (position in the group, members' periods and probes
  as the real averager reports them). A unit alone at its scheduled time completes the round alone (quorum 1);
* churn: units leave at a rate (per hour) and as many join, downloading a random live unit's state.

Measured like the real swarms (bench/scale.py): group sizes per unit and merged round, member drift of groups of two
or more, pairwise relative distances over time (every second, after the median unit's third round) and at the end
(among 64 random units in larger swarms),
bytes sent per unit (hivemind's butterfly all-reduce sends about 2·(k−1)/k of a payload per member of a group of k).
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
from p2p_diloco.consensus import pairwise_distances
from p2p_diloco.diloco import probe_drift, weighted_average
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome, check_round_request
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.rounds.results import RoundKind, RoundStatus

DIMENSION = 256
SAMPLED_UNITS = 64  # pairwise distances of larger swarms are measured on this many random units
JITTERS = (0.05, 0.1, 0.2, 0.4, 0.8)  # the candidates calibrate() tries
NOISES = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)
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
    eval_s: float = 1.0
    latency_s: float = 1.5  # all-reduce of a group of 2 after its scheduled time
    latency_per_member_s: float = 0.5
    noise: float = 0.02
    pull: float = 0.02
    churn_per_hour: float = 0.0
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


class Matchmaker:
    """hivemind's group formation as the module docstring states it, in simulated time."""

    def __init__(self, target_group: int, latency_s: float, latency_per_member_s: float):
        self.target_group, self.latency_s, self.per_member_s = target_group, latency_s, latency_per_member_s
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
                leader, found = entries[0], [entry for entry in entries[1:] if entry.begun_at + DISCOVERY_S <= now]
                group = [leader, *found[: (leader.group_size or self.target_group) - 1]]
                entries[:] = [entry for entry in entries if entry not in group]
                self._form(group)
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
                    group: GroupRequest = GroupRequest()) -> bool:  # fmt: skip
        check_round_request(self.in_flight, self.shapes, proposal, weight)
        self.in_flight = True
        entry = _Waiting(self.matchmaker.now + window_s, next(self.matchmaker._order), self,
                         [tensor.clone() for tensor in proposal], float(weight), outer_round, list(probe), period_s,
                         self.matchmaker.now, group.size)  # fmt: skip
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


class Simulation:
    """A swarm of :class:`SimUnit` (see the module docstring); :meth:`run` returns its figures."""

    def __init__(self, spec: SimSpec):
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.generator = torch.Generator().manual_seed(spec.seed)
        outer = OuterSection(inner_steps=spec.inner_steps, target_group_size=max(2, spec.target_group),
                             schedule=spec.schedule, settle_rounds=0)  # fmt: skip
        self.plan = RoundPlan.from_config(outer, [(DIMENSION,)])
        self.matchmaker = Matchmaker(spec.target_group, spec.latency_s, spec.latency_per_member_s)
        self.target = torch.randn(DIMENSION, generator=self.generator)
        self.start = torch.randn(DIMENSION, generator=self.generator)
        self.units: list[SimUnit] = []
        self.left_bytes = 0.0
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
        return SimUnit(engine, averager, step, now + self.rng.uniform(0, step), now)

    def _inner_step(self, unit: SimUnit) -> None:
        theta = unit.engine.state.local[0]
        scale = self.spec.noise * float(self.target.norm()) / math.sqrt(DIMENSION)
        noise = torch.randn(DIMENSION, generator=self.generator) * scale
        theta.add_(self.spec.pull * (self.target - theta) + noise)
        unit.engine.record_step(512, unit.step_time_s)

    def _churn(self, now: float) -> None:
        rate = self.spec.churn_per_hour * len(self.units) * TICK_S / 3600.0
        if self.units and self.rng.random() < rate:
            leaving = self.units.pop(self.rng.randrange(len(self.units)))
            leaving.averager.shutdown()
            self.left_bytes += leaving.averager.sent_bytes
            donor = self.rng.choice(self.units) if self.units else None
            self.units.append(self._new_unit(now, donor))

    def run(self) -> dict[str, Any]:
        spec, now = self.spec, 0.0
        samples: list[tuple[float, list[float]]] = []
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
                samples.append((now, pairwise_distances(self._sampled_phis())))
                next_sample += 1.0
        settled = statistics.median(third_round) if third_round else 0.0
        during = [d for t, distances in samples if t >= settled for d in distances]
        final = pairwise_distances(self._sampled_phis())
        sent = [unit.averager.sent_bytes for unit in self.units]
        return {
            "spec": spec.__dict__,
            "group_sizes": dict(sorted(sizes.items())),
            "mean_group": sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values())),
            "member_drift": {"p50": percentile(drifts, 0.5), "p90": percentile(drifts, 0.9)},
            "distance_during": {"p50": percentile(during, 0.5), "p90": percentile(during, 0.9)},
            "final_max_distance": max(final, default=0.0),
            "bytes_sent_per_unit_per_hour": statistics.median(sent) * 3600.0 / spec.duration_s if sent else 0.0,
        }

    def _sampled_phis(self) -> list[torch.Tensor]:
        """φ of every unit, or of SAMPLED_UNITS random ones in a larger swarm (the pairwise measures' sample)."""
        units = self.units if len(self.units) <= SAMPLED_UNITS else self.rng.sample(self.units, SAMPLED_UNITS)
        return [unit.engine.state.global_params[0] for unit in units]

    def _tick(self, unit: SimUnit, now: float, sizes: Counter[int], drifts: list[float], third: list[float]) -> None:
        engine = unit.engine
        for end in engine.poll():
            if end.kind is RoundKind.FRAGMENT and end.merged:
                sizes[end.group_size] += 1
                if end.group_size > 1:
                    drifts.append(end.member_drift)
                if engine.outer_round == 3:
                    third.append(now)
                unit.next_step_at = max(unit.next_step_at, now + self.spec.eval_s)
        if now < unit.next_step_at:
            return
        self._inner_step(unit)
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
        },  # fmt: skip
        "final_max_distance": median_of(("final_max_distance",)),
        "bytes_sent_per_unit_per_hour": median_of(("bytes_sent_per_unit_per_hour",)),
    }


# ------------------------------------------------------------------------------------------------- calibration
def calibrate(spec: SimSpec, mean_group: float, distance_p90: float) -> SimSpec:
    """``spec`` with the ``step_jitter`` whose simulated mean group size is nearest ``mean_group``, then the ``noise``
    whose simulated 90th percentile of pairwise distance (after round 3) is nearest ``distance_p90`` on a log scale:
    the two parameters fitted to one measured swarm (the median distance is often ~0: units agree most of the time)."""

    def group_error(jitter: float) -> float:
        return abs(simulate(replace(spec, step_jitter=jitter), repeats=2)["mean_group"] - mean_group)

    spec = replace(spec, step_jitter=min(JITTERS, key=group_error))

    def distance_error(noise: float) -> float:
        p90 = simulate(replace(spec, noise=noise), repeats=2)["distance_during"]["p90"]
        return abs(math.log(max(p90 or 1e-12, 1e-12) / distance_p90))

    return replace(spec, noise=min(NOISES, key=distance_error))
