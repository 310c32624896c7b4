"""Metrics: JSONL event log, progress bars, throughput averages, log format."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from p2p_diloco.unit.events import Eval, Event, InnerStep, read_events
from p2p_diloco.unit.metrics import (
    MetricsLog,
    ProgressBars,
    Throughput,
    configure_library_logging,
    configure_logging,
)


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Step(Event):
    """A kind of this test's own (as the laboratory defines its kinds)."""

    event = "step"
    writer: str
    index: int
    padding: str = ""


def test_metrics_log_writes_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "metrics.jsonl"
    before = time.time()
    with MetricsLog(path) as log:
        log.write(InnerStep(step=1, loss=2.5, seconds=0.25, lr=1e-3))
        assert _lines(path)[0]["step"] == 1, "lines are flushed as they are written"
        log.write(Eval(reason="join", outer_round=0, eval_loss=None))
    records = _lines(path)
    assert [record["event"] for record in records] == ["inner_step", "eval"]
    first = {key: value for key, value in records[0].items() if key != "time"}
    assert first == {"event": "inner_step", "step": 1, "loss": 2.5, "seconds": 0.25, "lr": 1e-3, "tokens_per_s": None}
    assert before <= records[0]["time"] <= records[1]["time"] <= time.time()


def test_metrics_log_appends_and_writes_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        log.write(InnerStep(step=1, loss=float("nan"), seconds=1.0))
    with MetricsLog(path) as log:
        log.write(InnerStep(step=2, loss=float("inf"), seconds=1.0))
    records = [json.loads(line, parse_constant=pytest.fail) for line in path.read_text().splitlines()]
    assert [(record["step"], record["loss"]) for record in records] == [(1, None), (2, None)]


