"""Fault schedules, the executor's action order, and the chaos report (no processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos.harness import run_schedule
from bench.chaos.report import equal_tokens, loss_at_tokens, write_report
from bench.chaos.results import EvalPoint, MethodResult, UnitResult
from bench.chaos.schedule import Fault, FaultRates, fraction_with_any_unit_down, poisson_schedule
from bench.chaos.swarm_target import time_breakdown
from bench.events import FaultAction
from p2p_diloco.unit.events import Join, read_events
from p2p_diloco.unit.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.unit.metrics import MetricsLog

RATES = FaultRates(crash_mtbf_s=60, recovery_s=10, straggler_mtbf_s=120, straggler_s=5, bootstrap_crash_at_s=50)


def test_schedule_is_reproducible_and_one_fault_at_a_time_per_unit() -> None:
    schedule = poisson_schedule(4, 600, RATES, seed=3, start_after_s=20)
    assert schedule == poisson_schedule(4, 600, RATES, seed=3, start_after_s=20)
    assert schedule != poisson_schedule(4, 600, RATES, seed=4, start_after_s=20)
    assert [fault.at_s for fault in schedule] == sorted(fault.at_s for fault in schedule)
    assert all(20 <= fault.at_s < 600 for fault in schedule)
    for unit in range(4):
        own = [fault for fault in schedule if fault.unit == unit]
        assert own, "a 600 s budget with a 40 s mean gap gives every unit faults"
        assert all(later.at_s >= earlier.end_s for earlier, later in zip(own, own[1:]))
    assert [fault for fault in schedule if fault.kind == "bootstrap_crash"] == [
        Fault(50, "bootstrap_crash", None, RATES.bootstrap_down_s)
    ]


def test_adding_a_unit_keeps_the_other_units_faults() -> None:
    three = [fault for fault in poisson_schedule(3, 300, RATES, seed=1) if fault.unit is not None]
    four = [fault for fault in poisson_schedule(4, 300, RATES, seed=1) if fault.unit is not None and fault.unit < 3]
    assert three == four


def test_rates_match_the_mean_time_between_failures() -> None:
    rates = FaultRates(crash_mtbf_s=50, recovery_s=1)
    crashes = poisson_schedule(1, 200_000, rates, seed=0)
    mean_gap = 200_000 / len(crashes) - rates.recovery_s
    assert mean_gap == pytest.approx(50, rel=0.05)


def test_fraction_with_a_unit_down_merges_overlaps() -> None:
    faults = [
        Fault(10, "crash", 0, 20),
        Fault(20, "crash", 1, 20),
        Fault(50, "straggler", 2, 30),
        Fault(90, "crash", 0, 50),
    ]
    assert fraction_with_any_unit_down(faults, 100) == pytest.approx((40 - 10 + 100 - 90) / 100)


def test_invalid_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="crash_mtbf_s"):
        FaultRates(crash_mtbf_s=0)
    with pytest.raises(ValueError, match="recovery_s"):
        FaultRates(recovery_s=-1)


class RecordingTarget:
    """A ChaosTarget that only records the calls the executor makes."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []

    def start(self) -> None:
        self.calls.append(("start", None))

    def _record(self, call: str, unit: int | None = None) -> list[int]:
        self.calls.append((call, unit))
        return [1234]

    def crash(self, unit: int) -> list[int]:
        return self._record("crash", unit)

    def recover(self, unit: int) -> list[int]:
        return self._record("recover", unit)

    def freeze(self, unit: int) -> list[int]:
        return self._record("freeze", unit)

    def thaw(self, unit: int) -> list[int]:
        return self._record("thaw", unit)

    def partition(self, unit: int) -> None:
        self._record("partition", unit)

    def heal(self, unit: int) -> None:
        self._record("heal", unit)

    def crash_bootstrap(self) -> list[int]:
        return self._record("crash_bootstrap")

    def recover_bootstrap(self) -> list[int]:
        return self._record("recover_bootstrap")

    def tick(self) -> None:
        pass

    def finish(self) -> None:
        self.calls.append(("finish", None))

    def result(self) -> MethodResult:
        return MethodResult(self.name, 1.0, [], [], None)


