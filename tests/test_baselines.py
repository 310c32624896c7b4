"""The synchronous baselines of the chaos comparison: goodput reconstruction from rank logs, the inner trainer's
gradient-synchronization hook, and one real sync-dp gang (2 ranks) that loses a unit and restarts from the checkpoint.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from swarms import session_helper

from bench.chaos.gang import GangTarget, eval_points, kept_step_limits, unit_results
from bench.chaos.network import Loopback
from bench.events import JobStart, RankCheckpoint, RankEval, RankFailed, RankStart, RankStep, RankStop, RendezvousStart
from bench.swarm import wait_until
from bench.training import TrainingSetup
from p2p_diloco.config import InnerSection
from p2p_diloco.lifecycle import descendant_pids, is_running
from p2p_diloco.unit.events import E, read_events
from p2p_diloco.unit.inner import InnerTrainer


# ------------------------------------------------------------------------------------ goodput reconstruction
def _start(incarnation: int, resumed_step: int, world_size: int = 2) -> RankStart:
    return RankStart(
        incarnation=incarnation, rank=0, world_size=world_size, resumed_step=resumed_step, tokens_in_model=0
    )


def _steps(incarnation: int, first: int, last: int, compute_s: float = 1.0, tokens: int = 10) -> list[RankStep]:
    return [
        RankStep(incarnation=incarnation, step=step, compute_s=compute_s, sync_s=0.0, tokens=tokens, loss=1.0)
        for step in range(first, last + 1)
    ]


def _checkpoint(incarnation: int, step: int) -> RankCheckpoint:
    return RankCheckpoint(incarnation=incarnation, step=step)


def test_a_job_that_ran_and_stopped_gracefully_keeps_every_step() -> None:
    rank0 = [_start(0, 0), *_steps(0, 1, 10), _checkpoint(0, 5), _checkpoint(0, 10)]
    rank1 = [_start(0, 0), *_steps(0, 1, 10)]
    assert kept_step_limits(rank0 + rank1) == {0: 10}
    assert [(r.compute_s, r.useful_compute_s, r.tokens, r.useful_tokens) for r in unit_results([rank0, rank1])] == [
        (10.0, 10.0, 100, 100),
        (10.0, 10.0, 100, 100),
    ]


def test_steps_after_the_checkpoint_a_failed_incarnation_restarted_from_are_lost() -> None:
    # incarnation 0 checkpoints at 4 and dies at step 7; incarnation 1 resumes from 4 and stops at 9 (final checkpoint)
    rank0 = [_start(0, 0), *_steps(0, 1, 7), _checkpoint(0, 4), _start(1, 4), *_steps(1, 5, 9), _checkpoint(1, 9)]
    rank1 = [_start(0, 0), *_steps(0, 1, 6, compute_s=2.0), _start(1, 4), *_steps(1, 5, 9, compute_s=2.0)]
    assert kept_step_limits(rank0 + rank1) == {0: 4, 1: 9}
    unit0, unit1 = unit_results([rank0, rank1])
    assert (unit0.compute_s, unit0.useful_compute_s, unit0.tokens, unit0.useful_tokens) == (12.0, 9.0, 120, 90)
    assert (unit1.compute_s, unit1.useful_compute_s) == (22.0, 18.0)


def test_an_incarnation_that_never_started_training_passes_the_resume_point_on() -> None:
    # incarnation 1 failed during rendezvous (no start event); incarnation 2 resumed from incarnation 0's checkpoint
    events = [_start(0, 0), *_steps(0, 1, 8), _checkpoint(0, 6), _start(2, 6), *_steps(2, 7, 8), _checkpoint(2, 8)]
    assert kept_step_limits(events) == {0: 6, 2: 8}
    assert unit_results([events])[0].useful_tokens == 80


def test_the_last_incarnation_keeps_only_what_its_last_checkpoint_holds() -> None:
    # killed without a final checkpoint (e.g. stop timed out, or it failed and nothing restarted before the budget end)
    with_checkpoint = [_start(0, 0), *_steps(0, 1, 9), _checkpoint(0, 3), _checkpoint(0, 6)]
    without = [_start(0, 0), *_steps(0, 1, 4), _checkpoint(0, 2), _start(1, 2), *_steps(1, 3, 5)]
    assert kept_step_limits(with_checkpoint) == {0: 6}
    assert kept_step_limits(without) == {0: 2, 1: 2}
    assert unit_results([without])[0].useful_compute_s == 2.0


def test_an_elastic_scale_up_loses_nothing_when_the_job_stopped_with_a_final_checkpoint() -> None:
    # unit 1 is down during incarnation 1 (world size 1); the scale-up stops incarnation 1 gracefully at step 8
    unit0 = [_start(0, 0), *_steps(0, 1, 4), _checkpoint(0, 2), _start(1, 2, 1), *_steps(1, 3, 8), _checkpoint(1, 8)]
    unit0 += [_start(2, 8), *_steps(2, 9, 10), _checkpoint(2, 10)]
    unit1 = [_start(0, 0), *_steps(0, 1, 4), _start(2, 8), *_steps(2, 9, 10)]
    assert kept_step_limits(unit0 + unit1) == {0: 2, 1: 8, 2: 10}
    assert [result.useful_tokens for result in unit_results([unit0, unit1])] == [100, 40]


def test_no_events_means_no_compute() -> None:
    assert kept_step_limits([]) == {}
    assert unit_results([[], []])[1].compute_s == 0.0


def test_eval_points_are_rank_zeros_evals_in_time_order_without_non_finite_losses() -> None:
    def rank_eval(at: float, tokens: int, loss: float | None) -> RankEval:
        return RankEval(time=at, step=1, tokens_in_model=tokens, eval_loss=loss, final=False, incarnation=0)

    evals = [rank_eval(105.0, 200, 5.0), rank_eval(102.0, 100, 6.0), rank_eval(103.0, 150, None)]
    evals.append(_steps(0, 1, 1)[0])
    points = eval_points(evals, started_at=100.0)
    assert [(point.wall_s, point.tokens, point.eval_loss) for point in points] == [(2.0, 100, 6.0), (5.0, 200, 5.0)]


# ------------------------------------------------------------------------------------ InnerTrainer's hook
class _TinyLM(torch.nn.Module):
    """An embedding and a head; ``unused`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 16)
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        logits = self.head(self.embedding(input_ids))
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.view(-1, 16), labels.view(-1)))


def _trainer() -> InnerTrainer:
    section = InnerSection(inner_lr=0.01, warmup_steps=0, weight_decay=0.0, grad_clip=1e9)
    return InnerTrainer(_TinyLM(), section, torch.device("cpu"))


def _batches() -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return iter([torch.randint(0, 16, (2, 5), generator=generator) for _ in range(4)])


def test_the_hook_sees_every_gradient_and_its_values_are_the_ones_applied() -> None:
    trainer = _trainer()
    before = trainer.local_parameters()
    seen = []

    def replace(gradients: list[torch.Tensor]) -> None:
        seen.append([gradient.clone() for gradient in gradients])
        for gradient in gradients:
            gradient.fill_(-3.0)

    stats = trainer.train_step(_batches(), synchronize_gradients=replace)
    assert len(seen) == 1 and len(seen[0]) == len(trainer.params)
    unused = next(index for index, param in enumerate(trainer.params) if param is trainer.model.unused)
    assert torch.equal(seen[0][unused], torch.zeros(3))  # the parameter backward did not reach: zeros, not None
    # AdamW's first step moves each coordinate by lr * g / |g|: +lr everywhere for a gradient of -3
    for old, new in zip(before, trainer.local_parameters()):
        assert torch.allclose(new - old, torch.full_like(old, 0.01), atol=1e-5)
    assert math.isfinite(stats.loss) and stats.tokens == 10


def test_the_hook_time_is_reported_apart_and_inside_the_step_time() -> None:
    stats = _trainer().train_step(_batches(), synchronize_gradients=lambda gradients: time.sleep(0.05))
    assert 0.05 <= stats.sync_seconds <= stats.seconds


def test_without_a_hook_the_step_is_unchanged_and_no_sync_time_is_reported() -> None:
    plain, hooked = _trainer(), _trainer()
    stats = plain.train_step(_batches())
    hooked.train_step(_batches(), synchronize_gradients=lambda gradients: None)
    assert stats.sync_seconds == 0.0
    assert all(torch.equal(a, b) for a, b in zip(plain.local_parameters(), hooked.local_parameters()))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no optimizer step: expected
def test_non_finite_synchronized_gradients_skip_the_update_on_every_rank() -> None:
    trainer = _trainer()
    before = trainer.local_parameters()
    calls = []

    def poison(gradients: list[torch.Tensor]) -> None:
        calls.append(1)
        gradients[0].fill_(float("nan"))

    trainer.train_step(_batches(), synchronize_gradients=poison)
    assert calls == [1]
    assert all(torch.equal(old, new) for old, new in zip(before, trainer.local_parameters()))


# ------------------------------------------------------------------------------------ a real gang
def test_a_rank_does_not_import_hivemind() -> None:
    # hivemind switches torch's tensor sharing to file_system: a rank SIGTERMed while datasets opens the corpus then
    # hangs in the shared-memory manager's handshake (and every start pays for the manager)
    code = "import sys, bench.chaos.baseline_worker; assert 'hivemind' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def _events(run_dir: Path, unit: int, kind: type[E]) -> list[E]:
    return read_events(run_dir / f"unit{unit}" / "metrics.jsonl", kind)


@pytest.mark.swarm
def test_fixed_gang_restarts_every_rank_from_the_checkpoint_once_the_crashed_unit_is_back(tmp_path: Path) -> None:
    setup = TrainingSetup(seq_len=32, batch_size=4, eval_every_steps=10)
    target = GangTarget(
        "sync-dp", "sync-dp", "fixed", 2, tmp_path, Loopback(), setup, budget_s=30.0, checkpoint_every_steps=3
    )

    def ticked(condition: Callable[[], object]) -> Callable[[], bool]:  # the harness ticks about every 0.2 s
        def check() -> bool:
            target.tick()
            return bool(condition())

        return check

    finished = False
    try:
        target.start()
        wait_until(ticked(lambda: _events(tmp_path, 0, RankCheckpoint)), 90, "incarnation 0 to checkpoint")
        assert target.crash(1)
        wait_until(ticked(lambda: target.job is None), 30, "the gang to kill the failed incarnation")
        target.tick()
        assert target.job is None and target.incarnations == 1  # fixed: nothing restarts while unit 1 is down
        target.recover(1)
        target.tick()
        assert target.job is not None and target.job.incarnation == 1

        def restarted() -> bool:
            return all(any(event.incarnation == 1 for event in _events(tmp_path, unit, RankStep)) for unit in (0, 1))

        wait_until(ticked(restarted), 90, "both ranks of incarnation 1 to train")
        starts = [event for unit in (0, 1) for event in _events(tmp_path, unit, RankStart) if event.incarnation == 1]
        checkpoints = [event.step for event in _events(tmp_path, 0, RankCheckpoint) if event.incarnation == 0]
        assert sorted(event.rank for event in starts) == [0, 1]
        assert {(event.world_size, event.resumed_step) for event in starts} == {(2, max(checkpoints))}
        assert max(checkpoints) > 0
        target.finish()
        finished = True
    finally:
        if not finished:
            target.finish()
    gang = tmp_path / "gang.jsonl"
    pids = [int(pid) for event in read_events(gang, JobStart) for pid in event.pids.split()]
    pids += [event.pid for event in read_events(gang, RendezvousStart)]
    # helpers that live as long as pytest (torch's shared-memory manager, the swarms' fork server) are not the gang's
    started = [pid for pid in descendant_pids(os.getpid()) if not session_helper(psutil.Process(pid))]
    assert len(pids) == 5 and not [pid for pid in pids if is_running(pid)] and not started
    assert not [event for unit in (0, 1) for event in _events(tmp_path, unit, RankFailed) if event.incarnation == 1]
    assert [event.rank for unit in (0, 1) for event in _events(tmp_path, unit, RankStop)] == [0, 1]
    result = target.result()
    assert all(0 < unit.useful_compute_s <= unit.compute_s for unit in result.units)
    assert result.final_eval_loss is not None and result.evals[0].tokens == 0
