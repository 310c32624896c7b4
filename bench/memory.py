"""Peak memory per trained parameter of a learning unit against a bare training loop of the same model.

For each model (:func:`models`), run one after the other, never two at once:

* the bare loop: ``python -m bench.memory FLAGS``, i.e. :func:`bench.overhead.bare_loop` (the unit's model, data
  pipeline, batch and AdamW, one process, no network), which also writes the CUDA peak allocation when on CUDA;
* per variant (:data:`VARIANTS`: extra ``join`` flags), a real lone unit, ``python -m p2p_diloco.cli join FLAGS``
  without initial peers: it runs its own DHT, its rounds complete alone after their matchmaking window, and every
  buffer of a unit exists; a checkpoint every outer round.

Both get the same flags and ``--max-steps`` and are watched from outside every SAMPLE_EVERY_S: the sum of PSS over
the run's whole process tree (main process, hivemind's forked DHT and averager processes, p2pd, the watchdog), whose
peak over time is the run's peak host memory; also the main process's USS and its kernel high-water mark of RSS
(VmHWM: no sampling gaps, but shared pages counted whole), and the most processes at once. Bytes per parameter are
bytes over trained parameters (counted on the meta device from the model's config). Device memory: on CPU the device
is the host; on CUDA the bare loop reports ``torch.cuda.max_memory_allocated`` and the unit is not measured (its
process cannot be asked from outside).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers

from bench import CHECKOUT, lab_environment, module_command
from bench.memory_inventory import as_json, inventory, predicted
from bench.overhead import bare_loop
from bench.process_memory import ProcessSample, sample_tree
from p2p_diloco.config import PeerConfig
from p2p_diloco.ops.launcher import CLI, spawn, stop_process_groups
from p2p_diloco.presets import CORPUS
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.settings import add_config_arguments, load_config
from p2p_diloco.unit.events import OuterRound, Stop, read_events
from p2p_diloco.unit.model import resolve_device

SAMPLE_EVERY_S = 0.2
TIMELINE_EVERY_S = 1.0  # the report keeps one sample per this many seconds
RUN_TIMEOUT_S = 1800.0
STOP_GRACE_S = 20.0
DEVICE_FILE = "device_memory.json"
SMOLLM2_DIR = Path("/work/dl/smollm2-135m")

# The default outer step is a plain average (--outer-momentum 0), which never syncs m: the momentum variants turn it on.
VARIANTS: dict[str, tuple[str, ...]] = {
    "P1-fp32": (),
    "P4": ("--fragments", "4"),
    "fp16": ("--codec", "fp16"),
    "momentum": ("--outer-momentum", "0.9"),
    "no-sync-momentum": ("--outer-momentum", "0.9", "--no-sync-momentum"),
    "ranks2": ("--nproc-per-node", "2"),
    "ranks2-sharded": ("--nproc-per-node", "2", "--shard-model"),
}


@dataclass(frozen=True)
class ModelSpec:
    """A model's ``join`` flags and the inner steps of its runs by default (several outer rounds)."""

    flags: tuple[str, ...]
    steps: int


def models(smollm2_dir: Path = SMOLLM2_DIR) -> dict[str, ModelSpec]:
    """The measured models: the tiny preset, and SmolLM2-135M from a plain Hugging Face folder (scripts/smollm2_fp32.py
    writes it from the GGUF of ASSETS.md)."""
    return {
        "tiny": ModelSpec(("--preset", "tiny"), steps=100),
        "smollm2-135m": ModelSpec(
            ("--preset", "tiny", "--model", str(smollm2_dir), "--dataset", str(CORPUS), "--seq-len", "128",
             "--batch-size", "4", "--inner-steps", "10", "--threads", "2"),
            steps=40,
        ),
    }  # fmt: skip


def run_flags(spec: ModelSpec, steps: int, work_dir: Path, run_id: str) -> list[str]:
    """The flags both runs of a model take: its own, ``steps`` steps, a checkpoint every outer round."""
    return [*spec.flags, "--checkpoint-every-rounds", "1", "--max-steps", str(steps), "--work-dir", str(work_dir),
            "--run-id", run_id, "--no-progress"]  # fmt: skip


def parse_flags(flags: list[str]) -> PeerConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return load_config(parser.parse_args(flags))


def meta_model(config: PeerConfig) -> torch.nn.Module:
    """The configured model on the meta device (shapes only, no weights)."""
    section = config.model
    source = section.model if section.model is not None else section.model_config_path
    assert source is not None  # ModelSection's validator
    model_config = transformers.AutoConfig.from_pretrained(source, gguf_file=section.gguf_file)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(model_config)


@dataclass(frozen=True)
class Setup:
    """What a unit of these flags trains and how it rounds."""

    trained: int  # trained parameters
    weight_bytes: int  # bytes of one weight in --dtype
    plan: RoundPlan
    cuda: bool


