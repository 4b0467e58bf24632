"""gossiploco: decentralized peer-to-peer language-model training with Factored Gossip DiLoCo."""

__version__ = "0.1.0"
