"""Bad input: one clear ``error:`` line, exit status 2, bounded time, and nothing in the work dirs overwritten."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from swarms import close_leaving_nothing, quick_swarm

from p2p_diloco.presets import CORPUS, TINY_MODEL
from p2p_diloco.unit.events import Join

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/QmTabXVwgtEVWSWAHrsg2eYXD65Laf44CqQh96Hpmjd4UB"


def join(*flags: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "p2p_diloco.cli", "join", "--no-progress", *flags],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=ENV,
        stdin=subprocess.DEVNULL,
    )


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def work_dirs(tmp_path: Path) -> dict[str, Path]:
    """A work dir with a checkpoint and metrics, and an exported model, that a failing run must not touch."""
    work, save = tmp_path / "work", tmp_path / "export"
    for directory, name in ((work, "checkpoint.pt"), (work, "metrics.jsonl"), (save, "config.json")):
        directory.mkdir(exist_ok=True)
        (directory / name).write_text(f"sentinel {name}")
    return {"work": work, "save": save}


def assert_untouched(work_dirs: dict[str, Path]) -> None:
    for directory in work_dirs.values():
        for path in directory.iterdir():
            assert path.read_text() == f"sentinel {path.name}", path
    assert sorted(path.name for path in work_dirs["work"].iterdir()) == ["checkpoint.pt", "metrics.jsonl"]


def flags(work_dirs: dict[str, Path], **overrides: str | None) -> list[str]:
    """The join flags of a short run in ``work_dirs``, with ``overrides`` (a value of "" drops the flag, None gives it
    without a value)."""
    values = {
        "--model-config": str(TINY_MODEL),
        "--dataset": str(CORPUS),
        "--work-dir": str(work_dirs["work"]),
        "--save-dir": str(work_dirs["save"]),
        "--max-steps": "5",
        **overrides,
    }
    return [item for flag, value in values.items() if value != "" for item in (flag, value) if item is not None]


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"--model-config": "", "--model": "/nonexistent/model-dir"}, ["/nonexistent/model-dir"]),
        ({"--model-config": "", "--model": "no-such-org/no-such-model"}, ["no-such-org/no-such-model"]),
        ({"--dataset": "/nonexistent/corpus.txt"}, ["/nonexistent/corpus.txt"]),
        ({"--initial-peers": "/ip4/127.0.0.1/tcp/notaport"}, ["--initial-peers"]),
        ({"--outer-lr": "-1"}, ["--outer-lr"]),
        ({"--inner-steps": "0"}, ["--inner-steps"]),
        ({"--quorum": "9", "--target-group-size": "4"}, ["--quorum"]),
        ({"--run-id": "bad/run"}, ["--run-id"]),
        ({"--nproc-per-node": "0"}, ["--nproc-per-node"]),
        ({"--autocast": "bfloat16", "--dtype": "bfloat16"}, ["--autocast"]),
        ({"--attn-implementation": "no-such-kernel"}, ["no-such-kernel"]),
        ({"--shard-model": None}, ["--shard-model", "--nproc-per-node"]),
        ({"--shard-model": None, "--nproc-per-node": "2", "--lora-r": "4"}, ["--shard-model", "--lora-r"]),
        ({"--shard-model": None, "--nproc-per-node": "2", "--autocast": "float16"}, ["--shard-model", "float16"]),
    ],
    ids=[
        "model-path",
        "model-hub-name",
        "dataset-path",
        "multiaddr",
        "outer-lr",
        "inner-steps",
        "quorum",
        "run-id",
        "nproc-per-node",
        "autocast-dtype",
        "attention-kernel",
        "shard-one-rank",
        "shard-lora",
        "shard-float16",
    ],  # fmt: skip
)
def test_bad_input_is_refused_cleanly(work_dirs: dict[str, Path], overrides: dict, fragments: list[str]) -> None:
    assert_user_error(join(*flags(work_dirs, **overrides)), *fragments)
    assert_untouched(work_dirs)


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"--dataset": "no-such-org/no-such-dataset"}, ["no-such-org/no-such-dataset", "hub"]),
        ({"--dataset": "/nonexistent/corpus.txt"}, ["/nonexistent/corpus.txt"]),
        ({"--initial-peers": "/ip4/127.0.0.1/tcp/notaport"}, ["--initial-peers"]),
    ],
    ids=["dataset-hub-name", "dataset-path", "multiaddr"],
)
def test_data_and_addresses_are_checked_before_anything_starts(
    tmp_path: Path, overrides: dict, fragments: list[str]
) -> None:
    """Refused before the model is built, the DHT starts or the work dir is created."""
    fresh = {"work": tmp_path / "new-work", "save": tmp_path / "new-save"}
    result = join(*flags(fresh, **overrides), "--log-level", "INFO")
    assert_user_error(result, *fragments)
    assert "model ready" not in result.stderr and "dht started" not in result.stderr, result.stderr
    assert not fresh["work"].exists() and not fresh["save"].exists()


def test_a_host_port_in_use_is_named(work_dirs: dict[str, Path]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = join(*flags(work_dirs, **{"--host-maddrs": f"/ip4/127.0.0.1/tcp/{port}"}))
    assert_user_error(result, f"port {port} is already in use")
    assert "Loop is closed" not in result.stderr
    assert_untouched(work_dirs)


def test_an_unknown_preset_is_one_line() -> None:
    result = join("--preset", "tny")
    assert result.stderr == "error: unknown preset 'tny' (presets: tiny)\n" and result.returncode == 2


def test_unreachable_bootstrap_fails_within_the_join_timeout(work_dirs: dict[str, Path]) -> None:
    started = time.monotonic()
    result = join(*flags(work_dirs, **{"--initial-peers": UNREACHABLE, "--join-timeout-s": "5"}))
    elapsed = time.monotonic() - started
    assert_user_error(result, "initial peer")
    assert elapsed < 40, f"took {elapsed:.1f} s"
    assert_untouched(work_dirs)


@pytest.mark.swarm
def test_peer_with_another_model_is_refused(tmp_path: Path, work_dirs: dict[str, Path]) -> None:
    other = tmp_path / "other-model"
    other.mkdir()
    config = (TINY_MODEL / "config.json").read_text().replace('"n_layer": 2', '"n_layer": 3')
    assert config != (TINY_MODEL / "config.json").read_text()
    (other / "config.json").write_text(config)
    swarm = quick_swarm(tmp_path / "swarm")
    try:
        maddr = swarm.bootstrap("bootstrap")
        swarm.unit("member", [maddr])
        swarm.wait_for(lambda: swarm.events("member", Join), timeout_s=90, what="the first peer to join")
        result = join(
            *flags(work_dirs, **{"--model-config": str(other), "--tokenizer": str(TINY_MODEL)}),
            "--initial-peers",
            maddr,
            "--run-id",
            swarm.run_id,
        )
        assert_user_error(result, "fingerprint")
        assert_untouched(work_dirs)
        assert all(r.group_size == 1 for r in swarm.rounds("member"))
    finally:
        close_leaving_nothing(swarm)


@pytest.mark.parametrize("command", ["bootstrap", "join", "status", "demo"])
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "p2p_diloco.cli", command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "usage: p2p-diloco" in result.stdout, result.stderr
