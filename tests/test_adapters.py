"""LoRA adapters (peft) on the embedded tiny GPT-2: only the adapters train, the fingerprint covers their
configuration, bad target modules are one error line, and both exports load (offline, CPU); and two real units on
127.0.0.1 that average their adapters alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from swarms import close_leaving_nothing, quick_swarm
from transformers import AutoModelForCausalLM

import p2p_diloco
from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.config import ConfigError, InnerSection, ModelSection
from p2p_diloco.settings import load_config
from p2p_diloco.unit.adapters import AdapterError
from p2p_diloco.unit.events import Join
from p2p_diloco.unit.inner import InnerTrainer
from p2p_diloco.unit.model import LoadedModel, export_pretrained, load_model

TINY = Path(p2p_diloco.__file__).parent / "assets" / "tiny-gpt2"


def _adapted(**fields: object) -> LoadedModel:
    section = ModelSection(model_config_path=str(TINY), device="cpu", lora_r=4, **fields)  # type: ignore[arg-type]
    return load_model(section)


def _batches() -> Iterator[torch.Tensor]:
    batch = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    while True:
        yield batch


def test_only_the_adapters_train_and_the_base_stays_as_it_was() -> None:
    loaded = _adapted()
    trained = {name for name, param in loaded.model.named_parameters() if param.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    base = {name: param.detach().clone() for name, param in loaded.model.named_parameters() if name not in trained}
    trainer = InnerTrainer(loaded.model, InnerSection(inner_lr=1e-2, warmup_steps=0), loaded.device)
    losses = [trainer.train_step(_batches()).loss for _ in range(8)]
    assert losses[-1] < losses[0]
    assert all(torch.equal(param, base[name]) for name, param in loaded.model.named_parameters() if name in base)
    full = sum(param.numel() for param in load_model(ModelSection(model_config_path=str(TINY))).model.parameters())
    assert sum(param.numel() for param in trainer.params) < full / 50


def test_every_unit_of_a_run_draws_the_same_adapters_and_the_callers_random_state_is_kept() -> None:
    """Two units start from identical adapters whatever random numbers were drawn before (a unit's own data order,
    hivemind's start): their first round has nothing to reconcile. The seed draws them."""
    torch.manual_seed(1)
    first = _adapted()
    torch.rand(1000)  # the second unit's process drew other numbers before it built its model
    before = torch.get_rng_state()
    second = _adapted()
    assert torch.equal(torch.get_rng_state(), before)
    pairs = list(zip(first.model.named_parameters(), second.model.named_parameters(), strict=True))
    adapters = [(one, other) for (name, one), (_, other) in pairs if ".lora_A." in name]
    assert adapters and all(torch.equal(one, other) for one, other in adapters)
    assert any(one.abs().sum() > 0 for one, _ in adapters)  # drawn, not zeros
    third = _adapted(seed=1)
    lora_a = [param for name, param in third.model.named_parameters() if ".lora_A." in name]
    assert not torch.equal(lora_a[0], adapters[0][0])


def test_the_fingerprint_covers_the_adapter_configuration() -> None:
    fingerprints = {
        _adapted().fingerprint,
        _adapted(lora_alpha=32).fingerprint,
        _adapted(lora_target_modules=["c_attn"]).fingerprint,
        load_model(ModelSection(model_config_path=str(TINY), device="cpu")).fingerprint,
    }
    assert len(fingerprints) == 4
    assert _adapted().fingerprint == _adapted().fingerprint


def test_target_modules_the_model_does_not_have_are_one_error_line() -> None:
    with pytest.raises(AdapterError, match="q_proj") as error:
        _adapted(lora_target_modules=["q_proj"])
    assert "c_attn" in str(error.value) and "\n" not in str(error.value)


def test_an_adapter_export_needs_adapters() -> None:
    with pytest.raises(ConfigError, match="--export-adapter needs --lora-r"):
        load_config(preset="tiny", run__export_adapter=True)


def test_the_merged_and_the_adapter_exports_load_and_compute_the_trained_model(tmp_path: Path) -> None:
    loaded = _adapted()
    trainer = InnerTrainer(loaded.model, InnerSection(inner_lr=1e-2, warmup_steps=0), loaded.device)
    for _ in range(3):
        trainer.train_step(_batches())
    probe = next(_batches())
    loaded.model.eval()
    with torch.no_grad():
        expected = loaded.model(input_ids=probe).logits
    merged = AutoModelForCausalLM.from_pretrained(export_pretrained(loaded.model, loaded.tokenizer, tmp_path / "m"))
    assert not hasattr(merged, "peft_config")
    adapter_dir = export_pretrained(loaded.model, loaded.tokenizer, tmp_path / "a", adapter_only=True)
    assert (adapter_dir / "adapter_config.json").exists() and not (adapter_dir / "model.safetensors").exists()
    base = load_model(ModelSection(model_config_path=str(TINY), device="cpu")).model  # the same seed's base
    with_adapter = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        for model in (merged, with_adapter):
            model.eval()
            assert torch.allclose(model(input_ids=probe).logits, expected, atol=1e-4)
    assert any(".lora_A." in name for name, _ in loaded.model.named_parameters())  # the unit's model is not merged


@pytest.mark.swarm
def test_two_units_average_only_their_adapters_and_export_both_ways(tmp_path: Path) -> None:
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        swarm.unit("merged", [maddr], "--lora-r", "4", "--max-steps", "200")
        swarm.unit("adapter", [maddr], "--lora-r", "4", "--max-steps", "200", "--export-adapter")
        swarm.wait_for(lambda: all(not swarm.running(name) for name in ("merged", "adapter")), timeout_s=240,
                       what="both units to finish their 200 steps")  # fmt: skip
        assert all(swarm.processes[name].returncode == 0 for name in ("merged", "adapter")), swarm.tails()
    finally:
        close_leaving_nothing(swarm)
    adapters = sum(param.numel() for param in _adapted().model.parameters() if param.requires_grad)
    full = sum(param.numel() for param in load_model(ModelSection(model_config_path=str(TINY))).model.parameters())
    for name in ("merged", "adapter"):
        (join,) = swarm.events(name, Join)
        assert join.trained_parameters == adapters, join
        rounds = [event for event in swarm.rounds(name) if event.status == "merged" and event.group_size == 2]
        assert rounds, swarm.rounds(name)  # the averaged bytes below are those of merged rounds
        checkpoint = load_checkpoint(swarm.root / name / "checkpoint.pt")
        assert checkpoint is not None
        assert sum(tensor.numel() for tensor in checkpoint["global_params"]) == adapters  # all that is averaged
        # the bytes between the first and the last round that read the wire counters, per round: the rounds', not
        # the start's and the exit's (those grow with the wall time a loaded machine takes)
        counted = [event for event in swarm.rounds(name) if event.wire_bytes_sent is not None]
        assert len(counted) >= 2, swarm.rounds(name)
        sent_per_round = (counted[-1].wire_bytes_sent - counted[0].wire_bytes_sent) / (len(counted) - 1)
        assert 0 < sent_per_round < 0.25 * full * 4 * 2, sent_per_round  # a full model's φ and momentum: 8 B each
    merged = AutoModelForCausalLM.from_pretrained(swarm.root / "merged" / "model")
    assert not hasattr(merged, "peft_config")
    base = load_model(ModelSection(model_config_path=str(TINY), device="cpu")).model
    adapted = PeftModel.from_pretrained(base, swarm.root / "adapter" / "model")
    assert sum(param.numel() for name, param in adapted.named_parameters() if "lora_" in name) == adapters
