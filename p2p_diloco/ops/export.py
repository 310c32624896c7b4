"""``p2p-diloco export``: turn a unit's checkpoint into a Hugging Face model folder, offline, whatever way the unit
ended (SIGKILL and OOM included: the checkpoint is written atomically).

The model is rebuilt from the resolved configuration the unit saved in its work dir (``run.json``, tracking.py), its
fingerprint checked against the checkpoint's, and the checkpoint's consensus parameters φ written into it; the folder
is written by ``save_pretrained`` atomically (model.py ``export_pretrained``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from p2p_diloco.checkpoint import CheckpointError, load_checkpoint
from p2p_diloco.config import PeerConfig
from p2p_diloco.errors import UserError
from p2p_diloco.unit.inner import copy_into
from p2p_diloco.unit.model import export_pretrained, load_model
from p2p_diloco.unit.tracking import RUN_FILE


def run_export(work_dir: Path, out: Path, adapter_only: bool = False) -> int:
    """Export the consensus model of the checkpoint in ``work_dir`` to ``out``; returns 0. Raises UserError (one line)
    when the work dir has no run description or checkpoint, either is unreadable, or they do not fit together."""
    config = _run_config(work_dir)
    checkpoint = load_checkpoint(work_dir / "checkpoint.pt")
    if checkpoint is None:
        raise UserError(f"{work_dir} holds no checkpoint.pt: the unit wrote none yet (see --checkpoint-every-rounds)")
    loaded = load_model(config.model.model_copy(update={"device": "cpu"}))
    if checkpoint.get("model_fingerprint") != loaded.fingerprint:
        raise CheckpointError(
            f"the checkpoint in {work_dir} is of model {checkpoint.get('model_fingerprint')}, but {RUN_FILE} builds "
            f"{loaded.fingerprint}"
        )
    trained = [param for param in loaded.model.parameters() if param.requires_grad]
    phi = checkpoint.get("global_params")
    if not isinstance(phi, list) or [tuple(t.shape) for t in phi] != [tuple(p.shape) for p in trained]:
        raise CheckpointError(f"the checkpoint in {work_dir} does not hold the model's parameters")
    with torch.no_grad():
        copy_into(trained, phi)
    export_pretrained(loaded.model, loaded.tokenizer, out, adapter_only=adapter_only)
    print(f"exported outer round {checkpoint.get('outer_round')} of {work_dir} to {out}")
    return 0


def _run_config(work_dir: Path) -> PeerConfig:
    """The unit's resolved configuration from its ``run.json``. Raises UserError."""
    path = work_dir / RUN_FILE
    try:
        run = json.loads(path.read_text())
        return PeerConfig.model_validate(run["config"])
    except FileNotFoundError:
        raise UserError(f"{path} not found: export needs the work dir of a unit that joined a swarm") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{path} does not describe a unit of `p2p-diloco join`: {type(error).__name__}") from None
