"""Process ownership: the orphan reaper kills a SIGKILLed peer's whole group; stop signals; forked children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from bench.swarm import wait_until
from p2p_diloco.lifecycle import group_pids, is_running

pytestmark = pytest.mark.swarm

PEER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    from p2p_diloco.config import NetworkSection
    from p2p_diloco.network.dht import start_dht
    from p2p_diloco.lifecycle import children_group, descendant_pids, install_stop_signals, start_orphan_reaper

    stop = install_stop_signals()
    threading.Thread(target=lambda: stop.wait() and print("stop requested", flush=True), daemon=True).start()
    reaper = start_orphan_reaper()
    dht = start_dht(NetworkSection(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    if sys.argv[1:] == ["averager"]:  # a forked process of its own that replicates the DHT's p2pd client
        import hivemind, torch
        averager = hivemind.averaging.DecentralizedAverager([torch.zeros(4)], dht, prefix="t", start=True)
    cmdlines = {pid: open(f"/proc/{pid}/cmdline", "rb").read().decode() for pid in descendant_pids(dht.pid)}
    p2pd = [pid for pid, cmd in cmdlines.items() if "p2pd" in cmd]
    sockets = [arg.split("=/unix", 1)[1] for cmd in cmdlines.values() for arg in cmd.split("\\0")
               if arg.startswith("-listen=/unix")]
    print(json.dumps(dict(pid=os.getpid(), pgid=os.getpgid(0), children=children_group(), dht=dht.pid, p2pd=p2pd,
                          reaper=reaper.pid, sockets=sockets)), flush=True)
    sys.stdin.read()  # until the test closes stdin; then exit WITHOUT shutting the DHT down
    """
)


@pytest.fixture
def peer():
    """A child peer process with a reaper and a DHT in its children group; everything is killed at teardown."""
    yield from _peer()


@pytest.fixture
def peer_with_averager():
    """``peer`` with a hivemind averager too (a forked process of its own in the children group)."""
    yield from _peer("averager")


def _peer(*args: str):
    child = subprocess.Popen(
        [sys.executable, "-c", PEER_SCRIPT, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    info = json.loads(child.stdout.readline())
    yield child, info
    for pid in [info["reaper"], *group_pids(info["children"])]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    child.kill()
    child.wait()


def test_sigkill_of_main_kills_dht_and_p2pd(peer):
    child, info = peer
    assert info["children"] == info["reaper"] != info["pgid"]
    members = set(group_pids(info["children"]))
    assert {info["reaper"], info["dht"], *info["p2pd"]} <= members and info["p2pd"]
    assert info["pid"] not in members
    assert all(Path(path).exists() for path in info["sockets"])

    child.send_signal(signal.SIGKILL)
    child.wait(timeout=5)
    wait_until(lambda: not group_pids(info["children"]), 10, "the DHT process and p2pd to die")
    wait_until(lambda: not is_running(info["reaper"]), 5, "the reaper to exit")
    assert not any(Path(path).exists() for path in info["sockets"])


def test_sigkill_of_main_leaves_no_socket_file_of_its_averagers(peer_with_averager):
    """Each forked hivemind process that replicates the p2pd client listens on a socket file of its own, named
    nowhere on a command line: the reaper removed only the daemon's, and every SIGKILLed unit left the others in
    /tmp."""
    child, info = peer_with_averager
    named = set(info["sockets"])  # on the p2pd command line: the daemon's and its first client's

    def listened() -> set[str]:  # psutil's reading of /proc, independent of the reaper's
        return {str(connection.laddr) for pid in group_pids(info["children"]) if is_running(pid)
                for connection in psutil.Process(pid).net_connections(kind="unix")
                if str(connection.laddr).startswith("/tmp/hivemind-")}  # fmt: skip

    wait_until(lambda: listened() - named, 15, "the averager to listen on a socket file of its own")
    sockets = listened() | named
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=5)
    wait_until(lambda: not is_running(info["reaper"]), 15, "the reaper to exit")
    assert not any(Path(path).exists() for path in sockets), sockets


def test_reaper_cleans_up_after_normal_exit(peer):
    child, info = peer
    child.stdin.close()
    assert child.wait(timeout=10) == 0
    wait_until(lambda: not group_pids(info["children"]), 10, "leftover DHT process and p2pd to die")
    wait_until(lambda: not is_running(info["reaper"]), 5, "the reaper to exit")


SIGNAL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from p2p_diloco.lifecycle import install_stop_signals

    stop = install_stop_signals()
    assert stop is install_stop_signals()  # one process-wide event
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # after the fork hooks ran
        os.write(ready_w, b"x")
        time.sleep(30)
        os._exit(0)
    os.read(ready_r, 1)
    os.kill(pid, signal.SIGINT)  # ignored by forked children
    os.kill(pid, signal.SIGTERM)  # default action: terminate
    _, status = os.waitpid(pid, 0)
    print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
    print("ready", flush=True)
    stop.wait()
    try:
        print("graceful", flush=True)
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("aborted", flush=True)
        sys.exit(3)
    """
)


def test_a_signal_to_the_main_group_spares_the_children(peer):
    """SIGTERM to the peer's own group (a supervisor stopping the job, Ctrl+C) reaches the main process only,
    which then owns the shutdown; the DHT process and p2pd must not die from the signal itself."""
    child, info = peer
    os.killpg(info["pgid"], signal.SIGTERM)
    assert child.stdout.readline().strip() == "stop requested"
    assert all(is_running(pid) for pid in [info["dht"], *info["p2pd"]])
    child.stdin.close()
    assert child.wait(timeout=10) == 0
    wait_until(lambda: not group_pids(info["children"]), 10, "the reaper to remove the children")


def test_stop_signals_first_graceful_second_sigint_aborts():
    child = subprocess.Popen([sys.executable, "-c", SIGNAL_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().split() == ["child", str(int(signal.SIGTERM))]
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().strip() == "graceful"
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline().strip() == "aborted"
        assert child.wait(timeout=5) == 3
    finally:
        child.kill()
        child.wait()
