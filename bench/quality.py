"""Model quality at equal tokens: M learning units in one process, no network, through the unit's own code.

Every DiLoCo method runs M :class:`~p2p_diloco.unit.unit.LearningUnit`\\ s (inner AdamW and its schedule, the round
engine: outer step, merge rule, fragments, codecs with error feedback, the overlap rule) in lockstep: each tick every
unit takes one inner step, begins the rounds that are due, and merges the outcomes that arrived. Only the swarm is
replaced, by :class:`LocalSwarm`: who averages with whom in each round is drawn from a seed (a unit alone with
probability ``alone_p``, the others in one group), and an outcome arrives ``delay_steps`` inner steps after its last
member began (the overlap a real round has). ``data-parallel`` trains one model whose step takes one micro-batch from
each of the M units' data streams (the combined batch). Every method consumes exactly the same token budget and is
evaluated on the same held-out batches.

What :class:`LocalSwarm` does not model: compressed parts are decoded by the receivers only (a member's own
proposal enters its average exact, as in hivemind, but every receiver decodes the same bytes, so members of one group
agree exactly); a round fails only for a group below the quorum (with quorum 1 a unit drawn alone completes alone).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from p2p_diloco.config import Codec, PeerConfig
from p2p_diloco.diloco import probe_drift
from p2p_diloco.network.compression import roundtrip
from p2p_diloco.network.records import PeerProgress, PendingProgress, PendingRead, RunListing, answered
from p2p_diloco.network.state_sync import SwarmState
from p2p_diloco.rounds.averager import GroupRequest, RoundOutcome, check_round_request
from p2p_diloco.settings import load_config
from p2p_diloco.unit.data import TextData, load_text_data, shard_seed
from p2p_diloco.unit.inner import InnerTrainer
from p2p_diloco.unit.metrics import MetricsLog
from p2p_diloco.unit.model import export_pretrained, load_model, round_plan
from p2p_diloco.unit.unit import LearningUnit, UnitNetwork

Kind = Literal["data-parallel", "diloco"]


@dataclass(frozen=True)
class Method:
    """One line of the comparison: ``units`` learning units (``diloco``) or one model on their combined batch
    (``data-parallel``); ``outer`` overrides ``[outer]`` fields (outer lr, momentum, fragments, codec, ...);
    ``settings`` are ``section__field`` overrides of this method alone over the budget's (a unit's batch size when
    every method splits one global batch among its units)."""

    name: str
    kind: Kind
    units: int
    alone_p: float = 0.0
    delay_steps: int = 0
    outer: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.units < 1 or not 0.0 <= self.alone_p <= 1.0 or self.delay_steps < 0:
            raise ValueError(f"{self.name}: units >= 1, alone_p in [0, 1] and delay_steps >= 0 are required")


@dataclass(frozen=True)
class Budget:
    """What every method consumes: ``tokens`` in all (over all units), evaluated ``evals`` times at equal spacing;
    ``settings`` are ``section__field`` overrides of the tiny preset that every method shares (model, data, inner)."""

    tokens: int
    evals: int = 8
    seed: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def config(self, work_dir: Path, **overrides: Any) -> PeerConfig:
        """The shared config of a unit working in ``work_dir``: no periodic eval or checkpoint (the bench evaluates),
        no settle rounds (nobody leaves), rounds counted in steps (lockstep units have no shared clock)."""
        return load_config(preset="tiny", **{
            "model__seed": self.seed, "run__work_dir": str(work_dir), "run__progress": False,
            "run__eval_every_rounds": 10**9, "run__checkpoint_every_rounds": 10**9, "outer__settle_rounds": 0,
            "outer__schedule": "steps",
            **self.settings, **overrides,
        })  # fmt: skip

    def steps(self, config: PeerConfig, units: int) -> int:
        """Inner steps per unit (or per data-parallel step of ``units`` micro-batches): a whole number of rounds.
        Raises ValueError when the budget holds less than one round."""
        per_step = units * config.data.batch_size * config.data.seq_len * config.inner.grad_accum
        steps = self.tokens // per_step // config.outer.inner_steps * config.outer.inner_steps
        if steps == 0:
            raise ValueError(f"a budget of {self.tokens} tokens holds no round of {units} units")
        return steps


@dataclass(frozen=True)
class EvalPoint:
    tokens: int  # consumed by all units together (0: before training)
    loss: float  # data-parallel: its model; diloco: the units' mean φ (what they would agree on)
    unit_losses: tuple[float, ...] = ()  # diloco: each unit's own φ


@dataclass(frozen=True)
class MethodResult:
    method: Method
    tokens: int
    inner_steps: int  # per unit
    rounds: int  # per unit, merged (alone included)
    mean_group: float
    points: tuple[EvalPoint, ...]
    seconds: float

    @property
    def final_loss(self) -> float:
        return self.points[-1].loss

    @property
    def start_loss(self) -> float:
        """The eval loss before any training (the pretrained start when fine-tuning)."""
        return self.points[0].loss


# ------------------------------------------------------------------------------------------------ the local swarm
@dataclass
class _Begun:
    averager: LocalAverager
    member: int
    proposal: list[torch.Tensor]
    weight: float
    outer_round: int
    probe: list[float]
    tag: str
    tick: int


class LocalSwarm:
    """Matchmaking and all-reduce between the units of one process: the ``r``-th round of a fragment groups the
    members drawn for it (:meth:`groups`); it completes when all of them began it and arrives ``delay_steps`` ticks
    after that. Drawn from ``seed`` alone, so a schedule is reproducible."""

    def __init__(self, members: int, alone_p: float, delay_steps: int, seed: int, codec: Codec = "fp32",
                 quorum: int = 1):  # fmt: skip
        self.members, self.alone_p, self.delay_steps, self.seed, self.codec = members, alone_p, delay_steps, seed, codec
        self.quorum = quorum
        self.now = 0
        self.group_sizes: list[int] = []
        self._waiting: dict[tuple[str, int, int], list[_Begun]] = {}  # (key, round index, group) -> begun
        self._rounds: dict[tuple[str, int], int] = {}  # (key, member) -> rounds begun

    def groups(self, key: str, index: int) -> list[list[int]]:
        """Who meets in round ``index`` of ``key``: each member alone with probability ``alone_p``, the rest
        together (in member order)."""
        draw = random.Random(f"{self.seed}:{key}:{index}")
        alone = [member for member in range(self.members) if draw.random() < self.alone_p]
        together = [member for member in range(self.members) if member not in alone]
        return [[member] for member in alone] + ([together] if together else [])

    def averager(self, key: str, member: int, template: Sequence[torch.Tensor]) -> LocalAverager:
        return LocalAverager(self, key, member, [tuple(tensor.shape) for tensor in template])

    def tick(self) -> None:
        """One inner step of every unit went by."""
        self.now += 1

    def _begin(self, begun: _Begun) -> None:
        """File a begun round under its group; the group completes with its last member."""
        key = begun.averager.key
        index = self._rounds.get((key, begun.member), 0)
        self._rounds[(key, begun.member)] = index + 1
        number, members = next((n, group) for n, group in enumerate(self.groups(key, index)) if begun.member in group)
        slot = (key, index, number)
        self._waiting.setdefault(slot, []).append(begun)
        if len(self._waiting[slot]) == len(members):
            self._complete(self._waiting.pop(slot))

    def _complete(self, group: list[_Begun]) -> None:
        """Every member's outcome: the weighted mean of the proposals, others' decoded through the codec."""
        total = sum(begun.weight for begun in group)
        arrives = max(begun.tick for begun in group) + 1 + self.delay_steps  # polled after the tick of its begin
        self.group_sizes.extend([len(group)] * len(group))
        if len(group) < self.quorum:
            for own in group:
                own.averager.deliver(RoundOutcome(None, len(group), own.outer_round, total, float(own.tick),
                                                  float(arrives), error="below the quorum"), arrives)  # fmt: skip
            return
        for own in group:
            parts = [begun.proposal if begun is own else [roundtrip(t, self.codec) for t in begun.proposal]
                     for begun in group]  # fmt: skip
            averaged = [torch.stack([begun.weight * part[i] for begun, part in zip(group, parts)]).sum(dim=0) / total
                        for i in range(len(own.proposal))]  # fmt: skip
            outcome = RoundOutcome(
                averaged=averaged, group_size=len(group), max_member_round=max(b.outer_round for b in group),
                total_weight=total, started_at=float(own.tick), finished_at=float(arrives),
                member_drift=probe_drift([begun.probe for begun in group if begun.probe]),
                member_tags=tuple(begun.tag for begun in group), position=group.index(own),
            )  # fmt: skip
            own.averager.deliver(outcome, arrives)


class LocalAverager:
    """One unit's averager of one fragment in a :class:`LocalSwarm` (the ``Averager`` protocol of averaging.py)."""

    def __init__(self, swarm: LocalSwarm, key: str, member: int, shapes: list[tuple[int, ...]]):
        self.swarm, self.key, self.member, self.shapes = swarm, key, member, shapes
        self._in_flight = False
        self._outcome: tuple[RoundOutcome, int] | None = None

    def begin_round(
        self,
        proposal: Sequence[torch.Tensor],
        weight: float,
        outer_round: int,
        window_s: float,
        probe: Sequence[float] = (),
        tag: str = "",
        period_s: float = 0.0,
        group: GroupRequest = GroupRequest(),
        reference: Sequence[torch.Tensor] | None = None,
    ) -> bool:
        check_round_request(self._in_flight, self.shapes, proposal, weight)
        self._in_flight = True
        begun = _Begun(self, self.member, [t.detach().clone() for t in proposal], float(weight), int(outer_round),
                       list(probe), tag, self.swarm.now)  # fmt: skip
        self.swarm._begin(begun)
        return True

    def deliver(self, outcome: RoundOutcome, arrives: int) -> None:
        self._outcome = (outcome, arrives)

    def poll(self) -> RoundOutcome | None:
        if self._outcome is None or self._outcome[1] > self.swarm.now:
            return None
        outcome, self._outcome, self._in_flight = self._outcome[0], None, False
        return outcome

    def finish_round(self, timeout_s: float) -> RoundOutcome | None:
        return self.poll()

    def shutdown(self) -> None:
        self._in_flight = False


