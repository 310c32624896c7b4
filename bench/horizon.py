"""The quality bench at a real horizon: bench/quality.py's methods trained to a number of tokens per parameter.

In the shape of the DiLoCo scaling-laws paper: every method splits one *global batch* among its units (data-parallel
takes it whole, each of M units takes 1/M of it), so every method makes the same inner steps on the same tokens and a
DiLoCo method with H inner steps per round makes ``steps / H`` rounds whatever its M. The inner learning rate decays
over the whole run (``inner.decay_steps`` = the run's steps). Every method runs once per seed (the seed draws the
initial weights, each unit's data order and the partial groups of ours-async), in worker processes of one CPU thread
each, so that a 2-core machine runs two at once.
"""

from __future__ import annotations

import math
import multiprocessing
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.quality import Budget, Method, MethodResult, run_method
from p2p_diloco.config import PeerConfig
from p2p_diloco.unit.model import load_model


@dataclass(frozen=True)
class Horizon:
    """How far and on what every method trains: ``tokens_per_param`` tokens per trained parameter and at least
    ``rounds`` rounds (whichever is longer, in whole rounds; a fine-tune counts rounds), ``global_batch`` sequences
    per inner step over all of a method's units, ``inner_steps`` (H) per round, evaluated ``evals`` times on the same
    ``eval_rows`` held-out sequences whatever a method's batch; ``settings`` are ``section__field`` overrides of the
    tiny preset every method shares (model, data, inner lr)."""

    tokens_per_param: float
    global_batch: int
    inner_steps: int
    evals: int = 16
    eval_rows: int = 128
    rounds: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.tokens_per_param, self.rounds) < 0 or not (self.tokens_per_param > 0 or self.rounds > 0):
            raise ValueError("tokens_per_param and rounds must not be negative, and one of them must be positive")
        if min(self.global_batch, self.inner_steps, self.evals, self.eval_rows) < 1:
            raise ValueError("global_batch, inner_steps, evals and eval_rows must be at least 1")

    def config(self) -> PeerConfig:
        """The shared config (model, data, inner settings) before any method's overrides."""
        return Budget(0, settings=self.settings).config(Path(tempfile.gettempdir()))

    def parameters(self) -> int:
        """Trained parameters of the model (built once from its config or loaded)."""
        model = load_model(self.config().model).model
        return sum(param.numel() for param in model.parameters() if param.requires_grad)

    def steps(self, parameters: int) -> int:
        """Inner steps of every method: the fewest whole rounds, at least ``rounds``, reaching ``tokens_per_param``."""
        per_step = self.global_batch * self.config().data.seq_len
        rounds = math.ceil(self.tokens_per_param * parameters / per_step / self.inner_steps)
        return max(rounds, self.rounds) * self.inner_steps

    def budget(self, parameters: int, seed: int) -> Budget:
        """Seed ``seed``'s budget: the tokens of :meth:`steps`, H, and the inner schedule decaying over the run."""
        steps = self.steps(parameters)
        tokens = steps * self.global_batch * self.config().data.seq_len
        settings = {**self.settings, "outer__inner_steps": self.inner_steps, "inner__decay_steps": steps}
        return Budget(tokens, self.evals, seed, settings)

    def method(self, name: str, kind: Any, units: int, **fields: Any) -> Method:
        """A method whose ``units`` share the global batch, evaluated on ``eval_rows`` sequences in batches of a
        unit's size. Raises ValueError when either does not split evenly."""
        batch = self.global_batch // units
        if self.global_batch % units or self.eval_rows % batch:
            raise ValueError(f"{name}: {units} units do not split a global batch of {self.global_batch} sequences "
                             f"into batches that divide {self.eval_rows} eval rows")  # fmt: skip
        settings = {"data__batch_size": batch, "data__eval_batches": self.eval_rows // batch}
        return Method(name, kind, units, settings=settings, **fields)


@dataclass(frozen=True)
class SeededResult:
    seed: int
    result: MethodResult


def run_seeds(
    methods: Sequence[Method],
    horizon: Horizon,
    seeds: Sequence[int],
    jobs: int,
    report: Callable[[SeededResult], None] = lambda done: None,
) -> tuple[int, list[SeededResult]]:
    """Every method once per seed, ``jobs`` at a time in worker processes; returns the model's trained parameters and
    the results in the order of ``methods`` then ``seeds``. ``report`` is called with each result as it is ready.
    A method that fails raises its error here (after the methods already running have finished)."""
    parameters = horizon.parameters()
    tasks = [(method, seed) for method in methods for seed in seeds]
    context = multiprocessing.get_context("spawn")  # no torch state forked from this process
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:  # fmt: skip
        futures = {pool.submit(_run_one, method, horizon.budget(parameters, seed)): (method, seed)
                   for method, seed in tasks}  # fmt: skip
        done: dict[tuple[str, int], SeededResult] = {}
        for future in as_completed(futures):
            method, seed = futures[future]
            done[(method.name, seed)] = SeededResult(seed, future.result())
            report(done[(method.name, seed)])
    return parameters, [done[(method.name, seed)] for method, seed in tasks]


def _run_one(method: Method, budget: Budget) -> MethodResult:
    with tempfile.TemporaryDirectory(prefix="horizon-") as scratch:
        return run_method(method, budget, Path(scratch))