def setup(flags: list[str]) -> Setup:
    config = parse_flags(flags)
    trained = [param for param in meta_model(config).parameters() if param.requires_grad]
    plan = RoundPlan.from_config(config.outer, [param.shape for param in trained])
    weight_bytes = torch.finfo(getattr(torch, config.model.dtype)).bits // 8
    cuda = resolve_device(config.model.device).type == "cuda"
    return Setup(sum(param.numel() for param in trained), weight_bytes, plan, cuda)


# ---------------------------------------------------------------------------------------------------- watching
@dataclass
class TreeWatch:
    """The samples of one process tree over a run (:meth:`add` each), reduced as they come."""

    started: float = field(default_factory=time.monotonic)
    peak_pss: int = 0
    peak_at_s: float = 0.0
    peak_by_process: list[dict[str, Any]] = field(default_factory=list)
    main_uss_peak: int = 0
    main_rss_hwm: int = 0
    max_processes: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (seconds, tree PSS, main USS)
    seen: dict[int, float] = field(default_factory=dict)  # pid → create time of every process sampled

    def add(self, samples: list[ProcessSample]) -> None:
        if not samples:
            return
        now = time.monotonic() - self.started
        total = sum(sample.pss for sample in samples)
        main = samples[0]  # sample_tree puts the root first
        if total > self.peak_pss:
            self.peak_pss, self.peak_at_s = total, now
            self.peak_by_process = [{"pid": s.pid, "kind": s.kind, "pss": s.pss, "uss": s.uss} for s in samples]
        if main.kind == "main":
            self.main_uss_peak = max(self.main_uss_peak, main.uss)
            self.main_rss_hwm = max(self.main_rss_hwm, main.rss_peak)
        self.max_processes = max(self.max_processes, len(samples))
        if not self.timeline or now - self.timeline[-1][0] >= TIMELINE_EVERY_S:
            self.timeline.append((round(now, 2), total, main.uss))
        self.seen.update({sample.pid: sample.started for sample in samples})


def watch(command: list[str], work_dir: Path, timeout_s: float = RUN_TIMEOUT_S) -> tuple[TreeWatch, int, int]:
    """Run ``command`` in its own process group to its end, sampling its tree every SAMPLE_EVERY_S; returns the
    watch, the exit code and how many of its processes outlived it and were killed. Every process it started is gone
    when this returns or raises. Raises RuntimeError when it outlives ``timeout_s``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tree = TreeWatch()
    process = spawn(command, work_dir / "stdout.log", env=lab_environment())
    try:
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(command)} ran over {timeout_s:.0f} s; see {work_dir / 'stdout.log'}")
            tree.add(sample_tree(process.pid))
            time.sleep(SAMPLE_EVERY_S)
    finally:
        code = stop_process_groups([process], grace_s=STOP_GRACE_S)[0]
        leftovers = stop_leftovers(tree.seen)
    return tree, code, leftovers


def stop_leftovers(seen: dict[int, float], grace_s: float = 10.0) -> int:
    """Wait up to ``grace_s`` for the processes of ``seen`` (pid → create time) that still run (their watchdog
    kills them), then SIGKILL the rest; returns how many had to be killed."""
    alive = []
    for pid, started in seen.items():
        with contextlib.suppress(psutil.Error):
            candidate = psutil.Process(pid)
            if candidate.create_time() == started:  # not a recycled pid
                alive.append(candidate)
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for leftover in still:
        with contextlib.suppress(psutil.Error):
            leftover.kill()
    psutil.wait_procs(still, timeout=grace_s)
    return len(still)


# ------------------------------------------------------------------------------------------------------- runs
def run_record(command: list[str], work_dir: Path, trained: int, device: dict[str, Any]) -> dict[str, Any]:
    """Watch one run (:func:`watch`) and return its figures. Raises RuntimeError when it fails."""
    started = time.monotonic()
    tree, code, leftovers = watch(command, work_dir)
    if code != 0:
        raise RuntimeError(f"{' '.join(command)} ended with {code}; see {work_dir / 'stdout.log'}")
    metrics = work_dir / "metrics.jsonl"
    stops = read_events(metrics, Stop)
    return {
        "command": " ".join(command),
        "wall_s": time.monotonic() - started,
        "peak_pss": tree.peak_pss,
        "bytes_per_param": tree.peak_pss / trained,
        "peak_at_s": tree.peak_at_s,
        "peak_by_process": tree.peak_by_process,
        "main_uss_peak": tree.main_uss_peak,
        "main_rss_hwm": tree.main_rss_hwm,
        "max_processes": tree.max_processes,
        "leftovers_killed": leftovers,
        "rounds": len(read_events(metrics, OuterRound)),
        "inner_steps": stops[-1].inner_step if stops else None,
        "checkpoint": (work_dir / "checkpoint.pt").exists(),
        "device": device,
        "timeline": tree.timeline,
    }


def cpu_or(cuda: bool, measured: dict[str, Any] | None) -> dict[str, Any]:
    if not cuda:
        return {"kind": "cpu", "note": "cpu: device = host"}
    if measured is None:
        return {"kind": "cuda", "note": "not measured: the unit's process cannot be asked from outside"}
    return {"kind": "cuda", **measured}


def measure_model(name: str, spec: ModelSpec, variants: dict[str, tuple[str, ...]], steps: int,
                  out: Path) -> dict[str, Any]:  # fmt: skip
    """The bare loop, then every variant's lone unit, of model ``name``, one at a time; work dirs under ``out``."""
    run_id = f"memory-{os.getpid()}-{name}"
    shutil.rmtree(out / "runs" / name, ignore_errors=True)  # fresh work dirs: no earlier checkpoint is resumed
    base = setup(run_flags(spec, steps, out, run_id))
    bare_dir = out / "runs" / name / "bare"
    bare_flags = run_flags(spec, steps, bare_dir, run_id)
    bare = run_record(module_command("bench.memory", *bare_flags), bare_dir, base.trained, {})
    bare["device"] = cpu_or(base.cuda, _read_json(bare_dir / DEVICE_FILE))
    print(f"{name} bare: {bare['bytes_per_param']:.1f} B/param", flush=True)
    units = {}
    for variant, extra in variants.items():
        work_dir = out / "runs" / name / variant
        flags = [*run_flags(spec, steps, work_dir, f"{run_id}-{variant}"), *extra]
        facts = setup(flags)
        record = run_record([*CLI, "join", *flags], work_dir, facts.trained, cpu_or(facts.cuda, None))
        record["excess_bytes_per_param"] = (record["peak_pss"] - bare["peak_pss"]) / facts.trained
        units[variant] = {"flags": " ".join(extra), "run": record, **unit_inventory(facts)}
        print(f"{name} {variant}: {record['bytes_per_param']:.1f} B/param", flush=True)
    return {"flags": " ".join(spec.flags), "steps": steps, "trained_parameters": base.trained,
            "weight_bytes": base.weight_bytes, "bare": bare, "units": units}  # fmt: skip


