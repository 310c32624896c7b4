"""The library API: the settings it takes, the optimizer it wraps, and the README's example (examples/train_loop.py)
training and averaging between two real processes on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from swarms import close_leaving_nothing, quick_swarm
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState, TrainingArguments

from bench.swarm import Swarm
from p2p_diloco.api import DiLoCoCallback
from p2p_diloco.config import ConfigError, SwarmSections, swarm_sections
from p2p_diloco.ops.launcher import spawn
from p2p_diloco.unit.events import ConsensusRound, Eval, InnerStep, Join
from p2p_diloco.unit.inner import InnerTrainer

EXAMPLES = Path(__file__).parent.parent / "examples"
ASSETS = Path(__file__).parent.parent / "p2p_diloco" / "assets"
TINY_MODEL, CORPUS = ASSETS / "tiny-gpt2", ASSETS / "corpus"
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
    for counting in (True, "all", "non_padding"):  # every form transformers accepts (a command line's "true": True)
        counted = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                    include_num_input_tokens_seen=counting)  # fmt: skip
        with pytest.raises(ValueError, match="processing_class"):
            callback.on_train_begin(counted, state, control, **kwargs)
    assert callback.diloco is None and not list(tmp_path.iterdir())


@pytest.mark.swarm
def test_the_example_loop_and_trainer_train_and_average_between_two_processes(tmp_path: Path) -> None:
    """a: examples/train_loop.py (the context manager), b: examples/hf_trainer.py (the Trainer callback)."""
    swarm = quick_swarm(tmp_path)
    try:
        maddr = swarm.bootstrap("bootstrap")
        commands = {name: [sys.executable, str(LOOPS[name]), "--initial-peers", maddr, "--run-id", swarm.run_id,
                           "--work-dir", str(tmp_path / name), "--steps", "100", "--data-seed", str(index)]
                    for index, name in enumerate(("a", "b"))}  # fmt: skip
        run_to_the_end(swarm, commands, os.environ, "both examples to finish their 100 steps")
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


@pytest.mark.swarm
def test_a_run_clm_style_script_is_a_unit_with_the_documented_change(tmp_path: Path) -> None:
    """tests/clm_unit.py (built as transformers' run_clm.py builds its Trainer) as two units: the CLI's round lines on
    their consoles, evals of the Trainer's eval dataset and the Trainer's lr and loss in every step's record, the same
    consensus model saved by both ``trainer.save_model()`` calls (to float rounding), and ``p2p-diloco export`` of a
    work dir."""
    swarm = quick_swarm(tmp_path)
    stop_at = time.time() + 50  # about 30 s of training once both started
    try:
        maddr = swarm.bootstrap("bootstrap")
        commands = {name: [sys.executable, str(Path(__file__).parent / "clm_unit.py"), "--config_name",
                           str(TINY_MODEL), "--tokenizer_name", str(TINY_MODEL), "--train_file",
                           str(CORPUS / "moby_dick.txt"), "--output_dir", str(tmp_path / name / "trainer"),
                           "--max_steps", "100000", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
                           "--lr_scheduler_type", "constant", "--use_cpu", "true",
                           "--include_num_input_tokens_seen", "true", "--save_strategy", "no", "--report_to", "none",
                           "--logging_steps", "50", "--disable_tqdm", "true", "--seed", "0",
                           "--data_seed", str(ord(name))]
                    for name in ("a", "b")}  # fmt: skip
        environment = {**os.environ, "RUN_ID": swarm.run_id, "SWARM_MADDR": maddr, "STOP_AT": str(stop_at),
                       "HF_DATASETS_CACHE": str(tmp_path / "datasets")}  # fmt: skip
        run_to_the_end(swarm, commands, environment, "both scripts to stop at the run's stop time",
                       work_dir_variable="UNIT_WORK_DIR")  # fmt: skip
    finally:
        close_leaving_nothing(swarm)
    for name in ("a", "b"):
        console = (tmp_path / name / "stdout.log").read_text()
        assert re.search(r"INFO - p2p_diloco\.peer - joined run=", console), console[-3000:]
        assert re.search(r"p2p_diloco\.unit\.tracking - outer round \d+ \(fragment 1/1\): merged in a group of 2",
                         console), console[-3000:]  # fmt: skip
        assert "could not find a group" not in console
        evals = [event.eval_loss for event in swarm.events(name, Eval)]
        assert evals and all(loss is not None for loss in evals), evals
        steps = swarm.events(name, InnerStep)
        assert steps and all(step.lr == pytest.approx(3e-3) for step in steps)
        assert len({step.loss for step in steps}) > len(steps) // 2  # each step's own loss, not the last logged
    saved = [load_file(tmp_path / name / "trainer" / "model.safetensors") for name in ("a", "b")]
    assert saved[0].keys() == saved[1].keys()
    # one model: the final round held both units; their φ differ by float rounding alone (drift ~1e-9 per round)
    assert all(torch.allclose(saved[0][key], saved[1][key], rtol=0, atol=1e-6) for key in saved[0])
    export_command = [sys.executable, "-m", "p2p_diloco.cli", "export", "--work-dir", str(tmp_path / "a"),
                      "--out", str(tmp_path / "exported")]  # fmt: skip
    export = subprocess.run(export_command, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert exported.keys() == saved[0].keys() and all(torch.equal(exported[key], saved[0][key]) for key in exported)


def run_to_the_end(swarm: Swarm, commands: dict[str, list[str]], environment: Mapping[str, str], what: str,
                   work_dir_variable: str | None = None) -> None:  # fmt: skip
    """Start each of ``commands`` as node ``name`` of ``swarm`` (its stdout.log in the work dir ``swarm.root / name``,
    also given in ``work_dir_variable`` when named) and wait until all exited, each with status 0."""
    for name, command in commands.items():
        work_dir = swarm.root / name
        work_dir.mkdir()
        unit_environment = {**environment, **({work_dir_variable: str(work_dir)} if work_dir_variable else {})}
        swarm.processes[name] = spawn(command, work_dir / "stdout.log", env=unit_environment)
    swarm.wait_for(lambda: not any(swarm.running(name) for name in commands), timeout_s=240, what=what)
    assert all(swarm.processes[name].returncode == 0 for name in commands), swarm.tails()
