"""Reaching peers behind NAT: reachability checks, per-pair paths, relays and the libp2p carrier."""
