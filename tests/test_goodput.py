"""The goodput ledger of a work directory: create, reload, corrupt files, atomic saves, the goodput ratio."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from p2p_diloco.unit.goodput import LEDGER_FILE, GoodputLedger


def test_a_missing_ledger_is_created_and_saved(tmp_path: Path) -> None:
    path = tmp_path / "work" / LEDGER_FILE
    ledger = GoodputLedger.load_or_create(path, now=1000.0)
    assert ledger == GoodputLedger(allocated_since=1000.0, starts=1)
    assert GoodputLedger.model_validate_json(path.read_text()) == ledger


def test_reload_counts_the_start_and_keeps_the_first_start_time(tmp_path: Path) -> None:
    path = tmp_path / LEDGER_FILE
    first = GoodputLedger.load_or_create(path, now=1000.0)
    first.record_step(2.0, 64)
    first.record_merge(1.5, 32)
    first.save(path)
    again = GoodputLedger.load_or_create(path, now=5000.0)
    assert again.starts == 2 and again.allocated_since == 1000.0
    assert (again.compute_s, again.useful_compute_s, again.tokens, again.useful_tokens) == (2.0, 1.5, 64, 32)


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"\xff\xfe", b'{"allocated_since": -1}', b'{"allocated_since": 1, "unknown": 2}', b"[]"],
)
def test_an_invalid_ledger_starts_fresh_with_a_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / LEDGER_FILE
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.unit.goodput"):
        ledger = GoodputLedger.load_or_create(path, now=42.0)
    assert ledger == GoodputLedger(allocated_since=42.0, starts=1)
    assert "goodput ledger unreadable" in caplog.text and str(path) in caplog.text
    assert GoodputLedger.model_validate_json(path.read_text()) == ledger  # the bad file was replaced


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / LEDGER_FILE
    (tmp_path / f".{LEDGER_FILE}.killed.tmp").write_text("{")  # left by a writer killed mid-save
    ledger = GoodputLedger.load_or_create(path, now=0.0)
    for _ in range(3):
        ledger.record_step(1.0, 10)
        ledger.save(path)
    assert [entry.name for entry in tmp_path.iterdir()] == [LEDGER_FILE]
    assert GoodputLedger.model_validate_json(path.read_text()).compute_s == 3.0


def test_goodput_is_useful_compute_over_allocated_time() -> None:
    ledger = GoodputLedger(allocated_since=100.0, compute_s=80.0, useful_compute_s=50.0)
    assert ledger.allocated_s(200.0) == 100.0
    assert ledger.goodput(200.0) == pytest.approx(0.5)
    assert ledger.allocated_s(100.0) == 0.0 and ledger.goodput(100.0) == 0.0
    assert ledger.allocated_s(50.0) == 0.0 and ledger.goodput(50.0) == 0.0  # clock behind the first start


def test_steps_and_merges_accumulate() -> None:
    ledger = GoodputLedger(allocated_since=0.0)
    ledger.record_step(0.25, 64)
    ledger.record_step(0.5, 64)
    ledger.record_merge(0.75, 128)
    assert (ledger.compute_s, ledger.tokens, ledger.useful_compute_s, ledger.useful_tokens) == (0.75, 128, 0.75, 128)
