"""Seeded fault schedules: per unit, failures arrive as a Poisson process (exponential gaps with a given mean time
between failures), one fault at a time per unit; the bootstrap node may be crashed at a fixed time.

A schedule is data: the same seed and rates give the same faults, so every method of a comparison meets exactly
the same failures at the same offsets from its start.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Literal

FaultKind = Literal["crash", "straggler", "partition", "bootstrap_crash"]


@dataclass(frozen=True)
class Fault:
    """``kind`` hits ``unit`` (None: the bootstrap node) ``at_s`` seconds after the start and lasts ``duration_s``
    (crash: until the machine is back; straggler: frozen; partition: link down)."""

    at_s: float
    kind: FaultKind
    unit: int | None
    duration_s: float

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FaultRates:
    """Mean time between failures of each kind per unit (None: that kind never happens) and durations."""

    crash_mtbf_s: float | None = None
    recovery_s: float = 20.0
    straggler_mtbf_s: float | None = None
    straggler_s: float = 10.0
    partition_mtbf_s: float | None = None
    partition_s: float = 15.0
    bootstrap_crash_at_s: float | None = None
    bootstrap_down_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("crash_mtbf_s", "straggler_mtbf_s", "partition_mtbf_s", "bootstrap_crash_at_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("recovery_s", "straggler_s", "partition_s", "bootstrap_down_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def poisson_schedule(
    units: int, budget_s: float, rates: FaultRates, seed: int, start_after_s: float = 0.0
) -> list[Fault]:
    """Faults of ``units`` units during ``budget_s`` seconds, sorted by time.

    Each unit draws its next failure ``Exp(total rate)`` seconds after its previous fault ended (a unit that is down
    does not fail again), the kind chosen in proportion to the rates. No fault starts before ``start_after_s`` (time
    for the units to start) or after the budget; a fault may last past the budget.
    """
    if units < 1 or budget_s <= 0:
        raise ValueError("need units >= 1 and budget_s > 0")
    per_kind: list[tuple[FaultKind, float | None, float]] = [
        ("crash", rates.crash_mtbf_s, rates.recovery_s),
        ("straggler", rates.straggler_mtbf_s, rates.straggler_s),
        ("partition", rates.partition_mtbf_s, rates.partition_s),
    ]
    kinds = [(kind, 1.0 / mtbf, duration) for kind, mtbf, duration in per_kind if mtbf is not None]
    faults: list[Fault] = []
    total_rate = sum(rate for _, rate, _ in kinds)
    for unit in range(units):
        rng = random.Random(f"{seed}:unit{unit}")  # per-unit streams: adding a unit leaves the others' faults alone
        clock = start_after_s
        while total_rate > 0:
            clock += rng.expovariate(total_rate)
            if clock >= budget_s:
                break
            kind, _, duration = rng.choices(kinds, weights=[rate for _, rate, _ in kinds])[0]
            faults.append(Fault(round(clock, 3), kind, unit, duration))
            clock += duration
    if rates.bootstrap_crash_at_s is not None and rates.bootstrap_crash_at_s < budget_s:
        faults.append(Fault(rates.bootstrap_crash_at_s, "bootstrap_crash", None, rates.bootstrap_down_s))
    return sorted(faults, key=lambda fault: (fault.at_s, -1 if fault.unit is None else fault.unit))


def fraction_with_any_unit_down(faults: list[Fault], budget_s: float) -> float:
    """Fraction of ``[0, budget_s]`` during which at least one unit is crashed (stragglers and partitions excluded)."""
    intervals = sorted((fault.at_s, min(fault.end_s, budget_s)) for fault in faults if fault.kind == "crash")
    covered, reach = 0.0, 0.0
    for start, end in intervals:
        start = max(start, reach)
        if end > start:
            covered += end - start
            reach = end
    return covered / budget_s
