"""A peer started with other settings than the run going in its swarm is refused at once, naming the
differences; a waiting peer says who is here and who is missing.

Fast: the pure parts (the config diff and its wording, the run entry's wire form and what every DHT
node checks of it, the waiting line and when it is said). Slow: real ``gossiploco peer`` processes
through a real bootstrap node (a refused peer's exit code and message, ``--new-run``, the waiting
line and the deadline's warning).
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

from conftest import TINY, tiny_config, wait_until
from gossiploco.config import preset_names
from gossiploco.errors import RunMismatch
from gossiploco.membership.record import IncompatibleRecord
from gossiploco.membership.runs import (MAX_ENTRY_BYTES, MAX_LIST_ITEMS, RunEntry, announced_config, check_entry_bytes,
                                        runs_key)
from gossiploco.runtime.run_match import (MISSING, Difference, RunWatch, active_runs, config_differences,
                                          describe_differences, fixing_flags, show_value)
from gossiploco.runtime.waiting_line import CHANGE_EVERY_S, REPORT_EVERY_S, WaitingReport, short_start_line, waiting_line
from gossiploco.security.identity import Identity
from gossiploco.membership.record_validator import SwarmRecordValidator, entry_subkey
from gossiploco.security.swarm_key import SwarmKey
from testbed.overrides import set_args

# -- comparing configs ---------------------------------------------------------------------------


def test_config_differences_name_every_leaf_dotted_and_sorted():
    mine = {"workers": 4, "timeouts": {"startup_s": 60.0, "hello_s": 5.0}, "name": "a", "only_mine": 1,
            "data": {"paths": ["x"]}}
    theirs = {"workers": 2, "timeouts": {"startup_s": 30.0, "hello_s": 5.0}, "name": "a", "data": {"paths": ["y"]},
              "extra": {"deep": True}}
    assert config_differences(mine, theirs) == [
        Difference("data.paths", ["x"], ["y"]), Difference("extra", MISSING, {"deep": True}),
        Difference("only_mine", 1, MISSING), Difference("timeouts.startup_s", 60.0, 30.0), Difference("workers", 4, 2)]
    assert config_differences(mine, mine) == []
    assert config_differences({"a": 1}, {"a": 1.0}) == [Difference("a", 1, 1.0)]  # as the run id tells them apart
    assert config_differences({"a": True}, {"a": 1}) == [Difference("a", True, 1)]


def test_values_are_shown_compactly_and_long_ones_truncated():
    assert show_value(4) == "4" and show_value(60.0) == "60.0" and show_value(True) == "true"
    assert show_value(None) == "null" and show_value("gossip") == '"gossip"' and show_value(MISSING) == "(absent)"
    assert show_value(list(range(10))) == "[0, 1, 2, 3, +6 more]"
    long = show_value("x" * 500)
    assert len(long) <= 48 and long.endswith("...")
    text = describe_differences([Difference("workers", 4, 2), Difference("timeouts.startup_s", 60.0, 30.0)])
    assert text == "workers: this peer 4, the running run 2; timeouts.startup_s: this peer 60.0, the running run 30.0"
    many = describe_differences([Difference(f"f{i:02d}", i, i + 1) for i in range(20)])
    assert many.endswith("and 8 more fields") and many.count("this peer") == 12


def test_fixing_flags_give_the_other_runs_values_where_a_flag_can():
    flags = fixing_flags([Difference("inner.lr", 0.001, 0.0003), Difference("name", "a", "diloco"),
                          Difference("workers", 4, 2), Difference("mix1.kind", "global", "gossip"),
                          Difference("monitor.enabled", True, False), Difference("mix2.blocks", ["*"], ["layers.0", "head"]),
                          Difference("data.tokenizer", "sha256:aa", "sha256:bb"), Difference("seed", 0, MISSING),
                          Difference("kind", "gossip", "true")])
    assert flags == ("--config diloco --workers 2 --set inner.lr=0.0003 --set mix1.kind=gossip --set monitor.enabled=false "
                     "--set 'mix2.blocks=[\"layers.0\", \"head\"]' --set 'kind=\"true\"'")


# -- the run entry on the wire --------------------------------------------------------------------


def entry(peer: int = 3, run: str = "run-a", separate: bool = False, **config) -> RunEntry:
    return RunEntry(peer, run, {"workers": 2, "timeouts": {"startup_s": 60.0}, **config}, separate=separate)


def test_run_entry_round_trips_and_every_preset_fits_the_bounds():
    e = entry(tags=["a", "b"], flag=None)
    assert RunEntry.from_wire(e.to_wire()) == e
    assert RunEntry.from_wire(msgpack.unpackb(msgpack.packb(e.to_wire()))) == e
    for preset in preset_names():
        watch = RunWatch.for_config(tiny_config(preset), "r", 1)
        check_entry_bytes(msgpack.packb(watch.entry.to_wire()))  # what every DHT node checks


def test_announced_config_bounds_long_values_by_digest_and_keeps_equality():
    config = {"data": {"paths": [f"file{i}.txt" for i in range(100)], "name": "n" * 1000}, "t": (1, 2), "o": Path("x")}
    bounded = announced_config(config)
    assert re.fullmatch(r"<100 items, sha256 [0-9a-f]{16}>", bounded["data"]["paths"])
    assert bounded["data"]["name"].startswith("<1000 chars, sha256") and bounded["t"] == [1, 2] and bounded["o"] == "x"
    assert announced_config(bounded) == bounded == announced_config(json.loads(json.dumps(config, default=str)))
    other = announced_config({**config, "data": {**config["data"], "paths": [f"file{i}.txt" for i in range(101)]}})
    assert other["data"]["paths"] != bounded["data"]["paths"]
    RunEntry(1, "r", bounded)  # valid on the wire


@pytest.mark.parametrize("change, reason", [
    (lambda w: w.pop("config"), "wrong fields"),
    (lambda w: w.update(extra=1), "wrong fields"),
    (lambda w: w.update(peer=-1), "peer must be in"),
    (lambda w: w.update(peer="3"), "peer must be an int"),
    (lambda w: w.update(run=""), "run must be"),
    (lambda w: w.update(run="a\nb"), "run must be"),
    (lambda w: w.update(run=7), "run must be"),
    (lambda w: w.update(separate=1), "separate must be a bool"),
    (lambda w: w.update(config=[1]), "config must be a dict"),
    (lambda w: w.update(config={"a": {"b": {"c": {"d": {"e": 1}}}}}), "nests deeper"),
    (lambda w: w.update(config={"a": list(range(MAX_LIST_ITEMS + 1))}), "list of 33 items"),
    (lambda w: w.update(config={"a": [[1]]}), "has a list"),
    (lambda w: w.update(config={"a": "x" * 1000}), "printable text"),
    (lambda w: w.update(config={"a": b"bytes"}), "has a bytes"),
    (lambda w: w.update(config={"a": float("nan")}), "NaN"),
    (lambda w: w.update(config={"a": 2**70}), "64-bit"),
    (lambda w: w.update(config={7: 1}), "field names"),
    (lambda w: w.update(config={"": 1}), "field names"),
    (lambda w: w.update(config={f"k{i}": i for i in range(600)}), "more than 512 values"),
])
def test_malformed_run_entries_are_refused_naming_the_problem(change, reason):
    wire = entry().to_wire()
    change(wire)
    with pytest.raises(ValueError, match=reason):
        RunEntry.from_wire(wire)


def test_run_entries_of_another_version_and_non_dicts_are_told_apart():
    with pytest.raises(IncompatibleRecord):
        RunEntry.from_wire({**entry().to_wire(), "version": 2})
    for junk in (None, [], "x", 5):
        with pytest.raises(ValueError, match="must be a dict"):
            RunEntry.from_wire(junk)


def test_dht_nodes_check_run_entries_size_and_form_before_storing_them():
    check_entry_bytes(msgpack.packb(None))  # a departing peer's tombstone
    check_entry_bytes(msgpack.packb(entry().to_wire()))
    for junk, reason in [(b"\xc1" * 10, "not msgpack"), (msgpack.packb("x" * (MAX_ENTRY_BYTES + 1)), "oversized"),
                         (msgpack.packb({**entry().to_wire(), "blob": b"\0" * 10}), "not msgpack"),
                         (msgpack.packb(msgpack.ExtType(5, b"x")), "not msgpack"),
                         (msgpack.packb({**entry().to_wire(), "peer": -1}), "peer must be in")]:
        with pytest.raises(ValueError, match=reason):
            check_entry_bytes(junk)


def signed_run_entry(validator: SwarmRecordValidator, peer: int, value: object) -> DHTRecord:
    key = DHTID.generate(source=runs_key(validator.swarm)).to_bytes()
    record = DHTRecord(key, msgpack.packb(entry_subkey(validator.swarm, peer)), msgpack.packb(value), 1e10)
    return dataclasses.replace(record, value=validator.sign_value(record))


@pytest.mark.parametrize("private", [True, False])
def test_the_validator_stores_signed_run_entries_and_tombstones_and_refuses_junk_ones(private):
    swarm, writer = (SwarmKey.generate() if private else None), Identity.generate()
    honest, signer = SwarmRecordValidator(None, swarm), SwarmRecordValidator(writer, swarm)
    assert honest.validate(signed_run_entry(signer, writer.peer_id, entry(writer.peer_id).to_wire()))
    assert honest.validate(signed_run_entry(signer, writer.peer_id, None))
    for junk in ({"config": "x"}, "y" * (MAX_ENTRY_BYTES + 100), {**entry().to_wire(), "config": {"a": "b" * 500}}):
        assert not honest.validate(signed_run_entry(signer, writer.peer_id, junk))
    assert honest.rejected == {"bad run entry": 3}  # counted under one reason however bad
    # under a run's own key, a value is that run's business (its readers check its records)
    other = DHTRecord(b"k", msgpack.packb(entry_subkey(swarm, writer.peer_id)), msgpack.packb({"config": "x"}), 1e10)
    assert honest.validate(dataclasses.replace(other, value=signer.sign_value(other)))


# -- deciding -------------------------------------------------------------------------------------


def test_a_peer_whose_run_is_not_among_the_runs_going_is_refused_naming_every_difference():
    going = {1: entry(1), 2: entry(2)}
    watch = RunWatch("run-b", {"workers": 4, "timeouts": {"startup_s": 30.0}}, 9)
    with pytest.raises(RunMismatch) as refused:
        watch.check_start(going)
    text = str(refused.value)
    assert text.startswith("run: this swarm already has a run going with other settings")
    assert "run run-a (peers 1, 2)" in text
    assert "timeouts.startup_s: this peer 30.0, the running run 60.0; workers: this peer 4, the running run 2" in text
    assert "(here: --workers 2 --set timeouts.startup_s=60.0)" in text and "--new-run" in text


def test_new_run_starts_beside_the_others_and_nobody_is_warned_about_it():
    going = {1: entry(1)}
    beside = RunWatch("run-b", {"workers": 4}, 9, new_run=True)
    assert [run.run_id for run in beside.check_start(going)] == ["run-a"]
    assert beside.entry.separate and beside.warnings(going) == []
    first = RunWatch("run-a", entry().config, 1)
    assert first.warnings({1: first.entry, 9: beside.entry}) == []  # started beside it on purpose


def test_a_peer_joins_its_own_run_whatever_else_runs_and_ignores_its_own_old_entry():
    mine = entry(5)
    watch = RunWatch(mine.run_id, mine.config, 5)
    assert watch.check_start({}) == []
    assert [r.run_id for r in watch.check_start({1: entry(1), 2: entry(2, "run-z", workers=9)})] == ["run-z"]
    assert watch.check_start({5: entry(5, "run-old", workers=7)}) == []  # this peer's previous process


def test_peers_of_this_run_id_with_other_settings_are_refused_even_with_new_run():
    watch = RunWatch("run-a", {"workers": 3, "timeouts": {"startup_s": 60.0}}, 9, new_run=True)
    with pytest.raises(RunMismatch, match=r"run run-a \(peer 1\) announces other settings .* workers: this peer 3, "
                                          r"those peers 2.*--run-id"):
        watch.check_start({1: entry(1)})


def test_a_strangers_conflicting_entry_is_a_warning_not_a_lock_out():
    """Issue 25: a throwaway identity (peer 66, no member record) copies the run's entry with one field changed.
    A newcomer with the run's exact settings joins (a live member's entry matches) and is warned, naming 66."""
    forged = entry(66, workers=3)
    newcomer = RunWatch("run-a", entry().config, 9)
    assert newcomer.check_start({1: entry(1), 2: entry(2), 66: forged}, members={1, 2}) == []
    [warning] = newcomer.twin_warnings
    assert "run run-a (peer 66)" in warning and "no live member record" in warning and "workers" in warning
    assert newcomer.conflicting_entries == 1
    # the first peer of a run: only the stranger's entry, no member backs it: joins, warned
    first = RunWatch("run-a", entry().config, 1)
    assert first.check_start({66: forged}, members=set()) == [] and first.conflicting_entries == 1
    # warned once; a new signer group is warned about again, also while running
    assert newcomer.warnings({1: entry(1), 66: forged}, members={1}) == []
    [later] = newcomer.warnings({1: entry(1), 66: forged, 67: entry(67, workers=5)}, members={1})
    assert "peer 67" in later and newcomer.conflicting_entries == 2


def test_a_peer_whose_settings_match_no_backed_entry_is_still_refused():
    """The running swarm (members 1, 2) really has other settings: refused with the differences named,
    even when a stranger (77) published an entry with this peer's settings."""
    newcomer = RunWatch("run-a", {**entry().config, "workers": 3}, 9)
    with pytest.raises(RunMismatch, match=r"run run-a \(peers 1, 2\) announces other settings .* workers: this peer 3, "
                                          r"those peers 2"):
        newcomer.check_start({1: entry(1), 2: entry(2), 77: entry(77, workers=3)}, members={1, 2})
    # members disagree among themselves and one group matches this peer: it joins, warned about the other
    split = RunWatch("run-a", entry().config, 9)
    assert split.check_start({1: entry(1), 2: entry(2, workers=3)}, members={1, 2}) == []
    assert "backed by live member 2" in split.twin_warnings[0]


