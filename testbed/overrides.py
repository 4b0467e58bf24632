"""Config overrides as command-line arguments: the one place a dict of dotted overrides becomes ``--set`` flags.

``gossiploco.cli_options.parse_sets`` reads ``--set KEY=VALUE`` (a TOML value, else a string);
``set_args`` writes them, so ``parse_sets`` of ``set_args(overrides)`` gives ``overrides`` back for
every value a config holds (strings, numbers, booleans, lists of them). ``peer_args`` adds the preset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def set_args(overrides: Mapping[str, Any], *, without: Iterable[str] = ()) -> list[str]:
    """``["--set", "KEY=VALUE", ...]`` for every override but the keys in ``without`` (``workers``, for a peer
    whose world size comes from ``--peers`` or ``--workers``). A value is written as JSON, which TOML reads
    back as the same string, number, boolean or list."""
    leave_out = set(without)
    args: list[str] = []
    for key, value in overrides.items():
        if key not in leave_out:
            args += ["--set", f"{key}={json.dumps(value)}"]
    return args


def peer_args(preset: str, overrides: Mapping[str, Any], *, quiet: bool = True) -> list[str]:
    """``gossiploco peer`` arguments running ``preset`` with ``overrides`` (``workers`` left out: the world size
    is ``--peers``' length, or ``--workers`` with ``--join``)."""
    return ["--config", preset, *(["--quiet"] if quiet else []), *set_args(overrides, without=("workers",))]
