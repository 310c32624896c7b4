"""The inner optimizer of a learning unit: AdamW (or plain SGD) with warm-up and cosine decay, clipping,
accumulation, and mixed precision (autocast over the model's own, normally float32, weights; a loss scaler for
float16)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from p2p_diloco.config import InnerSection
from p2p_diloco.diloco import all_finite

# A held-out batch: the input ids (the labels too), or a mapping of the model's inputs (labels defaulting to input_ids).
EvalBatch: TypeAlias = torch.Tensor | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int
    seconds: float  # the whole step, gradient synchronization included
    sync_seconds: float = 0.0  # time spent in the ``synchronize_gradients`` hook
    lr: float | None = None  # the learning rate the step was taken with (None: not known, the caller's optimizer)


def _gradient(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient, zeros where backward produced none (it is then stored as the gradient)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def lr_factor(step: int, warmup_steps: int, decay_steps: int, floor: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine decay to ``floor`` at ``decay_steps``, then held at ``floor``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class InnerTrainer:
    """Trains a causal LM in place; the parameters it trains are ``self.params`` (θ). With ``autocast``, forward and
    backward (and evals) run in that dtype while the optimizer updates the weights in theirs; float16 scales the loss
    (torch's GradScaler: a step whose gradients overflow is skipped and the scale lowered).

    ``replica``, the model wrapped in DistributedDataParallel, makes the training forward and backward go through it:
    the gradients are then averaged over the unit's ranks in backward (once per step, at the last micro-batch), and
    a step is skipped when the *averaged* gradients are non-finite, so that every rank decides alike. Evals use the
    model itself (no collective). ``sharded``: the model is sharded over the ranks (sharding.py), its backward
    reduce-scatters the gradients, and the step is skipped when the clipping norm (a collective: the same on every
    rank) is non-finite; a loss scaler is not supported then, and an eval is a collective (ranks.py)."""

    def __init__(
        self,
        model: torch.nn.Module,
        section: InnerSection,
        device: torch.device,
        autocast: torch.dtype | None = None,
        replica: torch.nn.parallel.DistributedDataParallel | None = None,
        sharded: bool = False,
    ):
        self.model, self.section, self.device, self.autocast, self.replica = model, section, device, autocast, replica
        self.sharded = sharded
        assert not (sharded and autocast is torch.float16), "a sharded model has no loss scaler (config.py refuses it)"
        self.scaler = torch.amp.GradScaler(device.type, enabled=autocast is torch.float16)
        self.params = [param for param in model.parameters() if param.requires_grad]
        self.optimizer: torch.optim.Optimizer
        if section.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=section.inner_lr, weight_decay=section.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=section.inner_lr, weight_decay=section.weight_decay, betas=(0.9, 0.95)
            )
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, section.warmup_steps, section.decay_steps)
        )

    @classmethod
    def around(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> InnerTrainer:
        """A trainer of a caller's own ``model`` and ``optimizer`` (and learning-rate ``scheduler``), which the caller
        steps itself: the unit only reads and writes θ, evaluates, checkpoints the optimizer's state and resets its
        moments. Raises ValueError unless the optimizer holds exactly the model's trainable parameters."""
        device = next(model.parameters()).device
        trainer = cls(model, InnerSection(optimizer="sgd"), device)  # the optimizer built here is replaced
        held = {id(param) for group in optimizer.param_groups for param in group["params"]}
        if held != {id(param) for param in trainer.params}:
            raise ValueError("the optimizer must hold exactly the model's parameters that require grad")
        trainer.optimizer, trainer.scheduler = optimizer, scheduler
        return trainer

    def train_step(
        self,
        batches: Iterator[torch.Tensor],
        synchronize_gradients: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> StepStats:
        """One optimizer step over ``grad_accum`` micro-batches of token ids (labels = inputs).

        A non-finite loss skips the update (gradients dropped) and is reported as the loss.

        ``synchronize_gradients``, if given, is called once per step after backward and before clipping with the
        gradient of every parameter of ``self.params`` (zeros where backward produced none), which it may overwrite
        in place, e.g. with their mean over data-parallel ranks; its time is reported as ``sync_seconds``. It is
        called whatever the loss (a collective in it then runs on every rank at every step), and the update is
        skipped when the *synchronized* gradients are non-finite, so ranks holding the same gradients decide alike.
        Exceptions it raises propagate (the step is not taken).
        """
        started = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])  # before the scheduler moves it
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, tokens = 0.0, 0
        forward = self.replica or self.model
        for micro_batch in range(self.section.grad_accum):
            input_ids = next(batches).to(self.device)
            last = micro_batch == self.section.grad_accum - 1
            with self._gradient_sync(last):
                with self._autocast():
                    loss = forward(input_ids=input_ids, labels=input_ids).loss
                self.scaler.scale(loss / self.section.grad_accum).backward()
            total_loss += float(loss.detach()) / self.section.grad_accum
            tokens += input_ids.numel()
        sync_seconds = 0.0
        if self.sharded:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.section.grad_clip)
            if math.isfinite(float(norm)):
                self.optimizer.step()
            update = False  # taken or skipped alike on every rank
        elif self.replica is not None:  # the gradients were averaged over the ranks
            update = self.scaler.is_enabled() or all_finite([p.grad for p in self.params if p.grad is not None])
        elif synchronize_gradients is None:
            update = math.isfinite(total_loss)
        else:
            gradients = [_gradient(param) for param in self.params]
            sync_started = time.perf_counter()
            synchronize_gradients(gradients)  # still scaled: the scaler then judges the synchronized gradients
            sync_seconds = time.perf_counter() - sync_started
            update = self.scaler.is_enabled() or all_finite(gradients)
        if update:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.section.grad_clip)
            self.scaler.step(self.optimizer)  # skipped when the (unscaled) gradients overflowed
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return StepStats(total_loss, tokens, time.perf_counter() - started, sync_seconds, lr)

    def evaluate(self, batches: Sequence[EvalBatch]) -> float:
        """Mean loss over held-out batches with the current parameters."""
        losses = self.batch_losses(batches)
        return sum(losses) / len(losses)

    @torch.no_grad()
    def batch_losses(self, batches: Sequence[EvalBatch]) -> list[float]:
        """The loss of each of ``batches`` with the current parameters (the model in eval mode meanwhile)."""
        self.model.eval()
        with self._autocast():
            losses = [float(self.model(**self._inputs(batch)).loss) for batch in batches]
        self.model.train()
        return losses

    def _inputs(self, batch: EvalBatch) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for a held-out ``batch``, on the unit's device."""
        inputs = {"input_ids": batch} if isinstance(batch, torch.Tensor) else dict(batch)
        inputs.setdefault("labels", inputs["input_ids"])
        return {name: value.to(self.device) for name, value in inputs.items() if isinstance(value, torch.Tensor)}

    def _gradient_sync(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """The replica averages gradients in the backward of a step's last micro-batch only."""
        return contextlib.nullcontext() if self.replica is None or last_micro_batch else self.replica.no_sync()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    @contextlib.contextmanager
    def parameters_swapped(self, replacement: Sequence[torch.Tensor]) -> Iterator[None]:
        """Temporarily make ``replacement`` (e.g. the global parameters) the model's parameters; θ is back after. For
        reading only (evals, exports): a replacement of its parameter's dtype and device is not copied but used as it
        is, so a write to the parameters meanwhile would write it (a copy of the model less at every eval and
        export); others are converted. Raises ValueError when the counts differ."""
        saved = [param.data for param in self.params]
        for param, value in zip(self.params, replacement, strict=True):
            param.data = value.detach().to(device=param.device, dtype=param.dtype).view_as(param)
        try:
            yield
        finally:
            for param, data in zip(self.params, saved, strict=True):
                param.data = data

    def load_parameters(self, values: Sequence[torch.Tensor]) -> None:
        copy_into(self.params, values)

    def local_parameters(self) -> list[torch.Tensor]:
        """A CPU fp32 copy of θ."""
        return host_copies(self.params)

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (e.g. after they became non-finite); the schedule position is kept."""
        self.optimizer.state.clear()

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict``; one saved without a loss scaler (or before there was one) keeps the fresh
        scaler, one without the optimizer's state (a sharded unit's start, ranks.py) keeps the optimizer's."""
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


@torch.no_grad()
def copy_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Write ``values`` into ``targets`` in place, one for one, each converted to its target's device and dtype.
    Raises ValueError when the counts differ."""
    for target, value in zip(targets, values, strict=True):
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU fp32 copies of ``tensors``."""
    return [tensor.detach().to(device="cpu", dtype=torch.float32, copy=True) for tensor in tensors]


def on_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as CPU fp32 tensors to be read at once (e.g. written to a file): those that are already CPU fp32
    themselves (detached, not copied), the others converted."""
    return [tensor.detach().to(device="cpu", dtype=torch.float32) for tensor in tensors]
