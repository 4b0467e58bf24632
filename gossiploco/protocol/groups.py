"""Who exchanges with whom: each exchange runs in groups of bounded size, formed without a global barrier.

For exchange ``key`` (``"mix2/12"``), a peer with a view of M members splits it into ``n = bucket_count(M, size)``
buckets, the smallest power of two with ``M / n <= size``, and puts member ``m`` in bucket
``score(seed, key, "bucket", m) mod n``. Its group is its bucket; the group's leader is the member with the lowest
``score(seed, key, "lead", m)``. Scores are a keyed 64-bit mix (splitmix64 of the member id under a BLAKE2b salt of
``(seed, key)``), so:

* **No one chooses to lead.** The leader changes with every key; an id ground to lead one exchange leads one group of
  that one exchange (and the run's seed keeps even that from being planned before the run).
* **A view that differs is a local matter.** Whether peer ``p`` is in this peer's bucket depends only on ``p``, the
  key and ``n``: a member one peer knows and another does not changes that member's bucket only. ``n`` changes only
  when M crosses ``size`` times a power of two, and the node counts M over the members of the round before
  (``PeerNode._buckets``, ``PeerTable.counted``), so that a joiner moving it across such a boundary changes nothing
  until every view had a round to hold it. Two peers whose views differ form disjoint groups or one does identity,
  never a mixed-up exchange (``agreement``).
* **Nothing waits for the whole swarm.** A leader waits (at most ``grace_s``) for its bucket's members only; a
  late or dead member costs its own group one grace window at most, and the others nothing.

**An exchange run again** (``keys.again_key``: ``"mix1/12/again"``, Mix1's ring retried among the survivors of a
group that lost a member mid-exchange) keeps the buckets of the key it repeats (``keys.first_key``), so its group is
that group's survivors, and draws its leader anew (the first attempt's may be the member that failed).

Bucket sizes are Binomial(M, 1/n): mean in (size / 2, size]; a leader takes at most ``cap(size)`` members (the
lowest lead scores) and tells the others they were left out.

**The mixing this gives** (the paper's rho, eq. 27 onward: rho = the second eigenvalue of E[W^T W]). The buckets
are exchangeable (a random function of the key), so E[W] = a I + b 11^T for any operator run inside them, and for
the averaging operators here W^T W = W:

* group mean (``GlobalMix`` in groups, Mix1 above ``size``): ``rho = (M E[1/|g|] - 1) / (M - 1)``, about ``1 / size``
  (the global mean's rho is 0). ``mean_rho`` computes it exactly for Binomial buckets.
* gossip pairs inside groups (Mix2): a peer matched with probability ``p`` (every group of even size matches all its
  members; an odd one leaves one out) gives ``rho = 1 - p M / (2 (M - 1))``; with ``p = 1`` this is the uniform
  random perfect matching's ``(M - 2) / (2 (M - 1))``. ``gossip_rho`` computes it. The matching is unbiased: every
  pair of members is matched with the same probability.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import numpy as np

from gossiploco.protocol.keys import first_key

DEFAULT_SIZE = 16
"""Views of at most this many members are one group (every exchange waits for the whole view, as a small swarm
should); larger views split into buckets of at most this many on average."""


def cap(size: int) -> int:
    """The most members a leader puts in one group: twice the target (a Binomial bucket of mean <= ``size`` passes
    this with probability below 1e-4 for ``size`` >= 16)."""
    return 2 * size


def bucket_count(view_size: int, size: int) -> int:
    """The smallest power of two ``n`` with ``view_size / n <= size``."""
    if size < 1:
        raise ValueError(f"group size must be at least 1, got {size}")
    n = 1
    while view_size > n * size:
        n *= 2
    return n


def _salt(seed: int, key: str, what: str) -> np.uint64:
    digest = hashlib.blake2b(f"{seed}\0{key}\0{what}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def scores(seed: int, key: str, what: str, members: Sequence[int]) -> np.ndarray:
    """splitmix64 of ``member ^ salt(seed, key, what)``: one uniform 64-bit score per member (a key run again
    scores its buckets as the key it repeats: ``first_key``)."""
    key = first_key(key) if what == "bucket" else key
    x = np.asarray(members, dtype=np.int64).astype(np.uint64) ^ _salt(seed, key, what)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def group_of(seed: int, key: str, view: Sequence[int], me: int, size: int, buckets: int | None = None) -> list[int]:
    """The members of ``view`` in ``me``'s bucket for ``key`` (``me`` included, whether or not ``view`` names it),
    sorted; ``buckets``: how many (default: ``bucket_count`` of the view's size)."""
    members = sorted(set(view) | {me})
    n = bucket_count(len(members), size) if buckets is None else buckets
    if n == 1:
        return members
    buckets = scores(seed, key, "bucket", members) % np.uint64(n)
    mine = buckets[members.index(me)]
    return [m for m, b in zip(members, buckets) if b == mine]


def same_bucket(seed: int, key: str, view_size: int, a: int, b: int, size: int) -> bool:
    """Whether ``a`` and ``b`` share a bucket of ``key`` in a view of ``view_size`` members."""
    return in_bucket(seed, key, bucket_count(view_size, size), a, b)


def in_bucket(seed: int, key: str, buckets: int, a: int, b: int) -> bool:
    """Whether ``a`` and ``b`` share a bucket of ``key`` when the view splits into ``buckets``."""
    if buckets == 1:
        return True
    both = scores(seed, key, "bucket", [a, b]) % np.uint64(buckets)
    return bool(both[0] == both[1])


def lead_order(seed: int, key: str, members: Iterable[int]) -> list[int]:
    """``members`` by their lead score, lowest (the leader) first."""
    members = sorted(members)
    order = np.argsort(scores(seed, key, "lead", members), kind="stable")
    return [members[i] for i in order]


def leader_of(seed: int, key: str, group: Iterable[int]) -> int:
    return lead_order(seed, key, group)[0]


def bucket_size_pmf(view_size: int, size: int) -> list[float]:
    """P(a given member's bucket holds k members), k = 0..M: 1 + Binomial(M - 1, 1 / n)."""
    m, n = view_size, bucket_count(view_size, size)
    p = 1.0 / n
    pmf = [0.0] * (m + 1)
    for k in range(1, m + 1):
        pmf[k] = math.comb(m - 1, k - 1) * p ** (k - 1) * (1 - p) ** (m - k) if n > 1 else float(k == m)
    return pmf


def mean_rho(view_size: int, size: int) -> float:
    """rho of the group mean run in buckets (module docstring): ``(M E[1/|g|] - 1) / (M - 1)``; 0 for one bucket."""
    m = view_size
    if m <= 1:
        return 0.0
    inverse = sum(p / k for k, p in enumerate(bucket_size_pmf(m, size)) if k)
    return max(0.0, (m * inverse - 1) / (m - 1))


def matched_probability(view_size: int, size: int) -> float:
    """P(a given member has a partner) when each bucket is matched uniformly at random: 1 - E[1{|g| odd} / |g|]."""
    return 1.0 - sum(p / k for k, p in enumerate(bucket_size_pmf(view_size, size)) if k % 2)


def gossip_rho(view_size: int, size: int) -> float:
    """rho of pairwise gossip matched inside buckets (module docstring): ``1 - p M / (2 (M - 1))``."""
    m = view_size
    if m <= 1:
        return 0.0
    return 1.0 - matched_probability(m, size) * m / (2 * (m - 1))
