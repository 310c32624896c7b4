"""What rebuilds a library unit's model without its caller's script (``p2p-diloco export`` of the work dir of a unit
of the library API or the Trainer callback, api.py), in ``<work dir>/model``: the model's class and config and its
tokenizer, no trained weights (the checkpoint holds φ), and the values of the parameters the unit does not train
(frozen: the checkpoint holds none of them; on disk as large as they are).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer

from p2p_diloco.errors import first_line
from p2p_diloco.unit.model import ModelLoadError, staged_dir

logger = logging.getLogger(__name__)

ARCHITECTURE_DIR = "model"
_FROZEN_FILE = "frozen.safetensors"


def save_architecture(
    model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase, work_dir: Path
) -> Path | None:
    """Write what rebuilds ``model`` into ``work_dir/model`` atomically and return that folder; None, with a
    warning, for a model that is not a transformers ``PreTrainedModel`` (a peft ``PeftModel``: its caller saves it)."""
    if not isinstance(model, transformers.PreTrainedModel):
        logger.warning("p2p-diloco export cannot rebuild a %s: save it from your script", type(model).__name__)
        return None
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    frozen = {name: param.detach().cpu().contiguous()
              for name, param in model.named_parameters() if not param.requires_grad}  # fmt: skip
    with staged_dir(Path(work_dir) / ARCHITECTURE_DIR) as staging:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if frozen:
            save_file(frozen, str(staging / _FROZEN_FILE))
    return Path(work_dir) / ARCHITECTURE_DIR


def rebuild_architecture(
    work_dir: Path,
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """The model :func:`save_architecture` described in ``work_dir`` (on the CPU, its trained parameters freshly
    initialised, the frozen ones loaded and frozen) and its tokenizer. Raises ModelLoadError."""
    directory = Path(work_dir) / ARCHITECTURE_DIR
    try:
        config = AutoConfig.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"{directory} does not describe a model: {first_line(error)}") from error
    name = (config.architectures or ["?"])[0]
    model_class = getattr(transformers, name, None)
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise ModelLoadError(f"{directory} describes a {name}, which transformers does not have")
    model = model_class._from_config(config, dtype=torch.float32)
    frozen_path = directory / _FROZEN_FILE
    frozen = load_file(str(frozen_path)) if frozen_path.exists() else {}
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name in frozen:
                param.copy_(frozen.pop(param_name))
                param.requires_grad_(False)
    if frozen:
        raise ModelLoadError(f"{frozen_path} holds parameters a {name} does not have: {', '.join(sorted(frozen))}")
    return model, tokenizer
