"""Tests never reach a model or dataset hub: everything loads from the files shipped with the project; and every test
leaves no process behind."""

import os
import time
from collections.abc import Iterator

import psutil
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Inherited by every process a test starts, and by theirs (units, hivemind's forked children, p2pd daemons), orphans
# included: how the guard below finds them.
LEFTOVER_MARK = "P2P_DILOCO_TEST_SESSION"
os.environ[LEFTOVER_MARK] = str(os.getpid())
LEFTOVER_WAIT_S = 10.0

from swarms import session_helper  # noqa: E402
from unit_peers import make_peer  # noqa: E402,F401  (the fixture, shared by the unit test modules)


def _marked_processes() -> list[psutil.Process]:
    """Live processes (other than this one and its helpers) that carry this session's mark."""
    found = []
    for process in psutil.process_iter():
        try:
            if (process.pid != os.getpid() and process.status() != psutil.STATUS_ZOMBIE
                    and not session_helper(process)
                    and process.environ().get(LEFTOVER_MARK) == os.environ[LEFTOVER_MARK]):  # fmt: skip
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(autouse=True)
def leaves_no_process_behind() -> Iterator[None]:
    """A process this test started (directly or not) that still runs LEFTOVER_WAIT_S after the test fails it, and is
    killed so that nothing leaks into the next test."""
    yield
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (leftovers := _marked_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if leftovers:
        described = []
        for process in leftovers:
            try:
                described.append(f"{process.pid} {' '.join(process.cmdline())[:200]}")
                process.kill()
            except psutil.NoSuchProcess:
                continue
        pytest.fail("processes outlived the test:\n" + "\n".join(described), pytrace=False)
