"""The embedded default: the small GPT-2 and the Moby Dick corpus shipped in ``assets/``, and the one training preset
that trains them. The demo, the laboratory's swarms and baselines, the tests and ``p2p-diloco join --preset tiny``
all start from it. A preset is the lowest layer of a configuration: ``--config`` files and flags override it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets"
TINY_MODEL = ASSETS / "tiny-gpt2"  # a config and tokenizer only: weights are initialised from the seed
CORPUS = ASSETS / "corpus"

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "model": {"model_config": str(TINY_MODEL), "device": "cpu", "seed": 0},
        "data": {"dataset": str(CORPUS), "seq_len": 64, "batch_size": 8},
        "inner": {"inner_lr": 3e-3},
        "outer": {"inner_steps": 20},
        "network": {"run_id": "tiny-moby-dick"},
        "run": {"work_dir": "runs/tiny", "threads": 1},
    },
}
"""Sections and fields as in a ``--config`` TOML file."""
