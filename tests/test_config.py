"""Configuration: TOML file + CLI flags + keyword overrides, validated into one-line ConfigErrors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from p2p_diloco.config import SECTIONS, ConfigError, PeerConfig
from p2p_diloco.settings import add_config_arguments, load_config

REQUIRED = dict(model__model="gpt2", data__dataset="corpus.txt")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return parser.parse_args(list(argv))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


def _error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(**kwargs)  # type: ignore[arg-type]
    message = str(error.value)
    assert "\n" not in message
    return message


def test_defaults_with_overrides() -> None:
    config = load_config(**REQUIRED, outer__inner_steps=10)
    assert isinstance(config, PeerConfig)
    assert config.model.model == "gpt2" and config.model.model_config_path is None
    assert config.data.dataset == "corpus.txt"
    assert config.outer.inner_steps == 10
    assert config.outer.outer_lr == 1.0 and config.outer.outer_momentum == 0.0 and config.outer.nesterov


def test_every_field_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    destinations = {action.dest for action in parser._actions}
    for section_name, section in SECTIONS.items():
        for name in section.model_fields:
            assert f"{section_name}.{name}" in destinations


def test_cli_flags_are_parsed_and_validated() -> None:
    args = _parse(
        "--model",
        "gpt2",
        "--dataset",
        "d",
        "--outer-lr",
        "0.5",
        "--no-nesterov",
        "--initial-peers",
        "/ip4/1.2.3.4/tcp/1/p2p/QmA",
        "/ip4/1.2.3.5/tcp/1/p2p/QmB",
        "--max-steps",
        "10",
    )
    config = load_config(args)
    assert config.outer.outer_lr == 0.5
    assert config.outer.nesterov is False
    assert config.network.initial_peers == ["/ip4/1.2.3.4/tcp/1/p2p/QmA", "/ip4/1.2.3.5/tcp/1/p2p/QmB"]
    assert config.run.max_steps == 10


def test_flags_not_given_keep_defaults() -> None:
    config = load_config(_parse("--model", "gpt2", "--dataset", "d"))
    assert config.outer == type(config.outer)()
    assert config.run.progress is True


def test_toml_file_then_cli_then_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[model]\nmodel = "gpt2"\n[data]\ndataset = "d"\nseq_len = 64\n'
        "[outer]\ninner_steps = 50\nouter_lr = 0.3\nquorum = 2\n",
    )
    config = load_config(_parse("--config", str(path), "--inner-steps", "30"), outer__outer_lr=0.9)
    assert config.data.seq_len == 64
    assert config.outer.quorum == 2
    assert config.outer.inner_steps == 30
    assert config.outer.outer_lr == 0.9
    assert load_config(toml_path=path).outer.inner_steps == 50


def test_model_config_flag_selects_pretraining() -> None:
    config = load_config(_parse("--model-config", "configs/tiny.json", "--dataset", "d"))
    assert config.model.model is None and config.model.model_config_path == "configs/tiny.json"


@pytest.mark.parametrize(
    "argv",
    [["--dataset", "d"], ["--model", "gpt2", "--model-config", "c.json", "--dataset", "d"]],
    ids=["neither", "both"],
)
def test_exactly_one_model_source(argv: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(_parse(*argv))
    assert "--model" in str(error.value) and "--model-config" in str(error.value)


def test_unknown_toml_section(tmp_path: Path) -> None:
    path = _write(tmp_path, '[model]\nmodel = "gpt2"\n[data]\ndataset = "d"\n[optimizer]\nlr = 1\n')
    assert "unknown section [optimizer]" in _error(toml_path=path)


def test_unknown_toml_key(tmp_path: Path) -> None:
    path = _write(tmp_path, '[model]\nmodel = "gpt2"\n[data]\ndataset = "d"\n[outer]\nlearning_rate = 1\n')
    assert "outer.learning_rate" in _error(toml_path=path)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    assert "not found" in _error(toml_path=tmp_path / "absent.toml")
    assert "not valid TOML" in _error(toml_path=_write(tmp_path, "[model\n"))


def test_missing_dataset_names_the_flag() -> None:
    assert "--dataset" in _error(model__model="gpt2")


@pytest.mark.parametrize(
    "override, flag",
    [
        (dict(outer__outer_lr=-1.0), "--outer-lr"),
        (dict(outer__outer_momentum=1.0), "--outer-momentum"),
        (dict(outer__inner_steps=0), "--inner-steps"),
        (dict(data__seq_len="many"), "--seq-len"),
        (dict(model__dtype="int8"), "--dtype"),
        (dict(network__run_id="has space"), "--run-id"),
        (dict(inner__grad_accum=0), "--grad-accum"),
        (dict(run__max_time_s=0), "--max-time-s"),
    ],
)
def test_invalid_values_name_the_flag(override: dict[str, object], flag: str) -> None:
    assert f"({flag})" in _error(**REQUIRED, **override)


def test_invalid_cli_value_names_the_flag() -> None:
    args = _parse("--model", "gpt2", "--dataset", "d", "--outer-lr", "fast")
    with pytest.raises(ConfigError, match=r"\(--outer-lr\)"):
        load_config(args)


@pytest.mark.parametrize(
    "override, flag",
    [
        (dict(outer__quorum=9, outer__target_group_size=8), "--quorum"),
        (dict(outer__min_window_s=5.0, outer__max_window_s=1.0), "--min-window-s"),
        (dict(outer__min_grace_s=5.0, outer__max_grace_s=1.0), "--min-window-s"),  # the old names
    ],
)
def test_cross_field_errors_name_the_flag(override: dict[str, object], flag: str) -> None:
    assert flag in _error(**REQUIRED, **override)


@pytest.mark.parametrize("override", [dict(outer_lr=1.0), dict(optimizer__lr=1.0)])
def test_malformed_override_keys_are_config_errors(override: dict[str, object]) -> None:
    _error(**REQUIRED, **override)


def test_the_matchmaking_windows_old_names_still_work_as_flags_toml_keys_and_overrides(tmp_path: Path) -> None:
    toml = _write(tmp_path, '[model]\nmodel = "gpt2"\n[data]\ndataset = "c.txt"\n[outer]\ngrace_fraction = 0.3\n')
    config = load_config(_parse("--config", str(toml), "--min-grace-s", "2", "--max-window-s", "9"))
    assert (config.outer.window_fraction, config.outer.min_window_s, config.outer.max_window_s) == (0.3, 2.0, 9.0)
    assert load_config(**REQUIRED, outer__max_grace_s=7.0).outer.max_window_s == 7.0
    # whatever the name, the higher layer wins: a flag over the file, an override over a flag
    assert load_config(_parse("--config", str(toml), "--window-fraction", "0.2")).outer.window_fraction == 0.2
    assert load_config(_parse("--config", str(toml)), outer__window_fraction=0.1).outer.window_fraction == 0.1
    assert load_config(toml_path=toml, outer__grace_fraction=0.4).outer.window_fraction == 0.4
