"""What every method of a comparison trains, identically: model, data, batch, optimizers, eval cadence. The
defaults are the tiny preset's (``p2p_diloco/presets.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.presets import CORPUS, TINY_MODEL
from p2p_diloco.settings import load_config

_TINY = load_config(preset="tiny")


@dataclass(frozen=True)
class TrainingSetup:
    model_config: Path = TINY_MODEL
    dataset: Path = CORPUS
    seq_len: int = _TINY.data.seq_len
    batch_size: int = _TINY.data.batch_size
    inner_lr: float = _TINY.inner.inner_lr
    inner_steps: int = _TINY.outer.inner_steps
    eval_every_steps: int = 100
    eval_batches: int = _TINY.data.eval_batches
    seed: int = _TINY.model.seed

    def join_flags(self) -> list[str]:
        """The ``p2p-diloco join`` flags of this setup (over the tiny preset, which the launcher starts from)."""
        return [
            "--model-config", str(self.model_config),
            "--dataset", str(self.dataset),
            "--seq-len", str(self.seq_len),
            "--batch-size", str(self.batch_size),
            "--inner-lr", str(self.inner_lr),
            "--inner-steps", str(self.inner_steps),
            "--eval-every-rounds", str(max(1, self.eval_every_steps // self.inner_steps)),
            "--eval-batches", str(self.eval_batches),
            "--seed", str(self.seed),
        ]  # fmt: skip