def unit_inventory(facts: Setup) -> dict[str, Any]:
    """The inventory of a unit's copies (bench/memory_inventory.py) and what it predicts."""
    copies = inventory(facts.plan, facts.weight_bytes)
    return {"inventory": as_json(copies), "predicted": predicted(copies)}


def refreshed(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with every unit's inventory made again by this code from the unit's command line."""
    for result in report["models"].values():
        for unit in result["units"].values():
            unit.update(unit_inventory(setup(unit["run"]["command"].split(" join ", 1)[1].split())))
    return report


def imported_package() -> str:
    """Where a child started like the runs imports p2p_diloco from. Raises RuntimeError unless from this checkout."""
    probe = [sys.executable, "-c", "import p2p_diloco; print(p2p_diloco.__file__)"]
    found = subprocess.run(probe, check=True, capture_output=True, text=True, env=lab_environment(), cwd=CHECKOUT)
    path = found.stdout.strip()
    if not Path(path).resolve().is_relative_to(CHECKOUT):
        raise RuntimeError(f"the runs would import p2p_diloco from {path}, not from {CHECKOUT}")
    return path


def measure(out: Path, chosen: dict[str, ModelSpec], variants: dict[str, tuple[str, ...]],
            steps: int | None) -> dict[str, Any]:  # fmt: skip
    """Every chosen model (see the module docstring); ``steps`` overrides each model's own. Raises RuntimeError
    when a run fails."""
    package = imported_package()
    results = {name: measure_model(name, spec, variants, steps or spec.steps, out) for name, spec in chosen.items()}
    return {"package": package, "models": results}


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


# ------------------------------------------------------------------------------------------------- bare loop
def main(argv: list[str] | None = None) -> int:
    """The bare loop (bench/overhead.py) with ``p2p-diloco join`` flags; on CUDA it then writes the peak of
    ``torch.cuda.max_memory_allocated`` to DEVICE_FILE in the work dir."""
    parser = argparse.ArgumentParser(description="the bare inner loop of a learning unit, its CUDA peak written")
    add_config_arguments(parser)
    config = load_config(parser.parse_args(argv))
    bare_loop(config)
    if resolve_device(config.model.device).type == "cuda":
        peak = {"max_memory_allocated": torch.cuda.max_memory_allocated()}
        (Path(config.run.work_dir) / DEVICE_FILE).write_text(json.dumps(peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())
