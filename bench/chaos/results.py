"""What one method produced in a chaos run: per-unit compute and goodput, and its eval loss over time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnitResult:
    """One unit slot over the whole run (all its restarts)."""

    unit: int
    compute_s: float  # inner-step compute time, all of it
    useful_compute_s: float  # compute time whose result reached the consensus (final) model
    tokens: int  # tokens processed
    useful_tokens: int  # tokens whose update reached the consensus model


@dataclass(frozen=True)
class EvalPoint:
    """Held-out eval loss of the method's consensus model at ``wall_s`` seconds after the run started, when it
    contained ``tokens`` training tokens (the whole swarm's)."""

    wall_s: float
    tokens: int
    eval_loss: float


@dataclass
class MethodResult:
    method: str
    budget_s: float
    units: list[UnitResult]
    evals: list[EvalPoint]
    final_eval_loss: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def allocated_s(self) -> float:
        """Allocated peer-time: every unit slot for the whole budget, down or not."""
        return self.budget_s * len(self.units)

    @property
    def goodput(self) -> float:
        """Useful compute time over allocated peer-time, for the whole method."""
        return sum(unit.useful_compute_s for unit in self.units) / self.allocated_s if self.units else 0.0

    def unit_goodput(self, unit: int) -> float:
        return self.units[unit].useful_compute_s / self.budget_s
