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


def block_names(n_layers: int, tied: bool = False) -> list[str]:
    """All block names of a model with ``n_layers`` transformer layers, in model order. A model with tied
    embeddings has no ``lm_head`` block: its LM head is the ``embed`` block's matrix."""
    names = ["embed"]
    for i in range(n_layers):
        names += [f"layers.{i}.attention", f"layers.{i}.mlp"]
    return names + ["norm"] + ([] if tied else ["lm_head"])


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


FRAGMENT_ORDERS = ("forward", "backward")


def split_fragments(param_names: Sequence[str], sizes: dict[str, int], count: int, order: str = "forward") -> list[list[str]]:
    """``param_names`` cut into at most ``count`` runs of consecutive parameters of about equal total size
    (Streaming DiLoCo's fragments), in model order (``forward``: embeddings first) or reversed
    (``backward``: the LM head first). Every parameter is in exactly one fragment; none is empty."""
    if count < 1:
        raise ValueError(f"fragment count must be at least 1, got {count}")
    if order not in FRAGMENT_ORDERS:
        raise ValueError(f"fragment order must be one of {FRAGMENT_ORDERS}, got {order!r}")
    names = list(param_names) if order == "forward" else list(reversed(param_names))
    count = max(1, min(count, len(names)))
    total = sum(sizes[n] for n in names)
    parts: list[list[str]] = [[]]
    done = 0
    for i, name in enumerate(names):
        # start the next fragment once this one reached its share, keeping a name for each one left
        if parts[-1] and len(parts) < count and (done >= total * len(parts) / count or len(names) - i <= count - len(parts)):
            parts.append([])
        parts[-1].append(name)
        done += sizes[name]
    return parts
