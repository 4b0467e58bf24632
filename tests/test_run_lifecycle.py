"""The run lifecycle ``simulate`` and ``peer`` share (``runtime.run_lifecycle``): what a finished, an interrupted
and a failed run leave in their directory. The commands themselves run in test_cli.py and test_checkpoint.py."""

from __future__ import annotations

import faulthandler
import json
import signal
from dataclasses import dataclass, field

import pytest
import torch

from gossiploco.errors import ExchangeError
from gossiploco.runtime.run_dir import holds_run
from gossiploco.runtime.run_lifecycle import RunLifecycle


@dataclass
class Result:
    summary: dict
    final_params: dict = field(default_factory=lambda: {"w": torch.ones(2)})


class Runner:
    """A runner that writes ``records`` metrics records, then ends, stops (``KeyboardInterrupt``) or fails."""

    start_round = 0

    def __init__(self, records: int, end: BaseException | None = None):
        self.records, self.end = records, end

    def resume(self, checkpoint) -> None:
        raise AssertionError("nothing to resume in these tests")

    def summary_so_far(self) -> dict:
        return {"interrupted": True, "records": self.records}

    def run(self, sink, writer) -> Result:
        for h in range(self.records):
            sink.write({"round": 0, "h": h})
        if self.end is not None:
            raise self.end
        return Result({"records": self.records})


@pytest.fixture(autouse=True)
def signals_restored():
    """``start`` dumps stacks on SIGUSR1 for the process: put pytest's handling back (SIGINT and SIGTERM are the
    command's: ``runtime.stopping``, tested in tests/test_stopping.py; a stopped run's ``exit_stopped`` resets them:
    put pytest's back too)."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    faulthandler.unregister(signal.SIGUSR1)
    for signum, handler in before.items():
        signal.signal(signum, handler)


def stop_line(capsys, stop) -> str:
    """A stopped run ends the command: exit code 130 and one stop line on stderr (``runtime.stopping``)."""
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gossiploco peer: stopped"), err
    return err[0]


def started(make_config, out, runner, lines, *, forget_unstarted=False) -> RunLifecycle:
    run = RunLifecycle.open(make_config("globalm1-localm2"), out, out, resume=False, say=lines.append,
                            forget_unstarted=forget_unstarted, command="peer")
    run.start(runner)
    return run


def test_a_finished_run_leaves_its_summary_and_model(make_config, tmp_path):
    lines: list[str] = []
    runner = Runner(3)
    run = started(make_config, tmp_path / "o", runner, lines)
    result = run.train(lambda sink, writer: runner.run(sink, writer))
    assert run.finish(result) == tmp_path / "o" / "model.safetensors" and (tmp_path / "o" / "model.safetensors").exists()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["records"] == 3 and summary["run_config"]["name"] == "globalm1-localm2"
    assert "checkpoints_written" in summary and lines == []
    assert len((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("forget_unstarted", [False, True])
def test_an_interrupted_run_keeps_what_it_measured_and_says_how_to_continue(make_config, tmp_path, forget_unstarted,
                                                                           capsys):
    lines: list[str] = []
    runner = Runner(2, KeyboardInterrupt())
    run = started(make_config, tmp_path / "o", runner, lines, forget_unstarted=forget_unstarted)
    stopped = []
    with pytest.raises(SystemExit) as stop:
        run.train(lambda sink, writer: runner.run(sink, writer), before_report=lambda: stopped.append(len(lines)))
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["run_config"]["name"] == "globalm1-localm2"
    assert "--resume --out" in stop_line(capsys, stop) and stopped == [0] and lines == []


def test_a_peer_stopped_before_its_first_record_leaves_no_run_behind(make_config, tmp_path, capsys):
    lines: list[str] = []
    out = tmp_path / "o"
    runner = Runner(0, KeyboardInterrupt())
    run = started(make_config, out, runner, lines, forget_unstarted=True)
    with pytest.raises(SystemExit) as stop:
        run.train(lambda sink, writer: runner.run(sink, writer))
    assert not holds_run(out) and "nothing kept" in stop_line(capsys, stop)
    failing = Runner(0, ExchangeError("refused"))
    run = started(make_config, out, failing, lines, forget_unstarted=True)  # the same directory, no --resume
    with pytest.raises(ExchangeError):
        run.train(lambda sink, writer: failing.run(sink, writer))
    assert not holds_run(out)


def test_a_simulation_stopped_before_its_first_record_keeps_its_summary(make_config, tmp_path, capsys):
    lines: list[str] = []
    runner = Runner(0, KeyboardInterrupt())
    run = started(make_config, tmp_path / "o", runner, lines)
    with pytest.raises(SystemExit) as stop:
        run.train(lambda sink, writer: runner.run(sink, writer))
    stop_line(capsys, stop)
    assert holds_run(tmp_path / "o") and json.loads((tmp_path / "o" / "summary.json").read_text())["interrupted"]
