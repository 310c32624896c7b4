"""What an operator sees of a real swarm (a bootstrap node and two units, separate processes on 127.0.0.1): the
dashboard in a real headless Chromium, ``status --json``, the units' console lines, their TensorBoard event files and
run.json.

The browser is the distribution's Chromium (``.ci/run`` installs it), driven by Playwright. Without Chromium the
browser test is skipped, except under CI, where it fails. ``DASHBOARD_SCREENSHOT=path`` also saves the screenshot there
(the README's picture comes from this test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from swarms import close_leaving_nothing, quick_swarm

from bench.swarm import Swarm
from p2p_diloco.unit.events import Eval, Join, Stop

pytestmark = pytest.mark.swarm

UNITS = ("unit-a", "unit-b")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip  # without the network flags Chromium keeps calling out of this closed machine


def test_operator_view_of_a_real_swarm(tmp_path: Path) -> None:
    """Two units reporting to TensorBoard, once they merged a round with each other and evaluated after it: the
    dashboard, status --json, then (the units stopped cleanly, so that their trackers closed) their files. One swarm
    for the three: each real swarm costs the suite its start-up."""
    swarm = quick_swarm(tmp_path / "swarm")
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in UNITS:
            swarm.unit(name, [maddr], "--report-to", "tensorboard", duration_s=300)
        for name in UNITS:
            swarm.wait_for(lambda name=name: [r for r in swarm.rounds(name) if r.group_size == 2], 120,
                           f"{name} to merge a round with the other unit")  # fmt: skip
            swarm.wait_for(lambda name=name: [e for e in swarm.events(name, Eval) if e.reason == "outer_round"], 60,
                           f"{name}'s eval after a round")  # fmt: skip
        check_dashboard_in_a_real_browser(swarm, tmp_path)
        check_status_json(swarm)
        check_units_files_after_a_clean_stop(swarm)
    finally:
        close_leaving_nothing(swarm)


def peer_ids(swarm: Swarm) -> set[str]:
    return {swarm.events(name, Join)[-1].peer_id for name in UNITS}


def check_dashboard_in_a_real_browser(swarm: Swarm, tmp_path: Path) -> None:
    """Both units' rows and a plot of each unit's eval loss over several DHT reads; a screenshot."""
    if CHROMIUM is None:
        assert not os.environ.get("CI"), "CI must install Chromium (.ci/run: apt-get install chromium)"
        warnings.warn(
            "no Chromium on this machine (apt-get install chromium): the dashboard was not checked", stacklevel=1
        )
        return
    from playwright.sync_api import sync_playwright

    url = swarm.dashboard("dashboard", [swarm.bootstrap_maddr or ""])
    expected = peer_ids(swarm)
    screenshot = tmp_path / "dashboard.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            page.goto(url)
            page.wait_for_function(
                "(ids) => ids.every((id) => document.querySelector(`tr[data-peer='${id}']`))", arg=sorted(expected),
                timeout=60_000,
            )  # fmt: skip
            page.wait_for_function(  # a plotted eval loss of each unit, read from the DHT over several reads
                "() => { const plot = document.getElementById('eval-plot');"
                " return plot.data && plot.data.filter((t) => t.name !== 'swarm mean'"
                " && t.y.filter((v) => v !== null).length >= 2).length >= 2; }",
                timeout=60_000,
            )
            rows = page.locator("tr[data-peer]")
            assert rows.count() == 2
            for index in range(2):
                cells = rows.nth(index).locator("td").all_inner_texts()
                assert cells[1] == "live" and int(cells[2]) > 0 and cells[6] != "n/a", cells
            assert page.locator("#live-peers").inner_text() == "2 / 2"
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("DASHBOARD_SCREENSHOT"):
        shutil.copyfile(screenshot, os.environ["DASHBOARD_SCREENSHOT"])


def check_status_json(swarm: Swarm) -> None:
    """One object: every unit live with its eval loss, and the swarm's totals."""
    command = [sys.executable, "-m", "p2p_diloco.cli", "status", "--json", "--run-id", swarm.run_id,
               "--initial-peers", swarm.bootstrap_maddr or ""]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert {peer["peer_id"] for peer in snapshot["peers"]} == peer_ids(swarm)
    assert all(peer["state"] == "live" and peer["eval_loss"] is not None for peer in snapshot["peers"])
    assert snapshot["swarm"]["live_peers"] == 2 and snapshot["swarm"]["tokens_per_s"] > 0
    assert "admission" not in snapshot["peers"][0]


def check_units_files_after_a_clean_stop(swarm: Swarm) -> None:
    """TensorBoard event files with every step's loss and the rounds' scalars, run.json, one console line per
    round with its evals and no exception text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert swarm.stop(list(UNITS)) == [0, 0]
    for name in UNITS:
        work_dir = swarm.root / name
        stop = swarm.events(name, Stop)[-1]
        accumulator = EventAccumulator(str(work_dir / "tensorboard"))
        accumulator.Reload()
        scalars = set(accumulator.Tags()["scalars"])
        expected = {"train/loss", "train/lr", "train/tokens_per_s", "outer/group_size", "outer/seconds",
                    "outer/drift", "outer/goodput", "outer/wire_bytes_sent", "eval/loss"}  # fmt: skip
        assert expected <= scalars, expected - scalars
        assert [event.step for event in accumulator.Scalars("train/loss")] == list(range(1, stop.inner_step + 1))
        assert max(event.value for event in accumulator.Scalars("outer/group_size")) == 2
        run = json.loads((work_dir / "run.json").read_text())
        assert run["peer_id"] == swarm.events(name, Join)[-1].peer_id and run["config"]["run"]["report_to"] == [
            "tensorboard"
        ]
        assert run["keys"]["progress"] == f"{swarm.run_id}_progress" and len(run["keys"]["fragment_rounds"]) == 1
        console = (work_dir / "stdout.log").read_text()
        # a round's eval is appended to its line, or has a line of its own when the next round began first
        assert "merged in a group of 2" in console and "eval loss " in console
        assert "Exception" not in console and "Traceback" not in console
