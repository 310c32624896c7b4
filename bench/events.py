"""The laboratory's event kinds, by log: the executed schedule of a comparison (``schedule.jsonl``), a gang's decisions
(``gang.jsonl``), a baseline rank's log (``unit<i>/metrics.jsonl``) and the link sampler's (``links.jsonl``). Written
with :class:`p2p_diloco.unit.metrics.MetricsLog` and read with :func:`p2p_diloco.unit.events.read_events`, like the
unit's own events (``p2p_diloco/unit/events.py``)."""

from __future__ import annotations

from typing import Literal

from bench.chaos.schedule import FaultKind
from p2p_diloco.unit.events import Event


# ------------------------------------------------------------------------------ schedule.jsonl (harness, targets)
class MethodStart(Event):
    event = "method_start"
    method: str
    budget_s: float


class MethodBudgetOver(Event):
    event = "method_budget_over"
    method: str
    elapsed_s: float


class MethodFinished(Event):
    event = "method_finished"
    method: str
    elapsed_s: float


class MethodLoad(Event):
    """The machine's load average just before a method started (WAN comparison)."""

    event = "method_load"
    method: str
    load_average_1min: float


class FaultAction(Event):
    """One begin or end action of a fault, as executed."""

    event = "fault"
    method: str
    kind: FaultKind
    phase: Literal["begin", "end"]
    unit: int | None  # None for the bootstrap node
    planned_s: float
    actual_s: float
    pids: str | None  # space-separated pids it touched; None for a partition


class UnitExit(Event):
    """A unit (or rank) exited by itself."""

    event = "unit_exit"
    method: str
    unit: int
    exit_code: int


class UnitRestart(Event):
    event = "unit_restart"
    method: str
    unit: int
    pids: str


# ------------------------------------------------------------------------------------------- gang.jsonl
class GangStart(Event):
    event = "gang_start"
    mode: str
    policy: str
    units: int


class RendezvousStart(Event):
    event = "rendezvous_start"
    pid: int
    port: int


class RendezvousCrash(Event):
    event = "rendezvous_crash"
    pids: str


class JobStart(Event):
    event = "job_start"
    incarnation: int
    world_size: int
    units: str
    pids: str


class JobEnd(Event):
    event = "job_end"
    incarnation: int
    reason: Literal["failure", "scale_up", "finish"]
    exit_codes: str  # "unit<i>:<code>" for every rank


class ScaleUp(Event):
    event = "scale_up"
    incarnation: int
    available: str


class GangFinish(Event):
    event = "gang_finish"
    incarnations: int


class GangUnitAction(Event):
    """What the gang did to one unit, or saw happen to it (subclasses name the action)."""

    unit: int
    pids: str = ""  # space-separated pids it touched


class GangCrash(GangUnitAction):
    event = "crash"


class GangRecover(GangUnitAction):
    event = "recover"


class GangFreeze(GangUnitAction):
    event = "freeze"


class GangThaw(GangUnitAction):
    event = "thaw"


class GangPartition(GangUnitAction):
    event = "partition"


class GangHeal(GangUnitAction):
    event = "heal"


# --------------------------------------------------------------------------------- a baseline rank's log
class RankStart(Event):
    event = "start"
    incarnation: int
    rank: int
    world_size: int
    resumed_step: int
    tokens_in_model: int


class RankStep(Event):
    event = "step"
    step: int  # the job's step count after it
    compute_s: float  # the step minus its synchronization
    sync_s: float
    tokens: int  # this rank's
    loss: float | None
    incarnation: int


class RankCheckpoint(Event):
    event = "checkpoint"
    step: int
    incarnation: int


class RankEval(Event):
    """Rank 0's eval of the job's parameters."""

    event = "eval"
    step: int
    tokens_in_model: int  # of all ranks
    eval_loss: float | None
    final: bool
    incarnation: int


class RankStop(Event):
    event = "stop"
    step: int
    incarnation: int
    rank: int


class RankFailed(Event):
    event = "failed"
    incarnation: int
    rank: int
    error: str


# ------------------------------------------------------------------------------------------ links.jsonl
class LinkBytes(Event):
    """Cumulative bytes of one node's link (its namespace's eth0 counters)."""

    event = "link_bytes"
    node: str
    tx_bytes: int
    rx_bytes: int
