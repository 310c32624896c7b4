"""Where a unit's events go: the console's round lines, tracker scalars, a failing tracker, TensorBoard event files,
W&B offline runs, and run.json."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from p2p_diloco import __version__
from p2p_diloco.rounds.grid import grid_cell
from p2p_diloco.rounds.results import RoundBegin, RoundId, RoundKind, RoundStatus
from p2p_diloco.unit import events
from p2p_diloco.unit.metrics import MetricsLog
from p2p_diloco.unit.tracking import (
    RoundLines,
    TensorBoardTracker,
    UnitCounters,
    UnitReport,
    WandbTracker,
    event_scalars,
    round_event,
    run_description,
    write_run_file,
)


def outer_round(**overrides: Any) -> events.OuterRound:
    fields: dict[str, Any] = dict(status="merged", fragment=1, outer_round=3, unit_outer_round=2, group_size=3,
                                  overlap_steps=4, seconds=1.25, weight=100, member_drift=0.0123,
                                  useful_compute_s=10.0, useful_tokens=1000, goodput=0.5)  # fmt: skip
    return events.OuterRound(**{**fields, **overrides})


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "p2p_diloco.unit.tracking"]


def test_one_line_per_round_with_its_eval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    lines = RoundLines(fragments=2)
    lines.write(events.Eval(reason="join", outer_round=0, eval_loss=5.0))
    lines.write(outer_round())
    lines.write(events.ModelProbe(outer_round=3, values=[0.0]))
    assert logged(caplog) == ["eval loss 5.0000 (join, outer round 0)"], "held until its eval or the next event"
    lines.write(events.Eval(reason="outer_round", outer_round=3, eval_loss=4.25))
    lines.write(outer_round(status="alone", group_size=1, fragment=0, unit_outer_round=3, seconds=0.5))
    lines.write(events.InnerStep(step=9, loss=4.0, seconds=0.1))
    lines.write(events.OuterRoundFailed(status="failed", fragment=0, outer_round=4, error="quorum 2 not reached"))
    not_finite = "the average was not finite"
    lines.write(events.OuterRoundFailed(status="rejected", fragment=1, outer_round=4, error=not_finite))
    lines.write(events.Stop(inner_step=40, outer_round=4, tokens=1000, eval_loss=4.0, compute_s=10.0,
                            useful_compute_s=9.0, useful_tokens=900, allocated_s=12.0, goodput=0.75,
                            wire_bytes_sent=None, wire_bytes_received=None))  # fmt: skip
    lines.close()
    assert logged(caplog)[1:] == [
        "outer round 2 (fragment 2/2): merged in a group of 3, 1.2 s, drift 0.012, 4 steps overlapped, "
        "eval loss 4.2500",
        "outer round 3 (fragment 1/2): alone (no other unit in the round), 0.5 s",
        "outer round 4 (fragment 1/2): nothing merged (no group reached the quorum); its steps go into the next round",
        "outer round 4 (fragment 2/2): nothing merged (the average was not finite); its steps go into the next round",
        "left after 40 inner steps and 4 outer rounds: 1000 tokens, goodput 75%",
    ]
    assert not any("Exception" in line or "quorum 2" in line for line in logged(caplog)), "no exception text"


def test_event_scalars_name_what_trackers_plot() -> None:
    step = events.InnerStep(step=5, loss=3.5, seconds=0.2, lr=1e-3, tokens_per_s=float("nan"))
    assert event_scalars(step) == {"train/loss": 3.5, "train/lr": 1e-3, "train/step_seconds": 0.2}
    scalars = event_scalars(outer_round(wire_bytes_sent=2048))
    assert scalars["outer/group_size"] == 3 and scalars["outer/goodput"] == 0.5
    assert scalars["outer/wire_bytes_sent"] == 2048 and "outer/wire_bytes_received" not in scalars
    assert event_scalars(events.Eval(reason="final", outer_round=1, eval_loss=2.0)) == {"eval/loss": 2.0}
    assert event_scalars(events.ModelProbe(outer_round=1, values=[1.0])) == {}


class _Recorder:
    def __init__(self, fail: bool = False):
        self.fail, self.calls, self.closed = fail, [], False

    def describe(self, run: Mapping[str, Any]) -> None:
        self.calls.append(("describe", dict(run)))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self.fail:
            raise OSError("disk full\nmore details")
        self.calls.append((step, dict(values)))

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good, bad = _Recorder(), _Recorder(fail=True)
    with UnitReport(MetricsLog(tmp_path / "metrics.jsonl"), RoundLines(1), [good, bad]) as report:
        report.describe({"version": "x"})
        report.write(events.InnerStep(step=7, loss=1.0, seconds=0.1))
        report.write(events.Eval(reason="outer_round", outer_round=1, eval_loss=0.5))
    assert good.calls == [("describe", {"version": "x"}), (7, {"train/loss": 1.0, "train/step_seconds": 0.1}),
                          (7, {"eval/loss": 0.5})]  # fmt: skip
    assert good.closed and not bad.closed, "a dropped tracker is not called again"
    assert any("reporting to it stops: disk full" in message for message in logged(caplog))
    assert len(events.read_events(tmp_path / "metrics.jsonl", events.InnerStep, events.Eval)) == 2


def test_tensorboard_event_files_hold_the_scalars_and_the_run(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorBoardTracker(tmp_path / "tb")
    tracker.describe({"version": __version__})
    for step in (1, 2):
        tracker.scalars({"train/loss": 4.0 - step}, step)
    tracker.close()
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("train/loss")] == [(1, 3.0), (2, 2.0)]
    assert "run/text_summary" in accumulator.Tags()["tensors"]


def test_wandb_offline_run_is_written_under_the_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(tmp_path, run_id="my-run", name="my-run-abcdefgh")
    tracker.describe({"version": __version__})
    tracker.scalars({"train/loss": 2.5}, 3)
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_run_file_is_replaced_atomically(tmp_path: Path) -> None:
    description = run_description({"outer": {"inner_steps": 5}}, "QmPeer", {"progress": "run_progress"})
    path = write_run_file(tmp_path, description)
    assert json.loads(path.read_text()) == {"version": __version__, "peer_id": "QmPeer",
                                            "config": {"outer": {"inner_steps": 5}},
                                            "keys": {"progress": "run_progress"}}  # fmt: skip
    write_run_file(tmp_path, {**description, "peer_id": "QmOther"})
    assert json.loads(path.read_text())["peer_id"] == "QmOther"
    assert [child.name for child in tmp_path.iterdir()] == ["run.json"]


def test_a_round_begun_on_the_clock_says_where_the_unit_is_in_the_rounds_layout() -> None:
    cell = grid_cell([f"peer{index}" for index in range(16)], "peer3", "0@1000.000", target=8)
    begin = RoundBegin(RoundId(RoundKind.FRAGMENT, 0), RoundStatus.BEGUN, 4, window_s=2.0, weight=256, cell=cell)
    event = round_event(begin, UnitCounters(inner_step=40, outer_round=4, now=1000.0, period_s=8.0))
    assert isinstance(event, events.OuterRoundBegin)
    assert (event.census_units, event.row, event.rows, event.place) == (16, cell.row, 2, cell.place)
    unplaced = round_event(replace(begin, cell=None), UnitCounters(inner_step=40, outer_round=4, now=1000.0))
    assert isinstance(unplaced, events.OuterRoundBegin) and unplaced.census_units is None
