"""The memory benchmarks' pure parts (bench/memory*.py, bench/exit_memory.py, bench/process_memory.py); the scripts
memory.py and exit_memory.py run them."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from bench import exit_memory
from bench.memory import TreeWatch, stop_leftovers
from bench.memory_inventory import as_json, forked_children, inventory, predicted
from bench.memory_report import markdown
from bench.process_memory import ProcessSample, sample_tree
from p2p_diloco.config import OuterSection
from p2p_diloco.rounds.plan import RoundPlan

SHAPES = [(64, 16), (16,)]


def plan(**outer: object) -> RoundPlan:
    return RoundPlan.from_config(OuterSection.model_validate(outer), SHAPES)


def test_sample_tree_reads_this_process_first() -> None:
    samples = sample_tree(os.getpid())
    assert samples[0].pid == os.getpid() and samples[0].kind == "main"
    assert 0 < samples[0].uss <= samples[0].pss <= samples[0].rss_peak
    assert samples[0].threads >= 1


def sample(pid: int, kind: str, pss: int) -> ProcessSample:
    return ProcessSample(pid=pid, started=1.0, kind=kind, pss=pss, uss=pss // 2, rss_peak=2 * pss, threads=1, cpu_s=0)


def test_tree_watch_keeps_the_peak_of_the_sum_and_its_processes() -> None:
    watch = TreeWatch()
    watch.add([sample(1, "main", 100), sample(2, "forked", 50)])
    watch.add([sample(1, "main", 120), sample(2, "forked", 10), sample(3, "p2pd", 5)])  # 135 < 150
    assert (watch.peak_pss, watch.max_processes, watch.main_uss_peak, watch.main_rss_hwm) == (150, 3, 60, 240)
    assert [process["pid"] for process in watch.peak_by_process] == [1, 2]
    assert set(watch.seen) == {1, 2, 3}


def test_stop_leftovers_kills_what_outlived_its_run() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(process.pid).create_time()
        assert stop_leftovers({process.pid: started, 999_999_999: 0.0}, grace_s=0.2) == 1
        assert not psutil.pid_exists(process.pid)  # killed and reaped
    finally:
        process.kill()


def test_inventory_counts_the_persistent_copies_of_each_plan() -> None:
    default = plan()  # a plain average: proposals at momentum 0 (no m kept), 3 forked children
    assert forked_children(default) == 3
    default_bytes = predicted(inventory(default))
    # φ, averager, its reference, state server; in flight only θ_p at send (the payload sent is in the averager's
    # buffer alone); the largest momentary copy: Δ_p, stepped into the payload in place
    assert default_bytes["persistent"] == 4 + 4 + 4 + 4 and default_bytes["in_flight"] == 4
    assert default_bytes["momentary"] == 4
    synced = predicted(inventory(plan(outer_momentum=0.9)))  # m'_p travels in the payload: no own copy is kept
    assert synced["persistent"] == 4 + 4 + 8 + 8 + 8 and synced["in_flight"] == 4
    unsynced = predicted(inventory(plan(outer_momentum=0.9, sync_momentum=False)))
    assert unsynced["in_flight"] == 4 + 4  # θ_p and the unit's own m'_p
    lossy = plan(codec="fp16", fragments=4)  # consensus averagers and error feedback; 2 of 4 fragments in flight
    assert forked_children(lossy) == 10
    assert predicted(inventory(lossy)) == pytest.approx(
        {"persistent": 4 + 4 + 4 + 4 + 4 + 4, "in_flight": 2, "momentary": 4, "peak_low": 26, "peak_high": 30}
    )


def test_markdown_puts_the_command_first_and_a_row_per_run() -> None:
    copies = inventory(plan())
    timeline = [[0.0, 100, 50]]
    processes = [{"pid": 1, "kind": "main", "pss": 2**20, "uss": 2**19}]
    run = {"peak_pss": 8 * 2**20, "bytes_per_param": 8.0, "main_uss_peak": 2**20, "main_rss_hwm": 2**21,
           "max_processes": 1, "rounds": 0, "inner_steps": None, "checkpoint": False,
           "device": {"note": "cpu: device = host"},
           "peak_by_process": processes, "timeline": timeline}  # fmt: skip
    unit = {**run, "peak_pss": 12 * 2**20, "bytes_per_param": 12.0, "excess_bytes_per_param": 4.0, "rounds": 3,
            "inner_steps": 20,
            "checkpoint": True, "max_processes": 6}  # fmt: skip
    report = {
        "command": "python scripts/memory.py --out x",
        "machine": {"python": "3.11", "torch": "2.13", "cpus": 2, "memory_bytes": 2**30},
        "package": "/x/p2p_diloco/__init__.py",
        "models": {"m": {"trained_parameters": 2**20, "steps": 40, "bare": run, "units": {"P4": {
            "flags": "--fragments 4", "run": unit, "inventory": as_json(copies), "predicted": predicted(copies)}}}},
    }  # fmt: skip
    table = markdown(report)
    assert table.startswith("Reproduce with:\n\n```\npython scripts/memory.py --out x\n```")
    assert "| m | 1.05 M | bare loop |  |  | 8 | 8.0 |" in table
    assert "| m | 1.05 M | P4 | `--fragments 4` | 20 | 12 | 12.0 | +4.0 | 20–24 |" in table
    assert "Fewer inner steps than --max-steps m P4: stopped by SIGTERM" in table
    assert "| **predicted excess: persistent** | | | | 16 |" in table


def test_the_exit_report_passes_a_unit_only_below_its_training_peak_by_both_measures() -> None:
    unit = {"exit_code": 0, "exported": True, "training_peak": 7 * 2**30, "exit_peak": 6 * 2**30,
            "exit_over_training": 6 / 7, "training_main_hwm": 5 * 2**30, "exit_main_hwm": 4 * 2**30, "exit_s": 50.0,
            "inner_steps": 20, "rounds": 3, "final_eval": 4.2}  # fmt: skip
    assert exit_memory.passed(unit)
    assert not exit_memory.passed({**unit, "exit_main_hwm": 6 * 2**30})  # a peak between samples counts too
    assert not exit_memory.passed({**unit, "exit_peak": 8 * 2**30})
    assert not exit_memory.passed({**unit, "exported": False})
    report = {"command": "python scripts/exit_memory.py --out x", "environment": "Python 3.11", "train_s": 360.0,
              "flags": ["--seq-len", "128"], "lowest_available": 2**30, "total_memory": 2**34,
              "units": {"unit0": unit}}  # fmt: skip
    table = exit_memory.markdown(report)
    assert table.startswith("Reproduce with:\n\n```\npython scripts/exit_memory.py --out x\n```")
    assert "| unit0 | 0 | yes | 7,168 | 6,144 | 0.857 | 5,120 | 4,096 | 0.800 | 50 | 20 | 3 | 4.2000 | yes |" in table
