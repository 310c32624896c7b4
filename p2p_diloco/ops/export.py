"""``p2p-diloco export``: turn a unit's checkpoint into a Hugging Face model folder, offline, whatever way the unit
ended (SIGKILL and OOM included: the checkpoint is written atomically).

The model is rebuilt from the resolved configuration the unit saved in its work dir (``run.json``, tracking.py), or,
for a unit of the library API or the Trainer callback, from the ``model`` folder it wrote (architecture.py); its
fingerprint is checked against the checkpoint's, and the checkpoint's consensus parameters φ written into it; the folder
is written by ``save_pretrained`` atomically (model.py ``export_pretrained``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from p2p_diloco.checkpoint import CheckpointError, load_checkpoint
from p2p_diloco.config import PeerConfig
from p2p_diloco.errors import UserError
from p2p_diloco.unit.architecture import ARCHITECTURE_DIR, rebuild_architecture
from p2p_diloco.unit.inner import copy_into
from p2p_diloco.unit.model import export_pretrained, load_model, model_fingerprint
from p2p_diloco.unit.tracking import RUN_FILE


def run_export(work_dir: Path, out: Path, adapter_only: bool = False) -> int:
    """Export the consensus model of the checkpoint in ``work_dir`` to ``out``; returns 0. Raises UserError (one line)
    when the work dir has no run description or checkpoint, either is unreadable, or they do not fit together."""
    model, tokenizer, fingerprint = _unit_model(work_dir)
    checkpoint = load_checkpoint(work_dir / "checkpoint.pt")
    if checkpoint is None:
        raise UserError(f"{work_dir} holds no checkpoint.pt: the unit wrote none yet (see --checkpoint-every-rounds)")
    if checkpoint.get("model_fingerprint") != fingerprint:
        raise CheckpointError(
            f"the checkpoint in {work_dir} is of model {checkpoint.get('model_fingerprint')}, but the work dir "
            f"describes {fingerprint}"
        )
    trained = [param for param in model.parameters() if param.requires_grad]
    phi = checkpoint.get("global_params")
    if not isinstance(phi, list) or [tuple(t.shape) for t in phi] != [tuple(p.shape) for p in trained]:
        raise CheckpointError(f"the checkpoint in {work_dir} does not hold the model's parameters")
    with torch.no_grad():
        copy_into(trained, phi)
    export_pretrained(model, tokenizer, out, adapter_only=adapter_only)
    print(f"exported outer round {checkpoint.get('outer_round')} of {work_dir} to {out}")
    return 0


def _unit_model(
    work_dir: Path,
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase, str]:
    """The model of the unit that trained in ``work_dir`` (initial weights; on the CPU), its tokenizer and
    fingerprint: a unit of ``p2p-diloco join`` from its resolved configuration in ``run.json``, a unit of the library
    API or the Trainer callback from its ``model`` folder (architecture.py). Raises UserError."""
    path = work_dir / RUN_FILE
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found: export needs the work dir of a unit that joined a swarm") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{path} is unreadable: {type(error).__name__}") from None
    try:
        config = PeerConfig.model_validate(run["config"])
    except (ValueError, KeyError, TypeError) as error:
        if (work_dir / ARCHITECTURE_DIR).is_dir():
            model, tokenizer = rebuild_architecture(work_dir)
            return model, tokenizer, model_fingerprint(model, len(tokenizer))
        raise UserError(f"{path} does not describe a unit of `p2p-diloco join` ({type(error).__name__}), and "
                        f"{work_dir} has no {ARCHITECTURE_DIR}/ folder of a library unit") from None  # fmt: skip
    loaded = load_model(config.model.model_copy(update={"device": "cpu"}))
    return loaded.model, loaded.tokenizer, loaded.fingerprint
