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
rounds, final eval, checkpoint and ``save_pretrained`` export. After a clean exit the model holds the consensus
parameters φ (those the export wrote); after an exit by an exception it holds the unit's own θ of its last step.
The work dir also gets what ``p2p-diloco export`` rebuilds the model from (``model/``: architecture.py). The
console gets the CLI's lines (join, rounds, evals, leave) through the ``p2p_diloco`` logger at ``log_level``
(metrics.py ``configure_library_logging``). One process per unit (several ranks: the CLI).

Settings are the ``[outer]``, ``[network]`` and ``[run]`` fields of ``p2p-diloco join`` by name (``inner_steps``,
``run_id``, ``work_dir``, ...). Every unit of a run must share the model (its fingerprint counts the tokenizer's
length, as the CLI's does) and the outer settings.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import transformers

from p2p_diloco.config import SwarmSections, swarm_sections
from p2p_diloco.lifecycle import ensure_fork_start_method, ensure_orphan_reaper
from p2p_diloco.peer import unit_in_swarm
from p2p_diloco.unit.architecture import save_architecture
from p2p_diloco.unit.inner import EvalBatch, InnerTrainer, StepStats, copy_into
from p2p_diloco.unit.metrics import configure_library_logging
from p2p_diloco.unit.model import LoadedModel, model_fingerprint
from p2p_diloco.unit.unit import LearningUnit


class DiLoCo:
    """One learning unit around a caller's model and inner optimizer (see the module docstring).

    ``eval_batches``: held-out batches, each the ``input_ids`` (the labels too) or a mapping of the model's inputs
    (``labels`` defaulting to ``input_ids``). ``log_level``: the console's level ("WARNING" silences the unit's lines,
    None leaves logging alone).

    Raises ConfigError for unknown or invalid settings, ValueError when ``optimizer`` does not hold exactly the
    model's trainable parameters or ``log_level`` is no level's name; entering raises what ``p2p-diloco join``
    reports as one-line errors (NetworkError, JoinError, ...), with every process it started stopped.
    """

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        optimizer: torch.optim.Optimizer,
        tokenizer: transformers.PreTrainedTokenizerBase,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        eval_batches: Sequence[EvalBatch] = (),
        config: SwarmSections | None = None,
        log_level: str | None = "INFO",
        **settings: Any,
    ):
        self.config = swarm_sections(config, **settings)
        configure_library_logging(log_level)
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
            save_architecture(self.loaded.model, self.loaded.tokenizer, Path(self.config.run.work_dir))
            unit.start_training()
            session.callback(unit.stop_training)
            self._session, self._unit = session.pop_all(), unit
        self._last_step = time.monotonic()
        return self

    def step(self, tokens: int, loss: float = math.nan, lr: float | None = None) -> bool:
        """Call after each optimizer step of the caller's with the tokens it trained on (the unit's weight in the
        rounds), its loss and learning rate (for the logs; ``lr`` None: the optimizer's first group's now): rounds that
        ended merge into the model, rounds that are due begin. Returns whether a limit of the run was reached (the
        caller should then leave the ``with`` block)."""
        now = time.monotonic()
        if lr is None:
            lr = float(self.trainer.optimizer.param_groups[0]["lr"])
        stats = StepStats(loss=loss, tokens=tokens, seconds=now - self._last_step, lr=lr)
        self._last_step = now
        unit = self.unit
        unit.stepped(unit.record_step(stats))
        return unit.limit_reached()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Leave the swarm: the exit rounds, final eval, checkpoint and export (whether the loop ended or raised);
        after a clean exit the model holds φ."""
        session, unit, self._session, self._unit = self._session, self._unit, None, None
        if session is None or unit is None:
            return
        session.__exit__(kind, error, traceback)
        if kind is None:
            with torch.no_grad():
                copy_into(self.trainer.params, unit.state.global_params)


class DiLoCoCallback(transformers.TrainerCallback):
    """A Hugging Face ``Trainer`` joins a swarm as one learning unit: the :class:`DiLoCo` of the Trainer's own model,
    optimizer, scheduler and tokenizer (its ``processing_class``), entered when training begins (they exist by then)
    and left when it ends. A Trainer built first (as transformers' example scripts build theirs) takes it with
    :meth:`attach`; else pass it in ``callbacks``::

        trainer = Trainer(model, args, train_dataset=data, eval_dataset=held_out, processing_class=tokenizer)
        with DiLoCoCallback(run_id="my-run", initial_peers=[maddr], inner_steps=50).attach(trainer):
            trainer.train()

    ``TrainingArguments(include_num_input_tokens_seen=True)`` (``"all"`` or ``"non_padding"`` too; on a command line
    ``--include_num_input_tokens_seen true``) counts each optimizer step's tokens, its weight in the rounds. The unit
    evaluates φ on ``eval_batches``, else on the first ``eval_limit`` batches of the Trainer's eval dataset (its
    ``eval_dataset`` and collator) when the callback was attached; each step's loss (the mean of its forwards'
    losses) and learning rate go to ``metrics.jsonl``. A limit of the run (``max_steps``, ``max_time_s``,
    ``stop_at``) stops training. After training ends the Trainer's model holds the consensus parameters φ
    (``trainer.save_model()`` then saves them). The ``with`` block leaves the swarm even when training raises (the
    Trainer then never calls ``on_train_end``). One process per unit: a Trainer of several processes is refused.
    ``settings``, ``eval_batches`` and ``log_level``: those of :class:`DiLoCo`.

    Raises ValueError at ``on_train_begin`` when the Trainer counts no tokens, runs several processes or has no
    tokenizer; then what :class:`DiLoCo` raises on entering.
    """

    def __init__(self, *, eval_batches: Sequence[EvalBatch] = (), eval_limit: int = 8,
                 config: SwarmSections | None = None, log_level: str | None = "INFO", **settings: Any):  # fmt: skip
        self.config = swarm_sections(config, **settings)
        configure_library_logging(log_level)
        self.eval_batches, self.eval_limit = list(eval_batches), eval_limit
        self.log_level = log_level
        self.diloco: DiLoCo | None = None
        self._trainer: transformers.Trainer | None = None
        self._tokens_seen = 0
        self._losses: list[torch.Tensor] = []  # of the forwards of the step under way
        self._loss_is_share = False  # each a share of the step's loss (summed), else a mean (averaged)
        self._loss_hook: torch.utils.hooks.RemovableHandle | None = None

    def attach(self, trainer: transformers.Trainer) -> DiLoCoCallback:
        """Add this callback to ``trainer``, whose eval dataset the unit then evaluates on; returns the callback (a
        context manager)."""
        trainer.add_callback(self)
        self._trainer = trainer
        return self

    def on_train_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        if args.include_num_input_tokens_seen in (False, "no", "false", "False"):
            raise ValueError("DiLoCoCallback weighs steps by their tokens: set TrainingArguments("
                             "include_num_input_tokens_seen=True) (on a command line: "
                             "--include_num_input_tokens_seen true)")  # fmt: skip
        if args.world_size > 1:
            raise ValueError("DiLoCoCallback: a learning unit is one process here; run several ranks with the CLI")
        if kwargs.get("processing_class") is None:
            raise ValueError("DiLoCoCallback: give the Trainer its tokenizer (processing_class): the model's "
                             "fingerprint counts its tokens")  # fmt: skip
        model, optimizer, tokenizer = kwargs["model"], kwargs["optimizer"], kwargs["processing_class"]
        diloco = DiLoCo(model, optimizer, tokenizer, scheduler=kwargs.get("lr_scheduler"),
                        eval_batches=self.eval_batches or self._trainer_eval_batches(), config=self.config,
                        log_level=self.log_level)  # fmt: skip
        self._loss_hook = model.register_forward_hook(self._record_loss, with_kwargs=True)
        self.diloco = diloco.__enter__()
        self._tokens_seen = state.num_input_tokens_seen

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: Any) -> None:  # fmt: skip
        if self.diloco is None:
            return
        tokens, self._tokens_seen = state.num_input_tokens_seen - self._tokens_seen, state.num_input_tokens_seen
        losses, self._losses = self._losses, []
        if losses:
            total = torch.stack(losses).float()
            loss = float(total.sum() if self._loss_is_share else total.mean())
        else:
            loss = _last_logged_loss(state)
        if self.diloco.step(tokens=int(tokens), loss=loss):
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

    def _trainer_eval_batches(self) -> list[EvalBatch]:
        """The first ``eval_limit`` batches of the attached Trainer's eval dataset (none without one)."""
        if self._trainer is None or self._trainer.eval_dataset is None:
            return []
        loader = self._trainer.get_eval_dataloader()
        return [_tensors(batch) for batch in itertools.islice(loader, self.eval_limit)]

    def _record_loss(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """A training forward's loss (the model's output's ``loss``, when it computed one), kept for the step. A
        forward given ``num_items_in_batch`` (the Trainer's gradient accumulation) returns its share of the step's
        loss: the step's loss is then their sum, else their mean."""
        loss = getattr(output, "loss", None)
        if module.training and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())
            self._loss_is_share = kwargs.get("num_items_in_batch") is not None

    def _leave(self, kind: type[BaseException] | None, error: BaseException | None,
               traceback: TracebackType | None) -> None:  # fmt: skip
        diloco, hook, self.diloco, self._loss_hook = self.diloco, self._loss_hook, None, None
        if hook is not None:
            hook.remove()
        if diloco is not None:
            diloco.__exit__(kind, error, traceback)


def _tensors(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A collated batch's tensors (its other entries dropped)."""
    return {name: value for name, value in batch.items() if isinstance(value, torch.Tensor)}


def _last_logged_loss(state: transformers.TrainerState) -> float:
    """The training loss the Trainer logged last (it logs every ``logging_steps``), NaN before the first."""
    losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
    return float(losses[-1]) if losses else math.nan
