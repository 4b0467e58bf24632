"""A dishonest member, for the attack bench and the tests: what it does to the pseudo-gradient it sends
and to the token weight it claims.

An ``Adversary`` sits in ``FactoredDiLoCo.end_round`` between line 10 (``Delta_{m,r}``) and line 11 (Mix2):
the corrupted pseudo-gradient is what Mix2 sends and what the attacker's own outer step applies, so with a
global Mix1 its corrupted ``z`` is what it sends in the next Mix1 as well. A network peer gets one from
``GOSSIPLOCO_ATTACK=KIND[:STRENGTH]`` (read by the ``peer`` command, like ``GOSSIPLOCO_FAULT``); the
virtual swarm from its ``adversaries`` argument. Normal runs have none.

Kinds (``STRENGTH``, default in parentheses):

* ``scale``: ``s * Delta`` (1000).
* ``sign``: ``-s * Delta`` (1).
* ``noise``: Gaussian noise with ``s`` times the standard deviation of ``Delta``'s values (10), instead of it.
* ``replay``: the pseudo-gradient of the attacker's first round, sent again every round, times ``s`` (1).
* ``weight``: an honest ``Delta`` with ``s`` times the tokens it processed claimed (1000; a weighted run).
* ``alie``: "A Little Is Enough" (Baruch et al. 2019): ``mu - s * sigma``, coordinate-wise, where ``mu`` and
  ``sigma`` are the mean and standard deviation of the honest members' pseudo-gradients when the caller
  can give them (the virtual swarm: an omniscient attacker, the paper's threat model), else of the
  attacker's own last ``ALIE_WINDOW`` rounds (a network peer sees only its own) (1).

``state_flood`` is the one kind that does not touch the pseudo-gradient: the peer asks every member for
its state ``s`` times per round (5; ``runtime``).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gossiploco.errors import ConfigError

TensorDict = dict[str, torch.Tensor]

ATTACK_ENV = "GOSSIPLOCO_ATTACK"
DEFAULT_STRENGTH = {"scale": 1000.0, "sign": 1.0, "noise": 10.0, "replay": 1.0, "weight": 1000.0, "alie": 1.0,
                    "state_flood": 5.0}
KINDS = tuple(DEFAULT_STRENGTH)
ALIE_WINDOW = 4


@dataclass
class Adversary:
    """One dishonest member's behaviour (module docstring)."""

    kind: str
    strength: float
    seed: int = 0
    _first: TensorDict | None = field(default=None, repr=False)
    _recent: deque = field(default_factory=lambda: deque(maxlen=ALIE_WINDOW), repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("attack", f"unknown attack {self.kind!r}; one of {', '.join(KINDS)}")
        self._rng = torch.Generator().manual_seed(self.seed)

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> Adversary:
        """``KIND[:STRENGTH]`` (``scale:1000``, ``sign``)."""
        kind, _, strength = spec.partition(":")
        try:
            value = float(strength) if strength else DEFAULT_STRENGTH.get(kind, 1.0)
        except ValueError:
            raise ConfigError("attack", f"{spec!r}: the strength after ':' must be a number") from None
        return cls(kind, value, seed)

    def pseudo_gradient(self, delta: TensorDict, round_index: int,
                        honest: Sequence[TensorDict] | None = None) -> TensorDict:
        """What the attacker sends (and applies itself) instead of its honest ``delta`` in ``round_index``;
        ``honest``: the honest members' pseudo-gradients of this round, where the caller knows them (``alie``)."""
        s = self.strength
        if self.kind == "scale":
            return {n: v * s for n, v in delta.items()}
        if self.kind == "sign":
            return {n: v * -s for n, v in delta.items()}
        if self.kind == "noise":
            return {n: torch.randn(v.shape, generator=self._rng, dtype=torch.float32).to(v.device) * (s * float(v.std()))
                    if v.numel() > 1 else v.clone() for n, v in delta.items()}
        if self.kind == "replay":
            if self._first is None:
                self._first = {n: v.detach().clone() for n, v in delta.items()}
            return {n: v * s for n, v in self._first.items()}
        if self.kind == "alie":
            return self._little_is_enough(delta, honest)
        return delta  # weight, state_flood: the values are honest

    def claimed_tokens(self, tokens: int) -> int:
        """The tokens the attacker says it processed (``weight``: ``strength`` times the truth)."""
        return int(tokens * self.strength) if self.kind == "weight" else tokens

    def state_requests_per_round(self) -> int:
        """How many times per round the attacker asks each member for its state (``state_flood``; else 0)."""
        return int(self.strength) if self.kind == "state_flood" else 0

    def _little_is_enough(self, delta: TensorDict, honest: Sequence[TensorDict] | None) -> TensorDict:
        if honest:
            sample = list(honest)
        else:
            self._recent.append({n: v.detach().clone() for n, v in delta.items()})
            sample = list(self._recent)
        out = {}
        for n, v in delta.items():
            stacked = torch.stack([d[n].to(v.device, torch.float32) for d in sample])
            sigma = stacked.std(dim=0, unbiased=False) if len(sample) > 1 else stacked[0].abs()
            out[n] = stacked.mean(dim=0) - self.strength * sigma
        return out


def adversary_from_env(seed: int = 0) -> Adversary | None:
    """The ``GOSSIPLOCO_ATTACK`` adversary of this process (the attack bench sets it), or None."""
    spec = os.environ.get(ATTACK_ENV, "").strip()
    return Adversary.parse(spec, seed) if spec else None
