"""Keys that stay secret (gossiploco.security.key_files): written 0600 from the start, refused when tracked by
git or accessible by others, and ``gossiploco dht``'s default key is the user's own, never a checkout's."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gossiploco.cli import app
from gossiploco.errors import ConfigError, UnsafeKeyFile
from gossiploco.security.identity import Identity
from gossiploco.security.key_files import check_key_file, write_secret_file
from gossiploco.security.options import bootstrap_swarm_key
from gossiploco.security.swarm_key import SwarmKey

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def run(args, **env):
    return CliRunner().invoke(app, args, catch_exceptions=False, env=env or None)


def one_line(text: str) -> str:
    """``text`` with every run of whitespace made one space (rich wraps long lines of a command's output)."""
    return " ".join(text.split())


def git_repo_with_committed_key(directory: Path) -> Path:
    """A git repository in ``directory`` whose commit holds a swarm key at ``swarm.key`` (as this repository did)."""
    directory.mkdir(parents=True, exist_ok=True)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-C", str(directory)]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    key_file = SwarmKey.generate().save(directory / "swarm.key")
    subprocess.run([*git, "add", "swarm.key"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-q", "-m", "a key"], check=True, timeout=30)
    return key_file


# -- writing ----------------------------------------------------------------------------------------------


def test_secret_files_are_0600_even_under_a_permissive_umask_and_exclusive_never_replaces(tmp_path):
    old = os.umask(0)
    try:
        write_secret_file(tmp_path / "a" / "k", "one\n")
        assert stat.S_IMODE((tmp_path / "a" / "k").stat().st_mode) == 0o600
        with pytest.raises(FileExistsError):
            write_secret_file(tmp_path / "a" / "k", "two\n", exclusive=True)
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "k").read_text() == "one\n"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["k"]  # no temporary file left behind


# -- refusing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_key_file_others_can_access_is_refused_with_its_mode_and_the_fix(tmp_path, mode):
    key_file = SwarmKey.generate().save(tmp_path / "swarm.key")
    identity_file = tmp_path / "identity.key"
    Identity.generate().save(identity_file)
    for path in (key_file, identity_file):
        path.chmod(mode)
    with pytest.raises(UnsafeKeyFile) as swarm:
        SwarmKey.load(key_file)
    with pytest.raises(UnsafeKeyFile) as identity:
        Identity.load_or_create(identity_file)
    for error, path, option in ((swarm, key_file, "--swarm-key"), (identity, identity_file, "--identity")):
        message = str(error.value)
        assert message.startswith(f"{option}:") and str(path) in message and f"mode {mode:04o}" in message
        assert error.value.fix == f"chmod 600 {path}" and f"chmod 600 {path}" in message
    key_file.chmod(0o600)
    assert SwarmKey.load(key_file).fingerprint  # the fix works


def test_a_bootstrap_nodes_libp2p_key_others_can_read_is_refused(tmp_path):
    from gossiploco.membership.bootstrap import load_or_create_identity

    path = tmp_path / "bootstrap.key"
    peer_id = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and load_or_create_identity(path) == peer_id
    path.chmod(0o644)
    with pytest.raises(UnsafeKeyFile, match=re.escape(f"chmod 600 {path}")):
        load_or_create_identity(path)


@needs_git
def test_a_key_file_tracked_by_git_is_refused_as_compromised(tmp_path):
    key_file = git_repo_with_committed_key(tmp_path / "repo")
    key_file.chmod(0o600)  # private on disk, yet everyone with the repository has it
    with pytest.raises(UnsafeKeyFile) as error:
        SwarmKey.load(key_file)
    message = str(error.value)
    assert "tracked by git" in message and "compromised" in message and str(key_file) in message
    assert "git -C" in error.value.fix and "rm --cached swarm.key" in error.value.fix and "new key" in error.value.fix
    identity_file = tmp_path / "repo" / "identity.key"
    Identity.generate().save(identity_file)
    subprocess.run(["git", "-C", str(tmp_path / "repo"), "add", "identity.key"], check=True, timeout=30)  # staged
    with pytest.raises(UnsafeKeyFile, match="tracked by git"):
        Identity.load_or_create(identity_file)
    untracked = SwarmKey.generate().save(tmp_path / "repo" / "other.key")  # in the repository, not tracked
    assert SwarmKey.load(untracked).fingerprint
    subprocess.run(["git", "-C", str(tmp_path / "repo"), "rm", "-q", "--cached", "swarm.key"], check=True, timeout=30)
    assert SwarmKey.load(key_file)  # the fix the message gives (then a new key: this one is in the history)


def test_a_key_outside_any_repository_or_given_as_text_is_accepted(tmp_path):
    key = SwarmKey.generate()
    check_key_file(key.save(tmp_path / "k"), "--swarm-key")
    assert SwarmKey.load(key.text) == key


def test_a_damaged_key_file_is_still_told_apart_from_an_unsafe_one(tmp_path):
    path = tmp_path / "swarm.key"
    write_secret_file(path, "not a key\n")
    with pytest.raises(ConfigError) as error:
        SwarmKey.load(path)
    assert not isinstance(error.value, UnsafeKeyFile) and "gsk1-" in str(error.value)


# -- every command that takes a key refuses the same way --------------------------------------------------


@needs_git
def test_every_command_refuses_an_unsafe_key_file_with_the_fix(tmp_path):
    readable = SwarmKey.generate().save(tmp_path / "readable.key")
    readable.chmod(0o644)
    tracked = git_repo_with_committed_key(tmp_path / "repo")
    tracked.chmod(0o600)
    join = "/ip4/127.0.0.1/tcp/1/p2p/QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupGHp"
    commands = {
        "dht": ["dht", "--host", "127.0.0.1"],
        "peer": ["peer", "--join", join, "--out", str(tmp_path / "out")],
        "dashboard": ["dashboard", "--join", join],
    }
    for name, args in commands.items():
        refused = run([*args, "--swarm-key", str(readable)], XDG_CONFIG_HOME=str(tmp_path / "config"))
        text = one_line(refused.output)
        assert refused.exit_code == 2 and "mode 0644" in text and f"chmod 600 {readable}" in text, (name, text)
        refused = run([*args, "--swarm-key", str(tracked)], XDG_CONFIG_HOME=str(tmp_path / "config"))
        text = one_line(refused.output)
        assert refused.exit_code == 2 and "tracked by git" in text and "rm --cached swarm.key" in text, (name, text)
    doctor = run(["doctor", "--join", join, "--swarm-key", str(readable), "--host", "127.0.0.1", "--json"])
    checks = {c["name"]: c for c in json.loads(doctor.output)}
    assert doctor.exit_code == 1 and checks["swarm key"]["status"] == "FAIL", doctor.output
    assert "mode 0644" in checks["swarm key"]["detail"] and checks["swarm key"]["fix"] == f"chmod 600 {readable}"
    assert "dht bootstrap" not in checks  # a local file is named before the network is asked
    own = tmp_path / "peer" / "identity.key"
    Identity.generate().save(own)
    own.chmod(0o644)
    refused = run(["peer", "--join", join, "--open", "--identity", str(own), "--out", str(tmp_path / "out2")])
    assert refused.exit_code == 2 and f"chmod 600 {own}" in one_line(refused.output), refused.output


def test_keygen_warns_when_its_file_could_be_committed(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=30)
    made = run(["keygen", "--out", str(tmp_path / "mine.key")])
    assert made.exit_code == 0 and "does not ignore it" in one_line(made.output)
    (tmp_path / ".gitignore").write_text("*.key\n")
    made = run(["keygen", "--out", str(tmp_path / "other.key")])
    assert made.exit_code == 0 and "does not ignore" not in one_line(made.output)


# -- gossiploco dht's own key -----------------------------------------------------------------------------


def test_dhts_default_key_is_the_users_own_made_once_then_reused_saying_so(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    SwarmKey.generate().save(tmp_path / "swarm.key")  # a key in the current directory is never picked up
    key, note = bootstrap_swarm_key(None)
    own = tmp_path / "config" / "gossiploco" / "swarm.key"
    assert f"created a new per-user swarm key {key.fingerprint} in {own}" in note
    assert stat.S_IMODE(own.stat().st_mode) == 0o600 and stat.S_IMODE(own.parent.stat().st_mode) == 0o700
    assert key != SwarmKey.load(tmp_path / "swarm.key")
    again, note = bootstrap_swarm_key(None)
    assert again == key and f"reusing your per-user swarm key {key.fingerprint} from {own}" in note
    given, note = bootstrap_swarm_key(str(tmp_path / "run.key"))  # an explicit file: created, then used
    assert given != key and f"created a new swarm key {given.fingerprint} in {tmp_path / 'run.key'}" in note
    assert bootstrap_swarm_key(str(tmp_path / "run.key"))[1].startswith(f"using the existing swarm key {given.fingerprint}")
    assert bootstrap_swarm_key(given.text) == (given, f"using swarm key {given.fingerprint} given as text (--swarm-key)")


def _start_dht(cwd: Path, env: dict[str, str], *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """``gossiploco dht`` started in ``cwd``; returns it with the lines it printed up to its first join line."""
    proc = subprocess.Popen([sys.executable, "-m", "gossiploco", "dht", "--host", "127.0.0.1", *extra], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # until the join line (the test's timeout bounds the wait)
        lines.append(line)
        if "gossiploco peer" in line:
            break
    return proc, lines


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    proc.stdout.close()


@needs_git
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dht_in_a_clone_prints_a_key_nobody_else_has_and_reuses_it_saying_so(tmp_path):
    clone = tmp_path / "clone"
    committed = SwarmKey.parse(git_repo_with_committed_key(clone).read_text())  # what everyone with the clone has
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONPATH": str(Path(__file__).parents[1])}
    own = tmp_path / "config" / "gossiploco" / "swarm.key"
    keys = []
    for start in range(2):
        proc, lines = _start_dht(clone, env)
        try:
            output = one_line("".join(lines))
            assert "gossiploco peer" in lines[-1], output
            text = re.search(r"--swarm-key (gsk1-\S+)", lines[-1]).group(1)
            key = SwarmKey.parse(text)
            keys.append(key)
            said = "created a new per-user swarm key" if start == 0 else "reusing your per-user swarm key"
            assert f"{said} {key.fingerprint}" in output and str(own) in output, output
        finally:
            _stop(proc)
    assert keys[0] == keys[1] == SwarmKey.load(own) and keys[0] != committed
    assert committed.fingerprint not in "".join(lines)
    assert stat.S_IMODE(own.stat().st_mode) == 0o600


@needs_git
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_dht_refuses_a_readable_or_tracked_key_file_before_starting(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONPATH": str(Path(__file__).parents[1])}
    readable = SwarmKey.generate().save(tmp_path / "readable.key")
    readable.chmod(0o644)
    tracked = git_repo_with_committed_key(tmp_path / "repo")
    tracked.chmod(0o600)
    for key_file, expected in ((readable, [f"{readable} can be accessed by group or others (mode 0644)",
                                           f"chmod 600 {readable}"]),
                               (tracked, [f"{tracked} is tracked by git", "compromised",
                                          f"git -C {tracked.parent} rm --cached swarm.key", "make a new key"])):
        proc = subprocess.run([sys.executable, "-m", "gossiploco", "dht", "--host", "127.0.0.1", "--swarm-key",
                               str(key_file)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
        output = one_line(proc.stdout + proc.stderr)
        assert proc.returncode == 2 and "gossiploco peer" not in output, output
        for phrase in expected:
            assert phrase in output, (phrase, output)