class _NoRecords:
    """Nobody reads progress records in one process: they are dropped."""

    def publish_progress(self, progress: PeerProgress, ttl_s: float = 60, wait: bool = False) -> None:
        pass

    def read_progress(self) -> dict[str, PeerProgress]:
        return {}

    def read_progress_soon(self) -> PendingProgress:
        return answered("local", {})

    def list_run(self, ttl_s: float = 600) -> None:
        pass

    def read_runs_soon(self) -> PendingRead[dict[str, RunListing]]:
        return answered("local", {})

    def refresh_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600) -> None:
        pass

    def publish_membership(self, ttl_s: float = 3600, wait: bool = False) -> None:
        pass


class _NoStateServer:
    """Nobody joins in one process: published states are dropped."""

    def publish(self, state: SwarmState) -> None:
        pass

    def download(self, timeout_s: float, refused: frozenset[str] = frozenset()) -> SwarmState | None:
        return None

    def declared_rounds(self) -> dict[str, int]:
        return {}


# ------------------------------------------------------------------------------------------------------ methods
def run_method(method: Method, budget: Budget, work_dir: Path) -> MethodResult:
    """Train ``method`` on ``budget`` (its units' files under ``work_dir``). Raises ValueError for a budget that
    holds no round or a method on the clock schedule (lockstep units have no shared clock)."""
    if method.outer.get("schedule", "steps") != "steps":
        raise ValueError(f"{method.name}: the bench runs the steps schedule only")
    started = time.perf_counter()
    run = _data_parallel if method.kind == "data-parallel" else _diloco
    return replace(run(method, budget, work_dir), seconds=time.perf_counter() - started)