def test_runs_found_later_are_warned_about_once_each_naming_the_differences():
    watch = RunWatch("run-a", entry().config, 1)
    assert watch.check_start({}) == []
    later = {1: watch.entry, 7: entry(7, "run-b", workers=3), 8: entry(8, "run-b", workers=3)}
    [warning] = watch.warnings(later)
    assert "run run-b (peers 7, 8)" in warning and "workers: this peer 2, that run 3" in warning
    assert watch.warnings(later) == []
    assert len(watch.warnings({**later, 9: entry(9, "run-c", workers=5)})) == 1
    assert [r.peers for r in active_runs(later, own_peer=1)] == [(7, 8)]


# -- the waiting line -----------------------------------------------------------------------------


def test_the_waiting_line_says_who_is_here_who_is_missing_when_it_starts_and_the_fix():
    assert waiting_line([1, 0], 4, 94.2) == ("waiting for peers: 2 of 4 here (0, 1); 2 missing; starting without them "
                                              "in 95 s. Running fewer peers? Start every peer with --workers 2")
    assert "(0, 1, 2, 3, 4, 5, 6, 7 and 4 more)" in waiting_line(list(range(12)), 20, 5)
    assert "in 0 s" in waiting_line([3], 2, -1.0)
    assert short_start_line(0, [5], 2, 61.4) == ("starting round 0 with 1 of 2 peers (5) after waiting 61 s; the others "
                                                 "join when they come. Running fewer peers? Start every peer with --workers 1")


