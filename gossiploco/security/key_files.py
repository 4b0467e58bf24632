"""Secret key files: how they are written, which ones are refused, and where a user's own live.

Every secret file gossiploco writes (swarm keys, identity keys, a bootstrap node's libp2p key) is
written by ``write_secret_file``: a temporary file created with mode 0600 (so there is no moment
at which it is readable by others), fsynced, then renamed over the target, or, with
``exclusive=True``, linked to it only if no file is there yet (two processes creating the same
key concurrently end up with one key, never one each).

Every key file gossiploco reads goes through ``check_key_file`` first, which refuses, as ssh does
for private keys:

* a file tracked by git (``git ls-files --error-unmatch``): everyone with the repository has the
  key, so it protects nothing; the error says how to untrack it and to make a new key;
* a file that group or others can access (any of the mode bits 0o077): the error names the file,
  its mode and the fix, ``chmod 600 FILE``.

``user_key_dir()`` is the per-user folder for keys that belong to a user rather than to a run's
output directory: ``$XDG_CONFIG_HOME/gossiploco`` (``~/.config/gossiploco`` when the variable is
unset or not absolute, as the XDG base directory specification says), created with mode 0700.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gossiploco.errors import UnsafeKeyFile

log = logging.getLogger(__name__)

GIT_TIMEOUT_S = 10.0
"""The longest a ``git ls-files`` check may take; after it the file counts as not tracked (with a warning)."""

_GIT_ENV_OVERRIDES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR")
"""Variables that would make ``git -C DIR`` look at another repository than the one DIR is in (a git hook sets them)."""


def write_secret_file(path: Path, text: str | bytes, *, exclusive: bool = False) -> None:
    """Write ``text`` (or bytes) to ``path`` atomically with mode 0600 from the start (the directory is created if
    missing). ``exclusive``: fail with ``FileExistsError`` if ``path`` exists (checked atomically), instead of
    replacing it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600, O_EXCL
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # FileExistsError when someone else made it first
            tmp.unlink()
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows opening a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _git(path: Path, *args: str) -> subprocess.CompletedProcess | None:
    """``git -C <path's folder> ARGS``, its output captured, without the caller's GIT_* overrides; None where git
    is absent or the folder does not exist. Raises ``subprocess.TimeoutExpired``/``OSError`` for the caller to log."""
    git = shutil.which("git")
    if git is None or not path.parent.is_dir():
        return None
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_OVERRIDES}
    return subprocess.run([git, "-C", str(path.parent), *args], capture_output=True, text=True, env=env,
                          timeout=GIT_TIMEOUT_S)


def tracked_by_git(path: Path) -> Path | None:
    """The work tree of the git repository that tracks ``path`` (resolved through symlinks), or None: not in a
    repository, not tracked, or git absent. A check that fails to run (timeout) is logged and counts as None."""
    path = Path(path).resolve()
    try:
        listed = _git(path, "--literal-pathspecs", "ls-files", "--error-unmatch", "--", path.name)
        if listed is None or listed.returncode != 0:  # 1: not tracked; 128: not a repository (or git refuses it)
            return None
        top = _git(path, "rev-parse", "--show-toplevel")
    except (subprocess.TimeoutExpired, OSError) as exc:
        log.warning("could not check whether %s is tracked by git (%s); going on as if it were not", path, exc)
        return None
    return Path(top.stdout.strip()) if top is not None and top.returncode == 0 and top.stdout.strip() else path.parent


def ignored_by_git(path: Path) -> bool | None:
    """Whether git ignores ``path`` (True), would let it be committed (False), or ``path`` is not in a git work
    tree / git is absent (None)."""
    path = Path(path).resolve()
    try:
        checked = _git(path, "check-ignore", "-q", "--", path.name)
    except (subprocess.TimeoutExpired, OSError) as exc:
        log.warning("could not check whether git ignores %s (%s)", path, exc)
        return None
    return None if checked is None else {0: True, 1: False}.get(checked.returncode)


def commit_warning(path: Path) -> str | None:
    """A warning to print after writing the key file ``path`` inside a git work tree that does not ignore it
    (one ``git add -A`` away from publishing it); None elsewhere."""
    if ignored_by_git(path) is False:
        return (f"{path} is inside a git work tree and git does not ignore it: add it to .gitignore (a key file "
                f"tracked by git is compromised and refused)")
    return None


def check_key_file(path: Path, option: str) -> None:
    """Raise ``UnsafeKeyFile`` (naming ``option``, the flag that gave the file) when the key file ``path`` is
    tracked by git or can be accessed by group or others; return quietly otherwise."""
    path = Path(path)
    repository = tracked_by_git(path)
    if repository is not None:
        raise UnsafeKeyFile(option, f"{path} is tracked by git in {repository}: the key is compromised, since "
                                    "everyone who has the repository has it",
                            f"stop tracking it (git -C {path.resolve().parent} rm --cached {path.name}, and add it to "
                            f".gitignore), then make a new key and use that one instead (this one stays in the "
                            f"repository's history)")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UnsafeKeyFile(option, f"{path} can be accessed by group or others (mode {mode:04o}); a secret key "
                                    "file must be private to its owner", f"chmod 600 {path}")


def user_key_dir() -> Path:
    """The per-user folder for a user's own keys (see the module docstring), created with mode 0700 if missing."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".config"
    directory = root / "gossiploco"
    if not directory.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
    return directory
