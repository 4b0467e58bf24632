"""``StateRequestLimit``: how often one requester may make this peer upload its state.

A state request is a 173-byte frame; its answer is the whole state (the model, its momentum and the inner
optimizer's moments: megabytes to gigabytes). Unlimited, one member could make every other peer upload the
model on demand (issue 25: 5 requests per member per round made honest peers upload 815 MiB instead of
213 MiB). The rule lives here, in the sans-I/O protocol, so the simulator runs it as the real peer does.

What the lifecycle really needs (``lifecycle.catch_up`` / ``download``): a peer catches up at most once per
round start, and one catch-up asks each donor once; a fresh process tries ``FRESH_ATTEMPTS`` (2) catch-ups,
the second after the swarm began another round. So an honest requester asks one donor at most about once a
round, and only while it is behind, which is rare. The rule is a token bucket per requester, counted in this
peer's rounds (the clock of catch-ups; wall time would let a flood through in a slow round and starve a
fast run): ``BURST`` requests at once, then one more each ``REFILL_ROUNDS`` rounds. A flood of ``n``
requests per round gets ``1 / REFILL_ROUNDS`` uploads per round after the first ``BURST``.

A refused request is answered with one empty chunk tagged ``REFUSED`` (``collectives.refusal_chunk``), so the
requester's download fails at once with the cause and it tries its next donor instead of waiting out its
deadline. Requesters are remembered in a bounded table (``MAX_REQUESTERS``; the oldest is forgotten first,
which can only give that requester a fresh bucket, never refuse an honest one wrongly).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gossiploco.protocol.messages import Data

BURST = 2
"""Requests one requester may make at once (a fresh process's two catch-up attempts)."""
REFILL_ROUNDS = 4
"""One more request per this many rounds of this peer's."""
MAX_REQUESTERS = 4096
"""Requesters remembered (memory stays bounded whatever ids ask)."""
NO_STATE = -1
"""Tag of the one empty chunk answering a state request when this peer has no state yet."""
REFUSED = -2
"""Tag of the one empty chunk answering a state request this limit refused."""


def refusal(nonce: str) -> Data:
    """The answer to a refused state request: one empty chunk tagged ``REFUSED`` (no upload)."""
    return Data(f"state/rep/{nonce}", 0, (0, REFUSED), torch.empty(0, dtype=torch.float32))


class StateRequestLimit:
    """A per-requester token bucket over this peer's rounds; see the module docstring."""

    def __init__(self, burst: int = BURST, refill_rounds: int = REFILL_ROUNDS, max_requesters: int = MAX_REQUESTERS):
        if burst < 1 or refill_rounds < 1:
            raise ValueError(f"burst ({burst}) and refill_rounds ({refill_rounds}) must be at least 1")
        self.burst = burst
        self.refill_rounds = refill_rounds
        self.max_requesters = max_requesters
        self._buckets: OrderedDict[int, tuple[float, int]] = OrderedDict()  # requester -> (tokens, round counted)
        self.served = 0
        """Requests allowed (each one state upload)."""
        self.refused_total = 0
        """Requests refused (no upload), all requesters together."""
        self.refused: dict[int, int] = {}
        """Requests refused, by requester (bounded like the buckets)."""

    def __len__(self) -> int:
        """Requesters remembered now (at most ``max_requesters``)."""
        return len(self._buckets)

    def allow(self, requester: int, round_index: int) -> bool:
        """Whether ``requester`` may have this peer's state now, this peer being in ``round_index``; counts it."""
        round_index = max(round_index, 0)
        tokens, counted = self._buckets.get(requester, (float(self.burst), round_index))
        tokens = min(float(self.burst), tokens + max(0, round_index - counted) / self.refill_rounds)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
            self.served += 1
        else:
            self.refused[requester] = self.refused.get(requester, 0) + 1
            self.refused_total += 1
        self._buckets[requester] = (tokens, round_index)
        self._buckets.move_to_end(requester)
        while len(self._buckets) > self.max_requesters:
            old, _ = self._buckets.popitem(last=False)
            self.refused.pop(old, None)
        return allowed
