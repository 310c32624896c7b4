"""One learning unit: the inner loop, join/resume/download, checkpoints, evals, publishing and metrics. Its outer rounds
(streaming fragments, payloads, merges, consensus rounds and what failures do) are the round engine's (rounds/), and
so is its exit protocol (rounds/departure.py); the unit does the I/O that their results call for.

Who steps θ: the unit's own trainer on its own data (:meth:`LearningUnit.run`, ``p2p-diloco join``; with several
ranks, rank 0's unit tells the others what each step did, ranks.py), or the library API's caller, who steps its own
optimizer and calls :meth:`LearningUnit.record_step` and :meth:`LearningUnit.stepped` after each step (api.py).

I/O that costs (saving the goodput ledger, publishing the state served to joiners, refreshing the DHT fingerprint,
reading the socket byte counters, evals and checkpoints) runs when the unit's outer round advances, i.e. once per
period whatever the number of fragments, not at every fragment merge: a joiner may download a state up to one period
old, which its next rounds bring back into consensus.

Goodput (goodput.py): the compute of the inner steps a fragment round sends becomes useful, in proportion to the
fragment's share of the weights, when that round merges; a failed or dropped round carries it into the next one, a
local reset discards it. How a unit joins: joining.py.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from p2p_diloco.checkpoint import save_checkpoint
from p2p_diloco.config import PeerConfig, SwarmSections
from p2p_diloco.consensus import record_probe
from p2p_diloco.network.compression import roundtrip
from p2p_diloco.network.dht import shared_time
from p2p_diloco.network.records import PeerProgress, PendingProgress, ProgressRecords, in_phase
from p2p_diloco.network.state_sync import StateService, SwarmState
from p2p_diloco.network.wire import WireCounter
from p2p_diloco.rounds.averager import Averager
from p2p_diloco.rounds.departure import Announcement, Departure, Phase
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.rounds.results import RoundBegin, RoundEnd, RoundKind, RoundStatus
from p2p_diloco.unit import events
from p2p_diloco.unit.data import DataPosition, TextData, TrainingStream
from p2p_diloco.unit.evaluation import Evaluator
from p2p_diloco.unit.forking import optimizer_tensors, release_freed_memory
from p2p_diloco.unit.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.unit.inner import EvalBatch, InnerTrainer, StepStats, copy_into, on_host
from p2p_diloco.unit.joining import (
    StatesRefused,
    data_position,
    donors_round,
    download_state,
    loss_refusal,
    own_checkpoint,
    swarm_round,
    swarm_round_seen,
)
from p2p_diloco.unit.metrics import ProgressBars, Throughput
from p2p_diloco.unit.mismatch import MismatchWatch
from p2p_diloco.unit.model import LoadedModel, export_pretrained
from p2p_diloco.unit.ranks import Ranks, ThetaLink, UnitStart, theta_probe
from p2p_diloco.unit.tracking import UnitCounters, consensus_event, round_event

logger = logging.getLogger(__name__)

# Every unit's progress record is a DHT store that several DHT nodes handle: with 16 units on one box, publishing every
# 2 s kept each unit's DHT process at about 0.04 cores (the largest part of its background CPU). A unit publishes once
# per period, as soon as φ holds its round's merge (so the records' probes show one model when the units hold one: with
# records only every 10 s and 8 s periods, the census of an 8-unit swarm that merged every round in one group of 8
# counted 2 or 3 lineages most of the time, records a round apart), and at least every PROGRESS_EVERY_S; it reads the
# census every PROGRESS_EVERY_S.
PROGRESS_EVERY_S = 10.0
PROGRESS_TTL_S = 30.0
LEFT_TTL_S = 600.0
"""A unit's last record (phase "left") outlives it this long, so that ``status`` and the dashboard show a finished
run's last records (and how old each is) for minutes; a joiner does not count it (joining.py)."""


