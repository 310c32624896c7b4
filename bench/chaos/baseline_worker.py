"""One rank of a conventional synchronous job (torch.distributed, gloo, CPU, one thread): the baselines of the chaos
comparison, started by :class:`bench.chaos.gang.GangTarget` as ``python -m bench.chaos.baseline_worker``.

Modes:

* ``sync-dp``: every step the gradients are averaged over the ranks (one all-reduce of one flat buffer) before
  clipping and the AdamW step, so every rank holds the same parameters and AdamW state;
* ``sync-diloco``: H local AdamW steps, then a blocking all-reduce of the pseudo-gradient (equal-weight mean over
  the ranks) and the Nesterov outer step on φ; θ ← φ. The all-reduce waits for every rank.

The gloo group is built directly on the incarnation's prefix of the rendezvous store (what ``init_process_group``
would do), with its device bound to ``--host``: ``init_process_group`` takes the address from the hostname, which is
not the unit's address inside a network namespace.

Stop: SIGTERM or SIGINT sets a flag carried by one extra element of the next all-reduce, so every rank stops after
the same step (sync-dp) or outer round (sync-diloco: up to H inner steps later); rank 0 then checkpoints and
evaluates, and every rank exits 0. A collective that fails (a peer died) or times out (a peer froze or is cut off
for ``--gloo-timeout-s``), or any other error, is logged as ``failed`` and the rank exits 1 at once.

Checkpoint (rank 0, atomic, ``work_dir/checkpoint.pt``): the parameters, AdamW and schedule state, the step and the
tokens in the model; sync-diloco adds the outer momentum and round. sync-diloco checkpoints at outer-round boundaries,
where θ = φ, with rank 0's AdamW moments only: on resume every rank starts from them (per-rank moments would need a
checkpoint consistent across ranks' files, and elastic restarts renumber the ranks). Data order: a fresh shuffle per
unit and incarnation (``data.shard_seed``).

Evaluation runs on every rank at the same steps (only rank 0 logs it), so no rank waits for another's eval: eval time
is neither compute nor sync time. Log (``work_dir/unit<i>/metrics.jsonl``, every event with its ``incarnation``):
``start`` (rank, world_size, resumed_step, tokens_in_model), ``step`` (step: the job's step count after it;
compute_s: step time minus sync time; sync_s: gradient all-reduce, or for sync-diloco the outer all-reduce on the
H-th step; tokens: this rank's; loss), ``checkpoint`` (step), ``eval`` (rank 0: step, tokens_in_model of all ranks,
eval_loss, final), ``stop`` (step, rank), ``failed`` (rank, error).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from bench.events import RankCheckpoint, RankEval, RankFailed, RankStart, RankStep, RankStop
from p2p_diloco.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from p2p_diloco.config import DataSection, InnerSection, ModelSection, OuterSection
from p2p_diloco.diloco import OuterHyperparams, outer_step, pseudo_gradient
from p2p_diloco.lifecycle import install_stop_signals
from p2p_diloco.unit.data import load_text_data, shard_seed
from p2p_diloco.unit.inner import InnerTrainer, StepStats
from p2p_diloco.unit.metrics import MetricsLog
from p2p_diloco.unit.model import load_model

MODES = ("sync-dp", "sync-diloco")
CHECKPOINT_FILE = "checkpoint.pt"
_OUTER = OuterSection()  # sync-diloco's outer step: the defaults of ``p2p-diloco join``
OUTER = OuterHyperparams(_OUTER.outer_lr, _OUTER.outer_momentum, _OUTER.nesterov)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one rank of a synchronous gloo baseline job")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--unit", type=int, required=True, help="unit slot: the log goes to WORK_DIR/unit<UNIT>/")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--incarnation", type=int, required=True, help="restart number of the job: its store prefix")
    parser.add_argument("--store-host", required=True, help="address of the rendezvous store")
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="this rank's address for gloo connections")
    parser.add_argument("--work-dir", type=Path, required=True, help="the job folder: shared checkpoint, unit logs")
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--dataset", required=True)
    # the training setup (bench/training.py) and the job's cadences: the gang passes them all
    for flag, kind in [("--seq-len", int), ("--batch-size", int), ("--eval-batches", int), ("--inner-lr", float),
                       ("--inner-steps", int), ("--checkpoint-every-steps", int), ("--eval-every-steps", int),
                       ("--gloo-timeout-s", float), ("--seed", int)]:  # fmt: skip
        parser.add_argument(flag, type=kind, required=True)
    parser.add_argument("--rendezvous-timeout-s", type=float, default=120.0, help="wait this long for every rank")
    return parser.parse_args(argv)


class GlooGroup:
    """The gloo process group of one incarnation, with the one collective the baselines need.

    Construction waits up to ``--rendezvous-timeout-s`` for every rank to reach the store and connect (ranks load at
    different speeds); raises RuntimeError (or a subclass) when they do not. Collectives time out after
    ``--gloo-timeout-s``."""

    def __init__(self, args: argparse.Namespace):
        rendezvous_timeout = timedelta(seconds=args.rendezvous_timeout_s)
        store = TCPStore(args.store_host, args.store_port, is_master=False, timeout=rendezvous_timeout)
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's private options, no stub
        options._devices = [ProcessGroupGloo.create_device(hostname=args.host)]
        options._timeout = rendezvous_timeout  # bounds the connection of every pair of ranks
        self.group = ProcessGroupGloo(
            PrefixStore(f"incarnation{args.incarnation}", store), args.rank, args.world_size, options
        )
        self.group.set_timeout(timedelta(seconds=args.gloo_timeout_s))  # bounds every collective from now on
        self.world_size = args.world_size
        self.stop_agreed = False

    def average(self, tensors: list[torch.Tensor], stop: bool) -> None:
        """Replace ``tensors`` in place by their mean over the ranks; ``stop_agreed`` becomes True when any rank
        passed ``stop``. Raises RuntimeError when a peer is gone or the collective times out."""
        flat = torch.cat([tensor.detach().reshape(-1).float() for tensor in tensors] + [torch.tensor([float(stop)])])
        self.group.allreduce([flat]).wait()  # type: ignore[attr-defined]  # bound at runtime, no stub
        flat /= self.world_size
        self.stop_agreed = bool(flat[-1] > 0)
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


class BaselineRank:
    """Model, data, optimizer state and counters of one rank; resumes the job's checkpoint when there is one."""

    def __init__(self, args: argparse.Namespace, metrics: MetricsLog):
        self.args, self.metrics = args, metrics
        loaded = load_model(ModelSection(model_config_path=args.model_config, device="cpu", seed=args.seed))
        data_section = DataSection(
            dataset=args.dataset, seq_len=args.seq_len, batch_size=args.batch_size, eval_batches=args.eval_batches
        )
        self.data = load_text_data(
            data_section, loaded.tokenizer, shard_seed(args.seed, f"unit{args.unit}-incarnation{args.incarnation}")
        )
        self.trainer = InnerTrainer(loaded.model, InnerSection(inner_lr=args.inner_lr), loaded.device)
        self.global_params = self.trainer.local_parameters()
        self.momentum = [torch.zeros_like(tensor) for tensor in self.global_params]
        self.step = self.tokens_in_model = self.outer_round = 0
        self.checkpoint_path = args.work_dir / CHECKPOINT_FILE
        checkpoint = load_checkpoint(self.checkpoint_path)
        if checkpoint is not None:
            self._resume(checkpoint)
        self.saved_step, self.evaluated_step = self.step, -1
        self.next_eval = 0 if self.step == 0 else (self.step // args.eval_every_steps + 1) * args.eval_every_steps
        self.group = GlooGroup(args)  # after the slow loading, so ranks wait for each other the least
        self.metrics.write(
            RankStart(
                incarnation=args.incarnation,
                rank=args.rank,
                world_size=args.world_size,
                resumed_step=self.step,
                tokens_in_model=self.tokens_in_model,
            )
        )

    def _resume(self, checkpoint: dict) -> None:
        if checkpoint.get("mode") != self.args.mode:
            raise CheckpointError(f"{self.checkpoint_path} was written by mode {checkpoint.get('mode')!r}")
        self.trainer.load_parameters(checkpoint["params"])
        self.trainer.load_state_dict(checkpoint["inner"])
        self.global_params = [tensor.clone() for tensor in checkpoint["params"]]
        self.momentum = checkpoint["momentum"]
        self.step, self.tokens_in_model, self.outer_round = (
            int(checkpoint[key]) for key in ("step", "tokens_in_model", "outer_round")
        )

    # ------------------------------------------------------------------------------------------------ loops
    def run_sync_dp(self, stop: threading.Event) -> None:
        """Data-parallel steps until every rank agreed to stop."""
        batches = self.data.train_batches()
        self.maybe_evaluate()

        def synchronize(gradients: list[torch.Tensor]) -> None:
            self.group.average(gradients, stop.is_set())

        while not self.group.stop_agreed:
            stats = self.trainer.train_step(batches, synchronize)
            self.tokens_in_model += stats.tokens * self.group.world_size
            self._log_step(stats, stats.sync_seconds)
            if self.step % self.args.checkpoint_every_steps == 0:
                self.save()
            self.maybe_evaluate()

    def run_sync_diloco(self, stop: threading.Event) -> None:
        """Rounds of H local steps and one outer step until every rank agreed to stop."""
        batches = self.data.train_batches()
        self.maybe_evaluate()
        while not self.group.stop_agreed:
            round_tokens = 0
            for index in range(1, self.args.inner_steps + 1):
                stats = self.trainer.train_step(batches)
                round_tokens += stats.tokens
                sync_seconds = self._outer_step(stop) if index == self.args.inner_steps else 0.0
                self._log_step(stats, sync_seconds)
            self.tokens_in_model += round_tokens * self.group.world_size
            self.outer_round += 1
            self.save()
            self.maybe_evaluate()

    def _outer_step(self, stop: threading.Event) -> float:
        """Average the pseudo-gradients (blocking), take the outer step, θ ← φ; returns the all-reduce seconds."""
        delta = pseudo_gradient(self.global_params, self.trainer.local_parameters())
        started = time.perf_counter()
        self.group.average(delta, stop.is_set())
        seconds = time.perf_counter() - started
        self.global_params, self.momentum = outer_step(self.global_params, self.momentum, delta, OUTER)
        self.trainer.load_parameters(self.global_params)
        return seconds

    # --------------------------------------------------------------------------------------- reporting, io
    def _log_step(self, stats: StepStats, sync_seconds: float) -> None:
        self.step += 1
        self.metrics.write(
            RankStep(
                step=self.step,
                compute_s=stats.seconds - stats.sync_seconds,
                sync_s=sync_seconds,
                tokens=stats.tokens,
                loss=stats.loss,
                incarnation=self.args.incarnation,
            )
        )

    def maybe_evaluate(self, final: bool = False) -> None:
        """Evaluate the model (every rank, at the same steps) when an eval step was reached, or for the ``final``
        eval, unless it was evaluated at this step already; rank 0 logs it."""
        if (not final and self.step < self.next_eval) or self.step == self.evaluated_step:
            return
        self.evaluated_step = self.step
        self.next_eval = (self.step // self.args.eval_every_steps + 1) * self.args.eval_every_steps
        eval_loss = self.trainer.evaluate(self.data.eval_batches)
        if self.args.rank == 0:
            self.metrics.write(
                RankEval(
                    step=self.step,
                    tokens_in_model=self.tokens_in_model,
                    eval_loss=eval_loss,
                    final=final,
                    incarnation=self.args.incarnation,
                )
            )

    def save(self) -> None:
        """Rank 0 writes the job's checkpoint (atomically); other ranks do nothing."""
        if self.args.rank != 0:
            return
        save_checkpoint(
            self.checkpoint_path,
            {
                "mode": self.args.mode,
                "params": self.trainer.local_parameters(),
                "inner": self.trainer.state_dict(),
                "momentum": self.momentum,
                "step": self.step,
                "tokens_in_model": self.tokens_in_model,
                "outer_round": self.outer_round,
            },
        )
        self.saved_step = self.step
        self.metrics.write(RankCheckpoint(step=self.step, incarnation=self.args.incarnation))

    def finish(self) -> None:
        """After an agreed stop: rank 0 checkpoints (if not done at this step) and evaluates; every rank logs."""
        if self.args.rank == 0:
            if self.saved_step != self.step:
                self.save()
            self.maybe_evaluate(final=True)
        self.metrics.write(RankStop(step=self.step, incarnation=self.args.incarnation, rank=self.args.rank))


def main(argv: list[str] | None = None) -> int:
    """Run one rank; returns 0 after an agreed stop. On any failure logs ``failed`` and leaves with os._exit(1):
    gloo aborts the interpreter's normal exit after a failed collective."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    stop = install_stop_signals()
    metrics = MetricsLog(args.work_dir / f"unit{args.unit}" / "metrics.jsonl")
    try:
        rank = BaselineRank(args, metrics)
        (rank.run_sync_dp if args.mode == "sync-dp" else rank.run_sync_diloco)(stop)
        rank.finish()
    except Exception as error:  # any failure ends this rank: the gang restarts the job
        metrics.write(
            RankFailed(incarnation=args.incarnation, rank=args.rank, error=f"{type(error).__name__}: {error}"[:500])
        )
        print(f"rank {args.rank} failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        metrics.close()
        sys.stdout.flush()
        os._exit(1)
    metrics.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
