"""The WAN report's arithmetic on hand-made logs and link samples (no processes), and the script's refusal of bad
settings."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.chaos.results import EvalPoint, MethodResult, UnitResult
from bench.events import LinkBytes, RankStart, RankStep
from bench.wan.report import (
    LinkUse,
    StepSpan,
    UnitWan,
    add_deeper_target,
    compare,
    comparison_tokens,
    crossing,
    deeper_target_loss,
    default_target_loss,
    eval_bracket,
    exit_share,
    judge_targets,
    ladder_rows,
    link_use,
    method_row,
    projected_time_to_target,
    step_span,
    target_ladder,
    time_to_target,
    token_rate,
    tokens_to_target,
    unit_span,
    write_report,
)
from p2p_diloco.unit.events import Event, InnerStep, Stop
from p2p_diloco.unit.metrics import MetricsLog


def result(method: str, curve: list[tuple[float, int, float]]) -> MethodResult:
    evals = [EvalPoint(wall_s, tokens, loss) for wall_s, tokens, loss in curve]
    return MethodResult(method, 100.0, [UnitResult(0, 1.0, 1.0, 10, 10)], evals, evals[-1].eval_loss if evals else None)


def sample(at: float, node: str, tx: int, rx: int) -> LinkBytes:
    return LinkBytes(time=at, node=node, tx_bytes=tx, rx_bytes=rx)


def rank_step(at: float, step: int, compute_s: float) -> RankStep:
    return RankStep(time=at, step=step, compute_s=compute_s, sync_s=0.5, tokens=64, loss=1.0, incarnation=0)


def mark(at: float, step: int, seconds: float) -> InnerStep:
    return InnerStep(time=at, step=step, loss=1.0, seconds=seconds)


def unit_stop(at: float, inner_step: int, compute_s: float) -> Stop:
    return Stop(
        time=at, inner_step=inner_step, outer_round=1, tokens=0, eval_loss=None, compute_s=compute_s,
        useful_compute_s=0.0, useful_tokens=0, allocated_s=1.0, goodput=0.0, wire_bytes_sent=None,
        wire_bytes_received=None,
    )  # fmt: skip


def write_log(path: Path, events: Sequence[Event]) -> Path:
    with MetricsLog(path) as log:
        for event in events:
            log.write(event)
    return path


def test_time_to_target_is_the_first_eval_at_or_below_it_and_the_default_target_is_reached_by_every_method() -> None:
    fast = result("ours", [(5.0, 0, 6.0), (20.0, 100, 4.5), (30.0, 200, 4.0), (40.0, 300, 4.2)])
    slow = result("sync-dp", [(200.0, 100, 5.0), (10.0, 0, 6.0)])
    assert default_target_loss([fast, slow, result("empty", [])]) == 5.0
    assert time_to_target(fast, 5.0) == 15.0  # counted from its first eval (training, start-up left out)
    assert time_to_target(fast, 5.0, since_first_eval=False) == 20.0
    assert time_to_target(slow, 5.0) == 190.0
    assert time_to_target(fast, 4.0) == 25.0
    assert time_to_target(slow, 4.9) is None
    assert default_target_loss([result("empty", [])]) is None


def test_crossing_interpolates_between_the_last_eval_above_the_target_and_the_first_at_or_below_it() -> None:
    curve = result("sync-dp", [(110.0, 400, 5.0), (10.0, 0, 8.0), (60.0, 200, 6.0), (160.0, 600, 4.0)])
    assert crossing(curve, 5.5, "wall_s") == 75.0  # halfway from 6.0 (50 s after the first eval) to 5.0 (100 s)
    assert crossing(curve, 5.5, "tokens") == 300.0
    assert crossing(curve, 5.0, "wall_s") == 100.0 and crossing(curve, 9.0, "wall_s") == 0.0
    assert crossing(curve, 3.9, "tokens") is None


def test_the_ladder_takes_targets_sync_dp_reached_and_prices_each_methods_speed_up_in_tokens() -> None:
    dp = result("sync-dp", [(0.0, 0, 8.0), (400.0, 100, 6.0), (800.0, 200, 5.0), (1000.0, 250, 5.2)])
    ours = result("ours-streaming", [(0.0, 0, 8.0), (10.0, 300, 6.0), (20.0, 600, 5.0)])
    reference = result("dp-reference", [(0.0, 0, 8.0), (5.0, 100, 6.0), (10.0, 150, 5.0)])
    assert target_ladder([ours, dp]) == [7.25, 6.5, 5.75, 5.0]  # from 8.0 toward its best, 5.0
    assert target_ladder([ours]) == [] and target_ladder([result("sync-dp", [(0.0, 0, 8.0)])]) == []
    rows = ladder_rows([dp, ours, reference], [6.0, 5.0])
    assert [(row["target_loss"], row["method"]) for row in rows] == [
        (6.0, "sync-dp"), (6.0, "ours-streaming"), (5.0, "sync-dp"), (5.0, "ours-streaming"),
    ]  # fmt: skip
    assert rows[1]["speedup_vs_sync_dp"] == 40.0 and rows[3]["speedup_vs_sync_dp"] == 40.0
    assert rows[1]["tokens_vs_data_parallel"] == 3.0 and rows[3]["tokens_vs_data_parallel"] == 4.0  # the reference's
    assert ladder_rows([dp, ours], [5.0])[1]["tokens_vs_data_parallel"] == 3.0  # sync-dp's own tokens without it
    assert ladder_rows([ours], [5.0])[0]["speedup_vs_sync_dp"] is None


def test_a_gang_ranks_span_counts_the_compute_of_every_step_after_its_first_one(tmp_path: Path) -> None:
    events = [rank_step(100.0 + 2 * step, step, 1.5) for step in range(1, 6)]
    start = RankStart(time=90.0, incarnation=0, rank=0, world_size=2, resumed_step=0, tokens_in_model=0)
    span = step_span(write_log(tmp_path / "metrics.jsonl", [*reversed(events), start]))
    assert span == StepSpan(inner_steps=5, compute_s=6.0, window_s=8.0)
    assert span.utilisation == 0.75


def test_a_swarm_units_span_uses_its_mean_step_compute_between_its_first_and_last_mark(tmp_path: Path) -> None:
    marks = [mark(10.0 * index, 10 * index, 0.5) for index in (1, 2, 3)]
    stop = unit_stop(40.0, 35, 28.0)
    span = step_span(write_log(tmp_path / "metrics.jsonl", [*marks, stop]))
    assert span == unit_span(marks, [stop]) == StepSpan(inner_steps=35, compute_s=0.8 * 20, window_s=20.0)
    assert span.utilisation == pytest.approx(0.8)
    # without a stop event (the unit was killed): its last mark's step and the mean of the marks' seconds
    assert unit_span(marks, []) == StepSpan(inner_steps=30, compute_s=0.5 * 20, window_s=20.0)
    assert unit_span([marks[0]], []) == StepSpan(30 // 3, 0.0, 0.0)
    assert unit_span([marks[0]], []).utilisation is None
    assert unit_span([], [stop]) is None
    assert step_span(tmp_path / "no-such-log.jsonl") is None


def test_eval_bracket_names_the_evals_that_the_loss_at_equal_tokens_is_interpolated_between() -> None:
    curve = result("ours", [(1.0, 0, 6.0), (2.0, 500, 5.0), (3.0, 900, 4.0)])
    assert eval_bracket(curve, 100) == (0, 500)
    assert eval_bracket(curve, 500) == (500, 500)
    assert eval_bracket(curve, 2_000) == (900, 900)
    assert eval_bracket(result("empty", []), 100) is None


def test_link_use_counts_the_whole_sampled_span_and_the_peak_over_one_second_windows() -> None:
    samples = [sample(10.0, "unit0", 0, 0), sample(11.0, "unit0", 1_000, 50), sample(13.0, "unit0", 1_500, 4_050)]
    samples.append(sample(10.0, "unit1", 7, 7))
    assert link_use(samples, "unit0") == LinkUse(1_500, 4_050, 16_000.0)
    assert link_use(samples, "unit1") == LinkUse(0, 0, None)
    assert link_use(samples, "unit2") is None


def test_exit_bytes_are_what_crossed_after_the_last_inner_step_and_their_share_counts_every_unit() -> None:
    samples = [sample(10.0, "unit0", 0, 0), sample(11.0, "unit0", 1_000, 50), sample(13.0, "unit0", 1_500, 4_050)]
    samples.append(sample(10.0, "unit1", 7, 7))
    assert link_use(samples, "unit0", last_step_at=11.0) == LinkUse(1_500, 4_050, 16_000.0, 500 + 4_000)
    assert link_use(samples, "unit0", last_step_at=99.0) == LinkUse(1_500, 4_050, 16_000.0, 0)  # stepped to the end
    exiting = link_use(samples, "unit0", last_step_at=11.0)
    units = [UnitWan(0, None, exiting), UnitWan(1, None, LinkUse(450, 0, None, 0))]
    assert exit_share(units) == 4_500 / (1_500 + 4_050 + 450)
    assert exit_share([*units, UnitWan(2, None, LinkUse(1, 1, None))]) is None  # a unit without a step: not measured


def test_rows_report_bytes_per_step_utilisation_and_every_ratio_to_sync_dp() -> None:
    dp = result("sync-dp", [(0.0, 0, 6.0), (100.0, 1_000, 5.0), (200.0, 2_000, 4.8)])
    ours = result("ours-streaming", [(0.0, 0, 6.0), (4.0, 1_000, 5.05), (5.0, 3_000, 4.0)])
    tokens = 2_000
    dp_units = [
        UnitWan(0, StepSpan(10, 8.0, 10.0), LinkUse(40_000_000, 40_000_000, 2e7)),
        UnitWan(1, StepSpan(10, 9.0, 10.0), LinkUse(38_000_000, 41_000_000, 1.9e7)),
    ]
    ours_units = [
        UnitWan(0, StepSpan(100, 9.7, 10.0), LinkUse(2_000, 1_000, 3e5)),
        UnitWan(1, StepSpan(200, 9.9, 10.0), LinkUse(3_000, 5_000, 1e5)),
        UnitWan(2, None, None),
    ]
    rows = [method_row(dp, dp_units, 5.0, tokens), method_row(ours, ours_units, 5.0, tokens)]
    compare(rows)
    dp_row, ours_row = rows
    assert dp_row["tx_bytes_per_step"] == 4_000_000 and dp_row["rx_bytes_per_step"] == 4_100_000
    assert dp_row["utilisation_min"] == 0.8 and dp_row["utilisation_median"] == pytest.approx(0.85)
    assert ours_row["tx_bytes_per_step"] == 20.0 and ours_row["rx_bytes_per_step"] == 25.0
    assert ours_row["inner_steps"] == 300 and ours_row["peak_bps"] == 3e5
    assert ours_row["time_to_target_s"] == 5.0 and ours_row["speedup_vs_sync_dp"] == 20.0
    assert ours_row["bytes_ratio_vs_sync_dp"] == 200_000.0
    assert ours_row["eval_loss_at_equal_tokens"] == pytest.approx(4.525)
    assert ours_row["loss_vs_sync_dp"] == pytest.approx(4.525 / 4.8 - 1)
    assert ours_row["equal_tokens_between_evals"] == (1_000, 3_000)
    assert dp_row["equal_tokens_between_evals"] == (2_000, 2_000)
    assert dp_row["speedup_vs_sync_dp"] == 1.0 and dp_row["loss_vs_sync_dp"] == 0.0
    assert ours_row["units"][2] == {
        "unit": 2,
        "inner_steps": None,
        "compute_s": None,
        "window_s": None,
        "utilisation": None,
        "tx_bytes": None,
        "rx_bytes": None,
        "peak_bps": None,
        "exit_bytes": None,
        "tx_bytes_per_step": None,
        "rx_bytes_per_step": None,
    }


def test_without_sync_dp_the_comparisons_are_not_measured() -> None:
    rows = [method_row(result("ours-p1", [(1.0, 0, 5.0)]), [UnitWan(0, StepSpan(5, 1.0, 2.0), None)], 5.0, 0)]
    compare(rows)
    assert (rows[0]["speedup_vs_sync_dp"], rows[0]["bytes_ratio_vs_sync_dp"], rows[0]["loss_vs_sync_dp"]) == (
        None,
        None,
        None,
    )
    judged = {judgement["target"]: judgement["met"] for judgement in judge_targets(rows)}
    assert judged == {
        "speed-up over sync-dp to the target eval loss": None,
        "speed-up over sync-dp to the deeper target (sync-dp projected)": None,
        "compute utilisation (lowest unit)": False,
        "sync-dp bytes per inner step / ours": None,
        "eval loss at equal tokens vs data-parallel": None,
    }


def test_targets_are_judged_on_our_methods_only_and_at_their_thresholds() -> None:
    base = {"speedup_vs_sync_dp": 20.0, "utilisation_min": 0.95, "bytes_ratio_vs_sync_dp": 1000.0}
    rows = [
        {"method": "sync-dp", **base, "loss_vs_sync_dp": 0.0},
        {"method": "ours-p1", **base, "loss_vs_sync_dp": 0.015},
        {
            "method": "ours-streaming",
            "speedup_vs_sync_dp": 19.9,
            "utilisation_min": 0.949,
            "bytes_ratio_vs_sync_dp": 999.0,
            "loss_vs_sync_dp": 0.0151,
        },
    ]
    judgements = judge_targets(rows)
    assert {judgement["method"] for judgement in judgements} == {"ours-p1", "ours-streaming"}
    assert [judgement["met"] for judgement in judgements] == [True, None, True, True, True] + [False, None] + [
        False
    ] * 3
    assert judgements[0]["line"].endswith("(target: ≥ 20×): **met**")
    assert judgements[9]["line"] == (
        "ours-streaming: eval loss at equal tokens vs data-parallel +1.51% (target: at most +1.5%): **NOT met**"
    )


def test_the_quality_reference_sets_the_equal_tokens_comparison_and_is_not_timed() -> None:
    wan_dp = result("sync-dp", [(0.0, 0, 8.0), (200.0, 1_000, 7.0)])
    ours = result("ours-p1", [(0.0, 0, 8.0), (10.0, 50_000, 6.5), (20.0, 100_000, 6.0)])
    reference = result("dp-reference", [(0.0, 0, 8.0), (30.0, 80_000, 5.6), (60.0, 160_000, 5.0)])
    results = [wan_dp, ours, reference]
    assert default_target_loss(results) == 7.0  # the reference's 5.0 does not count: it did not train on the links
    assert comparison_tokens(results) == 100_000  # sync-dp's 1,000 tokens are left out
    assert comparison_tokens([wan_dp, ours]) == 1_000
    rows = [method_row(r, [], 7.0, 100_000) for r in results]
    compare(rows)
    assert rows[2]["time_to_target_s"] is None and rows[1]["time_to_target_s"] == 10.0
    assert rows[1]["speedup_vs_sync_dp"] == 20.0
    assert rows[1]["loss_vs_sync_dp"] == pytest.approx(6.0 / 5.45 - 1)  # against the reference at 100,000 tokens


def test_sync_dp_time_to_a_deeper_target_is_projected_from_its_token_rate_and_the_references_tokens() -> None:
    wan_dp = result("sync-dp", [(10.0, 0, 8.0), (210.0, 2_000, 7.0)])  # 10 tokens/s on the links
    ours = result("ours-p1", [(0.0, 0, 8.0), (30.0, 50_000, 6.5), (60.0, 100_000, 6.0)])
    diloco = result("sync-diloco", [(0.0, 0, 8.0), (50.0, 50_000, 6.2)])
    reference = result("dp-reference", [(0.0, 0, 8.0), (30.0, 40_000, 6.1), (60.0, 80_000, 5.0)])
    results = [wan_dp, ours, diloco, reference]
    assert token_rate(wan_dp) == 10.0 and token_rate(result("one", [(1.0, 0, 8.0)])) is None
    assert tokens_to_target(reference, 6.2) == 40_000 and tokens_to_target(reference, 4.0) is None
    assert deeper_target_loss(results) == 6.2  # sync-diloco's best: every method but sync-dp reached it
    assert deeper_target_loss([wan_dp, ours]) is None  # no reference: nothing to project with
    assert projected_time_to_target(wan_dp, reference, 6.2) == 4_000.0
    rows = [method_row(r, [], 7.0, 50_000) for r in results]
    add_deeper_target(rows, results, 6.2)
    assert rows[0]["time_to_deeper_target_s"] == 4_000.0 and rows[0]["deeper_target_projected"]
    assert rows[1]["time_to_deeper_target_s"] == 60.0 and not rows[1]["deeper_target_projected"]
    assert rows[1]["speedup_deeper_vs_sync_dp"] == pytest.approx(4_000 / 60)
    assert rows[3]["time_to_deeper_target_s"] is None


def write_unit_logs(run_dir: Path, events_by_unit: list[list[Event]], samples: list[LinkBytes]) -> None:
    for unit, events in enumerate(events_by_unit):
        write_log(run_dir / f"unit{unit}" / "metrics.jsonl", events)
    write_log(run_dir / "links.jsonl", samples)


def test_write_report_reads_every_methods_logs_and_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    steps: list[Event] = [rank_step(100.0 + step, step, 0.5) for step in (1, 2, 3)]
    write_unit_logs(
        tmp_path / "sync-dp",
        [steps, steps],
        [sample(99.0, f"unit{unit}", 0, 0) for unit in (0, 1)] + [sample(104.0, f"unit{u}", 900, 600) for u in (0, 1)],
    )
    marks: list[Event] = [mark(100.0 + index, 10 * index, 0.09) for index in (1, 2)]
    stop = unit_stop(103.0, 30, 2.7)
    write_unit_logs(
        tmp_path / "ours-streaming",
        [[*marks, stop], [*marks, stop]],
        [sample(99.0, f"unit{unit}", 0, 0) for unit in (0, 1)] + [sample(104.0, f"unit{u}", 3, 3) for u in (0, 1)],
    )
    results = [
        result("sync-dp", [(1.0, 0, 6.0), (51.0, 100, 5.0)]),
        result("ours-streaming", [(1.0, 0, 6.0), (3.0, 100, 5.0), (4.0, 200, 4.0)]),
    ]
    command = ["python", "scripts/wan.py", "--rate-mbit", "5", "--swarm-flags", "--quorum 2"]
    markdown = write_report(tmp_path, results, 2, None, command, {})
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["command"] == "python scripts/wan.py --rate-mbit 5 --swarm-flags '--quorum 2'"
    assert report["target_loss"] == 5.0 and report["target_loss_default"] and report["equal_tokens"] == 100
    dp, ours = report["methods"]
    assert dp["tx_bytes_per_step"] == 300.0 and ours["tx_bytes_per_step"] == 0.1
    assert ours["speedup_vs_sync_dp"] == 25.0 and ours["bytes_ratio_vs_sync_dp"] == pytest.approx(3000.0)
    assert ours["utilisation_min"] == pytest.approx(0.9) and dp["utilisation_min"] == 0.5
    assert [judgement["met"] for judgement in report["targets"]] == [True, None, False, True, True]
    assert [(row["target_loss"], row["method"], row["speedup_vs_sync_dp"]) for row in report["ladder"][-2:]] == [
        (5.0, "sync-dp", 1.0), (5.0, "ours-streaming", 25.0),
    ]  # fmt: skip
    assert "| 5.0000 | ours-streaming | 2.0 | 25.0× | 100 | 1.00× |" in markdown
    assert "| ours-streaming | 60 | 2.0 | 25.00× | 90.0% / 90.0% |" in markdown
    assert f"```\n{report['command']}\n```" in markdown
    assert (tmp_path / "results.md").read_text() == markdown
    assert (tmp_path / "results.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate-mbit", "0"], "error: rate_mbit must be a positive number"),
        (["--rate-mbit", "10", "--units", "1"], "error: units must be at least 2"),
        (["--rate-mbit", "10", "--codec", "int4"], "error: invalid codec"),
        (["--rate-mbit", "10", "--swarm-flags=--fragments 2"], "error: swarm flags must not set ['--fragments']"),
        (["--rate-mbit", "10", "--report-only"], "error: "),
        (["--rate-mbit", "10", "--method-budget-s", "sync-dp"], "error: --method-budget-s takes METHOD=SECONDS"),
        (["--rate-mbit", "10", "--method-budget-s", "sync-dp=-1"], "error: the budget of sync-dp must be a positive"),
        (["--rate-mbit", "10", "--methods", "sync-dp", "--method-budget-s", "ours-p1=9"], "error: budgets given for"),
    ],
)
def test_wan_script_refuses_bad_settings_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "wan.py"
    command = [sys.executable, str(script), "--out", str(tmp_path / "out"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), done.stderr
    assert not (tmp_path / "out").exists()