def test_the_waiting_line_is_said_at_once_then_on_changes_and_every_few_seconds():
    report = WaitingReport(workers=3, deadline=100.0)
    assert "1 of 3 here (7); 2 missing; starting without them in 100 s" in report.update(0.0, [7])
    assert report.update(1.0, [7]) is None  # nothing new
    assert report.update(1.0, [7, 8]) is None  # news, but a moment ago it spoke: together with the next arrivals
    assert "2 of 3 here (7, 8)" in report.update(CHANGE_EVERY_S, [8, 7])
    assert report.update(CHANGE_EVERY_S + REPORT_EVERY_S - 0.1, [7, 8]) is None
    assert "in 88 s" in report.update(CHANGE_EVERY_S + REPORT_EVERY_S, [7, 8])  # still alive, still waiting


# -- real peers through a real bootstrap node -----------------------------------------------------


def peer_command(tmp_path: Path, name: str, bootstrap, *extra: str, **sets) -> list[str]:
    """``gossiploco peer`` of the tiny test config (not quiet: the INFO lines are what is tested)."""
    args = set_args({**TINY, **sets}, without=("workers",))
    return [sys.executable, "-m", "gossiploco", "peer", "--config", "globalm1-localm2", "--join", bootstrap.address,
            "--swarm-key", str(bootstrap.swarm_key), "--host", "127.0.0.1", "--reachability", "public",
            "--identity", str(tmp_path / name / "identity.key"), "--out", str(tmp_path / name), *args, *extra]


