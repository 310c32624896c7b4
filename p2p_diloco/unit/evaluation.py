"""Held-out evaluation of φ (:class:`Evaluator`), at once (at a join and at exit) or spread over the inner steps (after
a round), so that an eval never pauses training for longer than one held-out batch.

Why spread: an eval of 8 batches after every round held each unit 1 to 4 s (tiny preset, 8 units on 2 cores) and 31 to
53 s (SmolLM2-135M on the CPU); a unit busy in it missed the next boundary of shared time, and with it a round of
the swarm (results/scale). A spread eval snapshots φ when it begins (one copy of φ while it runs), evaluates
``BATCHES_PER_STEP`` batches after each inner step, and reports the mean over all batches for the round it began at:
the same number an eval at once gives. An eval still running when the next one is due finishes at once first (a
unit whose rounds come faster than its eval's batches evaluates every round all the same), but for the final eval at
exit: the final φ supersedes it, and finishing it only delayed the exit (4 s of a 16-unit run's shutdown).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.unit import events
from p2p_diloco.unit.inner import EvalBatch, InnerTrainer
from p2p_diloco.unit.ranks import Ranks

BATCHES_PER_STEP = 1


@dataclass
class _Running:
    phi: list[torch.Tensor]  # φ when the eval began
    outer_round: int
    evaluated: int = 0  # batches
    loss_sum: float = 0.0  # over the batches evaluated


class Evaluator:
    """Evaluates φ on the unit's held-out ``batches`` with ``trainer``'s model (θ is unchanged after every call) and
    writes each eval's event to ``metrics``. Without batches it evaluates and writes nothing."""

    def __init__(self, batches: Sequence[EvalBatch], trainer: InnerTrainer, ranks: Ranks, metrics: events.EventSink):
        self.batches, self.trainer, self.ranks, self.metrics = list(batches), trainer, ranks, metrics
        self.running: _Running | None = None
        self.last_loss: float | None = None  # of the last eval that ended

    def evaluate(self, phi: Sequence[torch.Tensor], outer_round: int, reason: events.EvalReason) -> None:
        """Evaluate ``phi`` (of ``outer_round``): after a round (``reason`` "outer_round") a spread eval begins (a
        unit whose ranks hold shards evaluates at once: each batch is a collective of all ranks); else at once. An eval
        still running finishes at once first, or is dropped by the final eval."""
        if reason == "final":
            self.running = None
        while self.running is not None:
            self.advance()
        if not self.batches:
            return
        if reason == "outer_round" and not self.ranks.sharded:
            self.running = _Running([tensor.detach().clone() for tensor in phi], outer_round)
        else:
            self.record(reason, outer_round, self.ranks.evaluate(self.trainer, phi, self.batches))

    def advance(self) -> None:
        """Evaluate the next batches of the spread eval running, if any; its event once every batch was evaluated."""
        running = self.running
        if running is None:
            return
        chunk = self.batches[running.evaluated : running.evaluated + BATCHES_PER_STEP]
        running.loss_sum += self.ranks.evaluate(self.trainer, running.phi, chunk) * len(chunk)
        running.evaluated += len(chunk)
        if running.evaluated == len(self.batches):
            self.running = None
            self.record("outer_round", running.outer_round, running.loss_sum / running.evaluated)

    def record(self, reason: events.EvalReason, outer_round: int, loss: float) -> None:
        """Write the eval of ``outer_round``'s φ whose loss was ``loss`` (one evaluated already, by the caller)."""
        self.last_loss = loss
        self.metrics.write(events.Eval(reason=reason, outer_round=outer_round, eval_loss=loss))
