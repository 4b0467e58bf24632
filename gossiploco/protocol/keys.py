"""Exchange keys and how they relate: ``"mix1/12"`` (an exchange of round 12), its phases (``"mix1/12/scatter"``,
``"monitor/0/2/terms"``: later steps of the same exchange) and the same exchange run again (``"mix1/12/again"``).

A key run again (``again_key``; Mix1's ring retried among the survivors of a group that lost a member mid-exchange,
``mixing.again``) is a new exchange: it keeps the buckets of the key it repeats (``first_key``; ``protocol.groups``)
and draws its own leader, and a peer that abandoned the first attempt has not abandoned it (``phases``).
"""

from __future__ import annotations

AGAIN = "/again"
"""The suffix of an exchange run a second time."""
_AGAIN_PART = AGAIN.strip("/")


def again_key(key: str) -> str:
    """The key of ``key``'s exchange run again."""
    return key + AGAIN


def first_key(key: str) -> str:
    """The key whose buckets ``key`` uses: ``key`` itself, or for a key run again the key it repeats."""
    return key[:-len(AGAIN)] if key.endswith(AGAIN) else key


def phases(key: str) -> list[str]:
    """``key`` and the exchanges it is a later phase of (``"monitor/0/2"`` for ``"monitor/0/2/terms"``): a peer that
    abandoned any of them runs none of their later phases. A key run again is not a phase of the key it repeats."""
    parts = key.split("/")
    first = parts.index(_AGAIN_PART, 2) + 1 if _AGAIN_PART in parts[2:] else 2
    return [key, *("/".join(parts[:n]) for n in range(first, len(parts)))]
