"""One learning unit: inner steps, outer rounds in the background, join/rejoin, checkpoints, clean exit.

Round schedule: a round starts ``inner_steps`` (H) inner steps after the previous one ended, so units that
averaged together stay in phase. While its average is in flight the unit keeps training; the result is
merged whenever it arrives with θ ← φ_new + (θ_now − θ_sent), so the overlapped steps are kept (no step
is ever thrown away and the inner loop never waits on the network). The wait is bounded: matchmaking by
the grace window (``grace_fraction`` × H × measured step time, clamped to [min_grace_s, max_grace_s]) and the
all-reduce by ``allreduce_timeout_s``. A failed round leaves φ unchanged, so its progress is carried by
the next pseudo-gradient. The outer round after a merge is max(rounds of the group members) + 1.

Goodput (see p2p_diloco/goodput.py): the compute seconds of the inner steps a round sends become useful when that
round merges; a failed or dropped round carries them into the next one, a local reset discards them.

Join rule: if live peers report a later outer round than this unit's local checkpoint (or it has none),
the unit downloads φ, the outer momentum and the counters from a live peer and trains from φ; otherwise
it resumes its checkpoint, or starts from the initial weights when the swarm has no state yet.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from hivemind.utils import get_dht_time

from p2p_diloco.averaging import OuterAverager, RoundOutcome
from p2p_diloco.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.config import PeerConfig
from p2p_diloco.data import TextData
from p2p_diloco.diloco import (
    OuterHyperparams,
    all_finite,
    consensus_probe,
    consensus_probe_indices,
    merge_local_progress,
    outer_step,
    pseudo_gradient,
)
from p2p_diloco.errors import UserError
from p2p_diloco.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.inner import InnerTrainer, StepStats
from p2p_diloco.metrics import MetricsLog, ProgressBars, Throughput
from p2p_diloco.model import LoadedModel, export_pretrained
from p2p_diloco.records import PeerProgress, SwarmRecords
from p2p_diloco.state_sync import StateServer, SwarmState
from p2p_diloco.wire import WireCounter

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0
PROGRESS_TTL_S = 30.0


class JoinError(UserError):
    """The unit cannot take part in this swarm; the message is one line for the user."""


@dataclass
class _SentRound:
    local_at_send: list[torch.Tensor]
    momentum_proposal: list[torch.Tensor]
    tokens: int
    compute_s: float
    inner_step: int


class LearningUnit:
    """Owns θ (through the trainer), φ, the outer momentum and the round bookkeeping of one unit."""

    def __init__(
        self,
        config: PeerConfig,
        loaded: LoadedModel,
        data: TextData,
        averager: OuterAverager,
        state_server: StateServer,
        records: SwarmRecords,
        peer_id: str,
        metrics: MetricsLog,
    ):
        self.config, self.loaded, self.data = config, loaded, data
        self.averager, self.state_server, self.records = averager, state_server, records
        self.peer_id, self.metrics = peer_id, metrics
        self.trainer = InnerTrainer(loaded.model, config.inner, loaded.device)
        self.hyper = OuterHyperparams(config.outer.outer_lr, config.outer.outer_momentum, config.outer.nesterov)
        self.global_params = self.trainer.local_parameters()
        self.momentum = [torch.zeros_like(tensor) for tensor in self.global_params]
        self.probe_indices = consensus_probe_indices(self.global_params)
        self.outer_round = self.inner_step = self.tokens = 0
        self.tokens_since_round = self.steps_since_round = 0
        self.compute_since_round = 0.0
        self.sent: _SentRound | None = None
        self.throughput = Throughput()
        self.last_loss = float("nan")
        self.last_group_size = 0
        self.last_eval: float | None = None
        self.checkpoint_path = Path(config.run.work_dir) / "checkpoint.pt"
        self.ledger_path = Path(config.run.work_dir) / LEDGER_FILE
        self.ledger = GoodputLedger.load_or_create(self.ledger_path)
        self.wire = WireCounter()

    # ----------------------------------------------------------------------------------------------- join
    def join(self) -> str:
        """Take the state to train from (see the module docstring); returns its source. Raises JoinError."""
        checkpoint = load_checkpoint(self.checkpoint_path)
        if checkpoint is not None and checkpoint.get("model_fingerprint") != self.loaded.fingerprint:
            raise JoinError(f"{self.checkpoint_path} holds a checkpoint of another model; use another --work-dir")
        local_round = int(checkpoint["outer_round"]) if checkpoint is not None else -1
        others = {pid: record for pid, record in self.records.read_progress().items() if pid != self.peer_id}
        swarm_round = max((record.outer_round for record in others.values()), default=-1)
        if swarm_round > max(local_round, 0):
            self._adopt(self._download(swarm_round))
            return "swarm"
        if checkpoint is not None:
            self._resume(checkpoint)
            return "checkpoint"
        self._publish_state()
        return "initial weights"

    def _download(self, swarm_round: int) -> SwarmState:
        started = time.monotonic()
        deadline = started + self.config.network.join_timeout_s
        while time.monotonic() < deadline:
            state = self.state_server.download(timeout_s=max(1.0, deadline - time.monotonic()))
            if state is not None:
                seconds = time.monotonic() - started
                self.metrics.write(
                    "state_download",
                    seconds=seconds,
                    outer_round=state.outer_round,
                    donor_inner_step=state.inner_step,
                    donor_tokens=state.tokens,
                )
                logger.info("downloaded swarm state: outer_round=%d seconds=%.2f", state.outer_round, seconds)
                return state
            time.sleep(0.5)
        raise JoinError(
            f"the swarm is at outer round {swarm_round} but no live peer served its state within "
            f"{self.config.network.join_timeout_s:.0f} s"
        )

    def _adopt(self, state: SwarmState) -> None:
        """Train from the swarm's φ, momentum and outer round; inner step and token counters stay per unit."""
        self.global_params, self.momentum = state.global_params, state.momentum
        self.outer_round = state.outer_round
        self.trainer.load_parameters(self.global_params)
        self._publish_state()

    def _resume(self, checkpoint: dict) -> None:
        self.global_params, self.momentum = checkpoint["global_params"], checkpoint["momentum"]
        self.trainer.load_parameters(checkpoint["local_params"])
        self.trainer.load_state_dict(checkpoint["inner"])
        self.outer_round, self.inner_step, self.tokens = (
            int(checkpoint[key]) for key in ("outer_round", "inner_step", "tokens")
        )
        self._publish_state()

    # ----------------------------------------------------------------------------------------- training
    def run(self, stop: threading.Event) -> None:
        """Train until ``stop`` is set or a max_steps / max_time_s limit is reached."""
        run = self.config.run
        started = time.monotonic()
        progress = ProgressBars(run.max_steps, enabled=run.progress)
        batches = self.data.train_batches()
        self._evaluate("join")
        last_progress = 0.0
        try:
            while not stop.is_set():
                if run.max_steps is not None and self.inner_step >= run.max_steps:
                    break
                if run.max_time_s is not None and time.monotonic() - started >= run.max_time_s:
                    break
                stats = self.train_step(batches)
                progress.inner_step(stats.loss, self.throughput.tokens_per_s or 0.0)
                if self.inner_step % 10 == 0:
                    self.metrics.write("inner_step", step=self.inner_step, loss=stats.loss, seconds=stats.seconds)
                outcome = self.poll_round()
                if outcome is not None:
                    progress.outer_round(outcome.group_size, self.last_eval)
                self.maybe_begin_round()
                if time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                    self._publish_progress()
                    last_progress = time.monotonic()
        finally:
            progress.close()

    def train_step(self, batches: Iterator[torch.Tensor]) -> StepStats:
        """One inner step and its bookkeeping (counters, compute, throughput)."""
        stats = self.trainer.train_step(batches)
        self.inner_step += 1
        self.steps_since_round += 1
        self.tokens += stats.tokens
        self.tokens_since_round += stats.tokens
        self.compute_since_round += stats.seconds
        self.ledger.record_step(stats.seconds, stats.tokens)
        self.last_loss = stats.loss
        self.throughput.add(stats.tokens, stats.seconds)
        return stats

    def poll_round(self) -> RoundOutcome | None:
        """Merge the outcome of the round in flight if it arrived; never waits."""
        outcome = self.averager.poll()
        if outcome is not None:
            self._end_round(outcome)
        return outcome

    def maybe_begin_round(self) -> bool:
        """Begin a round when H inner steps passed since the last one ended and none is in flight."""
        if self.sent is None and self.steps_since_round >= self.config.outer.inner_steps:
            self._begin_round()
            return True
        return False

    def _grace_window_s(self) -> float:
        """How long a round recruits members: grace_fraction × H measured step times, clamped.

        With a window of half a round period, two units meet whatever their phase; units that averaged
        together end the round together and stay in phase afterwards.
        """
        outer = self.config.outer
        if self.throughput.step_time_s is None:
            return outer.min_grace_s
        window = outer.grace_fraction * outer.inner_steps * self.throughput.step_time_s
        return min(outer.max_grace_s, max(outer.min_grace_s, window))

    def _begin_round(self) -> None:
        local_at_send = self.trainer.local_parameters()
        if not all_finite(local_at_send):
            # A diverged unit must not send NaN/inf: every group it joined would reject the average.
            logger.error("local parameters are non-finite at inner step %d: restarting from φ", self.inner_step)
            self.metrics.write("local_reset", outer_round=self.outer_round, inner_step=self.inner_step)
            self.trainer.load_parameters(self.global_params)
            self.trainer.reset_optimizer()
            self._reset_round_counters()
            return
        delta = pseudo_gradient(self.global_params, local_at_send)
        params_proposal, momentum_proposal = outer_step(self.global_params, self.momentum, delta, self.hyper)
        proposal = params_proposal + (momentum_proposal if self.config.outer.sync_momentum else [])
        weight, window_s = max(1, self.tokens_since_round), self._grace_window_s()
        self.averager.begin_round(
            proposal,
            weight=weight,
            outer_round=self.outer_round,
            window_s=window_s,
            probe=consensus_probe(self.global_params, self.probe_indices),
        )
        self.metrics.write(
            "outer_round_begin",
            outer_round=self.outer_round,
            inner_step=self.inner_step,
            window_s=window_s,
            scheduled_at=time.time() + window_s,
            weight=weight,
        )
        self.sent = _SentRound(
            local_at_send, momentum_proposal, self.tokens_since_round, self.compute_since_round, self.inner_step
        )
        self._reset_round_counters()

    def _reset_round_counters(self) -> None:
        self.tokens_since_round = self.steps_since_round = 0
        self.compute_since_round = 0.0

    def _carry(self, sent: _SentRound) -> None:
        """A round that did not merge: its steps' tokens and compute go into the next round."""
        self.tokens_since_round += sent.tokens
        self.compute_since_round += sent.compute_s

    def _end_round(self, outcome: RoundOutcome) -> None:
        sent, self.sent = self.sent, None
        assert sent is not None, "an outcome arrived without a round in flight"
        self.steps_since_round = 0
        averaged = outcome.averaged
        if averaged is not None and not all_finite(averaged):
            logger.error("rejected a non-finite average in outer round %d", self.outer_round)
            averaged = None
        if averaged is None:
            self._carry(sent)
            self.metrics.write("outer_round_failed", outer_round=self.outer_round, error=outcome.error)
            return
        count = len(self.global_params)
        self.global_params = averaged[:count]
        self.momentum = averaged[count:] if self.config.outer.sync_momentum else sent.momentum_proposal
        self.trainer.load_parameters(
            merge_local_progress(self.global_params, self.trainer.local_parameters(), sent.local_at_send)
        )
        self.outer_round = max(self.outer_round, outcome.max_member_round) + 1
        self.last_group_size = outcome.group_size
        self.ledger.record_merge(sent.compute_s, sent.tokens)
        self.ledger.save(self.ledger_path)
        self._publish_state()
        self.records.refresh_model_fingerprint(self.loaded.fingerprint)
        self.metrics.write(
            "outer_round",
            outer_round=self.outer_round,
            group_size=outcome.group_size,
            overlap_steps=self.inner_step - sent.inner_step,
            seconds=outcome.finished_at - outcome.started_at,
            weight=sent.tokens,
            member_drift=outcome.member_drift,
            useful_compute_s=self.ledger.useful_compute_s,
            useful_tokens=self.ledger.useful_tokens,
            **self._wire_fields(),
        )
        if self.outer_round % self.config.run.eval_every_rounds == 0:
            self._evaluate("outer_round")
        if self.outer_round % self.config.run.checkpoint_every_rounds == 0:
            self.save()

    # ------------------------------------------------------------------------------------ reporting, io
    def _evaluate(self, reason: str) -> None:
        with self.trainer.parameters_swapped(self.global_params):
            self.last_eval = self.trainer.evaluate(self.data.eval_batches)
        self.metrics.write("eval", reason=reason, outer_round=self.outer_round, eval_loss=self.last_eval)

    def _publish_state(self) -> None:
        self.state_server.publish(
            SwarmState(self.global_params, self.momentum, self.outer_round, self.inner_step, self.tokens)
        )

    def _publish_progress(self) -> None:
        self.records.publish_progress(
            PeerProgress(
                peer_id=self.peer_id,
                inner_step=self.inner_step,
                outer_round=self.outer_round,
                tokens_per_s=float(self.throughput.tokens_per_s or 0.0),
                loss=self.last_loss if math.isfinite(self.last_loss) else 0.0,
                last_seen=get_dht_time(),
                group_size=self.last_group_size,
                model_fingerprint=self.loaded.fingerprint,
                useful_compute_s=self.ledger.useful_compute_s,
                allocated_s=self.ledger.allocated_s(time.time()),
            ),
            ttl_s=PROGRESS_TTL_S,
        )

    def save(self) -> None:
        """Atomically write the local checkpoint (θ, φ, momentum, inner optimizer, counters) and the goodput
        ledger."""
        self.ledger.save(self.ledger_path)
        save_checkpoint(
            self.checkpoint_path,
            {
                "model_fingerprint": self.loaded.fingerprint,
                "local_params": self.trainer.local_parameters(),
                "global_params": self.global_params,
                "momentum": self.momentum,
                "inner": self.trainer.state_dict(),
                "outer_round": self.outer_round,
                "inner_step": self.inner_step,
                "tokens": self.tokens,
            },
        )

    def finish(self) -> None:
        """Leave cleanly: hand the last steps to the swarm in a final round (bounded: the grace window plus the
        all-reduce timeout; with quorum 1 it completes alone if nobody joins), then final eval, checkpoint and
        export of the consensus parameters. A round that does not end in time is dropped; its progress stays in
        the checkpoint's local parameters."""
        if self.sent is None and self.steps_since_round > 0:
            self._begin_round()
        if self.sent is not None:
            timeout_s = self._grace_window_s() + 1.0 + self.config.outer.allreduce_timeout_s
            logger.info("finishing the last outer round (at most %.0f s; Ctrl+C again to abort)", timeout_s)
            outcome = self.averager.finish_round(timeout_s)
            if outcome is not None:
                self._end_round(outcome)
            else:
                self._carry(self.sent)
                self.sent = None
        self._evaluate("final")
        self.save()
        if self.config.run.save_dir is not None:
            with self.trainer.parameters_swapped(self.global_params):
                export_pretrained(self.loaded.model, self.loaded.tokenizer, Path(self.config.run.save_dir))
            logger.info("exported the consensus model to %s", self.config.run.save_dir)
        now = time.time()
        self.metrics.write(
            "stop",
            inner_step=self.inner_step,
            outer_round=self.outer_round,
            tokens=self.tokens,
            eval_loss=self.last_eval,
            compute_s=self.ledger.compute_s,
            useful_compute_s=self.ledger.useful_compute_s,
            useful_tokens=self.ledger.useful_tokens,
            allocated_s=self.ledger.allocated_s(now),
            goodput=self.ledger.goodput(now),
            **self._wire_fields(),
        )

    def _wire_fields(self) -> dict[str, int | None]:
        """Cumulative bytes this unit's p2p daemon sent and received over TCP (None: not measurable here)."""
        totals = self.wire.sample()
        return {
            "wire_bytes_sent": totals.sent if totals else None,
            "wire_bytes_received": totals.received if totals else None,
        }
