"""The library API: an existing training loop joins a swarm as one learning unit. ::

    from p2p_diloco.api import DiLoCo

    with DiLoCo(model, optimizer, tokenizer, run_id="my-run", initial_peers=[maddr], inner_steps=50) as diloco:
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if diloco.step(tokens=batch["input_ids"].numel(), loss=loss.item()):
                break  # a limit of the run was reached (max_steps, max_time_s, stop_at)

The caller owns the model, the optimizer (and scheduler), the data and the loss; :class:`DiLoCo` does everything
``p2p-diloco join`` does around its inner steps, with the same code (peer.py ``unit_in_swarm``): joining (the swarm's
state downloaded into the model, or the checkpoint resumed), outer rounds every H of the caller's steps (θ, the
model's trainable parameters, is written in place when a round merges; the optimizer's moments are cleared when a
non-finite θ is reset), checkpoints of the model and optimizer, evals on ``eval_batches``, and on exit the exit
rounds, final eval, checkpoint and ``save_pretrained`` export. One process per unit (several ranks: the CLI).

Settings are the ``[outer]``, ``[network]`` and ``[run]`` fields of ``p2p-diloco join`` by name (``inner_steps``,
``run_id``, ``work_dir``, ...). Every unit of a run must share the model (its fingerprint counts the tokenizer's
length, as the CLI's does) and the outer settings.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import transformers

from p2p_diloco.config import SwarmSections, swarm_sections
from p2p_diloco.lifecycle import ensure_fork_start_method, ensure_orphan_reaper
from p2p_diloco.peer import unit_in_swarm
from p2p_diloco.unit.inner import InnerTrainer, StepStats
from p2p_diloco.unit.model import LoadedModel, model_fingerprint
from p2p_diloco.unit.unit import LearningUnit


class DiLoCo:
    """One learning unit around a caller's model and inner optimizer (see the module docstring).

    Raises ConfigError for unknown or invalid settings, ValueError when ``optimizer`` does not hold exactly the
    model's trainable parameters; entering raises what ``p2p-diloco join`` reports as one-line errors (NetworkError,
    JoinError, ...), with every process it started stopped.
    """

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        tokenizer: transformers.PreTrainedTokenizerBase,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        eval_batches: Sequence[torch.Tensor] = (),
        config: SwarmSections | None = None,
        **settings: Any,
    ):
        self.config = swarm_sections(config, **settings)
        self.trainer = InnerTrainer.around(model, optimizer, scheduler)
        device = next(model.parameters()).device
        fingerprint = model_fingerprint(model, len(tokenizer))
        self.loaded = LoadedModel(model=model, tokenizer=tokenizer, device=device, fingerprint=fingerprint)
        self.eval_batches = list(eval_batches)
        self._session: contextlib.ExitStack | None = None
        self._unit: LearningUnit | None = None
        self._last_step = time.monotonic()

    @property
    def unit(self) -> LearningUnit:
        """The learning unit, once entered."""
        if self._unit is None:
            raise RuntimeError("DiLoCo is a context manager: use it in a with statement")
        return self._unit

    def __enter__(self) -> DiLoCo:
        ensure_fork_start_method()
        ensure_orphan_reaper()
        with contextlib.ExitStack() as session:
            unit = session.enter_context(
                unit_in_swarm(
                    self.config,
                    self.loaded,
                    lambda _peer_id: None,
                    trainer=self.trainer,
                    eval_batches=self.eval_batches,
                )  # fmt: skip
            )
            unit.start_training()
            session.callback(unit.stop_training)
            self._session, self._unit = session.pop_all(), unit
        self._last_step = time.monotonic()
        return self

    def step(self, tokens: int, loss: float = math.nan) -> bool:
        """Call after each optimizer step of the caller's with the tokens it trained on (the unit's weight in the
        rounds) and its loss (for the logs): rounds that ended merge into the model, rounds that are due begin.
        Returns whether a limit of the run was reached (the caller should then leave the ``with`` block)."""
        now = time.monotonic()
        stats = StepStats(loss=loss, tokens=tokens, seconds=now - self._last_step)
        self._last_step = now
        unit = self.unit
        unit.stepped(unit.record_step(stats))
        return unit.limit_reached()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Leave the swarm: the exit rounds, final eval, checkpoint and export (whether the loop ended or raised)."""
        session, self._session, self._unit = self._session, None, None
        if session is not None:
            session.__exit__(kind, error, traceback)