def _eval_steps(steps: int, evals: int) -> list[int]:
    """The steps after which a method is evaluated: ``evals`` equally spaced, the last one included."""
    return sorted({max(1, round(steps * k / evals)) for k in range(1, evals + 1)})


def unit_data(config: PeerConfig, tokenizer: Any, member: int) -> TextData:
    """Unit ``member``'s data: its own order of the training documents, the held-out batches every unit shares."""
    return load_text_data(config.data, tokenizer, shard_seed(config.model.seed, f"unit{member}"))


def _data_parallel(method: Method, budget: Budget, work_dir: Path) -> MethodResult:
    config = budget.config(work_dir, **method.settings)
    per_unit = config.inner.grad_accum
    combined = config.inner.model_copy(update={"grad_accum": per_unit * method.units})
    loaded = load_model(config.model)
    trainer = InnerTrainer(loaded.model, combined, loaded.device)
    data = [unit_data(config, loaded.tokenizer, member) for member in range(method.units)]
    streams = [unit_data.train_batches() for unit_data in data]
    batches = (batch for _ in itertools.count() for stream in streams for batch in itertools.islice(stream, per_unit))
    eval_batches = data[0].eval_batches
    steps, points, tokens = budget.steps(config, method.units), [EvalPoint(0, trainer.evaluate(eval_batches))], 0
    eval_at = set(_eval_steps(steps, budget.evals))
    for step in range(1, steps + 1):
        tokens += trainer.train_step(batches).tokens
        if step in eval_at:
            points.append(EvalPoint(tokens, trainer.evaluate(eval_batches)))
    return MethodResult(method, tokens, steps, 0, float(method.units), tuple(points), 0.0)


