"""The shipped TOML files load through the config module, and the entry scripts start."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from p2p_diloco.config import PeerConfig
from p2p_diloco.presets import PRESETS as SHIPPED_PRESETS
from p2p_diloco.settings import load_config, load_network_section

ROOT = Path(__file__).resolve().parents[1]
BOOTSTRAP_TOML = ROOT / "bootstrap" / "bootstrap.toml"
PRESETS = sorted((ROOT / "peers" / "configs").glob("*.toml"))


def test_the_presets_are_shipped():
    assert {path.stem for path in PRESETS} >= {"cpu", "gpu"}
    assert "tiny" in SHIPPED_PRESETS


@pytest.mark.parametrize("path", PRESETS, ids=lambda path: path.stem)
def test_preset_loads_with_a_run_id_and_no_initial_peers(path: Path):
    config = load_config(toml_path=path)
    assert isinstance(config, PeerConfig)
    assert "run_id" in _toml_network(path), "a preset must name its run"
    assert config.network.initial_peers == [], "the user passes --initial-peers"


def test_bootstrap_toml_loads_as_a_network_section():
    network = load_network_section(argparse.Namespace(config=BOOTSTRAP_TOML))
    assert network.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]
    assert network.identity_path
    assert network.initial_peers == []


def test_the_tiny_preset_names_the_shipped_model_and_corpus_from_any_folder(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(preset="tiny")
    assert config.model.model_config_path is not None
    assert (Path(config.model.model_config_path) / "config.json").is_file()
    assert (Path(config.model.model_config_path) / "tokenizer.json").is_file()
    assert Path(config.data.dataset).is_dir() and any(Path(config.data.dataset).iterdir())
    assert config.network.run_id == "tiny-moby-dick" and config.run.threads == 1


def test_a_config_file_and_flags_override_the_preset(tmp_path: Path):
    toml = tmp_path / "mine.toml"
    toml.write_text('[model]\nmodel = "some/hub-model"\n[outer]\ninner_steps = 5\n')
    args = argparse.Namespace(preset="tiny", config=toml, **{"data.seq_len": 32})
    config = load_config(args)
    assert config.model.model == "some/hub-model" and config.model.model_config_path is None  # the file's source
    assert config.outer.inner_steps == 5 and config.data.seq_len == 32
    assert config.data.batch_size == 8  # the preset's, where nothing overrides it


def test_preset_values_are_overridden_by_flags():
    config = load_config(toml_path=ROOT / "peers" / "configs" / "cpu.toml", outer__inner_steps=7)
    assert config.outer.inner_steps == 7


@pytest.mark.parametrize("script", ["bootstrap/run_bootstrap.py", "peers/run_peer.py"])
def test_entry_script_help_exits_zero(script: str):
    result = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "--initial-peers" in result.stdout


def _toml_network(path: Path) -> dict:
    return tomllib.loads(path.read_text()).get("network", {})
