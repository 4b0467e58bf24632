"""No module writes another object's private attributes (a lint over the package's syntax trees).

An object's ``_name`` fields are its own: only its methods (``self._name``, ``cls._name``) assign them,
augment them, delete them, assign into them (``self._d[k] = v``) or mutate them in place (``.append``,
``.update``, ``.pop``...). Code that needs another object's state calls that object's public methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gossiploco"

OWNERS = {"self", "cls"}
"""The names an object's own methods reach it by."""
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "clear", "pop", "popitem", "remove", "discard",
            "add", "sort", "reverse", "__setitem__", "__delitem__"}
"""Methods that change a list, dict or set in place."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_private(target: ast.expr) -> ast.Attribute | None:
    """The first ``X._name`` (X not ``self``/``cls``) along ``target``'s chain of attributes and subscripts: what
    writing ``target`` changes of another object's private state; None when it changes none."""
    node = target
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in OWNERS):
                return node
        node = node.value
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    """What a statement writes: assignment targets (unpacked), augmented and annotated targets, deletions."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        found = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        found = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def private_writes(source: str, filename: str = "<source>") -> list[str]:
    """Every place ``source`` writes another object's private attribute, as ``file:line: code``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        hits = [t for t in map(_foreign_private, _targets(node)) if t is not None]
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                hit = _foreign_private(func.value)
                if hit is not None:
                    hits.append(hit)
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                    and _private(node.args[1].value)
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWNERS)):
                hits.append(node)
        for hit in hits:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node).splitlines()[0]}  (writes {ast.unparse(hit)})")
    return found


def test_no_module_writes_another_objects_private_attributes():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the scan found the package
    found = [w for path in files for w in private_writes(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "private attributes written from outside their object:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    "peer._pending = {}",
    "peer._counts['catchups'] += 1",
    "peer._tokens += 1",
    "peer._snapshot: tuple = (1, 2)",
    "a, peer._losses = 1, []",
    "self.peer._held = []",
    "self._node._closed = True",
    "del peer._deferred",
    "del peer._pending['x']",
    "peer._counts.update(meta)",
    "peer._held.append(record)",
    "peer._pending.clear()",
    "peer._pending.pop('x')",
    "peer._state.rounds.append(r)",
    "setattr(peer, '_tokens', 3)",
    "for peer._i in range(3): pass",
])
def test_the_lint_finds_a_planted_violation(code):
    assert len(private_writes(code)) == 1, code


@pytest.mark.parametrize("code", [
    "self._pending = {}",
    "cls._registry['x'] = 1",
    "self._counts['catchups'] += 1",
    "self._held.append(record)",
    "self._node.closed = True",
    "del self._deferred",
    "peer.pending = {}",
    "peer.progress.merge({'catchup_from': 3})",
    "x = peer._tokens",
    "peer._stop.wait(1.0)",
    "setattr(self, '_tokens', 3)",
    "obj.__dict__ = {}",
])
def test_the_lint_lets_an_object_write_its_own_fields(code):
    assert private_writes(code) == [], code