def _diloco(method: Method, budget: Budget, work_dir: Path) -> MethodResult:
    outer = {f"outer__{name}": value for name, value in method.outer.items()}
    configs = [budget.config(work_dir / f"unit{member}", **method.settings, **outer) for member in range(method.units)]
    outer_section = configs[0].outer
    swarm = LocalSwarm(method.units, method.alone_p, method.delay_steps, budget.seed, outer_section.codec,
                       outer_section.quorum)  # fmt: skip
    units = [_local_unit(config, member, swarm) for member, config in enumerate(configs)]
    streams = [_data(unit).train_batches() for unit in units]
    steps, points = budget.steps(configs[0], method.units), [_evaluate(units)]
    eval_at = set(_eval_steps(steps, budget.evals))
    try:
        for step in range(1, steps + 1):
            for unit, stream in zip(units, streams):
                unit.train_step(stream)
            for unit in units:
                unit.maybe_begin_round()
            swarm.tick()
            for unit in units:
                unit.poll_round()
            if step in eval_at and step < steps:
                points.append(_evaluate(units))
        _drain(units, swarm)  # the rounds in flight arrive, then, as when units leave, final rounds hand the
        for unit in units:  # steps since their last round over (nobody trains meanwhile)
            unit.engine.begin_final(unit.throughput.step_time_s)
        _drain(units, swarm)
        points.append(_evaluate(units))
    finally:
        for unit in units:
            unit.metrics.close()
    mean_group = sum(swarm.group_sizes) / len(swarm.group_sizes) if swarm.group_sizes else 1.0
    return MethodResult(method, sum(unit.tokens for unit in units), steps, units[0].outer_round, mean_group,
                        tuple(points), 0.0)  # fmt: skip


def _drain(units: Sequence[LearningUnit], swarm: LocalSwarm) -> None:
    """Tick without training until no round is in flight."""
    while any(unit.engine.in_flight for unit in units):
        swarm.tick()
        for unit in units:
            unit.poll_round()


def _local_unit(config: PeerConfig, member: int, swarm: LocalSwarm) -> LearningUnit:
    """A learning unit whose averagers meet in ``swarm`` (same seed: every unit starts from the same weights)."""
    loaded = load_model(config.model)
    trained = [param for param in loaded.model.parameters() if param.requires_grad]
    plan = round_plan(config.outer, loaded.model, trained)
    averagers = [swarm.averager(f"fragment{number}", member, template)
                 for number, template in enumerate(plan.round_templates(trained))]  # fmt: skip
    consensus = [swarm.averager(f"consensus{number}", member, template)
                 for number, template in enumerate(plan.consensus_templates())] if plan.consensus else []  # fmt: skip
    network = UnitNetwork(averagers, consensus, _NoStateServer(), _NoRecords(), f"unit{member}")
    metrics = MetricsLog(Path(config.run.work_dir) / "metrics.jsonl")
    return LearningUnit(config, plan, loaded, unit_data(config, loaded.tokenizer, member), network, metrics)


def _evaluate(units: Sequence[LearningUnit]) -> EvalPoint:
    """The eval loss of the units' mean φ, and of each unit's φ (computed once when they all agree)."""
    phis = [unit.state.global_params for unit in units]
    mean = [torch.stack(tensors).mean(dim=0) for tensors in zip(*phis)]
    judge = units[0]
    with judge.trainer.parameters_swapped(mean):
        loss = judge.trainer.evaluate(judge.evaluator.batches)
    agree = all(torch.equal(a, b) for phi in phis[1:] for a, b in zip(phis[0], phi))
    own = [loss] * len(units) if agree else [_own_loss(judge, phi) for phi in phis]
    return EvalPoint(sum(unit.tokens for unit in units), loss, tuple(own))


def _data(unit: LearningUnit) -> TextData:
    assert unit.data is not None, "the laboratory's units train on their own data"
    return unit.data


def _own_loss(judge: LearningUnit, phi: Sequence[torch.Tensor]) -> float:
    with judge.trainer.parameters_swapped(phi):
        return judge.trainer.evaluate(judge.evaluator.batches)


