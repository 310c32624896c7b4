"""One learning unit: inner steps, outer rounds in the background, join/rejoin, checkpoints, clean exit.

Streaming: the trained parameters are split into P fragments (fragments.py), each with its own averager, outer round
and schedule; P = 1 is plain DiLoCo. Fragment p's round starts ``inner_steps`` (H) inner steps after its previous
round ended (the first one after H·(p+1)/P steps), so units that averaged together stay in phase, and at most
``max_in_flight`` rounds (consensus rounds included) are in flight at once. While an average is in flight the unit
keeps training; the result is merged whenever it arrives with θ_p ← φ_p,new + (θ_p,now − θ_p,sent), so the
overlapped steps are kept (no step is ever thrown away and the inner loop never waits on the network). The wait is
bounded: matchmaking by the grace window (``grace_fraction`` × H × measured step time, clamped to
[min_grace_s, max_grace_s]) and the all-reduce by ``allreduce_timeout_s``. A failed round leaves φ_p unchanged, so
its progress is carried by the next pseudo-gradient. A fragment's outer round after a merge is max(rounds of the
group members) + 1; the unit's outer round is its smallest fragment round. What is sent (fp32 proposals or compressed
pseudo-gradients) and the consensus rounds of lossy codecs are described in streaming.py.

Goodput (see p2p_diloco/goodput.py): the compute seconds of the inner steps a fragment round sends become useful, in
proportion to the fragment's share of the weights, when that round merges; a failed or dropped round carries them
into the next one, a local reset discards them.

Bookkeeping that costs I/O (saving the goodput ledger, publishing the state served to joiners, refreshing the DHT
fingerprint, reading the socket byte counters, evals and checkpoints) runs when the unit's outer round advances, i.e.
once per period whatever P, not at every fragment merge: a joiner may download a state up to one period old, which
its next rounds bring back into consensus.

Join rule: if live peers report a later outer round than this unit's local checkpoint (or it has none),
the unit downloads φ, the outer momentum and the counters from a live peer and trains from φ; otherwise
it resumes its checkpoint, or starts from the initial weights when the swarm has no state yet.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
from hivemind.utils import get_dht_time

from p2p_diloco import events
from p2p_diloco.averaging import OuterAverager, RoundOutcome
from p2p_diloco.checkpoint import load_checkpoint, save_checkpoint
from p2p_diloco.compression import ErrorFeedback, roundtrip
from p2p_diloco.config import PeerConfig
from p2p_diloco.data import TextData
from p2p_diloco.diloco import (
    OuterHyperparams,
    all_finite,
    consensus_probe,
    consensus_probe_indices,
    merge_local_progress,
)
from p2p_diloco.errors import UserError
from p2p_diloco.fragments import assign, copies, due_fragments, partition, views
from p2p_diloco.goodput import LEDGER_FILE, GoodputLedger
from p2p_diloco.inner import InnerTrainer, StepStats
from p2p_diloco.metrics import MetricsLog, ProgressBars, Throughput
from p2p_diloco.model import LoadedModel, export_pretrained
from p2p_diloco.records import PeerProgress, SwarmRecords
from p2p_diloco.state_sync import StateServer, SwarmState
from p2p_diloco.streaming import (
    FragmentRounds,
    consensus_correction,
    consensus_payload,
)
from p2p_diloco.wire import WireCounter

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0
PROGRESS_TTL_S = 30.0


class JoinError(UserError):
    """The unit cannot take part in this swarm; the message is one line for the user."""


class LearningUnit:
    """Owns θ (through the trainer), φ, the outer momentum and the round bookkeeping of one unit.

    ``averagers`` holds one averager per streaming fragment (``config.outer.fragments``); ``consensus_averagers``
    (lossy codecs; None switches consensus rounds off) one more per fragment, which averages its φ_p flattened, in
    fp32 (separate averagers, so that only units re-averaging the same fragment can meet). Raises ValueError when the
    averagers do not match the fragments.
    """

    def __init__(
        self,
        config: PeerConfig,
        loaded: LoadedModel,
        data: TextData,
        averagers: Sequence[OuterAverager],
        state_server: StateServer,
        records: SwarmRecords,
        peer_id: str,
        metrics: MetricsLog,
        consensus_averagers: Sequence[OuterAverager] | None = None,
    ):
        self.config, self.loaded, self.data = config, loaded, data
        self.averagers = list(averagers)
        self.consensus_averagers = list(consensus_averagers) if consensus_averagers is not None else None
        self.state_server, self.records = state_server, records
        self.peer_id, self.metrics = peer_id, metrics
        self.trainer = InnerTrainer(loaded.model, config.inner, loaded.device)
        self.hyper = OuterHyperparams(config.outer.outer_lr, config.outer.outer_momentum, config.outer.nesterov)
        self.global_params = self.trainer.local_parameters()
        self.momentum = [torch.zeros_like(tensor) for tensor in self.global_params]
        outer = config.outer
        fragments = partition([tensor.shape for tensor in self.global_params], outer.fragments)
        for averager_list in (self.averagers, self.consensus_averagers):
            if averager_list is not None and len(averager_list) != len(fragments):
                raise ValueError(f"{len(fragments)} fragments need as many averagers, got {len(averager_list)}")
        total = sum(fragment.numel for fragment in fragments)
        compressed = outer.codec != "fp32"
        feedback = compressed and outer.error_feedback
        self.fragments = [
            FragmentRounds(
                fragment,
                fragment.numel / total,
                compressed,
                outer.sync_momentum,
                error_feedback=ErrorFeedback() if feedback else None,
                roundtrip=functools.partial(roundtrip, codec=outer.codec) if feedback else None,
            )
            for fragment in fragments
        ]
        self.consensus_due: list[int] = []  # fragments waiting for a consensus round, oldest first
        self.consensus_sent: dict[int, torch.Tensor] = {}  # fragment → payload of its consensus round in flight
        self.probe_indices = [consensus_probe_indices(views(self.global_params, f)) for f in fragments]
        self._restart_schedules()
        self.inner_step = self.tokens = 0
        self.throughput = Throughput()  # tokens and wall seconds per inner step (the training loop's period)
        self._last_step_end: float | None = None
        self.last_loss = float("nan")
        self.last_group_size = 0
        self.last_eval: float | None = None
        self.checkpoint_path = Path(config.run.work_dir) / "checkpoint.pt"
        self.ledger_path = Path(config.run.work_dir) / LEDGER_FILE
        self.ledger = GoodputLedger.load_or_create(self.ledger_path)
        self.wire = WireCounter()

    @property
    def outer_round(self) -> int:
        """The outer round every fragment reached (the smallest fragment round)."""
        return min(rounds.outer_round for rounds in self.fragments)

    def fragment_rounds(self) -> list[int]:
        return [rounds.outer_round for rounds in self.fragments]

    def set_fragment_rounds(self, values: Sequence[int]) -> None:
        """Adopt per-fragment rounds; a list for another number of fragments sets every fragment to its minimum."""
        if len(values) != len(self.fragments):
            values = [min(values, default=0)] * len(self.fragments)
        for rounds, value in zip(self.fragments, values):
            rounds.outer_round = int(value)

    def _restart_schedules(self) -> None:
        for rounds in self.fragments:
            rounds.restart_schedule(len(self.fragments), self.config.outer.inner_steps)

    # ----------------------------------------------------------------------------------------------- join
    def join(self) -> events.JoinSource:
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

    def _adopt(self, state: SwarmState) -> None:
        """Train from the swarm's φ, momentum and fragment rounds; inner step and token counters stay per unit."""
        self.global_params, self.momentum = state.global_params, state.momentum
        self.set_fragment_rounds(state.fragment_rounds)
        self.trainer.load_parameters(self.global_params)
        self._publish_state()

    def _resume(self, checkpoint: dict) -> None:
        self.global_params, self.momentum = checkpoint["global_params"], checkpoint["momentum"]
        self.trainer.load_parameters(checkpoint["local_params"])
        self.trainer.load_state_dict(checkpoint["inner"])
        self.set_fragment_rounds(checkpoint.get("fragment_rounds", [int(checkpoint["outer_round"])]))
        self.inner_step, self.tokens = int(checkpoint["inner_step"]), int(checkpoint["tokens"])
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
                    self.metrics.write(events.InnerStep(step=self.inner_step, loss=stats.loss, seconds=stats.seconds))
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
        now = time.monotonic()
        period = stats.seconds if self._last_step_end is None else max(stats.seconds, now - self._last_step_end)
        self._last_step_end = now
        self.inner_step += 1
        self.tokens += stats.tokens
        for rounds in self.fragments:
            rounds.record_step(stats.tokens, stats.seconds)
        self.ledger.record_step(stats.seconds, stats.tokens)
        self.last_loss = stats.loss
        self.throughput.add(stats.tokens, period)
        return stats

    def poll_round(self) -> RoundOutcome | None:
        """Merge every fragment (and consensus) round that ended; never waits. Returns the last outcome merged."""
        last = None
        for rounds, averager in zip(self.fragments, self.averagers):
            outcome = averager.poll()
            if outcome is not None:
                self._end_round(rounds, outcome)
                last = outcome
        for number, averager in enumerate(self.consensus_averagers or []):
            outcome = averager.poll()
            if outcome is not None:
                self._end_consensus(number, outcome)
        return last

    def in_flight(self) -> set[int]:
        """Rounds in flight: fragment numbers p, and P + p for fragment p's consensus round."""
        busy = {rounds.fragment.number for rounds in self.fragments if rounds.sent is not None}
        return busy | {len(self.fragments) + number for number in self.consensus_sent}

    def maybe_begin_round(self) -> bool:
        """Begin the rounds that are due (see the module docstring) within the in-flight bound; True if any began."""
        outer = self.config.outer
        in_flight = self.in_flight()
        due = due_fragments([rounds.steps_since_round for rounds in self.fragments], in_flight,
                            outer.inner_steps, outer.max_in_flight)  # fmt: skip
        began = False
        for number in due:
            result = self._begin_round(self.fragments[number])
            if result == "reset":
                return True  # every fragment starts over
            began |= result == "began"
        ready = [number for number in self.consensus_due if number not in self.consensus_sent]
        if ready and len(in_flight) + len(due) < outer.max_in_flight:
            self.consensus_due.remove(ready[0])
            began |= self._begin_consensus(ready[0])
        return began

    def _grace_window_s(self) -> float:
        """How long a round recruits members: grace_fraction × H measured wall times per inner step, clamped.

        With a window of half a round period, two units meet whatever their phase; units that averaged
        together end the round together and stay in phase afterwards.
        """
        outer = self.config.outer
        if self.throughput.step_time_s is None:
            return outer.min_grace_s
        window = outer.grace_fraction * outer.inner_steps * self.throughput.step_time_s
        return min(outer.max_grace_s, max(outer.min_grace_s, window))

    def _begin_round(self, rounds: FragmentRounds) -> Literal["began", "deferred", "reset"]:
        """Send fragment ``rounds``' payload. "reset": θ was non-finite and every fragment starts over from φ.
        "deferred": its averager cannot take it yet (its tensors are held, see ``OuterAverager.begin_round``); the
        round is not begun and stays due."""
        local_at_send = copies(self.trainer.params, rounds.fragment)
        if not all_finite(local_at_send):
            # A diverged unit must not send NaN/inf: every group it joined would reject the average.
            logger.error("local parameters are non-finite at inner step %d: restarting from φ", self.inner_step)
            self.metrics.write(events.LocalReset(outer_round=self.outer_round, inner_step=self.inner_step))
            self.trainer.load_parameters(self.global_params)
            self.trainer.reset_optimizer()
            self._restart_schedules()
            return "reset"
        payload, momentum_proposal = rounds.payload(self.global_params, self.momentum, local_at_send, self.hyper)
        weight, window_s = max(1, rounds.tokens_since_round), self._grace_window_s()
        number = rounds.fragment.number
        begun = self.averagers[number].begin_round(
            payload,
            weight=weight,
            outer_round=rounds.outer_round,
            window_s=window_s,
            probe=consensus_probe(views(self.global_params, rounds.fragment), self.probe_indices[number]),
            tag=f"fragment {number}",
        )
        if not begun:
            return "deferred"
        self.metrics.write(
            events.OuterRoundBegin(
                fragment=number,
                outer_round=rounds.outer_round,
                inner_step=self.inner_step,
                window_s=window_s,
                scheduled_at=time.time() + window_s,
                weight=weight,
            )
        )
        rounds.mark_sent(payload, local_at_send, momentum_proposal, self.inner_step)
        return "began"

    def _end_round(self, rounds: FragmentRounds, outcome: RoundOutcome) -> None:
        sent, rounds.sent = rounds.sent, None
        assert sent is not None, "an outcome arrived without a round in flight"
        rounds.steps_since_round = 0
        averaged = outcome.averaged
        status: Literal["failed", "rejected"] = "failed"
        if averaged is not None and not all_finite(averaged):
            logger.error("rejected a non-finite average in outer round %d", rounds.outer_round)
            averaged, status = None, "rejected"
        number = rounds.fragment.number
        if averaged is None:
            rounds.carry(sent)
            self.metrics.write(events.OuterRoundFailed(status=status, fragment=number, outer_round=rounds.outer_round,
                                                       error=outcome.error))  # fmt: skip
            return
        unit_round_before = self.outer_round
        new_params, new_momentum = rounds.merged(averaged, self.global_params, self.momentum, sent, self.hyper)
        assign(self.global_params, rounds.fragment, new_params)
        assign(self.momentum, rounds.fragment, new_momentum)
        merged_local = merge_local_progress(
            new_params, copies(self.trainer.params, rounds.fragment), sent.local_at_send
        )
        assign(self.trainer.params, rounds.fragment, merged_local)
        rounds.outer_round = max(rounds.outer_round, outcome.max_member_round) + 1
        self.last_group_size = outcome.group_size
        self.ledger.record_merge(sent.compute_s * rounds.share, round(sent.tokens * rounds.share))
        advanced = self.outer_round > unit_round_before  # once per period with P fragments: the I/O-bound bookkeeping
        if advanced:
            self.ledger.save(self.ledger_path)
            self._publish_state()
            self.records.refresh_model_fingerprint(self.loaded.fingerprint)
        outer = self.config.outer
        periodic = outer.consensus_every_rounds and rounds.outer_round % outer.consensus_every_rounds == 0
        drifted = outcome.member_drift > outer.consensus_tolerance  # every member saw the same probes: all decide alike
        if self.consensus_averagers is not None and (periodic or drifted) and number not in self.consensus_due:
            self.consensus_due.append(number)
        self.metrics.write(
            events.OuterRound(
                status="merged" if outcome.group_size > 1 else "alone",
                fragment=number,
                outer_round=rounds.outer_round,
                unit_outer_round=self.outer_round,
                group_size=outcome.group_size,
                overlap_steps=self.inner_step - sent.inner_step,
                seconds=outcome.finished_at - outcome.started_at,
                weight=sent.tokens,
                member_drift=outcome.member_drift,
                useful_compute_s=self.ledger.useful_compute_s,
                useful_tokens=self.ledger.useful_tokens,
                **(self._wire_fields() if advanced else {}),
            )
        )
        if advanced:
            if self.outer_round % self.config.run.eval_every_rounds == 0:
                self._evaluate("outer_round")
            if self.outer_round % self.config.run.checkpoint_every_rounds == 0:
                self.save()

    def _begin_consensus(self, number: int) -> bool:
        """Average fragment ``number``'s φ_p in fp32 with whichever units are in the same phase; False when its
        averager cannot take the round yet (it stays first in line)."""
        assert self.consensus_averagers is not None
        fragment = self.fragments[number].fragment
        payload = consensus_payload(self.global_params, fragment)
        begun = self.consensus_averagers[number].begin_round(
            [payload],
            weight=1.0,
            outer_round=self.fragments[number].outer_round,
            window_s=self._grace_window_s(),
            probe=consensus_probe(views(self.global_params, fragment), self.probe_indices[number]),
            tag=f"fragment {number}",
        )
        if not begun:
            self.consensus_due.insert(0, number)
            return False
        self.consensus_sent[number] = payload
        self.metrics.write(events.ConsensusBegin(fragment=number, inner_step=self.inner_step))
        return True

    def _end_consensus(self, number: int, outcome: RoundOutcome) -> None:
        """Add (group mean − sent) to φ_p and θ_p; a failed or lone round, or one mixing fragments, changes nothing."""
        sent = self.consensus_sent.pop(number)
        usable = outcome.averaged is not None and outcome.tags_agree and all_finite(outcome.averaged)
        if usable and outcome.group_size > 1:
            fragment = self.fragments[number].fragment
            fix = consensus_correction(outcome.averaged[0], sent, fragment, self.global_params)
            for tensors in (self.global_params, self.trainer.params):
                assign(tensors, fragment, [now + delta for now, delta in zip(copies(tensors, fragment), fix)])
        self.metrics.write(
            events.ConsensusRound(
                fragment=number,
                group_size=outcome.group_size,
                applied=usable and outcome.group_size > 1,
                member_drift=outcome.member_drift,
                seconds=outcome.finished_at - outcome.started_at,
                error=outcome.error,
            )
        )

    # ------------------------------------------------------------------------------------ reporting, io
    def _evaluate(self, reason: events.EvalReason) -> None:
        with self.trainer.parameters_swapped(self.global_params):
            self.last_eval = self.trainer.evaluate(self.data.eval_batches)
        self.metrics.write(events.Eval(reason=reason, outer_round=self.outer_round, eval_loss=self.last_eval))

    def _publish_state(self) -> None:
        self.state_server.publish(
            SwarmState(self.global_params, self.momentum, self.fragment_rounds(), self.inner_step, self.tokens)
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
                "fragment_rounds": self.fragment_rounds(),
                "inner_step": self.inner_step,
                "tokens": self.tokens,
            },
        )

    def finish(self) -> None:
        """Leave cleanly: hand the last steps to the swarm in a final round (bounded: the grace window plus the
        all-reduce timeout; with quorum 1 it completes alone if nobody joins), then final eval, checkpoint and
        export of the consensus parameters. A round that does not end in time is dropped; its progress stays in
        the checkpoint's local parameters."""
        for rounds in self.fragments:
            if rounds.sent is None and rounds.steps_since_round > 0 and self._begin_round(rounds) == "reset":
                break  # nothing finite to hand over
        for number in list(self.consensus_sent):  # a consensus round has no progress of its own to keep
            assert self.consensus_averagers is not None
            self.consensus_averagers[number].finish_round(0.0)
            del self.consensus_sent[number]
        in_flight = [(rounds, averager) for rounds, averager in zip(self.fragments, self.averagers) if rounds.sent]
        if in_flight:
            timeout_s = self._grace_window_s() + 1.0 + self.config.outer.allreduce_timeout_s
            logger.info("finishing the last outer rounds (at most %.0f s; Ctrl+C again to abort)", timeout_s)
            deadline = time.monotonic() + timeout_s
            for rounds, averager in in_flight:
                outcome = averager.finish_round(max(0.0, deadline - time.monotonic()))
                if outcome is not None:
                    self._end_round(rounds, outcome)
                elif rounds.sent is not None:
                    rounds.carry(rounds.sent)
                    rounds.sent = None
        self._evaluate("final")
        self.save()
        if self.config.run.save_dir is not None:
            with self.trainer.parameters_swapped(self.global_params):
                export_pretrained(self.loaded.model, self.loaded.tokenizer, Path(self.config.run.save_dir))
            logger.info("exported the consensus model to %s", self.config.run.save_dir)
        now = time.time()
        self.metrics.write(
            events.Stop(
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
        )

    def _wire_fields(self) -> dict[str, int | None]:
        """Cumulative bytes this unit's p2p daemon sent and received over TCP (None: not measurable here)."""
        totals = self.wire.sample()
        return {
            "wire_bytes_sent": totals.sent if totals else None,
            "wire_bytes_received": totals.received if totals else None,
        }