def test_metrics_log_refuses_writes_after_close(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.close()
    log.close()
    with pytest.raises(ValueError):
        log.write(InnerStep(step=1, loss=1.0, seconds=1.0))


def test_an_event_refuses_unknown_and_missing_fields() -> None:
    with pytest.raises(ValidationError):
        InnerStep(step=1, loss=1.0, seconds=1.0, peer="abc")  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        InnerStep(step=1, loss=1.0)  # type: ignore[call-arg]


def test_read_events_gives_back_the_kinds_asked_for_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    written = [
        InnerStep(step=10, loss=float("nan"), seconds=0.5),
        Eval(reason="outer_round", outer_round=1, eval_loss=4.5),
        InnerStep(step=20, loss=3.0, seconds=0.5),
    ]
    with MetricsLog(path) as log:
        for event in written:
            log.write(event)
    with path.open("a") as file:
        file.write('{"time": 1.0, "event": "inner_st')  # a line cut short by a kill
    steps = read_events(path, InnerStep)
    assert [(step.step, step.loss) for step in steps] == [(10, None), (20, 3.0)]
    assert read_events(path, Eval) == [written[1]]
    assert [type(event) for event in read_events(path, Eval, InnerStep)] == [InnerStep, Eval, InnerStep]
    assert read_events(tmp_path / "missing.jsonl", InnerStep) == []


def test_read_events_names_the_line_of_an_event_whose_fields_changed(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"time": 1.0, "event": "inner_step", "step": 1, "loss": 1.0}\n')  # no "seconds"
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_events(path, InnerStep)


def test_metrics_log_lines_from_threads_do_not_interleave(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:

        def writer(name: str) -> None:
            for index in range(200):
                log.write(_Step(writer=name, index=index, padding="x" * 500))

        threads = [threading.Thread(target=writer, args=(str(number),)) for number in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    records = read_events(path, _Step)
    assert len(records) == 800
    for name in "0123":
        assert [record.index for record in records if record.writer == name] == list(range(200))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_postfix_and_the_units_round() -> None:
    terminal = _Terminal()
    bars = ProgressBars(total_inner_steps=10, enabled=True, stream=terminal)
    bars.inner_step(loss=3.14159, tokens_per_s=1234.4)
    bars.outer_round(unit_round=1, group_size=3, eval_loss=2.5)
    bars.outer_round(unit_round=4, group_size=2, eval_loss=None)  # fragment rounds of later unit rounds
    bars.close()
    bars.close()
    out = terminal.getvalue()
    assert "loss=3.1416" in out and "tok_s=1234" in out
    assert "1/10" in out
    last = out.replace("\r", "\n").rstrip().splitlines()[-1]
    assert "outer rounds: 4round " in last, "the bar shows the unit's round, not the fragment rounds counted"
    assert last.endswith("group=2, eval_loss=2.5000]"), "the last eval loss stays shown"


def test_progress_bars_stay_off_when_not_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    file = io.StringIO()  # a log file, docker logs: no redraws
    for bars in (ProgressBars(total_inner_steps=None, enabled=False), ProgressBars(10, enabled=True, stream=file)):
        bars.inner_step(loss=1.0, tokens_per_s=1.0)
        bars.outer_round(unit_round=1, group_size=1, eval_loss=1.0)
        bars.close()
    assert capsys.readouterr() == ("", "")
    assert file.getvalue() == ""


def test_throughput_is_none_before_any_sample() -> None:
    throughput = Throughput()
    assert throughput.tokens_per_s is None
    assert throughput.step_time_s is None


def test_throughput_moving_average() -> None:
    throughput = Throughput(smoothing=0.5)
    throughput.add(tokens=100, seconds=1.0)
    assert throughput.step_time_s == 1.0
    assert throughput.tokens_per_s == 100.0
    throughput.add(tokens=300, seconds=2.0)
    assert throughput.step_time_s == pytest.approx(1.5)
    assert throughput.tokens_per_s == pytest.approx(200 / 1.5)
    throughput.add(tokens=0, seconds=0.5)
    assert throughput.step_time_s == pytest.approx(1.0)


def test_throughput_converges_to_a_steady_rate() -> None:
    throughput = Throughput()
    throughput.add(tokens=10, seconds=10.0)
    for _ in range(200):
        throughput.add(tokens=1000, seconds=0.25)
    assert throughput.step_time_s == pytest.approx(0.25, rel=1e-6)
    assert throughput.tokens_per_s == pytest.approx(4000, rel=1e-6)


def test_one_stalled_step_does_not_move_the_step_time_rounds_are_scheduled_by() -> None:
    throughput = Throughput()
    for _ in range(20):
        throughput.add(tokens=512, seconds=0.1)
    throughput.add(tokens=512, seconds=30.0)  # the step a frozen process was stopped in
    assert throughput.step_time_s == pytest.approx(0.1)
    assert throughput.tokens_per_s == pytest.approx(512 / (0.1 + 0.1 * 29.9))  # the reported rate still shows it
    for _ in range(16):
        throughput.add(tokens=512, seconds=0.3)  # a lasting change is followed within a window of steps
    assert throughput.step_time_s == pytest.approx(0.3)


@pytest.mark.parametrize("tokens, seconds", [(-1, 1.0), (1, 0.0), (1, -1.0), (1, float("nan")), (1, float("inf"))])
def test_throughput_rejects_bad_samples(tokens: int, seconds: float) -> None:
    with pytest.raises(ValueError):
        Throughput().add(tokens, seconds)


@pytest.mark.parametrize("smoothing", [0.0, -0.1, 1.5])
def test_throughput_rejects_bad_smoothing(smoothing: float) -> None:
    with pytest.raises(ValueError):
        Throughput(smoothing=smoothing)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    from hivemind.utils.logging import use_hivemind_log_handler

    root, library = logging.getLogger(), logging.getLogger("p2p_diloco")
    averager = logging.getLogger("hivemind.averaging.averager")
    saved = [
        (logger, list(logger.handlers), logger.level, list(logger.filters)) for logger in (root, library, averager)
    ]
    yield
    for logger, handlers, level, filters in saved:
        logger.handlers[:], logger.filters[:] = handlers, filters
        logger.setLevel(level)
    use_hivemind_log_handler("in_hivemind")


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_format_and_quiet_hivemind(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO")
    configure_logging("info")
    logging.getLogger("p2p_diloco.test").info("hello %s", "world")
    logging.getLogger("p2p_diloco.test").debug("hidden")
    logging.getLogger("hivemind.averaging").info("chatty")
    logging.getLogger("hivemind.averaging").warning("important")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} INFO p2p_diloco\.test: hello world", lines[0])
    assert lines[1].endswith(" hivemind.averaging: important")


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_debug_shows_hivemind_and_error_hides_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("DEBUG")
    logging.getLogger("hivemind.dht").debug("details")
    assert capsys.readouterr().err.endswith("DEBUG hivemind.dht: details\n")
    configure_logging("ERROR")
    logging.getLogger("hivemind.dht").warning("not shown")
    logging.getLogger("p2p_diloco").warning("not shown")
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("restore_logging")
def test_log_lines_go_above_the_progress_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    configure_logging("INFO")
    bars = ProgressBars(total_inner_steps=10, enabled=True)
    bars.inner_step(loss=1.0, tokens_per_s=1.0)
    logging.getLogger("p2p_diloco.test").info("a line of its own")
    bars.close()
    lines = terminal.getvalue().replace("\r", "\n").splitlines()
    assert any(line.endswith("INFO p2p_diloco.test: a line of its own") and "inner steps" not in line for line in lines)


def test_configure_logging_rejects_unknown_level() -> None:
    with pytest.raises(ValueError):
        configure_logging("LOUD")


@pytest.mark.usefixtures("restore_logging")
def test_library_lines_show_under_a_scripts_basic_config_and_lone_rounds_are_quiet() -> None:
    """A script's ``logging.basicConfig`` leaves the root at WARNING: the library's INFO lines show all the same, once,
    through the script's own handler, and hivemind's error for a round nobody joined does not."""
    root = logging.getLogger()
    root.handlers[:] = []
    script_console = io.StringIO()
    logging.basicConfig(format="%(name)s %(message)s", handlers=[logging.StreamHandler(script_console)])
    configure_library_logging("INFO")
    configure_library_logging("INFO")
    logging.getLogger("p2p_diloco.unit.tracking").info("outer round 1 (fragment 1/1): merged")
    logging.getLogger("p2p_diloco.unit.tracking").debug("hidden")
    hivemind_console = io.StringIO()
    averager = logging.getLogger("hivemind.averaging.averager")
    averager.addHandler(logging.StreamHandler(hivemind_console))  # hivemind's own loggers do not propagate
    averager.error("Averaging step failed: could not find a group")
    averager.error("Averaging step failed: a member sent garbage")
    logging.getLogger("elsewhere").info("the script's root stays at WARNING")
    assert script_console.getvalue() == "p2p_diloco.unit.tracking outer round 1 (fragment 1/1): merged\n"
    assert hivemind_console.getvalue() == "Averaging step failed: a member sent garbage\n"
    configure_library_logging("WARNING")
    logging.getLogger("p2p_diloco.unit.tracking").info("silenced")
    assert script_console.getvalue().count("\n") == 1


@pytest.mark.usefixtures("restore_logging")
def test_library_lines_show_with_no_logging_set_up(capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger().handlers[:] = []
    configure_library_logging("info")
    configure_library_logging("info")  # one handler, not two
    logging.getLogger("p2p_diloco.peer").info("joined run=r")
    assert re.fullmatch(r"\S+ INFO p2p_diloco\.peer: joined run=r\n", capsys.readouterr().err)
    configure_library_logging(None)  # left alone
    assert logging.getLogger("p2p_diloco").level == logging.INFO
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_library_logging("loud")
