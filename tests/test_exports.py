"""A unit killed with SIGKILL still leaves a usable model: its exports during training (--export-every-rounds) and
``p2p-diloco export`` of its checkpoint load with ``AutoModelForCausalLM.from_pretrained``; restarted on the same work
dir, its data stream resumes where its checkpoint says (tests/test_data.py: no document is trained on twice)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from swarms import close_leaving_nothing, quick_swarm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.unit.architecture import ARCHITECTURE_DIR, rebuild_architecture, save_architecture
from p2p_diloco.unit.events import OuterRound
from p2p_diloco.unit.model import ModelLoadError, model_fingerprint

pytestmark = pytest.mark.swarm


def test_a_killed_unit_exports_and_resumes_its_data(tmp_path: Path) -> None:
    swarm = quick_swarm(tmp_path / "swarm")
    work_dir = swarm.root / "unit"
    flags = ("--identity-path", str(tmp_path / "unit.key"), "--checkpoint-every-rounds", "1",
             "--export-every-rounds", "1")  # fmt: skip
    try:
        swarm.unit("unit", [], *flags)
        swarm.wait_for(lambda: len(swarm.rounds("unit")) >= 2 and (work_dir / "model" / "config.json").exists(), 120,
                       "two rounds and an export")  # fmt: skip
        swarm.kill_group("unit")
        exported = AutoModelForCausalLM.from_pretrained(work_dir / "model")
        assert exported.num_parameters() > 0

        out = tmp_path / "from-checkpoint"
        command = [sys.executable, "-m", "p2p_diloco.cli", "export", "--work-dir", str(work_dir), "--out", str(out)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr
        checkpoint = load_checkpoint(work_dir / "checkpoint.pt")
        assert checkpoint is not None
        model = AutoModelForCausalLM.from_pretrained(out)
        trained = [param for param in model.parameters() if param.requires_grad]
        assert all(torch.equal(p, phi) for p, phi in zip(trained, checkpoint["global_params"], strict=True))

        data = checkpoint["data"]
        assert data["documents"] > 0 or data["epoch"] > 0
        rounds_before = len(swarm.rounds("unit"))
        swarm.unit("unit", [], *flags)
        log = work_dir / "stdout.log"
        resumed = f"data resumes at epoch {data['epoch']} after {data['documents']} documents"
        swarm.wait_for(lambda: resumed in log.read_text(), 120, "the data to resume at the checkpoint's position")
        swarm.wait_for(lambda: len(swarm.events("unit", OuterRound)) > rounds_before + 1, 120, "rounds after it")
    finally:
        close_leaving_nothing(swarm)


def test_a_library_units_architecture_rebuilds_its_model_with_the_frozen_parameters(tmp_path: Path) -> None:
    """What export rebuilds a library unit's model from: the same class, fingerprint and frozen values; trained
    parameters freshly drawn (the checkpoint's φ replaces them)."""
    tiny = Path(__file__).parent.parent / "p2p_diloco" / "assets" / "tiny-gpt2"
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    model.transformer.wpe.weight.requires_grad_(False)
    assert save_architecture(model, tokenizer, tmp_path) == tmp_path / ARCHITECTURE_DIR
    rebuilt, rebuilt_tokenizer = rebuild_architecture(tmp_path)
    assert type(rebuilt) is type(model) and len(rebuilt_tokenizer) == len(tokenizer)
    assert model_fingerprint(rebuilt, len(tokenizer)) == model_fingerprint(model, len(tokenizer))
    assert torch.equal(rebuilt.transformer.wpe.weight, model.transformer.wpe.weight)
    assert not torch.equal(rebuilt.transformer.h[0].mlp.c_fc.weight, model.transformer.h[0].mlp.c_fc.weight)
    assert save_architecture(torch.nn.Linear(2, 2), tokenizer, tmp_path / "other") is None  # not rebuildable: said
    with pytest.raises(ModelLoadError, match="does not describe a model"):
        rebuild_architecture(tmp_path / "other")
