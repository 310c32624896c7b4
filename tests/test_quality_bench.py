"""The quality bench's machinery (bench/quality.py) on the embedded model, a short budget and small batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.quality import Budget, LocalSwarm, Method, MethodResult, run_method
from bench.quality_report import write_report

SMALL = {"data__seq_len": 32, "data__batch_size": 2, "data__eval_batches": 2, "inner__warmup_steps": 0}
PLAIN_AVERAGE = {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
# Per step, units × batch × seq_len tokens; each budget below is a whole number of rounds of every method.
BUDGET = Budget(tokens=4 * 2 * 32 * 4, evals=2, settings={**SMALL, "outer__inner_steps": 2})


def losses(result: MethodResult) -> list[float]:
    return [point.loss for point in result.points]


def test_every_method_consumes_the_same_token_budget(tmp_path: Path) -> None:
    methods = [
        Method("data-parallel", "data-parallel", 4),
        Method("diloco-m4", "diloco", 4),
        Method("async-m4", "diloco", 4, alone_p=0.5, delay_steps=1),
        Method("diloco-m2", "diloco", 2),
    ]
    results = [run_method(method, BUDGET, tmp_path / method.name) for method in methods]
    assert [result.tokens for result in results] == [BUDGET.tokens] * len(methods)
    assert [result.points[-1].tokens for result in results] == [BUDGET.tokens] * len(methods)
    assert [result.inner_steps for result in results] == [4, 4, 4, 8]
    assert [result.rounds for result in results[1:]] == [2, 2, 4]  # async: one in its run, one at its end
    assert results[1].mean_group == 4 and results[2].mean_group < 4
    assert all(len(result.points) == BUDGET.evals + 1 and result.points[0].tokens == 0 for result in results)
    assert len({result.start_loss for result in results}) == 1  # one initial model, evaluated before training

    write_report(results, BUDGET, tmp_path / "report", "scripts/quality.py ...", "this machine")
    document = json.loads((tmp_path / "report" / "quality.json").read_text())
    assert [row["final_loss"] for row in document["rows"]] == [result.final_loss for result in results]
    table = (tmp_path / "report" / "quality.md").read_text()
    assert "| diloco-m4 | 4 |" in table and "+0.00%" in table and (tmp_path / "report" / "quality.png").exists()


def test_one_unit_with_a_plain_average_is_the_plain_inner_loop(tmp_path: Path) -> None:
    """M = 1, outer lr 1, no momentum: φ after each round is θ, so the eval losses are those of one AdamW loop on the
    same data (data-parallel with one unit), to float rounding."""
    diloco = run_method(Method("m1", "diloco", 1, outer=PLAIN_AVERAGE), BUDGET, tmp_path / "m1")
    plain = run_method(Method("plain", "data-parallel", 1), BUDGET, tmp_path / "plain")
    assert diloco.tokens == plain.tokens
    assert losses(diloco) == pytest.approx(losses(plain), rel=1e-5)


def test_h1_with_sgd_in_one_group_is_data_parallel_on_the_combined_batch(tmp_path: Path) -> None:
    """H = 1, outer lr 1, no momentum, plain SGD inner steps (no clipping in play), M units in one group: each round
    averages φ − lr·g_i, which is data-parallel's step on the combined batch."""
    budget = Budget(tokens=4 * 2 * 32 * 3, evals=3, settings={
        **SMALL, "outer__inner_steps": 1, "inner__optimizer": "sgd", "inner__inner_lr": 0.5, "inner__grad_clip": 1e9,
    })  # fmt: skip
    diloco = run_method(Method("h1", "diloco", 4, outer=PLAIN_AVERAGE), budget, tmp_path / "h1")
    parallel = run_method(Method("dp", "data-parallel", 4), budget, tmp_path / "dp")
    assert diloco.rounds == 3 and diloco.mean_group == 4
    assert losses(diloco) == pytest.approx(losses(parallel), rel=1e-5)
    assert losses(parallel)[-1] < losses(parallel)[0]  # it trained


def test_the_partial_group_schedule_is_drawn_from_its_seed() -> None:
    def schedule(seed: int, alone_p: float) -> list[list[list[int]]]:
        swarm = LocalSwarm(members=6, alone_p=alone_p, delay_steps=0, seed=seed)
        return [swarm.groups("fragment0", index) for index in range(20)]

    assert schedule(3, 0.3) == schedule(3, 0.3)
    assert schedule(3, 0.3) != schedule(4, 0.3)
    assert all(sorted(sum(groups, [])) == list(range(6)) for groups in schedule(3, 0.3))  # everyone, once
    assert schedule(3, 0.0) == [[list(range(6))]] * 20
    assert schedule(3, 1.0) == [[[member] for member in range(6)]] * 20


def test_a_delayed_outcome_arrives_after_its_delay_and_others_decode_the_codec() -> None:
    swarm = LocalSwarm(members=2, alone_p=0.0, delay_steps=2, seed=0, codec="int8")
    template = [torch.zeros(1000)]
    first, second = (swarm.averager("fragment0", member, template) for member in range(2))
    proposals = [torch.randn(1000, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    for averager, proposal in zip((first, second), proposals):
        assert averager.begin_round([proposal], weight=1.0, outer_round=0, window_s=1.0)
    arrived = []
    for _ in range(3):
        swarm.tick()
        arrived.append(first.poll())
    assert arrived[:2] == [None, None] and arrived[2] is not None
    others_half = arrived[2].averaged[0] - proposals[0] / 2  # its own half is exact, the other's decoded
    error = float((others_half - proposals[1] / 2).norm() / (proposals[1] / 2).norm())
    assert 0 < error < 0.05  # int8 on Gaussian values: about 0.016 (compression.py)


def test_a_group_below_the_quorum_fails_for_its_members() -> None:
    swarm = LocalSwarm(members=2, alone_p=1.0, delay_steps=0, seed=0, quorum=2)
    template = [torch.zeros(3)]
    averager = swarm.averager("fragment0", 0, template)
    assert averager.begin_round([torch.ones(3)], weight=1.0, outer_round=0, window_s=1.0)
    swarm.tick()
    outcome = averager.poll()
    assert outcome is not None and outcome.averaged is None and outcome.group_size == 1