def test_executor_applies_begin_and_end_actions_in_time_and_logs_them(tmp_path: Path) -> None:
    schedule = [
        Fault(0.1, "crash", 0, 0.3),
        Fault(0.2, "straggler", 1, 0.2),
        Fault(0.3, "partition", 2, 5.0),  # would heal after the budget: healed when the budget is over
        Fault(0.5, "bootstrap_crash", None, 0.1),
    ]
    target = RecordingTarget()
    with MetricsLog(tmp_path / "schedule.jsonl") as log:
        run_schedule(target, schedule, budget_s=1.0, log=log)
    assert target.calls == [
        ("start", None),
        ("crash", 0),
        ("freeze", 1),
        ("partition", 2),
        ("recover", 0),
        ("thaw", 1),
        ("crash_bootstrap", None),
        ("recover_bootstrap", None),
        ("heal", 2),
        ("finish", None),
    ]
    faults = read_events(tmp_path / "schedule.jsonl", FaultAction)
    assert len(faults) == 8 and all(event.actual_s >= event.planned_s for event in faults[:7])
    assert faults[0].pids == "1234" and faults[2].pids is None


def _result(method: str, points: list[tuple[int, float]], useful: float) -> MethodResult:
    units = [UnitResult(unit, 10.0, useful, 1000, 900) for unit in range(2)]
    evals = [EvalPoint(float(index), tokens, loss) for index, (tokens, loss) in enumerate(points)]
    return MethodResult(method, 20.0, units, evals, points[-1][1] if points else None)


def test_report_interpolates_at_equal_tokens_and_writes_all_outputs(tmp_path: Path) -> None:
    ours = _result("ours", [(0, 8.0), (1000, 6.0), (3000, 5.0)], useful=18.0)
    baseline = _result("sync-dp", [(0, 8.0), (2000, 5.5)], useful=5.0)
    assert equal_tokens([ours, baseline]) == 2000
    assert loss_at_tokens(ours, 2000) == pytest.approx(5.5)
    assert ours.goodput == pytest.approx(0.9) and baseline.unit_goodput(0) == pytest.approx(0.25)
    markdown = write_report(tmp_path, [ours, baseline], {"command": "test"})
    assert "| ours | 90.0% | 90% / 90% |" in markdown
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["equal_tokens"] == 2000 and data["methods"][1]["eval_loss_at_equal_tokens"] == pytest.approx(5.5)
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_time_breakdown_accounts_for_every_allocated_second(tmp_path: Path) -> None:
    """One unit, 100 s budget from t=1000: joined at 1005, crashed 1020-1030, rejoined at 1034, frozen 1050-1055."""
    unit_dir = tmp_path / "unit0"
    unit_dir.mkdir()
    GoodputLedger(allocated_since=1000, compute_s=70.0, useful_compute_s=66.0).save(unit_dir / LEDGER_FILE)
    with MetricsLog(unit_dir / "metrics.jsonl") as log:
        for at in (1005, 1034):
            log.write(Join(time=at, peer_id="a", source="swarm", outer_round=1, fingerprint="f", multiaddrs=""))
    faults = [
        FaultAction(time=time, method="ours", unit=0, kind=kind, phase=phase, planned_s=0, actual_s=0, pids=None)
        for kind, phase, time in [
            ("crash", "begin", 1020),
            ("crash", "end", 1030),
            ("straggler", "begin", 1050),
            ("straggler", "end", 1055),
        ]
    ]
    line = time_breakdown(tmp_path, faults, units=1, budget_s=100, started_at=1000)
    assert line == (
        "allocated peer-time 100 s: useful 66.0%, start-up 5.0%, crashed 10.0%, rejoin 4.0%, frozen 5.0%, "
        "lost steps 4.0%, rest 6.0%"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--crash-mtbf-s", "0"], "error: crash_mtbf_s must be positive"),
        (["--partition-mtbf-s", "60"], "error: partitions need network namespaces"),
        (["--budget-s", "-1"], "error: need units >= 1 and budget_s > 0"),
    ],
)
def test_chaos_script_refuses_bad_settings_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "chaos.py"
    command = [sys.executable, str(script), "--out", str(tmp_path / "out"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(message), done.stderr
    assert not (tmp_path / "out").exists()
