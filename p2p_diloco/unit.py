"""One learning unit: the inner loop, join/resume/download, checkpoints, evals, publishing and metrics. Its outer rounds
(streaming fragments, payloads, merges, consensus rounds and what failures do) are the round engine's (rounds/);
the unit does the I/O that the engine's results call for.

Who steps θ: the unit's own trainer on its own data (:meth:`LearningUnit.run`, ``p2p-diloco join``; with several
ranks, rank 0's unit tells the others what each step did, ranks.py), or the library API's caller, who steps its own
optimizer and calls :meth:`LearningUnit.record_step` and :meth:`LearningUnit.stepped` after each step (api.py).

I/O that costs (saving the goodput ledger, publishing the state served to joiners, refreshing the DHT fingerprint,
reading the socket byte counters, evals and checkpoints) runs when the unit's outer round advances, i.e. once per
period whatever the number of fragments, not at every fragment merge: a joiner may download a state up to one period
old, which its next rounds bring back into consensus.

Goodput (goodput.py): the compute of the inner steps a fragment round sends becomes useful, in proportion to the
fragment's share of the weights, when that round merges; a failed or dropped round carries it into the next one, a
local reset discards it.

Join rule: if live peers report a later outer round than this unit's local checkpoint (or it has none), the unit
downloads φ, the outer momentum and the counters from a live peer and trains from φ; otherwise it resumes its
checkpoint, or starts from the initial weights when the swarm has no state yet.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from p2p_diloco import events
from p2p_diloco.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.compression import roundtrip
from p2p_diloco.config import PeerConfig, SwarmSections
from p2p_diloco.data import DataPosition, TextData, TrainingStream
from p2p_diloco.errors import UserError
from p2p_diloco.forking import optimizer_tensors
from p2p_diloco.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.inner import InnerTrainer, StepStats, copy_into, host_copies
from p2p_diloco.members import believed_rounds
from p2p_diloco.metrics import ProgressBars, Throughput
from p2p_diloco.model import LoadedModel, export_pretrained
from p2p_diloco.ranks import Ranks, ThetaLink, UnitStart, theta_probe
from p2p_diloco.records import PeerProgress, PendingProgress, Phase, ProgressRecords, in_phase
from p2p_diloco.rounds.averager import Averager
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.plan import FINAL_ROUND_SLACK_S, RoundPlan
from p2p_diloco.rounds.results import RoundBegin, RoundEnd, RoundKind, RoundStatus
from p2p_diloco.state_sync import StateService, SwarmState
from p2p_diloco.wire import WireCounter

logger = logging.getLogger(__name__)

# Every unit's progress record is a DHT store that several DHT nodes handle: with 16 units on one box, publishing every
# 2 s kept each unit's DHT process at about 0.04 cores (the largest part of its background CPU).
PROGRESS_EVERY_S = 10.0
PROGRESS_TTL_S = 30.0
SETTLED_DRIFT = 1e-6  # every finishing unit in a settle round, this close already: no more settle rounds


class JoinError(UserError):
    """The unit cannot take part in this swarm; the message is one line for the user."""


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
        eval_batches: Sequence[torch.Tensor] = (),
    ):
        self.config, self.loaded, self.data, self.network, self.metrics = config, loaded, data, network, metrics
        self.eval_batches = list(data.eval_batches if data is not None else eval_batches)  # none: no evals
        self.ranks = ranks or Ranks()  # rank 0 of them, or the unit's only process
        if trainer is None:  # the CLI's: the [inner] section's optimizer over the loaded model
            assert isinstance(config, PeerConfig), "a unit without a trainer of its caller's trains by [inner]"
            trainer = InnerTrainer(loaded.model, config.inner, loaded.device, loaded.autocast, self.ranks.replica,
                                   sharded=self.ranks.sharded)  # fmt: skip
        self.trainer = trainer  # θ is its params; the library API's caller steps its optimizer itself
        self.theta = self.ranks.theta(trainer.params)  # what the round engine reads and writes (ranks.py)
        self.engine = RoundEngine(plan, network.averagers, network.consensus_averagers, local=self.theta,
                                  sync=ThetaLink(self.ranks, trainer.params),
                                  roundtrip=functools.partial(roundtrip, codec=plan.codec))  # fmt: skip
        self.inner_step = self.tokens = 0
        self.data_position = DataPosition()  # where the unit's data stream starts (join: from its checkpoint)
        self._stream: TrainingStream | None = None
        self.throughput = Throughput()  # tokens and wall seconds per inner step (the training loop's period)
        self._last_step_end: float | None = None
        # the training session (start_training .. stop_training)
        self._started = time.monotonic()
        self._progress = ProgressBars(None, enabled=False)
        self._last_progress = 0.0  # when this unit last published its progress record (monotonic)
        self._census_read: PendingProgress | None = None  # the live units' progress records, read without waiting
        self.last_loss = float("nan")
        self.last_group_size = 0
        self.last_eval: float | None = None
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
    def join(self) -> events.JoinSource:
        """Take the state to train from (see the module docstring); returns its source. Raises JoinError."""
        checkpoint = load_checkpoint(self.checkpoint_path)
        if checkpoint is not None and checkpoint.get("model_fingerprint") != self.loaded.fingerprint:
            raise JoinError(f"{self.checkpoint_path} holds a checkpoint of another model; use another --work-dir")
        local_round = int(checkpoint["outer_round"]) if checkpoint is not None else -1
        self.data_position = self._data_position(checkpoint)
        records = self.network.records.read_progress()
        claims = {peer: record.outer_round for peer, record in records.items() if peer != self.network.peer_id}
        swarm_round = max(believed_rounds(claims).values(), default=-1)
        if swarm_round > max(local_round, 0):
            state = self._download(swarm_round)
            self.engine.load_state(state.global_params, state.momentum, state.fragment_rounds)
            self._load_theta(self.engine.global_params)
            source: events.JoinSource = "swarm"
        elif checkpoint is not None:
            self._resume(checkpoint)
            source = "checkpoint"
        else:
            source = "initial weights"
        self._publish_state()
        start = UnitStart(self.network.peer_id, self.inner_step, self.trainer.state_dict())
        self.ranks.share_start(self.trainer, start)
        self._write_replica_probe()
        return source

    def _data_position(self, checkpoint: dict | None) -> DataPosition:
        """Where the checkpoint's data stream was, if it was this unit's stream (the same shard seed: the same peer
        identity and seed), whatever state the unit then takes: the data it trained on stays trained on."""
        saved = checkpoint.get("data") if checkpoint is not None else None
        if self.data is None or not isinstance(saved, dict) or saved.get("shard_seed") != self.data.shard_seed:
            return DataPosition()
        try:
            position = DataPosition.from_dict({key: saved.get(key) for key in ("epoch", "documents")})
        except ValueError as error:
            logger.warning("the checkpoint's data position is unreadable, the data starts afresh: %s", error)
            return DataPosition()
        logger.info("data resumes at epoch %d after %d documents", position.epoch, position.documents)
        return position

    def _download(self, swarm_round: int) -> SwarmState:
        """The swarm's state from a live peer, retried until ``join_timeout_s``. Raises JoinError."""
        started = time.monotonic()
        deadline = started + self.config.network.join_timeout_s
        while time.monotonic() < deadline:
            state = self.network.state_server.download(timeout_s=max(1.0, deadline - time.monotonic()))
            if state is not None:
                seconds = time.monotonic() - started
                self.metrics.write(
                    events.StateDownload(
                        seconds=seconds,
                        outer_round=state.outer_round,
                        donor_inner_step=state.inner_step,
                        donor_tokens=state.tokens,
                    )
                )
                logger.info("downloaded swarm state: outer_round=%d seconds=%.2f", state.outer_round, seconds)
                return state
            time.sleep(0.5)
        raise JoinError(
            f"the swarm is at outer round {swarm_round} but no live peer served its state within "
            f"{self.config.network.join_timeout_s:.0f} s"
        )

    def _resume(self, checkpoint: dict) -> None:
        rounds = checkpoint.get("fragment_rounds", [int(checkpoint["outer_round"])])
        self.engine.load_state(checkpoint["global_params"], checkpoint["momentum"], rounds)
        self._load_theta(checkpoint["local_params"])
        self.ranks.load_inner_state(self.trainer, checkpoint["inner"])
        self.inner_step, self.tokens = int(checkpoint["inner_step"]), int(checkpoint["tokens"])

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
        self._evaluate("join")
        self._write_probe()

    def stop_training(self) -> None:
        """After the last inner step (before :meth:`finish`): the progress bars close."""
        self._progress.close()

    def stepped(self, stats: StepStats) -> None:
        """After an inner step (its bookkeeping done: :meth:`train_step` or :meth:`record_step`): merge the rounds
        that ended, begin those that are due, publish progress and read the census now and then."""
        self._progress.inner_step(stats.loss, self.throughput.tokens_per_s or 0.0)
        ended = self.poll_round()
        fragments = [end for end in ended if end.kind is RoundKind.FRAGMENT]
        if fragments:
            self._progress.outer_round(self.outer_round, fragments[-1].group_size, self.last_eval)
        self.maybe_begin_round()
        if time.monotonic() - self._last_progress >= PROGRESS_EVERY_S:
            self._publish_progress()
            self._census_read = self._census_read or self.network.records.read_progress_soon()
            self._last_progress = time.monotonic()
        if self._census_read is not None and (live := self._census_read.poll()) is not None:
            self._census_read = None
            if live:  # an empty or failed read keeps the last census
                self.engine.swarm_size = self._census(live, "training", "finishing")

    def _load_theta(self, values: Sequence[torch.Tensor]) -> None:
        """``values`` into θ (the other ranks get it at the start)."""
        copy_into(self.theta, values)

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
        now = time.monotonic()
        period = stats.seconds if self._last_step_end is None else max(stats.seconds, now - self._last_step_end)
        self._last_step_end = now
        tokens = stats.tokens * self.ranks.world_size  # every rank trained a batch of the same shape
        self.inner_step += 1
        self.tokens += tokens
        self.engine.record_step(tokens, stats.seconds)
        self.ledger.record_step(stats.seconds, tokens)
        self.last_loss = stats.loss
        self.throughput.add(tokens, period)
        self.metrics.write(events.InnerStep(step=self.inner_step, loss=stats.loss, seconds=stats.seconds, lr=stats.lr,
                                            tokens_per_s=self.throughput.tokens_per_s))  # fmt: skip
        return stats

    def poll_round(self) -> list[RoundEnd]:
        """Merge every round that ended (never waits) and do what each calls for; returns them."""
        ended = self.engine.poll()
        for end in ended:
            self._ended(end)
        return ended

    def maybe_begin_round(self) -> bool:
        """Begin the rounds that are due (rounds/engine.py); True if any began or θ was reset."""
        begins = self.engine.begin_due(self.throughput.step_time_s, get_dht_time())
        for begin in begins:
            self._began(begin)
        return any(begin.status in (RoundStatus.BEGUN, RoundStatus.RESET) for begin in begins)

    def _began(self, begin: RoundBegin) -> None:
        if begin.status is RoundStatus.RESET:  # the engine put θ back to φ: its moments are meaningless now
            self.ranks.reset_moments(self.trainer)
            self.metrics.write(events.LocalReset(outer_round=self.outer_round, inner_step=self.inner_step))
        elif begin.status is RoundStatus.BEGUN and begin.kind is RoundKind.FRAGMENT:
            self.metrics.write(events.OuterRoundBegin(
                fragment=begin.fragment, outer_round=begin.outer_round, inner_step=self.inner_step,
                window_s=begin.window_s, scheduled_at=time.time() + begin.window_s, weight=begin.weight,
                period_s=self.engine.clock.period_s if self.engine.clock else None,
            ))  # fmt: skip
        elif begin.status is RoundStatus.BEGUN and begin.kind is RoundKind.CONSENSUS:
            self.metrics.write(events.ConsensusBegin(fragment=begin.fragment, inner_step=self.inner_step))

    def _ended(self, end: RoundEnd) -> None:
        if end.kind in (RoundKind.CONSENSUS, RoundKind.SETTLE, RoundKind.MIX):
            applied = end.status is RoundStatus.MERGED
            self.metrics.write(events.ConsensusRound(
                kind=end.kind.value, fragment=end.fragment,
                group_size=end.group_size, applied=applied, member_drift=end.member_drift, seconds=end.seconds,
                error=end.error,
            ))  # fmt: skip
            if applied:
                self._write_probe()
        elif not end.merged:
            status = "rejected" if end.status is RoundStatus.REJECTED else "failed"
            self.metrics.write(events.OuterRoundFailed(status=status, fragment=end.fragment,
                                                       outer_round=end.outer_round, error=end.error))  # fmt: skip
        else:
            self._merged(end)

    def _merged(self, end: RoundEnd) -> None:
        """A merged fragment round: goodput, and once per period (the unit's round advanced) the costly I/O."""
        self.last_group_size = end.group_size
        self.ledger.record_merge(end.useful_compute_s, end.useful_tokens)
        if end.advanced:
            self.ledger.save(self.ledger_path)
            self._publish_state()
            self.network.records.refresh_model_fingerprint(self.loaded.fingerprint)
            self.network.records.publish_membership()
        self.metrics.write(events.OuterRound(
            status="merged" if end.status is RoundStatus.MERGED else "alone", fragment=end.fragment,
            outer_round=end.outer_round, unit_outer_round=end.unit_outer_round, group_size=end.group_size,
            overlap_steps=end.overlap_steps, seconds=end.seconds, weight=end.weight, member_drift=end.member_drift,
            useful_compute_s=self.ledger.useful_compute_s, useful_tokens=self.ledger.useful_tokens,
            goodput=self.ledger.goodput(time.time()), **(self._wire_fields() if end.advanced else {}),
        ))  # fmt: skip
        self._write_probe()
        if end.advanced and self.outer_round % self.config.run.eval_every_rounds == 0:
            self._evaluate("outer_round")
        if end.advanced and self.outer_round % self.config.run.checkpoint_every_rounds == 0:
            self.save()
        export_every, save_dir = self.config.run.export_every_rounds, self.config.run.save_dir
        if end.advanced and export_every is not None and save_dir is not None and self.outer_round % export_every == 0:
            self._export(Path(save_dir))

    # ------------------------------------------------------------------------------------ reporting, io
    def _evaluate(self, reason: events.EvalReason) -> None:
        """Evaluate φ on the held-out batches. Its time is left out of the training loop's period (the step time that
        sizes matchmaking windows and clock periods): an eval is no inner step."""
        started = time.monotonic()
        if not self.eval_batches:
            return
        self.last_eval = self.ranks.evaluate(self.trainer, self.engine.global_params, self.eval_batches)
        if self._last_step_end is not None:
            self._last_step_end += time.monotonic() - started
        self.metrics.write(events.Eval(reason=reason, outer_round=self.outer_round, eval_loss=self.last_eval))

    def _write_probe(self) -> None:
        self.metrics.write(events.ModelProbe(outer_round=self.outer_round, values=self.engine.probe()))

    def _publish_state(self) -> None:
        engine = self.engine
        rounds = engine.fragment_rounds()
        self.network.state_server.publish(
            SwarmState(engine.global_params, engine.momentum, rounds, self.inner_step, self.tokens)
        )

    def _census(self, records: dict[str, PeerProgress], *phases: Phase) -> int:
        """How many units are in one of ``phases`` by ``records``, this one included (its own record may not be
        readable yet)."""
        return len(set(in_phase(records, *phases)) | {self.network.peer_id})

    def _finishing(self, seen: set[str]) -> int:
        """How many units are finishing now that this one would settle with, this one included: those a read at exit
        showed finishing (``seen``, updated here) until one shows them in another phase, as a unit's record may expire
        while its final rounds run (it refreshes it at each settle round). A read without this unit's own record
        (stored before its final rounds) is incomplete, as reads of a loaded DHT can be: then at least the last census
        of live units."""
        records = self.network.records.read_progress()
        seen.update(in_phase(records, "finishing"))
        seen.difference_update(in_phase(records, "training", "left"))
        finishing = {peer_id for peer_id in seen if not self.network.settle_refuses(peer_id)} | {self.network.peer_id}
        if self.network.peer_id not in records:
            return max(self.engine.swarm_size, len(finishing))
        return len(finishing)

    def _publish_progress(self, phase: Phase = "training", wait: bool | None = None) -> None:
        """This unit's progress record; stored before returning (at most DHT_TIMEOUT_S) when ``wait``, by default for
        a phase other than training, so that the units leaving with it read it in time."""
        self.network.records.publish_progress(
            PeerProgress(
                peer_id=self.network.peer_id,
                inner_step=self.inner_step,
                outer_round=self.outer_round,
                tokens_per_s=float(self.throughput.tokens_per_s or 0.0),
                loss=self.last_loss if math.isfinite(self.last_loss) else 0.0,
                last_seen=get_dht_time(),
                group_size=self.last_group_size,
                model_fingerprint=self.loaded.fingerprint,
                useful_compute_s=self.ledger.useful_compute_s,
                allocated_s=self.ledger.allocated_s(time.time()),
                phase=phase,
                eval_loss=self.last_eval if self.last_eval is not None and math.isfinite(self.last_eval) else None,
            ),
            ttl_s=PROGRESS_TTL_S,
            wait=phase != "training" if wait is None else wait,
        )

    def save(self) -> None:
        """Atomically write the local checkpoint (θ, φ, momentum, inner optimizer, counters) and the goodput
        ledger."""
        self.ledger.save(self.ledger_path)
        save_checkpoint(
            self.checkpoint_path,
            {
                "model_fingerprint": self.loaded.fingerprint,
                "local_params": self._local_parameters(),
                "global_params": self.engine.global_params,
                "momentum": self.engine.momentum,
                "inner": self.ranks.inner_state(self.trainer),
                "outer_round": self.outer_round,
                "fragment_rounds": self.engine.fragment_rounds(),
                "inner_step": self.inner_step,
                "tokens": self.tokens,
                "data": self._data_fields(),
            },
        )

    def _data_fields(self) -> dict[str, int] | None:
        """The data stream's position after the last batch trained on, and whose stream it is (None: no data of the
        unit's own)."""
        if self.data is None:
            return None
        position = self._stream.position if self._stream is not None else self.data_position
        return {"shard_seed": self.data.shard_seed, **position.as_dict()}

    def _local_parameters(self) -> list[torch.Tensor]:
        """A CPU fp32 copy of θ (gathered from the ranks when sharded)."""
        self.ranks.fetch(self.trainer.params, range(len(self.theta)))
        return host_copies(self.theta)

    def finish(self) -> None:
        """Leave cleanly: hand the last steps to the swarm in final rounds at the next boundary (bounded by the
        engine's final-round bound; with quorum 1 a round completes alone if nobody joins; a round that does not end
        in time is dropped and its progress stays in the checkpoint's local parameters); then shut the round
        averagers down and settle with the units leaving at the same time (:meth:`_settle`); then final eval,
        checkpoint and export of the consensus parameters."""
        engine, step_time_s = self.engine, self.throughput.step_time_s
        self._publish_progress("finishing")  # the units finishing at the same time settle with this one
        bound_s = engine.final_round_bound_s(step_time_s)
        logger.info("finishing the last outer rounds (at most %.0f s each; Ctrl+C again to abort)", bound_s)
        now = get_dht_time()
        final_boundary = now + engine.boundary_window_s(0, step_time_s, now)  # the same for every unit leaving now
        self._exit_rounds(engine.begin_final(step_time_s, now), bound_s)
        for averager in (*self.network.averagers, *self.network.consensus_averagers):
            averager.shutdown()  # of no more use: the settle averager takes their place (memory stays flat at exit)
        settle_averager = self._start_settle_averager()
        if settle_averager is not None:
            try:
                self._settle(settle_averager, not_before=final_boundary)
            finally:
                settle_averager.shutdown()
        self._publish_progress("left")  # the units settling after this one no longer wait for it
        self._evaluate("final")
        self.save()
        self.ranks.stop()
        if self.config.run.save_dir is not None:
            self._export(Path(self.config.run.save_dir))
            logger.info("exported the consensus model to %s", self.config.run.save_dir)
        self._write_stop()

    def _export(self, save_dir: Path) -> None:
        """``save_pretrained`` of φ: loaded into the model (θ put back after), or, when θ is sharded over the ranks,
        handed over by name as the state to save."""
        loaded, adapter_only = self.loaded, self.config.run.export_adapter
        if not self.ranks.sharded:
            with self.trainer.parameters_swapped(self.engine.global_params):
                export_pretrained(loaded.model, loaded.tokenizer, save_dir, adapter_only=adapter_only)
            return
        names = [name for name, param in loaded.model.named_parameters() if param.requires_grad]
        state = {**dict(loaded.model.named_buffers()), **dict(zip(names, self.engine.global_params, strict=True))}
        export_pretrained(loaded.model, loaded.tokenizer, save_dir, state_dict=state)

    def _start_settle_averager(self) -> Averager | None:
        """The averager of the settle rounds; None without settle rounds, or when it fails to start (logged: the unit
        leaves without settling rather than lose its final evaluation, checkpoint and export)."""
        make_settle = self.network.settle_averager if self.engine.plan.settle_rounds else None
        if make_settle is None:
            return None
        try:
            return make_settle(self.engine.settle_template())
        except Exception:  # hivemind raises whatever its averager process raised while starting
            logger.exception("the settle averager did not start: leaving without settle rounds")
            return None

    def _settle(self, averager: Averager, not_before: float) -> None:
        """Settle rounds (rounds/engine.py) with the units leaving at the same time, the first after ``not_before`` (the
        boundary of the final rounds, whether this unit had one in flight or began one). Units whose final rounds end
        at different times may settle among themselves first, and a contended matchmaking may leave a unit out of a
        round, so the rounds go on until one held every unit finishing at the time (:meth:`_finishing`: units
        announce that they are finishing, refresh that each settle round, then announce that they left) with their φ
        already within SETTLED_DRIFT; at most ``settle_rounds``, and beyond them, while a unit finishing has not met
        this one yet, as many more as fit in the final rounds' bound (the time that unit may still spend in its own).
        A unit leaving a swarm that trains on settles once."""
        engine, plan = self.engine, self.engine.plan
        last = plan.settle_rounds + engine.settle_patience(self.throughput.step_time_s)
        seen_finishing: set[str] = set()
        for number in range(1, last + 1):
            self._publish_progress("finishing", wait=False)  # it may have expired in a long final round
            window_s = engine.settle_window_s(get_dht_time(), not_before)
            if not engine.begin_settle(averager, window_s):
                return
            end = engine.end_settle(averager.finish_round(window_s + FINAL_ROUND_SLACK_S + plan.allreduce_timeout_s))
            self._ended(end)
            close = end.member_drift <= SETTLED_DRIFT
            if number < plan.settle_rounds and not close:
                continue  # another round is due whoever finishes: no census read
            everyone = end.group_size >= self._finishing(seen_finishing)
            if everyone and (close or number >= plan.settle_rounds):
                return

    def _exit_rounds(self, begins: list[RoundBegin], bound_s: float) -> None:
        """Report ``begins`` and wait for the rounds in flight (at most ``bound_s``)."""
        for begin in begins:
            self._began(begin)
        for end in self.engine.drain(bound_s):
            self._ended(end)

    def _write_stop(self) -> None:
        now, ledger = time.time(), self.ledger
        self.metrics.write(events.Stop(
            inner_step=self.inner_step, outer_round=self.outer_round, tokens=self.tokens, eval_loss=self.last_eval,
            compute_s=ledger.compute_s, useful_compute_s=ledger.useful_compute_s, useful_tokens=ledger.useful_tokens,
            allocated_s=ledger.allocated_s(now), goodput=ledger.goodput(now), **self._wire_fields(),
            peak_device_bytes=self._peak_device_bytes(),
        ))  # fmt: skip

    def _peak_device_bytes(self) -> int | None:
        device = self.loaded.device
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    def _wire_fields(self) -> dict[str, int | None]:
        """Cumulative bytes this unit's p2p daemon sent and received over TCP (None: not measurable here)."""
        totals = self.wire.sample()
        return {
            "wire_bytes_sent": totals.sent if totals else None,
            "wire_bytes_received": totals.received if totals else None,
        }
