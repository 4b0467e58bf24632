"""What the package declares matches what is tested: the Python version (pyproject, bootstrap script, the
interpreter running these tests) and that every command a message tells users to run exists."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import typer

from gossiploco.cli import app

ROOT = Path(__file__).resolve().parents[1]


def declared_floor() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec)
    assert match, f"requires-python should be a plain floor, got {spec!r}"
    return int(match[1]), int(match[2])


def test_the_declared_python_is_the_tested_python():
    floor = declared_floor()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"Programming Language :: Python :: {floor[0]}.{floor[1]}" in project["classifiers"]
    assert sys.version_info[:2] >= floor  # these tests run on a Python the package accepts
    # the code relies on the floor: tomllib is new in 3.11
    assert floor >= (3, 11)


def test_bootstrap_refuses_an_older_python_with_a_clear_message(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Python 3.10.12' && exit 0\nexit 1\n")
    old.chmod(0o755)
    run = subprocess.run(["bash", str(tmp_path / "scripts" / "bootstrap.sh")], env={"PYTHON": str(old), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "Python 3.11 or newer" in run.stderr and "Python 3.10.12" in run.stderr, run.stderr
    assert not (tmp_path / ".venv").exists()  # refused before anything was made


def _commands() -> dict[str, click.Command]:
    group = typer.main.get_command(app)
    found = {}
    for name, command in group.commands.items():
        found[name] = command
        for sub_name, sub in getattr(command, "commands", {}).items():
            found[f"{name} {sub_name}"] = sub
    return found


# a command as users type it: in `code`, ``code`` or quotes, after .venv/bin/, or starting a line of a README code block
COMMAND_MENTION = re.compile(r"(?:[`'\"/]|^\s*|\"\s+)gossiploco ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)((?: +(?:--?[a-z][a-z0-9-]*|[A-Z_./:<>=-][^\s`'\"]*|\d\S*))*)", re.MULTILINE)


def test_every_command_and_flag_a_message_names_exists():
    """Errors and hints say "run `gossiploco X --flag`": each such X is a command and each flag one of its options."""
    commands = _commands()
    sources = [p for p in (ROOT / "gossiploco").rglob("*.py")] + [ROOT / "README.md"]
    checked, wrong = 0, []
    for path in sources:
        for match in COMMAND_MENTION.finditer(path.read_text()):
            words = match[1].split()
            name = " ".join(words) if " ".join(words) in commands else words[0]
            if name not in commands:
                wrong.append(f"{path.relative_to(ROOT)}: `gossiploco {match[1]}` is no command")
                continue
            options = {o for param in commands[name].params for o in getattr(param, "opts", [])}
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", match[2]):
                checked += 1
                if flag not in options:
                    wrong.append(f"{path.relative_to(ROOT)}: `gossiploco {name}` has no option {flag}")
    assert not wrong, "\n".join(wrong)
    assert checked > 20  # the scan found the hints


def _fields(tree: dict, prefix: str = "") -> set[str]:
    found = set()
    for key, value in tree.items():
        found.add(prefix + key)
        if isinstance(value, dict):
            found |= _fields(value, f"{prefix}{key}.")
    return found


FILE_SUFFIXES = {"py", "pt", "safetensors", "json", "jsonl", "toml", "png", "md", "txt", "bin", "log"}


def _messages(path: Path) -> list[str]:
    """The string literals of a module that are not docstrings (of modules, classes, functions, attributes: a
    string standing alone as a statement): what it prints, logs and raises."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_every_setting_a_message_names_exists():
    """Hints say "--set timeouts.startup_s=..." or "data.tokenizer": each such setting is a field of the config."""
    from gossiploco.config import RunConfig

    config = RunConfig().to_dict()
    fields = _fields(config)
    sections = "|".join(k for k, v in config.items() if isinstance(v, dict))
    mention = re.compile(rf"(?<![\w./-])((?:{sections})\.[a-z_0-9]+)\b(?![.(/])")
    texts = [(p, text) for p in (ROOT / "gossiploco").rglob("*.py") for text in _messages(p)]
    texts += [(ROOT / "README.md", code) for code in re.findall(r"`([^`]+)`", (ROOT / "README.md").read_text())]
    checked, wrong = 0, []
    for path, text in texts:
        for match in mention.finditer(text):
            if match[1].rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue  # a file name (model.safetensors, data.py), not a setting
            checked += 1
            if match[1] not in fields:
                wrong.append(f"{path.relative_to(ROOT)}: {match[1]} is no setting")
    assert not wrong, "\n".join(sorted(set(wrong)))
    assert checked > 50
