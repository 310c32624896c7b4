"""The swarms' preloaded nodes (bench/preloaded.py) behave as the processes ``subprocess.Popen`` starts: the program
runs as ``__main__`` with its arguments, this process's environment and directory, output in its log, its own
session, its exit status (or the signal that killed it) reported, and generators seeded apart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import preloaded
from bench.swarm import wait_until

REPORT = """
import os, random, sys
import numpy
print("argv", sys.argv[1:], "name", __name__, "cwd", os.getcwd(), flush=True)
print("mark", os.environ.get("PRELOADED_TEST_MARK"), "session", os.getsid(0) == os.getpid(), flush=True)
print("draws", random.random(), numpy.random.random(), flush=True)
sys.exit(int(sys.argv[1]))
"""


def _lines(log: Path) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in log.read_text().splitlines() if " " in line}


def test_a_script_runs_as_main_with_its_arguments_environment_directory_and_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    monkeypatch.setenv("PRELOADED_TEST_MARK", "set after the fork server started")
    monkeypatch.chdir(tmp_path)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    processes = [preloaded.start([sys.executable, str(script), "3", "x y"], log) for log in logs]
    assert [process.wait(timeout=60) for process in processes] == [3, 3]
    reports = [_lines(log) for log in logs]
    assert reports[0]["argv"] == f"['3', 'x y'] name __main__ cwd {tmp_path}"
    assert reports[0]["mark"] == "set after the fork server started session True"
    assert reports[0]["draws"] != reports[1]["draws"]


def test_a_module_runs_and_a_killed_node_reports_its_signal(tmp_path: Path) -> None:
    log = tmp_path / "cli.log"
    assert preloaded.start([sys.executable, "-m", "p2p_diloco.cli", "--version"], log).wait(timeout=60) == 0
    assert log.read_text().startswith("p2p-diloco ")
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    process = preloaded.start([sys.executable, str(sleeper)], tmp_path / "sleeper.log")
    wait_until(lambda: "sleeping" in (tmp_path / "sleeper.log").read_text(), 60, "the sleeper to start")
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.1)
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    assert process.returncode == -signal.SIGKILL


def test_the_preloaded_modules_make_no_process_shared_lock() -> None:
    """A lock made at import in the fork server would be shared by every node forked from it: one node killed while
    holding it hangs all later ones (hivemind's import makes four; it is not preloaded)."""
    script = (
        "import gc, importlib, sys, multiprocessing.synchronize as s\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "print(sum(isinstance(o, s.SemLock) for o in gc.get_objects()))\n"
    )
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", script, *preloaded.PRELOADED_MODULES],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0 and run.stdout.split() == ["0"], run.stdout + run.stderr
    hivemind = subprocess.run([sys.executable, "-W", "ignore", "-c", script, "hivemind"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert int(hivemind.stdout.split()[-1]) > 0, "the check finds the locks it is for"


def test_only_this_python_running_a_module_or_a_script_is_started_so(tmp_path: Path) -> None:
    assert preloaded.can_start([sys.executable, "-m", "p2p_diloco.cli"])
    assert not preloaded.can_start(["ip", "netns", "exec", "node", sys.executable, "-m", "p2p_diloco.cli"])
    assert not preloaded.can_start([sys.executable, "-c", "pass"])
    with pytest.raises(ValueError, match="not a command of this Python"):
        preloaded.start(["/bin/true"], tmp_path / "log")