class DiLoCoCallback(transformers.TrainerCallback):
    """A Hugging Face ``Trainer`` joins a swarm as one learning unit: the :class:`DiLoCo` of the Trainer's own model,
    optimizer, scheduler and tokenizer (its ``processing_class``), entered when training begins (they exist by then)
    and left when it ends. ::

        with DiLoCoCallback(run_id="my-run", initial_peers=[maddr], inner_steps=50) as diloco:
            args = TrainingArguments(..., include_num_input_tokens_seen="all")
            Trainer(model, args, train_dataset=data, processing_class=tokenizer, callbacks=[diloco]).train()

    Each optimizer step's weight is the tokens the Trainer counted in it (``include_num_input_tokens_seen``); a limit
    of the run (``max_steps``, ``max_time_s``, ``stop_at``) stops training. The ``with`` block leaves the swarm even
    when training raises (the Trainer then never calls ``on_train_end``). One process per unit: a Trainer of several
    processes is refused. ``settings`` and ``eval_batches``: those of :class:`DiLoCo`.

    Raises ValueError at ``on_train_begin`` when the Trainer counts no tokens, runs several processes or has no
    tokenizer; then what :class:`DiLoCo` raises on entering.
    """

    def __init__(self, *, eval_batches: Sequence[torch.Tensor] = (), config: SwarmSections | None = None,
                 **settings: Any):  # fmt: skip
        self.config = swarm_sections(config, **settings)
        self.eval_batches = list(eval_batches)
        self.diloco: DiLoCo | None = None
        self._tokens_seen = 0

    def on_train_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        if args.include_num_input_tokens_seen in (False, "no"):
            raise ValueError("DiLoCoCallback weighs steps by their tokens: set "
                             "TrainingArguments(include_num_input_tokens_seen='all')")  # fmt: skip
        if args.world_size > 1:
            raise ValueError("DiLoCoCallback: a learning unit is one process here; run several ranks with the CLI")
        if kwargs.get("processing_class") is None:
            raise ValueError("DiLoCoCallback: give the Trainer its tokenizer (processing_class): the model's "
                             "fingerprint counts its tokens")  # fmt: skip
        model, optimizer, tokenizer = kwargs["model"], kwargs["optimizer"], kwargs["processing_class"]
        scheduler = kwargs.get("lr_scheduler")
        diloco = DiLoCo(model, optimizer, tokenizer, scheduler=scheduler, eval_batches=self.eval_batches,
                        config=self.config)  # fmt: skip
        self.diloco = diloco.__enter__()
        self._tokens_seen = state.num_input_tokens_seen

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        if self.diloco is None:
            return
        tokens, self._tokens_seen = state.num_input_tokens_seen - self._tokens_seen, state.num_input_tokens_seen
        if self.diloco.step(tokens=int(tokens), loss=_last_logged_loss(state)):
            control.should_training_stop = True

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        self._leave(None, None, None)

    def __enter__(self) -> DiLoCoCallback:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._leave(kind, error, traceback)

    def _leave(self, kind: type[BaseException] | None, error: BaseException | None,
               traceback: TracebackType | None) -> None:  # fmt: skip
        diloco, self.diloco = self.diloco, None
        if diloco is not None:
            diloco.__exit__(kind, error, traceback)


def _last_logged_loss(state: transformers.TrainerState) -> float:
    """The training loss the Trainer logged last (it logs every ``logging_steps``), NaN before the first."""
    losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
    return float(losses[-1]) if losses else math.nan
