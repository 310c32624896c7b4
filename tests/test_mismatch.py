"""Mismatches made visible (p2p_diloco/unit/mismatch.py): units of the run that never meet this one, and a unit alone
told which other runs have units training (a typo in --run-id)."""

from __future__ import annotations

import logging

import pytest
from fakes import FakeRecords

from p2p_diloco.config import OuterSection
from p2p_diloco.network.records import PeerProgress, RunListing
from p2p_diloco.rounds.plan import RoundPlan
from p2p_diloco.unit import mismatch
from p2p_diloco.unit.mismatch import ALONE_ROUNDS, REREAD_ROUNDS, MismatchWatch, settings_differences, strangers

MINE = "fragments=1;payload=pseudo_gradient;codec=fp32;lr=1.0;momentum=0.0;nesterov=True"


def record(peer_id: str, fingerprint: str = "f" * 16, settings: str = MINE) -> PeerProgress:
    return PeerProgress(peer_id=peer_id, inner_step=1, outer_round=1, tokens_per_s=1.0, loss=1.0, last_seen=1.0,
                        group_size=1, model_fingerprint=fingerprint, round_settings=settings)  # fmt: skip


def test_the_settings_a_plan_publishes_name_what_its_round_keys_hash() -> None:
    shapes = [(4, 4), (4,)]
    plain = RoundPlan.from_config(OuterSection(), shapes, frozenset())
    int8 = RoundPlan.from_config(OuterSection(codec="int8"), shapes, frozenset())
    assert plain.round_settings().startswith("fragments=1;payload=")
    assert settings_differences(plain.round_settings(), int8.round_settings()) == [
        "codec=int8 (here: fp32)",
        "payload=pseudo-gradient (here: proposal)",  # a lossy codec carries pseudo-gradients (plan.py)
    ]
    assert (plain.round_settings() == int8.round_settings()) == (
        plain.keys("r", "f").fragment_round(0) == int8.keys("r", "f").fragment_round(0)
    )


def test_strangers_are_units_of_another_model_or_other_round_settings() -> None:
    census = {
        "me": record("me"),
        "alike": record("alike"),
        "older": record("older", settings=""),  # a unit of a version that publishes no settings: not judged
        "model": record("model", fingerprint="0" * 16),
        "momentum": record("momentum", settings=MINE.replace("momentum=0.0", "momentum=0.5")),
    }
    assert strangers(census, "me", "f" * 16, MINE) == {
        "model": f"model {'0' * 16} (here: {'f' * 16})",
        "momentum": "momentum=0.5 (here: 0.0)",
    }


def test_a_unit_names_the_strangers_of_its_run_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    watch = MismatchWatch(FakeRecords(), "run", "me", "f" * 16, MINE)
    odd = record("odd", settings=MINE.replace("codec=fp32", "codec=fp16"))
    with caplog.at_level(logging.WARNING, logger="p2p_diloco"):
        watch.census({"me": record("me"), "odd": odd})
        watch.census({"me": record("me"), "odd": odd})
    assert caplog.text.count("never average with this one") == 1
    assert "1 unit(s) of run run never average with this one: odd…: codec=fp16 (here: fp32)" in caplog.text


def test_a_unit_alone_is_told_which_other_runs_have_units_training(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mismatch, "shared_time", lambda: 100.0)
    records = FakeRecords(runs={"tiny-moby-dick": RunListing(run_id="tiny-moby-dick", last_seen=88.0),
                                "tiny-moby-dik": RunListing(run_id="tiny-moby-dik", last_seen=99.0)})  # fmt: skip
    watch = MismatchWatch(records, "tiny-moby-dik", "me", "f" * 16, MINE)
    watch.poll()
    assert records.listed == 1  # its own run listed at once (and then every LISTING_EVERY_S)
    for _ in range(ALONE_ROUNDS - 1):
        watch.round_merged(group_size=1)
    watch.round_merged(group_size=2)  # a round with another unit ends the streak
    for _ in range(ALONE_ROUNDS - 1):
        watch.round_merged(group_size=1)
    assert records.runs_reads == 0
    watch.round_merged(group_size=1)
    assert records.runs_reads == 1
    with caplog.at_level(logging.INFO, logger="p2p_diloco"):
        watch.poll()
        for _ in range(REREAD_ROUNDS):
            watch.round_merged(group_size=1)
        watch.poll()  # read again: the same runs, so nothing more is said
    assert records.runs_reads == 2 and records.listed == 1
    assert caplog.text.count("other runs have units training") == 1
    assert "'tiny-moby-dick' (listed 12 s ago); check --run-id" in caplog.text