@dataclass
class UnitNetwork:
    """What a unit talks to the swarm through: one averager per fragment of its plan (and one more per fragment for
    consensus rounds when the plan has them), the state server, the run's records, and its own peer id; at exit, a
    maker of its settle averager and whom that averager refuses (by peer id)."""

    averagers: Sequence[Averager]
    consensus_averagers: Sequence[Averager]
    state_server: StateService
    records: ProgressRecords
    peer_id: str
    settle_averager: Callable[[Sequence[torch.Tensor]], Averager] | None = None  # makes one for a template, at exit
    settle_refuses: Callable[[str], bool] = lambda _peer_id: False


class LearningUnit:
    """θ (the trainer's), the round engine (φ, m and the rounds) and the bookkeeping of one unit. Raises ValueError
    when ``network``'s averagers do not match ``plan``."""

    def __init__(
        self,
        config: SwarmSections,
        plan: RoundPlan,
        loaded: LoadedModel,
        data: TextData | None,
        network: UnitNetwork,
        metrics: events.EventSink,
        ranks: Ranks | None = None,
        trainer: InnerTrainer | None = None,
        eval_batches: Sequence[EvalBatch] = (),
    ):
        self.config, self.loaded, self.data, self.network, self.metrics = config, loaded, data, network, metrics
        self.ranks = ranks or Ranks()  # rank 0 of them, or the unit's only process
        if trainer is None:  # the CLI's: the [inner] section's optimizer over the loaded model
            assert isinstance(config, PeerConfig), "a unit without a trainer of its caller's trains by [inner]"
            trainer = InnerTrainer(loaded.model, config.inner, loaded.device, loaded.autocast, self.ranks.replica,
                                   sharded=self.ranks.sharded)  # fmt: skip
        self.trainer = trainer  # θ is its params; the library API's caller steps its optimizer itself
        batches = data.eval_batches if data is not None else eval_batches  # none: no evals
        self.evaluator = Evaluator(batches, trainer, self.ranks, metrics)
        self.theta = self.ranks.theta(trainer.params)  # what the round engine reads and writes (ranks.py)
        self.engine = RoundEngine(plan, network.averagers, network.consensus_averagers, local=self.theta,
                                  sync=ThetaLink(self.ranks, trainer.params),
                                  roundtrip=functools.partial(roundtrip, codec=plan.step.codec),
                                  peer_id=network.peer_id)  # fmt: skip
        self.state = self.engine.state  # φ, m and the fragments' rounds
        self.round_settings = plan.round_settings()
        self.mismatches = MismatchWatch(network.records, config.network.run_id, network.peer_id, loaded.fingerprint,
                                        self.round_settings)  # fmt: skip
        self.inner_step = self.tokens = 0
        self._join_loss: float | None = None  # the held-out loss of the state taken at join, when it was judged
        self._own_start_loss: float | None = None  # ... and of this unit's own starting weights, when it was needed
        self.data_position = DataPosition()  # where the unit's data stream starts (join: from its checkpoint)
        self._stream: TrainingStream | None = None
        self.throughput = Throughput()  # tokens and wall seconds per inner step (the training loop's period)
        self._last_step_end: float | None = None
        # the training session (start_training .. stop_training)
        self._started = time.monotonic()
        self._progress = ProgressBars(None, enabled=False)
        self._last_progress = 0.0  # when this unit last published its progress record (monotonic)
        self._last_census = 0.0  # when it last read the census (monotonic)
        self._census_read: PendingProgress | None = None  # the live units' progress records, read without waiting
        self.last_loss = float("nan")
        self.last_group_size = 0
        self._advanced = False  # the unit's round advanced since its last periodic I/O (ended)
        self._leaving = False  # in the exit protocol: no periodic I/O (the final eval, checkpoint and export follow)
        self._checkpointed = False  # this process wrote the unit's checkpoint
        self.checkpoint_path = Path(config.run.work_dir) / "checkpoint.pt"
        self.ledger_path = Path(config.run.work_dir) / LEDGER_FILE
        self.ledger = GoodputLedger.load_or_create(self.ledger_path)
        self.wire = WireCounter()

    @property
    def outer_round(self) -> int:
        return self.engine.outer_round

    def host_tensors(self) -> Iterator[torch.Tensor]:
        """The inner optimizer's state, θ's host mirror (a sharded unit's rank 0) and the round engine's host
        tensors (θ is the model's)."""
        yield from optimizer_tensors(self.trainer.optimizer)
        yield from self.ranks.mirror or ()
        yield from self.engine.host_tensors()

    # ----------------------------------------------------------------------------------------------- join
    def join(self, swarm_seen: bool = False) -> events.JoinSource:
        """Take the state to train from by the join rule (joining.py); returns its source. ``swarm_seen``: another
        unit joined the run before this one (its model record), so no readable progress or donor record is not taken
        for a swarm at round 0 at once (joining.py ``swarm_round_seen``). Raises JoinError."""
        checkpoint = own_checkpoint(self.checkpoint_path, self.loaded.fingerprint)
        local_round = int(checkpoint["outer_round"]) if checkpoint is not None else -1
        self.data_position = data_position(checkpoint, self.data)
        seen = swarm_seen and checkpoint is None  # a unit with a checkpoint may have claimed the run itself
        donors = self.network.state_server.declared_rounds
        claimed = swarm_round_seen(self._claimed_round, lambda: donors_round(donors()), seen,
                                   self.config.network.join_timeout_s)  # fmt: skip
        source: events.JoinSource = "initial weights"
        state = self._download(claimed, local_round) if claimed > max(local_round, 0) else None
        if state is not None:
            self.state.load_state(state.global_params, state.momentum, state.fragment_rounds)
            copy_into(self.theta, self.state.global_params)
            source = "swarm"
        elif checkpoint is not None:
            rounds = checkpoint.get("fragment_rounds", [int(checkpoint["outer_round"])])
            self.state.load_state(checkpoint["global_params"], checkpoint["momentum"], rounds)
            copy_into(self.theta, checkpoint["local_params"])
            self.ranks.load_inner_state(self.trainer, checkpoint["inner"])
            self.inner_step, self.tokens = int(checkpoint["inner_step"]), int(checkpoint["tokens"])
            source = "checkpoint"
        self._publish_state()
        self.ranks.share_start(self.trainer, UnitStart(self.network.peer_id, self.inner_step,
                                                       self.trainer.state_dict()))  # fmt: skip
        self._write_replica_probe()
        return source

    def _download(self, claimed: int, local_round: int) -> SwarmState | None:
        """The swarm's state (joining.py ``download_state``), or None when every state served was refused and no
        other unit claims a round past ``local_round`` once the refused donors' claims are left out (a lone liar at a
        swarm's start: every unit starting beside it would otherwise fail its join). Raises JoinError."""
        network = self.config.network
        try:
            return download_state(self.network.state_server, claimed, network.join_timeout_s, self.metrics,
                                  refusal=self._state_refusal)  # fmt: skip
        except StatesRefused as refused:
            if self._claimed_round(excluding=refused.donors) > max(local_round, 0):
                raise
            logger.warning("no unit but the refused donors (%s) claims a round past this unit's: it starts from its "
                           "own weights", ", ".join(sorted(refused.donors)))  # fmt: skip
            self._join_loss = self._own_start_loss  # the join eval: those weights', if they were evaluated
            return None

    def _state_refusal(self, state: SwarmState) -> str | None:
        """Why a downloaded state is not believed (joining.py ``loss_refusal``): its held-out loss against the median
        eval loss the live units other than its donors report at rounds up to the state's (a unit ahead evaluated a
        later φ: early in a run the loss falls fast, and an honest joiner refused three honest states once in CI), or,
        when none reports one (a swarm's start), against the loss of this unit's own starting weights (a lone donor
        declaring random tensors at round 10^6 was taken by every unit starting beside it: eval 69.3 at join). The
        state's loss is kept for the join eval. Not judged without held-out batches or on a sharded unit (its other
        ranks wait to start)."""
        self._join_loss = None
        if not self.evaluator.batches or self.ranks.sharded:
            return None
        live = in_phase(self.network.records.read_progress(), "training", "finishing")
        others = [record for peer, record in live.items() if peer not in {*state.donors, self.network.peer_id}]
        reported = [record.eval_loss for record in others
                    if record.eval_loss is not None and record.outer_round <= state.outer_round]  # fmt: skip
        loss = self.ranks.evaluate(self.trainer, state.global_params, self.evaluator.batches)
        if reported:
            median = statistics.median(reported)
            why = loss_refusal(loss, median, f"the median the live units report ({len(reported)} units)")
        else:
            if self._own_start_loss is None:
                batches = self.evaluator.batches
                self._own_start_loss = self.ranks.evaluate(self.trainer, self.state.global_params, batches)
            why = loss_refusal(loss, self._own_start_loss, "the loss of this unit's own starting weights")
        self._join_loss = loss if why is None else None
        return why

    def _claimed_round(self, excluding: frozenset[str] = frozenset()) -> int:
        """The latest round the other units (but ``excluding``) claim in the records readable now (-1: none)."""
        progress = in_phase(self.network.records.read_progress(), "training", "finishing")  # units that left serve none
        declared = self.network.state_server.declared_rounds()
        return swarm_round({peer: record for peer, record in progress.items() if peer not in excluding},
                           {peer: number for peer, number in declared.items() if peer not in excluding},
                           self.network.peer_id)  # fmt: skip

    # ----------------------------------------------------------------------------------------- training
    def run(self, stop: threading.Event) -> None:
        """Train on the unit's data until ``stop`` is set or a max_steps / max_time_s limit is reached."""
        assert self.data is not None, "a unit trains on its own data (the library API's callers train on theirs)"
        batches = self._stream = self.data.train_batches(self.data_position)
        self.start_training()
        try:
            while not (stop.is_set() or self.limit_reached()):
                if self.ranks.step():  # the other ranks train this step too
                    self._write_replica_probe()
                self.stepped(self.train_step(batches))
        finally:
            self.stop_training()

    def start_training(self) -> None:
        """Before the first inner step: the join eval and probe, the start of the run's limits, the progress bars."""
        self._started = time.monotonic()
        self._progress = ProgressBars(self.config.run.max_steps, enabled=self.config.run.progress)
        if self._join_loss is not None:  # the downloaded state's, evaluated when it was judged
            self.evaluator.record("join", self.outer_round, self._join_loss)
        else:
            self._evaluate("join")
        self._write_probe()

    def stop_training(self) -> None:
        """After the last inner step (before :meth:`finish`): the progress bars close."""
        self._progress.close()

    def stepped(self, stats: StepStats) -> None:
        """After an inner step (its bookkeeping done: :meth:`train_step` or :meth:`record_step`): merge the rounds
        that ended, begin those that are due, publish progress and read the census now and then."""
        self._progress.inner_step(stats.loss, self.throughput.tokens_per_s or 0.0)
        self._off_the_clock(self.evaluator.advance)
        ended = self.poll_round()
        fragments = [end for end in ended if end.kind is RoundKind.FRAGMENT]
        if fragments:
            self._progress.outer_round(self.outer_round, fragments[-1].group_size, self.evaluator.last_loss)
        self.maybe_begin_round()
        if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
            self._publish_progress()
        if time.monotonic() - self._last_census >= PROGRESS_EVERY_S:
            self._census_read = self._census_read or self.network.records.read_progress_soon()
            self._last_census = time.monotonic()
        if self._census_read is not None and (live := self._census_read.poll()) is not None:
            self._census_read = None
            if live:  # an empty or failed read keeps the last census; the unit counts itself
                live_units = in_phase(live, "training", "finishing")
                self.engine.census = {record.peer_id: record.period_s for record in live_units.values()}
                self.metrics.write(consensus_event(in_phase(live, "training").values()))
                self.mismatches.census(live_units)
        self.mismatches.poll()

    def _write_replica_probe(self) -> None:
        """θ at the probe coordinates, which each replica writes after θ was shared (ranks.py)."""
        if self.ranks.replicated:
            self.metrics.write(events.ReplicaProbe(rank=0, inner_step=self.inner_step,
                                                   values=theta_probe(self.trainer.params)))  # fmt: skip

    def limit_reached(self) -> bool:
        """Whether a max_steps, max_time_s (since :meth:`start_training`) or stop_at limit is reached."""
        run = self.config.run
        return (
            (run.max_steps is not None and self.inner_step >= run.max_steps)
            or (run.max_time_s is not None and time.monotonic() - self._started >= run.max_time_s)
            or (run.stop_at is not None and time.time() >= run.stop_at)
        )

    def train_step(self, batches: Iterator[torch.Tensor]) -> StepStats:
        """One inner step of the unit's trainer and its bookkeeping (:meth:`record_step`)."""
        return self.record_step(self.ranks.collective(lambda: self.trainer.train_step(batches)))  # DDP: collective

    def record_step(self, stats: StepStats) -> StepStats:
        """The bookkeeping of an inner step: counters, compute, throughput, the round engine's counters."""
        now, last_step_end = time.monotonic(), self._last_step_end
        period = stats.seconds if last_step_end is None else max(stats.seconds, now - last_step_end)
        self._last_step_end = now
        tokens = stats.tokens * self.ranks.world_size  # every rank trained a batch of the same shape
        self.inner_step += 1
        self.tokens += tokens
        self.engine.record_step(tokens, stats.seconds)
        self.ledger.record_step(stats.seconds, tokens)
        self.last_loss = stats.loss
        # A process's first step (allocations, first kernels: 1.4 s against 0.07 in a demo) is left out of the
        # throughput: it had set a 32 s round period, which the units then adopted from each other.
        if last_step_end is not None:
            self.throughput.add(tokens, period)
        self.metrics.write(events.InnerStep(step=self.inner_step, loss=stats.loss, seconds=stats.seconds, lr=stats.lr,
                                            tokens_per_s=self.throughput.tokens_per_s))  # fmt: skip
        return stats

    def poll_round(self) -> list[RoundEnd]:
        """Merge every round that ended (never waits) and do what each calls for; returns them."""
        ended = self.engine.poll()
        for end in ended:
            self.ended(end)
        return ended

    def maybe_begin_round(self) -> bool:
        """Begin the rounds that are due (rounds/engine.py); True if any began or θ was reset."""
        begins = self.engine.begin_due(self.throughput.step_time_s, shared_time())
        for begin in begins:
            self.began(begin)
        return any(begin.status in (RoundStatus.BEGUN, RoundStatus.RESET) for begin in begins)

    # --------------------------------------------------------------------------------------- round I/O
    def began(self, begin: RoundBegin) -> None:
        """Report a round that was due (a RESET put θ back to φ: the inner optimizer's moments are meaningless)."""
        if begin.status is RoundStatus.RESET:
            self.ranks.reset_moments(self.trainer)
        self._report(begin)

    def ended(self, end: RoundEnd) -> None:
        """Do what a round that ended calls for: goodput; its event; a probe whenever φ may have changed; once per
        period (the round advanced) and once φ holds that fragment's merge (after its mix round), the costly I/O."""
        merged = end.kind is RoundKind.FRAGMENT and end.merged
        if merged:
            self.last_group_size = end.group_size
            self.mismatches.round_merged(end.group_size)
            self.ledger.record_merge(end.useful_compute_s, end.useful_tokens)
            self._advanced = self._advanced or end.advanced
        self._report(end, wire=merged and end.advanced)
        if merged or end.kind is RoundKind.MIX or end.status is RoundStatus.MERGED:  # a mix applies a held merge
            self._write_probe()
        release_freed_memory()  # the round's momentary copies of the model (its merge's, its average's)
        if self._advanced and end.fragment not in self.state.held and not self._leaving:
            self._advanced = False
            self.ledger.save(self.ledger_path)
            self._publish_state()
            self._publish_progress()
            self.network.records.refresh_model_fingerprint(self.loaded.fingerprint)
            self.network.records.publish_membership()
            self._periodic_io()

    def _report(self, result: RoundBegin | RoundEnd, wire: bool = False) -> None:
        """The event of ``result`` (tracking.py ``round_event``) with this unit's counters."""
        ledger, now = self.ledger, time.time()
        counters = UnitCounters(self.inner_step, self.outer_round, now, self.engine.schedule.period_s,
                                ledger.useful_compute_s, ledger.useful_tokens, ledger.goodput(now),
                                self.wire.event_fields() if wire else {})  # fmt: skip
        event = round_event(result, counters)
        if event is not None:
            self.metrics.write(event)

    def _periodic_io(self) -> None:
        """Once the unit's round advanced: the evals, checkpoints and exports whose period came."""
        run, outer_round = self.config.run, self.outer_round
        if outer_round % run.eval_every_rounds == 0:
            self._evaluate("outer_round")
        if outer_round % run.checkpoint_every_rounds == 0 or not self._checkpointed:
            self.save()  # the first time the round advances too: a kill after it loses at most one round's work
        export_every, save_dir = run.export_every_rounds, run.save_dir
        if export_every is not None and save_dir is not None and outer_round % export_every == 0:
            self._export(Path(save_dir))

    # ------------------------------------------------------------------------------------ reporting, io
    def _evaluate(self, reason: events.EvalReason) -> None:
        """Evaluate φ on the held-out batches (evaluation.py: after a round, spread over the next inner steps)."""
        self._off_the_clock(lambda: self.evaluator.evaluate(self.state.global_params, self.outer_round, reason))

    def _off_the_clock(self, work: Callable[[], None]) -> None:
        """Run ``work`` (an eval) with its time left out of the training loop's period (the step time that sizes
        matchmaking windows and clock periods): an eval is no inner step."""
        started = time.monotonic()
        work()
        if self._last_step_end is not None:
            self._last_step_end += time.monotonic() - started

    def _write_probe(self) -> None:
        self.metrics.write(events.ModelProbe(outer_round=self.outer_round, values=self.state.probe()))

    def _publish_state(self) -> None:
        state = self.state
        self.network.state_server.publish(SwarmState(state.global_params, state.momentum, state.fragment_rounds(),
                                                     self.inner_step, self.tokens))  # fmt: skip

    def _publish_progress(self) -> None:
        """Publish this training unit's progress record without waiting (its φ probe as it is now)."""
        self.publish("training", wait=False)
        self._last_progress = time.monotonic()

    def publish(self, phase: Phase, wait: bool) -> None:
        """This unit's progress record (the census of departure.py: its phase); stored before returning (at most
        DHT_TIMEOUT_S) when ``wait``."""
        eval_loss = self.evaluator.last_loss if math.isfinite(self.evaluator.last_loss or math.nan) else None
        progress = PeerProgress(
            peer_id=self.network.peer_id, inner_step=self.inner_step, outer_round=self.outer_round,
            tokens_per_s=float(self.throughput.tokens_per_s or 0.0),
            loss=self.last_loss if math.isfinite(self.last_loss) else 0.0, last_seen=shared_time(),
            group_size=self.last_group_size, model_fingerprint=self.loaded.fingerprint,
            useful_compute_s=self.ledger.useful_compute_s, allocated_s=self.ledger.allocated_s(time.time()),
            phase=phase, eval_loss=eval_loss, probe=record_probe(self.state.probe()),
            period_s=self.engine.schedule.desired_period_s, round_settings=self.round_settings,
        )  # fmt: skip
        ttl_s = LEFT_TTL_S if phase == "left" else PROGRESS_TTL_S
        self.network.records.publish_progress(progress, ttl_s=ttl_s, wait=wait)

    def phases(self) -> dict[str, Announcement]:
        """Every unit's phase as the run's progress records show them now, when each was published and its φ probe
        (the census of departure.py)."""
        records = self.network.records.read_progress()
        return {peer_id: Announcement(record.phase, record.last_seen, tuple(record.probe))
                for peer_id, record in records.items()}  # fmt: skip

    def save(self) -> None:
        """Atomically write the local checkpoint (θ, φ, momentum, inner optimizer, counters, data position) and the
        goodput ledger."""
        self.ledger.save(self.ledger_path)
        self.ranks.fetch(self.trainer.params, range(len(self.theta)))  # gathered from the ranks when sharded
        position = self._stream.position if self._stream is not None else self.data_position
        data = None if self.data is None else {"shard_seed": self.data.shard_seed, **position.as_dict()}
        save_checkpoint(self.checkpoint_path, {
            "model_fingerprint": self.loaded.fingerprint, "local_params": on_host(self.theta),
            "global_params": self.state.global_params, "momentum": self.state.momentum,
            "inner": self.ranks.inner_state(self.trainer), "outer_round": self.outer_round,
            "fragment_rounds": self.state.fragment_rounds(), "inner_step": self.inner_step, "tokens": self.tokens,
            "data": data,
        })  # fmt: skip
        self._checkpointed = True

    def finish(self) -> None:
        """Leave cleanly: the exit protocol (rounds/departure.py: final rounds, settle rounds, the census), then the
        final eval, checkpoint and export of the consensus parameters."""
        network, self._leaving = self.network, True
        Departure(self.engine, census=self, observer=self, peer_id=network.peer_id, now=shared_time,
                  settle_averager=network.settle_averager,
                  refuses=network.settle_refuses).leave(self.throughput.step_time_s)  # fmt: skip
        self._evaluate("final")
        self.save()
        release_freed_memory()  # before the export's own copies
        self.ranks.stop()
        if self.config.run.save_dir is not None:
            self._export(Path(self.config.run.save_dir))
            logger.info("exported the consensus model to %s", self.config.run.save_dir)
        self._write_stop()

    def _export(self, save_dir: Path) -> None:
        """``save_pretrained`` of φ: loaded into the model (θ put back after), or, when θ is sharded over the ranks,
        handed over by name as the state to save."""
        loaded, adapter_only, phi = self.loaded, self.config.run.export_adapter, self.state.global_params
        if not self.ranks.sharded:
            with self.trainer.parameters_swapped(phi):
                export_pretrained(loaded.model, loaded.tokenizer, save_dir, adapter_only=adapter_only)
            return
        names = [name for name, param in loaded.model.named_parameters() if param.requires_grad]
        state = {**dict(loaded.model.named_buffers()), **dict(zip(names, phi, strict=True))}
        export_pretrained(loaded.model, loaded.tokenizer, save_dir, state_dict=state)

    def _write_stop(self) -> None:
        now, ledger, device = time.time(), self.ledger, self.loaded.device
        self.metrics.write(events.Stop(
            inner_step=self.inner_step, outer_round=self.outer_round, tokens=self.tokens,
            eval_loss=self.evaluator.last_loss, compute_s=ledger.compute_s, useful_compute_s=ledger.useful_compute_s,
            useful_tokens=ledger.useful_tokens, allocated_s=ledger.allocated_s(now), goodput=ledger.goodput(now),
            **self.wire.event_fields(),
            peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        ))  # fmt: skip