class Peers:
    """Peer processes whose stderr goes to ``<name>.log``; every one is stopped (SIGINT, then SIGKILL) at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.procs, self.files = tmp_path, {}, {}

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        self.files[name] = (self.tmp_path / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.files[name],
                                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        return self.procs[name]

    def log(self, name: str) -> str:
        return " ".join((self.tmp_path / f"{name}.log").read_text(errors="replace").split())  # rich wraps lines

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for file in self.files.values():
            file.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_peer_with_other_settings_is_refused_at_once_and_new_run_starts_beside(tmp_path, bootstrap):
    peers = Peers(tmp_path)
    try:
        first = peers.start("first", peer_command(tmp_path, "first", bootstrap, "--workers", "2"))
        assert wait_until(lambda: "waiting for peers: 1 of 2 here" in peers.log("first"), 90), peers.log("first")[-3000:]
        # Another --workers: another run; refused in seconds (not after startup_s = 60), the difference named
        started = time.monotonic()
        refused = subprocess.run(peer_command(tmp_path, "refused", bootstrap, "--workers", "3"), capture_output=True,
                                 text=True, timeout=60)
        took = time.monotonic() - started
        stderr = " ".join(refused.stderr.split())
        assert refused.returncode == 2, stderr[-3000:]
        assert "workers: this peer 3, the running run 2" in stderr and "--workers 2" in stderr, stderr[-3000:]
        assert "--new-run" in stderr and took < 30, (took, stderr[-3000:])
        assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # the corrected command may use this --out
        # --new-run: started beside it on purpose
        beside = peers.start("beside", peer_command(tmp_path, "beside", bootstrap, "--workers", "3", "--new-run"))
        assert wait_until(lambda: "waiting for peers: 1 of 3 here" in peers.log("beside"), 90), peers.log("beside")[-3000:]
        assert "beside the other runs of this swarm (--new-run)" in peers.log("beside")
        assert beside.poll() is None and first.poll() is None
    finally:
        peers.stop()
    assert "another run started beside" not in peers.log("first")  # --new-run: on purpose, nobody is warned
    # Ctrl+C while waiting (to restart with the right --workers): nothing kept, the same --out works again
    assert first.returncode == beside.returncode == 130
    assert not (tmp_path / "first" / "metrics.jsonl").exists() and not (tmp_path / "first" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_waiting_peer_says_who_is_missing_then_starts_without_them_at_the_deadline(tmp_path, bootstrap):
    startup_s = 12.0
    peers = Peers(tmp_path)
    try:
        alone = peers.start("alone", peer_command(tmp_path, "alone", bootstrap, "--workers", "2",
                                                  **{"timeouts.startup_s": startup_s}))
        assert alone.wait(timeout=150) == 0, peers.log("alone")[-3000:]
    finally:
        peers.stop()
    log = peers.log("alone")
    peer_id = Identity.load_or_create(tmp_path / "alone" / "identity.key").peer_id
    assert re.search(rf"waiting for peers: 1 of 2 here \({peer_id}\); 1 missing; starting without them in 1[12] s\. "
                     r"Running fewer peers\? Start every peer with --workers 1", log), log[-3000:]
    assert f"WARN gossiploco.runtime.peer: rank {peer_id}: starting round 0 with 1 of 2 peers ({peer_id})" in log
    assert log.count(" WARN") == 1, log  # one clear warning (no second one from discovery)
    summary = json.loads((tmp_path / "alone" / "summary.json").read_text())
    # one startup budget (startup_s plus hello_s for the last arrivals), not two as before
    assert startup_s <= summary["total_startup_s"] < 2 * startup_s - 2, summary["total_startup_s"]
