"""Mixed precision (autocast over float32 master weights, a loss scaler for float16), activation checkpointing and
the attention kernel flag, on the CPU with the embedded tiny GPT-2 (no network)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import p2p_diloco
from p2p_diloco.config import ConfigError, InnerSection, ModelSection
from p2p_diloco.settings import load_config
from p2p_diloco.unit.inner import InnerTrainer
from p2p_diloco.unit.model import LoadedModel, ModelLoadError, export_pretrained, load_model

TINY = Path(p2p_diloco.__file__).parent / "assets" / "tiny-gpt2"
STEPS = 30


def _tiny(**fields: object) -> LoadedModel:
    return load_model(ModelSection(model_config_path=str(TINY), device="cpu", **fields))  # type: ignore[arg-type]


def _same_batch(loaded: LoadedModel) -> Iterator[torch.Tensor]:
    """One fixed batch of real text, forever: a model that learns memorises it."""
    ids = loaded.tokenizer("Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail "
                           "about a little and see the watery part of the world.")["input_ids"]  # fmt: skip
    batch = torch.tensor([ids[:24], ids[1:25]])
    while True:
        yield batch


def _train(loaded: LoadedModel, steps: int = STEPS) -> tuple[InnerTrainer, list[float]]:
    trainer = InnerTrainer(loaded.model, InnerSection(inner_lr=3e-3, warmup_steps=0), loaded.device, loaded.autocast)
    batches = _same_batch(loaded)
    return trainer, [trainer.train_step(batches).loss for _ in range(steps)]


@pytest.mark.parametrize("autocast", ["bfloat16", "float16"])
def test_autocast_trains_float32_master_weights_and_the_export_loads(autocast: str, tmp_path: Path) -> None:
    loaded = _tiny(autocast=autocast)
    assert loaded.autocast is getattr(torch, autocast)
    trainer, losses = _train(loaded)
    assert all(param.dtype is torch.float32 for param in loaded.model.parameters())
    assert all(state["exp_avg"].dtype is torch.float32 for state in trainer.optimizer.state.values())
    assert losses[-1] < 0.5 * losses[0], losses
    assert trainer.scaler.is_enabled() is (autocast == "float16")
    probe = next(_same_batch(loaded))
    with torch.no_grad():
        logits = loaded.model(input_ids=probe).logits
    with torch.autocast("cpu", dtype=loaded.autocast):
        assert loaded.model(input_ids=probe).logits.dtype is loaded.autocast  # the forward did run in autocast
    saved = export_pretrained(loaded.model, loaded.tokenizer, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert next(reloaded.parameters()).dtype is torch.float32
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=probe).logits, logits, atol=1e-4)


def test_the_loss_scaler_survives_a_checkpoint() -> None:
    trainer, _ = _train(_tiny(autocast="float16"), steps=3)
    restored = InnerTrainer(_tiny(autocast="float16").model, InnerSection(), torch.device("cpu"), torch.float16)
    restored.load_state_dict(trainer.state_dict())
    assert restored.scaler.get_scale() == trainer.scaler.get_scale()
    unscaled = InnerTrainer(_tiny().model, InnerSection(), torch.device("cpu"))
    unscaled.load_state_dict({key: value for key, value in trainer.state_dict().items() if key != "scaler"})
    assert not unscaled.scaler.is_enabled()  # a checkpoint from before the scaler existed loads


def test_an_overflowing_float16_step_is_skipped_and_lowers_the_scale() -> None:
    loaded = _tiny(autocast="float16")
    trainer = InnerTrainer(loaded.model, InnerSection(), loaded.device, loaded.autocast)
    before = [param.detach().clone() for param in trainer.params]
    scale = trainer.scaler.get_scale()

    def overflow(gradients: list[torch.Tensor]) -> None:
        gradients[0].fill_(float("inf"))

    trainer.train_step(_same_batch(loaded), synchronize_gradients=overflow)
    assert all(torch.equal(param, old) for param, old in zip(trainer.params, before))
    assert trainer.scaler.get_scale() < scale


def test_activation_checkpointing_and_the_attention_kernel_reach_the_model() -> None:
    loaded = _tiny(gradient_checkpointing=True, attn_implementation="eager")
    assert any(getattr(module, "gradient_checkpointing", False) for module in loaded.model.modules())
    assert loaded.model.config._attn_implementation == "eager"
    _, losses = _train(loaded, steps=10)
    assert losses[-1] < losses[0]


def test_an_unknown_attention_kernel_is_one_load_error() -> None:
    with pytest.raises(ModelLoadError, match="could not be loaded") as error:
        _tiny(attn_implementation="no-such-kernel")
    assert "\n" not in str(error.value)


def test_pretrained_weights_load_straight_into_the_configured_dtype(tmp_path: Path) -> None:
    source = _tiny()
    saved = export_pretrained(source.model, source.tokenizer, tmp_path / "pretrained")
    loaded = load_model(ModelSection(model=str(saved), dtype="bfloat16", device="cpu"))
    assert {param.dtype for param in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.fingerprint == source.fingerprint


def test_autocast_over_half_precision_weights_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--autocast needs --dtype float32"):
        load_config(preset="tiny", model__dtype="bfloat16", model__autocast="bfloat16")
