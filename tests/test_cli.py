"""The command line itself: --version, --log-level on either side of the command, --print-config, and config errors
reported before any heavy import."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco import __version__
from p2p_diloco.cli import _parser, main
from p2p_diloco.config import SECTIONS, ConfigError, flag_of
from p2p_diloco.presets import CORPUS, TINY_MODEL
from p2p_diloco.settings import VOLUNTEER_SETTINGS, load_config


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"p2p-diloco {__version__}"
    assert __version__[0].isdigit()


@pytest.mark.parametrize(
    "argv, level",
    [
        (["join"], "INFO"),
        (["--log-level", "debug", "join"], "DEBUG"),
        (["join", "--log-level", "warning"], "WARNING"),
        (["--log-level", "debug", "join", "--log-level", "error"], "ERROR"),
        (["status", "--log-level", "DEBUG"], "DEBUG"),
    ],
)
def test_log_level_is_taken_before_or_after_the_command(argv: list[str], level: str) -> None:
    assert _parser().parse_args(argv).log_level == level


def test_unknown_log_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["join", "--log-level", "loud"])
    assert exit_info.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_print_config_reads_back_into_the_same_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--preset", "tiny", "--inner-steps", "7", "--report-to", "none", "--initial-peers", "/ip4/1.2.3.4/tcp/5"]
    assert main(["join", *flags, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("[model]\n") and "inner_steps = 7" in printed
    assert "\nmodel_config = " in printed and "model_config_path" not in printed  # the keys are the flags' names
    path = tmp_path / "resolved.toml"
    path.write_text(printed)
    assert load_config(toml_path=path) == load_config(_parser().parse_args(["join", *flags]))


def test_a_config_error_is_reported_before_any_heavy_import() -> None:
    code = (
        "import sys; from p2p_diloco.cli import main; code = main(sys.argv[1:]); "
        "heavy = sorted(m for m in ('torch', 'hivemind', 'transformers', 'datasets') if m in sys.modules); "
        "print('heavy:', heavy); sys.exit(code)"
    )
    flags = ["join", "--model-config", str(TINY_MODEL), "--dataset", str(CORPUS), "--outer-lr", "-1"]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: invalid config outer.outer_lr (--outer-lr)"), result.stderr
    assert "heavy: []" in result.stdout
    assert elapsed < 5, f"{elapsed:.1f} s"  # measured ~0.2 s; hivemind + transformers alone take ~4 s here


def test_report_to_takes_a_comma_separated_list() -> None:
    config = load_config(_parser().parse_args(["join", "--preset", "tiny", "--report-to", "tensorboard,wandb"]))
    assert config.run.report_to == ["tensorboard", "wandb"]
    assert load_config(_parser().parse_args(["join", "--preset", "tiny", "--report-to", "none"])).run.report_to == []


def test_exports_during_training_need_a_save_dir() -> None:
    with pytest.raises(ConfigError, match="--export-every-rounds needs --save-dir"):
        load_config(_parser().parse_args(["join", "--preset", "tiny", "--export-every-rounds", "2"]))


def test_export_of_a_work_dir_without_a_run_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["export", "--work-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'run.json'} not found")


def test_join_help_shows_a_volunteers_settings_and_help_all_every_flag() -> None:
    """``join --help`` fits 80 lines on an 80-column terminal and shows the settings a volunteer changes, grouped;
    ``--help-all`` shows every field's flag, and a flag left out of ``--help`` still works."""
    environment = {**os.environ, "COLUMNS": "80"}

    def help_of(flag: str) -> str:
        command = [sys.executable, "-m", "p2p_diloco.cli", "join", flag]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment, check=True).stdout

    brief, every = help_of("--help"), help_of("--help-all")
    assert len(brief.splitlines()) <= 80
    shown = {flag_of(name) for names in VOLUNTEER_SETTINGS.values() for name in names}
    assert all(flag in brief for flag in shown) and "--quorum" not in brief and "the run and its peers" in brief
    fields = {name for section in SECTIONS.values() for name in section.model_fields}
    assert all(flag_of(name) in every for name in fields)
    assert load_config(_parser().parse_args(["join", "--preset", "tiny", "--quorum", "2"])).outer.quorum == 2
