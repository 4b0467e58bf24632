"""Mixing operators (identity, global average, pairwise gossip) over a small exchange interface."""

from gossiploco.mixing.exchange import Exchange, MemoryExchange, MemoryHub
from gossiploco.mixing.operators import GlobalMix, GossipMix, IdentityMix, Mixer, MixResult, build_mixer, pair_matching

__all__ = [
    "Exchange", "MemoryExchange", "MemoryHub", "GlobalMix", "GossipMix", "IdentityMix", "Mixer", "MixResult",
    "build_mixer", "pair_matching",
]