def run_comparison(
    methods: Sequence[Method], budget: Budget, report: Callable[[MethodResult], None] = lambda result: None
) -> list[MethodResult]:
    """Every method on the same budget, one after the other (units' files in a temporary folder); ``report`` is
    called with each result as it is ready."""
    results = []
    with tempfile.TemporaryDirectory(prefix="quality-") as scratch:
        for method in methods:
            results.append(run_method(method, budget, Path(scratch) / method.name))
            report(results[-1])
    return results


@dataclass(frozen=True)
class Pretrained:
    """What :func:`pretrain` exported to ``path``, after how much training, and its held-out loss before and after."""

    path: Path
    steps: int
    tokens: int
    start_loss: float  # held-out, before training
    final_loss: float


def pretrain(budget: Budget, out: Path) -> Pretrained:
    """Train one model on ``budget.tokens`` tokens of its settings' data with a plain inner loop (no rounds) and
    export it to ``out`` (a Hugging Face folder, replaced atomically): a pretrained start for fine-tuning."""
    config = budget.config(out.parent / f".{out.name}-work")
    loaded = load_model(config.model)
    trainer = InnerTrainer(loaded.model, config.inner, loaded.device, loaded.autocast)
    data = unit_data(config, loaded.tokenizer, 0)
    batches, start, tokens, steps = data.train_batches(), trainer.evaluate(data.eval_batches), 0, 0
    while tokens < budget.tokens:
        tokens += trainer.train_step(batches).tokens
        steps += 1
    export_pretrained(loaded.model, loaded.tokenizer, out)
    return Pretrained(out, steps, tokens, start, trainer.evaluate(data.eval_batches))


def diloco_methods(
    units: Sequence[int],
    async_units: Sequence[int],
    outer_sets: Sequence[dict[str, Any]],
    outer: dict[str, Any],
    alone_p: float,
    delay_steps: int,
    make: Callable[..., Method] = Method,
) -> list[Method]:
    """``diloco-mM`` for each of ``units`` and ``async-mM`` (``alone_p``, ``delay_steps``) for each of ``async_units``,
    once per set of ``outer_sets`` over ``outer`` (named after the set), built by ``make(name, kind, units, ...)``."""
    methods = []
    for overrides in outer_sets:
        merged, suffix = {**outer, **overrides}, "".join(f" {key}={value}" for key, value in overrides.items())
        methods += [make(f"diloco-m{size}{suffix}", "diloco", size, outer=merged) for size in units]
        methods += [make(f"async-m{size}{suffix}", "diloco", size, alone_p=alone_p, delay_steps=delay_steps,
                         outer=merged) for size in async_units]  # fmt: skip
    return methods


# What real swarms showed (results/scale, steps-n4-g8: 10 of 44 unit-rounds alone; the demo's outer_round events:
# 8 inner steps of overlap at H = 20): ours-async's partial groups and overlap in the bench.
MEASURED_ALONE_P = 0.23
MEASURED_DELAY_STEPS = 8


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags both quality scripts share: which DiLoCo methods run (``--units``, ``--async-units``, ``--alone-p``,
    ``--outer``, ``--outer-sets``; see :func:`diloco_methods`) and what every method trains (``--set``)."""
    parser.add_argument("--units", type=int, nargs="*", default=[1, 2, 4, 8], help="synchronous DiLoCo sizes M")
    parser.add_argument("--async-units", type=int, nargs="*", default=[4], help="ours-async sizes M")
    parser.add_argument("--alone-p", type=float, default=MEASURED_ALONE_P, help="ours-async: P(a round alone)")
    parser.add_argument("--set", type=parse_assignment, action="append", default=[], help="section__field=value")
    parser.add_argument("--outer", type=parse_assignment, action="append", default=[], help="[outer] field=value")
    parser.add_argument(
        "--outer-sets", nargs="+", type=parse_assignments, default=[{}], metavar="FIELD=V,FIELD=V",
        help="every DiLoCo method once per set of [outer] overrides (over --outer): a sweep",
    )  # fmt: skip


def parse_assignments(text: str) -> dict[str, Any]:
    """``name=value,name=value`` of a command line (see :func:`parse_assignment`); empty text gives {}."""
    return dict(parse_assignment(item) for item in text.split(",") if item)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``name=value`` of a command line: the value as a Python literal, else as a plain string (a path, a codec
    name). Raises argparse.ArgumentTypeError without '='."""
    name, separator, value = text.partition("=")
    if not separator or not name:
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a plain string (a path, a codec name)
