"""The bandwidth-optimal ring all-reduce schedule, as pure functions.

``n`` members sorted by id form a ring; member ``me`` sends to ``(me + 1) % n`` and receives from
``(me - 1) % n``. The payload of ``total`` elements is cut into ``n`` segments
(``segment_bounds``). Step ``s`` of ``2 (n - 1)``:

* reduce-scatter (``s < n - 1``): send segment ``me - s``, receive segment ``me - s - 1`` and add
  it in. After ``n - 1`` steps member ``me`` holds the full sum of segment ``me + 1``;
* all-gather (``s >= n - 1``, ``t = s - (n - 1)``): send segment ``me + 1 - t``, receive segment
  ``me - t`` and copy it in. Each reduced segment travels once round the ring, so every member
  ends with the same bits (each segment was summed by exactly one member).

Each segment travels in ``chunks_per_segment`` chunks; chunk ``c`` of step ``s`` is numbered
``s * cps + c``. Every value is sent ``2 (n - 1) / n`` times its size per member: the optimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RingStep:
    index: int
    send_segment: int
    recv_segment: int
    reduce: bool
    """True: add the received segment in (reduce-scatter); False: copy it (all-gather)."""


def ring_steps(n: int, me: int) -> list[RingStep]:
    """The ``2 (n - 1)`` steps of member ``me`` of an ``n``-member ring (module docstring)."""
    steps = [RingStep(s, (me - s) % n, (me - s - 1) % n, True) for s in range(n - 1)]
    steps += [RingStep(n - 1 + t, (me + 1 - t) % n, (me - t) % n, False) for t in range(n - 1)]
    return steps


def segment_bounds(total: int, n: int) -> list[int]:
    """Segment ``k`` is ``[bounds[k], bounds[k + 1])``."""
    return [total * k // n for k in range(n + 1)]


def chunks_per_segment(total: int, n: int, chunk_elems: int) -> int:
    """How many chunks the largest segment needs (every member computes the same number)."""
    return max(1, math.ceil(math.ceil(total / n) / chunk_elems))


def neighbours(members: list[int], me_id: int) -> tuple[int, int]:
    """(left, right) of ``me_id`` in the ring of sorted ``members``."""
    ordered = sorted(members)
    me = ordered.index(me_id)
    return ordered[(me - 1) % len(ordered)], ordered[(me + 1) % len(ordered)]
