"""Parameter blocks: named groups of parameters that mixing can select.

Blocks, in model order::

    embed                   tok_embeddings.weight
    layers.{i}.attention    layers.{i}.attention_norm.weight, layers.{i}.attention.w{q,k,v,o}.weight
    layers.{i}.mlp          layers.{i}.mlp_norm.weight, layers.{i}.mlp.w{1,2,3}.weight
    norm                    norm.weight
    lm_head                 lm_head.weight

A selection pattern matches a block when it equals the block's name, is a prefix ending at a
dot (``layers.0`` selects ``layers.0.attention`` and ``layers.0.mlp``), or matches as a glob
(``layers.*.attention``, ``*``). A pattern that matches no block is a configuration error.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from gossiploco.errors import ConfigError

_LAYER = re.compile(r"^layers\.(\d+)\.(attention|mlp)(_norm)?\.")


def block_of(param_name: str) -> str:
    """The block a parameter belongs to."""
    if param_name.startswith("tok_embeddings."):
        return "embed"
    if param_name.startswith("lm_head."):
        return "lm_head"
    if param_name.startswith("norm."):
        return "norm"
    match = _LAYER.match(param_name)
    if match:
        return f"layers.{match.group(1)}.{match.group(2)}"
    raise ValueError(f"parameter {param_name!r} belongs to no known block")


def block_names(n_layers: int) -> list[str]:
    """All block names of a model with ``n_layers`` transformer layers, in model order."""
    names = ["embed"]
    for i in range(n_layers):
        names += [f"layers.{i}.attention", f"layers.{i}.mlp"]
    return names + ["norm", "lm_head"]


def pattern_matches(pattern: str, block: str) -> bool:
    return block == pattern or block.startswith(pattern + ".") or fnmatch.fnmatchcase(block, pattern)


def select_blocks(blocks: Sequence[str], patterns: Iterable[str], field: str = "blocks") -> list[str]:
    """The blocks (in model order) matched by any of ``patterns``; each pattern must match one."""
    patterns = list(patterns)
    for pattern in patterns:
        if not any(pattern_matches(pattern, b) for b in blocks):
            raise ConfigError(field, f"no block matches {pattern!r}; blocks are {', '.join(blocks)}")
    return [b for b in blocks if any(pattern_matches(p, b) for p in patterns)]


def group_by_block(param_names: Iterable[str]) -> dict[str, list[str]]:
    """Parameter names grouped by block, blocks in first-seen (model) order."""
    groups: dict[str, list[str]] = {}
    for name in param_names:
        groups.setdefault(block_of(name), []).append(name)
    return groups


def select_parameters(param_names: Sequence[str], patterns: Iterable[str], field: str = "blocks") -> list[str]:
    """Names of the parameters whose block is selected by ``patterns``."""
    groups = group_by_block(param_names)
    chosen = set(select_blocks(list(groups), patterns, field))
    return [n for n in param_names if block_of(n) in chosen]
