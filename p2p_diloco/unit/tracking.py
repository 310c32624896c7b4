"""What a learning unit reports: the events of its rounds' results (:func:`round_event`), and where its events go
besides its ``metrics.jsonl``: one console line per outer round, and the trackers of ``--report-to`` (TensorBoard,
Weights & Biases); and the run's description (package version, resolved configuration, swarm keys), written once
into the work dir as ``run.json`` and given to each tracker.

:class:`UnitReport` is what the unit writes its events to (the same ``write``/``close`` as ``MetricsLog``). A tracker
that fails while the unit trains is dropped with one warning: a dashboard never stops training.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

from p2p_diloco import __version__
from p2p_diloco.checkpoint import atomic_write
from p2p_diloco.consensus import SwarmConsensus, swarm_consensus
from p2p_diloco.errors import first_line
from p2p_diloco.rounds.results import RoundBegin, RoundEnd, RoundKind, RoundStatus
from p2p_diloco.unit import events
from p2p_diloco.unit.metrics import MetricsLog

RUN_FILE = "run.json"
TENSORBOARD_DIR = "tensorboard"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitCounters:
    """What a unit's round events report besides the round itself, taken when the round began or ended."""

    inner_step: int
    outer_round: int
    now: float  # unix seconds
    period_s: float | None = None  # clock schedule: the unit's round period
    useful_compute_s: float = 0.0  # the goodput ledger (after a merge)
    useful_tokens: int = 0
    goodput: float | None = None
    wire: Mapping[str, int | None] = field(default_factory=dict)  # when the unit's round advanced: TCP counters


class Probed(Protocol):
    """A record with a φ probe (records.py ``PeerProgress``)."""

    @property
    def probe(self) -> list[float]: ...


def consensus_event(records: Iterable[Probed]) -> events.SwarmConsensus:
    """The consensus of the units whose progress records are ``records`` (consensus.py ``swarm_consensus``)."""
    consensus = swarm_consensus([record.probe for record in records])
    return events.SwarmConsensus(distance=consensus.distance, lineages=consensus.lineages, units=consensus.units)


def round_event(result: RoundBegin | RoundEnd, unit: UnitCounters) -> events.Event | None:
    """The metrics event of a round's result (events.py says what each holds); None for a round deferred or a mix
    round begun."""
    if isinstance(result, RoundBegin):
        if result.status is RoundStatus.RESET:
            return events.LocalReset(outer_round=unit.outer_round, inner_step=unit.inner_step)
        if result.status is not RoundStatus.BEGUN or result.kind is RoundKind.MIX:
            return None
        if result.kind is RoundKind.CONSENSUS:
            return events.ConsensusBegin(fragment=result.fragment, inner_step=unit.inner_step)
        cell = result.cell
        layout = {} if cell is None else {"census_units": cell.count, "row": cell.row, "rows": cell.rows,
                                          "place": cell.place}  # fmt: skip
        return events.OuterRoundBegin(fragment=result.fragment, outer_round=result.outer_round,
                                      inner_step=unit.inner_step, window_s=result.window_s,
                                      scheduled_at=unit.now + result.window_s, weight=result.weight,
                                      period_s=unit.period_s, **layout)  # fmt: skip
    if result.kind is not RoundKind.FRAGMENT:
        return events.ConsensusRound(kind=result.kind.value, fragment=result.fragment, group_size=result.group_size,
                                     applied=result.status is RoundStatus.MERGED, member_drift=result.member_drift,
                                     seconds=result.seconds, error=result.error)  # fmt: skip
    if not result.merged:
        status = "rejected" if result.status is RoundStatus.REJECTED else "failed"
        return events.OuterRoundFailed(status=status, fragment=result.fragment, outer_round=result.outer_round,
                                       error=result.error)  # fmt: skip
    return events.OuterRound(
        status="merged" if result.status is RoundStatus.MERGED else "alone", fragment=result.fragment,
        outer_round=result.outer_round, unit_outer_round=result.unit_outer_round, group_size=result.group_size,
        overlap_steps=result.overlap_steps, seconds=result.seconds, weight=result.weight,
        member_drift=result.member_drift, useful_compute_s=unit.useful_compute_s, useful_tokens=unit.useful_tokens,
        goodput=unit.goodput, reason=result.error if result.status is RoundStatus.ALONE else None, **unit.wire,
    )  # fmt: skip


