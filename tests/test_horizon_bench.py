"""The long-horizon bench's machinery (bench/horizon.py, bench/horizon_report.py) on a very small model and budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.curves import first_reach, loss_at
from bench.horizon import Horizon, run_seeds
from bench.horizon_report import document, gaps, markdown, merge, token_penalties, write_report
from bench.quality import run_method

SMALL_MODEL = {"model__model_config": "bench/models/gpt2-l2-d32", "model__tokenizer": "p2p_diloco/assets/tiny-gpt2",
               "data__seq_len": 32, "inner__warmup_steps": 2}  # fmt: skip
# 164,736 parameters × 0.02 tokens = 3,295 tokens: 26 steps of 4 × 32 tokens, rounded up to 7 rounds of H = 4.
HORIZON = Horizon(tokens_per_param=0.02, global_batch=4, inner_steps=4, evals=2, eval_rows=4, settings=SMALL_MODEL)


def test_every_method_splits_one_global_batch_and_trains_the_same_tokens_per_seed(tmp_path: Path) -> None:
    methods = [
        HORIZON.method("data-parallel", "data-parallel", 1),
        HORIZON.method("diloco-m2", "diloco", 2),
        HORIZON.method("async-m4", "diloco", 4, alone_p=0.5, delay_steps=1),
    ]
    assert [method.settings for method in methods] == [
        {"data__batch_size": 4, "data__eval_batches": 1},
        {"data__batch_size": 2, "data__eval_batches": 2},
        {"data__batch_size": 1, "data__eval_batches": 4},
    ]
    parameters, results = run_seeds(methods, HORIZON, seeds=[0, 1], jobs=2)
    assert parameters == 164_736 and HORIZON.steps(parameters) == 28
    assert [(done.result.method.name, done.seed) for done in results] == [
        (method.name, seed) for method in methods for seed in (0, 1)
    ]
    assert {(done.result.tokens, done.result.inner_steps) for done in results} == {(28 * 4 * 32, 28)}
    assert [done.result.rounds for done in results[2:4]] == [7, 7]  # synchronous: steps / H
    for seed in (0, 1):  # one initial model per seed, evaluated on the same rows whatever the batch (to rounding)
        starts = [done.result.start_loss for done in results if done.seed == seed]
        assert starts == pytest.approx([starts[0]] * len(starts), rel=1e-6)
    assert results[0].result.start_loss != results[1].result.start_loss

    # a worker's result is the in-process one at its one thread: the seed draws weights, data orders, partial groups
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = run_method(methods[2], HORIZON.budget(parameters, 1), tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert [point.loss for point in again.points] == [point.loss for point in results[5].result.points]

    write_report(document(results, HORIZON, parameters, "scripts/horizon.py ...", "here"), tmp_path / "report")
    assert "| async-m4 | 4 |" in (tmp_path / "report" / "horizon.md").read_text()


def test_the_report_gives_each_seed_and_the_median_gap_and_merges_runs_of_one_horizon(tmp_path: Path) -> None:
    rows = [
        {"seed": seed, "method": {"name": name, "kind": kind, "units": units, "outer": {}, "alone_p": 0.0,
                                  "delay_steps": 0}, "final_loss": loss, "tokens": 100, "inner_steps": 8,
         "points": [{"tokens": 0, "loss": 9.0}, {"tokens": 100, "loss": loss}]}
        for name, kind, units, seed, loss in [
            ("data-parallel", "data-parallel", 1, 0, 4.0), ("data-parallel", "data-parallel", 1, 1, 5.0),
            ("diloco-m4", "diloco", 4, 0, 4.1), ("diloco-m4", "diloco", 4, 1, 5.0),
        ]
    ]  # fmt: skip
    first = {"commands": ["a"], "environment": "here", "horizon": {"tokens_per_param": 20.0, "global_batch": 4,
             "inner_steps": 4, "settings": {}}, "parameters": 10, "rows": rows[:3]}  # fmt: skip
    # a report written after a field was added (at its default) merges with one written before
    second = {**first, "commands": ["b"], "horizon": {**first["horizon"], "rounds": 0}, "rows": rows[3:]}
    merged = merge([first, second])
    assert merged["commands"] == ["a", "b"] and len(merged["rows"]) == 4
    assert gaps(merged, "diloco-m4", "data-parallel") == pytest.approx({0: 2.5, 1: 0.0})
    table = markdown(merged)
    assert "| diloco-m4 | 4 | defaults | 0 | 0 | 4.1000 / 5.0000 | 4.5500 | +2.50% / +0.00% | +1.25% |" in table
    with pytest.raises(ValueError):
        merge([first, {**second, "parameters": 11}])
    write_report(merged, tmp_path)
    assert json.loads((tmp_path / "horizon.json").read_text()) == merged and (tmp_path / "horizon.png").exists()


def test_curves_interpolate_the_loss_at_a_point_and_where_a_loss_is_first_reached() -> None:
    curve = [(100.0, 5.0), (0.0, 9.0), (400.0, 4.0), (500.0, 4.2)]
    assert loss_at(curve, 50) == 7.0 and loss_at(curve, 1000) == 4.2 and loss_at(curve, -5) == 9.0
    assert first_reach(curve, 7.0) == 50.0 and first_reach(curve, 9.5) == 0.0 and first_reach(curve, 3.9) is None
    assert first_reach(curve, 4.1) == pytest.approx(370.0)  # the first time below, not where the curve ends
    with pytest.raises(ValueError):
        loss_at([], 1.0)


def test_token_penalties_are_the_tokens_to_data_parallels_loss_at_fractions_of_the_run_over_its_own() -> None:
    dp = [{"tokens": 0, "loss": 9.0}, {"tokens": 100, "loss": 5.0}, {"tokens": 400, "loss": 4.0}]
    slow = [{"tokens": 0, "loss": 9.0}, {"tokens": 200, "loss": 5.0}, {"tokens": 400, "loss": 4.5}]
    rows = [
        {"seed": seed, "method": {"name": name, "kind": kind}, "tokens": 400, "points": points}
        for seed in (0, 1) for name, kind, points in [("dp", "data-parallel", dp), ("m4", "diloco", slow)]
    ]  # fmt: skip
    doc = {"rows": rows}
    # dp's loss at 10% (40 tokens) is 7.4, which m4 reaches at 80 tokens; at 25% (100) 5.0 at 200; at 50% (200)
    # 4.6667 at 333.3; at 100% 4.0, never
    assert token_penalties(doc, "m4", "dp") == pytest.approx([2.0, 2.0, 1.6667, None], abs=1e-4)
    assert token_penalties(doc, "dp", "dp") == pytest.approx([1.0, 1.0, 1.0, 1.0])


def test_a_global_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        HORIZON.method("diloco-m3", "diloco", 3)
    with pytest.raises(ValueError):
        Horizon(tokens_per_param=0, global_batch=4, inner_steps=4)
    fine_tune = Horizon(tokens_per_param=0, global_batch=4, inner_steps=4, rounds=300, settings=SMALL_MODEL)
    assert fine_tune.steps(parameters=164_736) == 1200  # the rounds, not the tokens, set a fine-tune's budget
