"""Atomic checkpoints: round trip, corrupt files, SIGKILL in the middle of saves, leftover temp files."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_diloco.checkpoint import CHECKPOINT_FORMAT, CheckpointError, load_checkpoint, save_checkpoint


def _payload() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "outer_round": 7,
        "tokens": 123_456,
        "lr": 0.7,
        "run_id": "demo",
        "last_eval": None,
        "global_params": [torch.randn(3, 4), torch.randn(3)],
        "momentum": [torch.zeros(3, 4), torch.zeros(3)],
        "local_params": [torch.randn(3, 4).bfloat16()],
        "inner_optimizer": optimizer.state_dict(),
    }


def _assert_same(expected: Any, actual: Any) -> None:
    assert type(expected) is type(actual)
    if isinstance(expected, torch.Tensor):
        assert expected.dtype == actual.dtype
        assert torch.equal(expected, actual)
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys()
        for key in expected:
            _assert_same(expected[key], actual[key])
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual)
        for a, b in zip(expected, actual):
            _assert_same(a, b)
    else:
        assert expected == actual


def _temp_files(directory: Path) -> list[Path]:
    return [path for path in directory.iterdir() if path.name.endswith(".tmp")]


def test_round_trip_keeps_tensors_numbers_and_optimizer_state(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "checkpoint.pt"
    payload = _payload()
    save_checkpoint(path, payload)
    _assert_same(payload, load_checkpoint(path))
    assert _temp_files(path.parent) == []


def test_second_save_replaces_the_first(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1})
    save_checkpoint(path, {"step": 2})
    assert load_checkpoint(path) == {"step": 2}


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path / "absent.pt") is None


@pytest.mark.parametrize("keep_fraction", [0.0, 0.3, 0.9])
def test_truncated_file_is_a_one_line_error(tmp_path: Path, keep_fraction: float) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _payload())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert str(path) in str(error.value)
    assert "\n" not in str(error.value)


def test_garbage_file_is_an_error_that_never_advises_loading_it_unsafely(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt or truncated") as error:
        load_checkpoint(path)
    assert "weights_only" not in str(error.value) and "move it out of the work dir" in str(error.value)


class _NotAllowed:
    pass


def test_objects_outside_the_weights_only_allow_list_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "payload": {"object": _NotAllowed()}}, path)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path)
    assert "\n" not in str(error.value) and "weights_only" not in str(error.value)


@pytest.mark.parametrize(
    "stored",
    [
        [1, 2, 3],
        {"payload": {"step": 1}},
        {"format": CHECKPOINT_FORMAT + 1, "payload": {}},
        {"format": CHECKPOINT_FORMAT, "payload": 3},
    ],
)
def test_wrong_format_or_layout_is_an_error(tmp_path: Path, stored: Any) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save(stored, path)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_a_tensor_changed_after_saving_makes_the_checkpoint_corrupt(tmp_path: Path) -> None:
    """``torch.load`` reads a file whose tensor bytes changed without complaint; the stored SHA-256 does not match."""
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _payload())
    stored = torch.load(path, weights_only=True)
    stored["payload"]["global_params"][0][0, 0] += 1.0
    torch.save(stored, path)
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        load_checkpoint(path)
    del stored["sha256"]  # as written before checksums: loads unchecked
    torch.save(stored, path)
    assert load_checkpoint(path)["outer_round"] == 7


def test_failed_save_keeps_previous_checkpoint_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1})
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(path, {"step": 2, "unpicklable": lambda: None})
    assert load_checkpoint(path) == {"step": 1}
    assert _temp_files(tmp_path) == []


def test_leftover_temp_files_do_not_break_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    leftover = tmp_path / ".checkpoint.pt.abc123.tmp"
    leftover.write_bytes(b"half a checkpoint")
    other = tmp_path / ".other.pt.abc123.tmp"
    other.write_bytes(b"belongs to another checkpoint")
    save_checkpoint(path, {"step": 3})
    assert load_checkpoint(path) == {"step": 3}
    assert _temp_files(tmp_path) == [other]


_SAVE_LOOP = """
import sys
import torch
from pathlib import Path
from p2p_diloco.checkpoint import save_checkpoint

path = Path(sys.argv[1])
step = 0
while True:
    step += 1
    save_checkpoint(path, {"step": step, "weights": torch.full((5_000_000,), float(step))})  # 20 MB
"""


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime): a saved file is never modified after its rename, so each save has its own identity."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


def _wait_for_saves(path: Path, saves: int, process: subprocess.Popen[bytes], deadline: float) -> None:
    """Poll until ``path`` has been replaced by at least ``saves`` new files (never stops early)."""
    stale = _file_identity(path)
    seen: set[tuple[int, int]] = set()
    while len(seen) < saves:
        assert process.poll() is None, f"saver exited early with code {process.returncode}"
        assert time.monotonic() < deadline, f"saver did not write {saves} checkpoints in time"
        identity = _file_identity(path)
        if identity is not None and identity != stale:
            seen.add(identity)
        time.sleep(0.002)


def test_sigkill_during_repeated_saves_never_leaves_an_unloadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    rng = random.Random(1234)
    last_step = 0
    for trial in range(2):
        process = subprocess.Popen([sys.executable, "-c", _SAVE_LOOP, str(path)])
        try:
            _wait_for_saves(path, 2, process, deadline=time.monotonic() + 60)
            delay = rng.uniform(0.0, 0.15)
            time.sleep(delay)
        finally:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        payload = load_checkpoint(path)
        assert payload is not None, f"trial {trial}: checkpoint vanished (kill after {delay:.3f}s)"
        assert payload["step"] >= 2
        assert torch.equal(payload["weights"], torch.full((5_000_000,), float(payload["step"])))
        last_step = payload["step"]
    save_checkpoint(path, {"step": last_step + 1})
    assert load_checkpoint(path) == {"step": last_step + 1}
    assert _temp_files(tmp_path) == []
