"""What one mixing call gives (``Mixer.mix``, ``gossiploco.mixing.operators``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TensorDict = dict[str, torch.Tensor]


@dataclass
class MixResult:
    """Outcome of one mixing call."""

    values: list[TensorDict]
    """The mixed dicts, in the order given (unselected entries are the inputs, not copies)."""
    ok: bool
    """False when the exchange failed and identity was applied instead."""
    cause: str | None = None
    """Why the exchange failed (None when ok)."""
    partner: int | None = None
    """Gossip partner this round (None for global, identity, or an unmatched peer)."""
    seconds: float = 0.0
    """Wall time spent in the exchange."""
    bytes: int = 0
    """Payload bytes this peer sent (0 when nothing was exchanged): a ring all-reduce sends 2 (M - 1) / M
    of the fp32 payload, a swap all of it, a compressed exchange its codec's bytes
    (``gossiploco.mixing.compressed``). When the exchange failed: what it would have sent."""
    weight: float | None = None
    """A weighted mix: this peer's weight after it (push-sum: the pair's mean weight; global: the group's mean
    weight; identity or failure: the weight given). None for an unweighted mix."""
    again: bool = False
    """The result of the exchange run a second time, after the first failed (``Mixer.mix(again=True)``)."""
    grouped: bool = True
    """Whether the group was agreed: a failure after it came in the data phase (a member lost mid-exchange)."""
    leaderless: bool = False
    """The group's leader never decided (``errors.NoDecision``: dead, frozen or late): the members of its bucket
    that followed it all failed alike, and would meet again under another leader."""


NON_FINITE = "non-finite values received"
"""``MixResult.cause`` of an exchange that gave NaN or infinite values (not an exchange's failure)."""
