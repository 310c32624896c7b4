"""The library API: the settings it takes, the optimizer it wraps, and the README's example (examples/train_loop.py)
training and averaging between two real processes on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from swarms import close_leaving_nothing, quick_swarm
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState, TrainingArguments

from p2p_diloco.api import DiLoCoCallback
from p2p_diloco.config import ConfigError, SwarmSections, swarm_sections
from p2p_diloco.ops.launcher import spawn
from p2p_diloco.unit.events import ConsensusRound, Eval, Join
from p2p_diloco.unit.inner import InnerTrainer

EXAMPLES = Path(__file__).parent.parent / "examples"
LOOPS = {"a": EXAMPLES / "train_loop.py", "b": EXAMPLES / "hf_trainer.py"}


def test_settings_are_the_swarm_fields_by_name() -> None:
    sections = swarm_sections(inner_steps=7, run_id="lib", max_steps=3)
    assert (sections.outer.inner_steps, sections.network.run_id, sections.run.max_steps) == (7, "lib", 3)
    assert swarm_sections(sections, quorum=2).outer.inner_steps == 7
    assert swarm_sections() == SwarmSections()
    with pytest.raises(ConfigError, match="unknown setting 'inner_lr'"):
        swarm_sections(inner_lr=1e-3)  # the caller's optimizer has its own
    with pytest.raises(ConfigError, match="--inner-steps"):
        swarm_sections(inner_steps=0)


def test_the_optimizer_must_hold_exactly_the_trainable_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    trainer = InnerTrainer.around(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(trainer.params) == 4 and trainer.scheduler is None
    with pytest.raises(ValueError, match="exactly the model's parameters"):
        InnerTrainer.around(model, torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_the_trainer_callback_needs_token_counts_one_process_and_a_tokenizer(tmp_path: Path) -> None:
    callback = DiLoCoCallback(run_id="lib")
    state, control = TrainerState(), TrainerControl()
    model = torch.nn.Linear(2, 2)
    kwargs = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "processing_class": None}
    uncounted = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="include_num_input_tokens_seen"):
        callback.on_train_begin(uncounted, state, control, **kwargs)
    counted = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                include_num_input_tokens_seen="all")  # fmt: skip
    with pytest.raises(ValueError, match="processing_class"):
        callback.on_train_begin(counted, state, control, **kwargs)
    assert callback.diloco is None and not list(tmp_path.iterdir())


@pytest.mark.swarm
def test_the_example_loop_and_trainer_train_and_average_between_two_processes(tmp_path: Path) -> None:
    """a: examples/train_loop.py (the context manager), b: examples/hf_trainer.py (the Trainer callback)."""
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for index, name in enumerate(("a", "b")):
            work_dir = tmp_path / name
            work_dir.mkdir()
            command = [sys.executable, str(LOOPS[name]), "--initial-peers", maddr, "--run-id", swarm.run_id,
                       "--work-dir", str(work_dir), "--steps", "100", "--data-seed", str(index)]  # fmt: skip
            swarm.processes[name] = spawn(command, work_dir / "stdout.log")
        swarm.wait_for(lambda: all(not swarm.running(name) for name in ("a", "b")), timeout_s=240,
                       what="both examples to finish their 100 steps")  # fmt: skip
        assert all(swarm.processes[name].returncode == 0 for name in ("a", "b")), swarm.tails()
    finally:
        close_leaving_nothing(swarm)
    for name in ("a", "b"):
        (join,) = swarm.events(name, Join)
        assert join.trained_parameters > 0
        # a 100-step run spans one or two periods of the round clock (4 s at the least): the two processes may
        # average only in the settle rounds at exit (the round clock's own tests make units meet while they train)
        averaged = [event for event in swarm.rounds(name) if event.group_size == 2]
        averaged += [event for event in swarm.events(name, ConsensusRound) if event.group_size == 2 and event.applied]
        assert averaged, swarm.tails()
        evals = [event.eval_loss for event in swarm.events(name, Eval) if event.eval_loss is not None]
        assert evals[-1] < evals[0] - 0.5, evals
        AutoModelForCausalLM.from_pretrained(tmp_path / name / "model")
