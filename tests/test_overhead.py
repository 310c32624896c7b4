"""The overhead measurement's arithmetic (bench/overhead.py) on made-up events; scripts/overhead.py runs it."""

from __future__ import annotations

import pytest

from bench.overhead import Repeat, RunTiming, Snapshot, markdown, summary, timing
from p2p_diloco.unit.events import InnerStep, OuterRound


def step(number: int, at: float, seconds: float) -> InnerStep:
    return InnerStep(time=at, step=number, loss=1.0, seconds=seconds)


def outer_round(at: float, group_size: int) -> OuterRound:
    return OuterRound(
        time=at, status="alone" if group_size == 1 else "merged", fragment=0, outer_round=1, unit_outer_round=1,
        group_size=group_size, overlap_steps=0, seconds=1.0, weight=1, member_drift=0.0, useful_compute_s=0.0,
        useful_tokens=0,
    )  # fmt: skip


STEPS = [step(40, 99.0, 0.5), step(50, 100.0, 0.5), step(60, 101.0, 0.06), step(70, 102.0, 0.08)]
ROUNDS = [outer_round(100.5, 1), outer_round(101.5, 2), outer_round(102.5, 1)]


def test_timing_covers_the_window_from_the_first_step_to_the_last() -> None:
    first = Snapshot(10.0, main=5.0, background={1: 1.0, 2: 2.0})
    last = Snapshot(12.0, main=6.0, background={1: 1.5, 2: 2.0, 3: 0.5})  # process 3 started in the window
    result = timing(STEPS, ROUNDS, 50, first, last)
    assert result.step_s == pytest.approx(0.1)
    assert result.train_step_s == pytest.approx(0.07)
    assert result.main_cpu_s == pytest.approx(1.0 / 2.0 * 0.1)  # a CPU share of 1/2 over 0.1 s per step
    assert result.background_cpu_s == pytest.approx(1.0 / 2.0 * 0.1)
    assert (result.rounds, result.solo_rounds) == (2, 1)  # the round after the last step is outside the window


def test_timing_refuses_a_window_the_events_do_not_cover() -> None:
    snapshot = Snapshot(0.0, 0.0, {})
    with pytest.raises(ValueError, match="from step 80"):
        timing(STEPS, ROUNDS, 80, snapshot, snapshot)
    with pytest.raises(ValueError, match="from step 70"):
        timing(STEPS, ROUNDS, 70, snapshot, snapshot)


def test_summary_takes_medians_over_repeats_of_each_ratio() -> None:
    def run(step_s: float) -> RunTiming:
        return RunTiming(step_s, step_s, step_s, 0.01, 3, 3)

    repeats = [Repeat(run(0.1), {"int8-P4": run(0.11)}), Repeat(run(0.2), {"int8-P4": run(0.2)}),
               Repeat(run(0.1), {"int8-P4": run(0.13)})]  # fmt: skip
    report = summary(repeats, 400, 50, ["python", "scripts/overhead.py"])
    row = report["variants"]["int8-P4"]
    assert row["median_overhead"] == pytest.approx(0.1)
    assert row["flags"] == "--fragments 4 --codec int8"
    table = markdown(report)
    assert "| int8-P4 | `--fragments 4 --codec int8` | 130.0 | +10.0% |" in table
    assert "python scripts/overhead.py" in table