class Tracker(Protocol):
    """An experiment tracker: scalars by name at an inner step, the run's description once."""

    def describe(self, run: Mapping[str, Any]) -> None: ...

    def scalars(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``log_dir`` through torch's SummaryWriter (the ``tensorboard`` package, which the config
    checked for)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def describe(self, run: Mapping[str, Any]) -> None:
        text = json.dumps(run, indent=2).replace("\n", "\n    ")  # TensorBoard's text tab renders markdown
        self._writer.add_text("run", "    " + text)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run in the group of the swarm's run id, under ``work_dir``. W&B's own environment variables
    apply (WANDB_MODE=offline, WANDB_PROJECT, WANDB_API_KEY, ...); the project defaults to ``p2p-diloco``."""

    def __init__(self, work_dir: Path, run_id: str, name: str):
        import wandb

        project = os.environ.get("WANDB_PROJECT", "p2p-diloco")
        self._run = wandb.init(project=project, group=run_id, name=name, dir=str(work_dir), reinit="create_new")

    def describe(self, run: Mapping[str, Any]) -> None:
        self._run.config.update(run, allow_val_change=True)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # its service process, which would otherwise live until this process exits


def open_trackers(report_to: Iterable[str], work_dir: Path, run_id: str, peer_id: str) -> list[Tracker]:
    """The trackers named by ``--report-to``."""
    trackers: list[Tracker] = []
    for name in report_to:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(work_dir / TENSORBOARD_DIR))
        elif name == "wandb":
            trackers.append(WandbTracker(work_dir, run_id, f"{run_id}-{peer_id[-8:]}"))
    return trackers


def event_scalars(event: events.Event) -> dict[str, float]:
    """The tracker scalars of one event (none for most kinds); non-finite values are left out."""
    values: dict[str, float | int | None] = {}
    if isinstance(event, events.InnerStep):
        values = {"train/loss": event.loss, "train/lr": event.lr, "train/tokens_per_s": event.tokens_per_s,
                  "train/step_seconds": event.seconds}  # fmt: skip
    elif isinstance(event, events.OuterRound):
        values = {
            "outer/group_size": event.group_size, "outer/seconds": event.seconds, "outer/drift": event.member_drift,
            "outer/overlap_steps": event.overlap_steps, "outer/unit_round": event.unit_outer_round,
            "outer/goodput": event.goodput, "outer/wire_bytes_sent": event.wire_bytes_sent,
            "outer/wire_bytes_received": event.wire_bytes_received,
        }  # fmt: skip
    elif isinstance(event, events.OuterRoundFailed):
        values = {"outer/failed_rounds": 1}
    elif isinstance(event, events.Eval):
        values = {"eval/loss": event.eval_loss}
    elif isinstance(event, events.ConsensusRound):
        values = {f"{event.kind}/group_size": event.group_size, f"{event.kind}/drift": event.member_drift}
    elif isinstance(event, events.StateDownload):
        values = {"join/download_seconds": event.seconds}
    elif isinstance(event, events.SwarmConsensus) and event.units > 0:
        values = {"swarm/consensus_distance": event.distance, "swarm/lineages": event.lineages,
                  "swarm/units": event.units}  # fmt: skip
    return {name: float(value) for name, value in values.items() if value is not None and math.isfinite(value)}


class RoundLines:
    """The console's account of training, for a person: one INFO line per fragment round (its fragment, group size,
    seconds and drift), with the eval that followed it appended, one per eval at join and at exit, and one when the
    unit left.

    A round's line is held until its eval or the next event other than an inner step (an eval after a round is spread
    over the next inner steps: evaluation.py), so that its eval joins it.
    """

    def __init__(self, fragments: int):
        self._fragments = fragments
        self._held: str | None = None
        self._lineages: int | None = None

    def write(self, event: events.Event) -> None:
        if isinstance(event, (events.ModelProbe, events.InnerStep)):
            return  # written between a round and its eval
        if isinstance(event, events.SwarmConsensus):
            self._consensus_line(event)
            return
        if isinstance(event, events.Eval) and event.reason == "outer_round" and self._held is not None:
            self._held += f", eval loss {_loss(event.eval_loss)}"
            self.close()
            return
        self.close()
        if isinstance(event, events.OuterRound):
            self._held = self._round_line(event)
        elif isinstance(event, events.OuterRoundFailed):
            why = "no group reached the quorum" if event.status == "failed" else event.error or "rejected"
            logger.info("outer round %d %s: nothing merged (%s); its steps go into the next round", event.outer_round,
                        self._fragment(event.fragment), why)  # fmt: skip
        elif isinstance(event, events.Eval):
            logger.info("eval loss %s (%s, outer round %d)", _loss(event.eval_loss), event.reason, event.outer_round)
        elif isinstance(event, events.Stop):
            logger.info("left after %d inner steps and %d outer rounds: %d tokens, goodput %.0f%%", event.inner_step,
                        event.outer_round, event.tokens, 100 * event.goodput)  # fmt: skip

    def _round_line(self, event: events.OuterRound) -> str:
        where = f"outer round {event.unit_outer_round} {self._fragment(event.fragment)}"
        if event.status == "alone":
            return f"{where}: alone (no other unit in the round), {event.seconds:.1f} s"
        return (
            f"{where}: merged in a group of {event.group_size}, {event.seconds:.1f} s, "
            f"drift {event.member_drift:.2g}, {event.overlap_steps} steps overlapped"
        )

    def _consensus_line(self, event: events.SwarmConsensus) -> None:
        """One line whenever the number of models the training units hold changes (not every census)."""
        if event.lineages != self._lineages and event.units > 0:
            consensus = SwarmConsensus(event.distance, event.lineages, event.units)
            logger.info("swarm: %s", consensus.described("training units"))
        self._lineages = event.lineages

    def _fragment(self, fragment: int) -> str:
        return f"(fragment {fragment + 1}/{self._fragments})"

    def close(self) -> None:
        """Log the held round line, if any."""
        if self._held is not None:
            logger.info("%s", self._held)
            self._held = None


def _loss(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


class UnitReport:
    """A unit's events to its metrics log, the console's round lines and its trackers. The trackers' step is the
    unit's inner step (the last InnerStep written)."""

    def __init__(self, metrics: MetricsLog, lines: RoundLines, trackers: list[Tracker]):
        self.metrics, self._lines, self._trackers = metrics, lines, trackers
        self._step = 0

    def describe(self, run: Mapping[str, Any]) -> None:
        """Hand the run's description to every tracker."""
        self._to_trackers(lambda tracker: tracker.describe(run))

    def write(self, event: events.Event) -> None:
        """Write ``event`` to the metrics log, the console and the trackers."""
        self.metrics.write(event)
        self._lines.write(event)
        if isinstance(event, events.InnerStep):
            self._step = event.step
        scalars = event_scalars(event) if self._trackers else {}  # none to compute on every step without a tracker
        if scalars:
            step = self._step
            self._to_trackers(lambda tracker: tracker.scalars(scalars, step))

    def _to_trackers(self, call: Callable[[Tracker], None]) -> None:
        """``call`` each tracker; one that fails is dropped (:func:`_safely`)."""
        self._trackers = [tracker for tracker in self._trackers if _safely(tracker, functools.partial(call, tracker))]

    def close(self) -> None:
        """Flush the console's last line, close the trackers and the metrics log; idempotent."""
        self._lines.close()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            _safely(tracker, tracker.close)
        self.metrics.close()

    def __enter__(self) -> UnitReport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _safely(tracker: Tracker, call: Callable[[], None]) -> bool:
    """Run a tracker's call; False (with one warning) when it failed: a tracker's failure (disk, network) must not
    stop training, and reporting to it stops."""
    try:
        call()
        return True
    except Exception as error:
        logger.warning("tracker %s failed, reporting to it stops: %s", type(tracker).__name__, first_line(error))
        return False


def run_description(config: Mapping[str, Any], peer_id: str, keys: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's ``run.json`` holds: package version, this unit's peer id, the resolved configuration and the
    DHT keys the unit uses."""
    return {"version": __version__, "peer_id": peer_id, "config": dict(config), "keys": dict(keys)}


def write_run_file(work_dir: Path, run: Mapping[str, Any]) -> Path:
    """Write ``run.json`` into ``work_dir`` atomically (a kill leaves the old file or the new one)."""
    path = work_dir / RUN_FILE
    text = (json.dumps(run, indent=2) + "\n").encode()

    def write(file: IO[bytes]) -> None:
        file.write(text)

    atomic_write(path, write)
    return path
