"""The dashboard's history and the swarm snapshot it serves, without a network; its web app answered in-process."""

from __future__ import annotations

from fastapi.testclient import TestClient
from test_records import progress

from p2p_diloco.ops.dashboard import SwarmHistory, create_app
from p2p_diloco.ops.status import format_table, swarm_snapshot
from p2p_diloco.trust import MAX_ROUND_LEAD


def test_snapshot_totals_count_live_peers_only() -> None:
    now = 1000.0
    rows = [
        progress("b", last_seen=now, tokens_per_s=100.0, eval_loss=4.0, useful_compute_s=9.0, allocated_s=10.0),
        progress("a", last_seen=now - 5, tokens_per_s=50.0, eval_loss=None, useful_compute_s=1.0, allocated_s=10.0),
        progress("c", last_seen=now - 600, tokens_per_s=999.0, eval_loss=1.0),  # stale
        progress("d", last_seen=now, tokens_per_s=999.0, eval_loss=1.0, phase="left"),
    ]
    snapshot = swarm_snapshot("run", rows, now)
    assert [(peer["peer_id"], peer["state"]) for peer in snapshot["peers"]] == [
        ("a", "live"), ("b", "live"), ("c", "stale"), ("d", "left")
    ]  # fmt: skip
    assert snapshot["swarm"] == {"live_peers": 2, "peers": 4, "tokens_per_s": 150.0, "goodput": 0.5,
                                 "eval_loss": 4.0, "max_outer_round": 3, "mean_group_size": 2.0,
                                 "consensus_distance": None, "lineages": None}  # no probe: none to compare  # fmt: skip


def test_a_peer_claiming_a_round_far_ahead_is_shown_refused_and_not_counted() -> None:
    now = 1000.0
    rows = [progress(peer, last_seen=now, outer_round=5, tokens_per_s=10.0) for peer in ("a", "b")]
    rows += [
        progress("c", last_seen=now, outer_round=5 + MAX_ROUND_LEAD, tokens_per_s=10.0),  # still believed
        progress("r", last_seen=now, outer_round=6 + MAX_ROUND_LEAD, tokens_per_s=999.0),
        progress("x", last_seen=now, outer_round=10**6, phase="left"),  # a peer that left claims nothing
    ]
    snapshot = swarm_snapshot("run", rows, now)
    states = {peer["peer_id"]: peer["state"] for peer in snapshot["peers"]}
    assert states == {"a": "live", "b": "live", "c": "live", "r": "refused", "x": "left"}
    assert snapshot["swarm"]["live_peers"] == 3 and snapshot["swarm"]["tokens_per_s"] == 30.0
    assert "(refused)" in format_table(rows, now, stale_after_s=60).splitlines()[4]


def test_history_gives_each_peer_a_series_with_gaps_where_it_was_not_live() -> None:
    history = SwarmHistory("run", max_points=3)
    history.add([progress("a", last_seen=10.0, eval_loss=5.0)], now=10.0)
    history.add([progress("a", last_seen=20.0, eval_loss=4.0), progress("b", last_seen=20.0, group_size=1)], 20.0)
    history.add([progress("b", last_seen=30.0, eval_loss=3.0)], now=30.0)
    history.add([progress("b", last_seen=40.0, eval_loss=2.5, group_size=2)], now=40.0)  # the first read drops out
    view = history.view()
    assert view["history"]["time"] == [20.0, 30.0, 40.0] and view["reads"] == 3
    assert view["history"]["eval_loss"] == {"a": [4.0, None, None], "b": [None, 3.0, 2.5]}
    assert view["history"]["group_size"] == {"a": [2, None, None], "b": [1, 2, 2]}
    assert view["history"]["swarm_eval_loss"] == [4.0, 3.0, 2.5]
    assert [peer["peer_id"] for peer in view["peers"]] == ["b"]


def test_app_serves_the_page_plotly_and_the_data_offline() -> None:
    history = SwarmHistory("run")
    history.add([progress("a", last_seen=10.0, eval_loss=5.0)], now=10.0)
    client = TestClient(create_app(history))
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/plotly.min.js">' in page.text and "https://" not in page.text
    script = client.get("/plotly.min.js")
    assert script.status_code == 200 and len(script.content) > 1_000_000 and b"plotly" in script.content[:2000]
    data = client.get("/api/swarm").json()
    assert data["run_id"] == "run" and data["peers"][0]["peer_id"] == "a" and data["history"]["time"] == [10.0]
