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
from transformers import AutoModelForCausalLM

from p2p_diloco.checkpoint import load_checkpoint
from p2p_diloco.unit.events import OuterRound

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
