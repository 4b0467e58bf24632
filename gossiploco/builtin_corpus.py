"""The built-in corpus: the Python standard library's source files on this machine (a leaf module).

The default training data (``data.paths`` empty) and the default text a BPE tokenizer is trained on;
nothing is downloaded. The list is sorted, so every peer on the same Python reads the same files.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_root() -> Path:
    """Where this Python's standard library lives (the files' keys are paths relative to it)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted by path relative to ``stdlib_root()``."""
    root = stdlib_root()
    files = [p for p in root.rglob("*.py") if not ({"site-packages", "dist-packages"} & set(p.relative_to(root).parts))]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())
