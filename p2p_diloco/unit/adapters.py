"""LoRA adapters through peft: a unit with ``--lora-r R`` trains, averages, checkpoints and serves only the adapters'
tensors (the base weights stay frozen, identical on every unit: the pretrained ones, or the seed's); its export is
the merged model, or the adapter alone with ``--export-adapter``.

The adapter configuration (rank, alpha, target modules) enters the model fingerprint, so units whose adapters differ
never meet in a round. peft is an optional dependency (``pip install 'p2p_diloco[lora]'``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers

from p2p_diloco.config import ModelSection
from p2p_diloco.errors import UserError, first_line


class AdapterError(UserError):
    """The adapters cannot be attached; the message is one line meant for the user."""


def adapter_signature(section: ModelSection) -> str:
    """What every unit's adapters must share (empty without LoRA): rank, alpha and target modules."""
    if section.lora_r is None:
        return ""
    return f"lora r={section.lora_r} alpha={section.lora_alpha} targets={sorted(section.lora_target_modules)}"


def with_adapters(model: transformers.PreTrainedModel, section: ModelSection) -> Any:
    """``model`` with LoRA adapters on ``section.lora_target_modules`` (``all-linear``: every linear layer but the
    output head), only the adapters left trainable, drawn from ``section.seed`` (the same on every unit of a run; the
    caller's random state is left as it was). Raises AdapterError without peft, or for target modules the model
    does not have."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise AdapterError("--lora-r needs peft: pip install 'p2p_diloco[lora]'") from None
    assert section.lora_r is not None, "only a section with --lora-r has adapters"
    targets: str | list[str] = section.lora_target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    config = LoraConfig(r=section.lora_r, lora_alpha=section.lora_alpha, lora_dropout=section.lora_dropout,
                        target_modules=targets, task_type="CAUSAL_LM")  # fmt: skip
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            torch.manual_seed(section.seed)  # every unit of the run draws the same adapters (peft draws LoRA's A)
            adapted = get_peft_model(model, config)
    except ValueError as error:
        leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        modules = sorted(leaf for leaf in leaves if leaf and not leaf.isdigit())  # not a ModuleList's indices
        raise AdapterError(f"--lora-target-modules: {first_line(error)} (its modules: {', '.join(modules)})") from None
    if section.gradient_checkpointing:
        adapted.enable_input_require_grads()  # frozen embeddings: recomputed blocks still need a grad to pass on
    return adapted


def is_adapted(model: Any) -> bool:
    return hasattr(model, "peft_config")


def saveable(model: Any, adapter_only: bool) -> Any:
    """What ``save_pretrained`` should be called on to export ``model``: itself (an adapted model saves its adapter
    alone), or for ``adapter_only=False`` a merged copy of an adapted model (the base weights with the adapters folded
    in: one more copy of the model while it is written)."""
    if not is_adapted(model) or adapter_only:
        return model
    return copy.deepcopy(model).merge_and_unload()
