"""A network peer's checkpoints: its worker state (``worker_state``) plus what the peer itself carries from
round to round: the metrics waiting for the next record, its counters, its tokens, adaptive Mix2 and the
adaptive deadlines it learned.

A resumed peer (``gossiploco peer --resume``) starts at its checkpoint's round k and can give that state
to others at once. Where the others are (``peer_join.join``): in round k, or none running (the whole
swarm was stopped and is started again), it trains round k with them; if the swarm went on, it downloads
the newer state as any late peer does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gossiploco.checkpoint import Checkpoint, CheckpointError, Snapshot
from gossiploco.runtime.worker_state import Copier, capture, restore

if TYPE_CHECKING:
    from gossiploco.runtime.peer import NetworkPeer

WORKER = "w0"
"""A peer's checkpoint holds one worker, under this prefix (``checkpoint.load_model_params`` reads it)."""


def peer_snapshot(peer: NetworkPeer, r: int) -> Snapshot:
    """The peer's state at the start of round ``r``."""
    copier = Copier()
    tensors, worker = capture(peer.algo, WORKER, copier)
    meta = {"workers": [WORKER], "worker_state": {WORKER: worker}, "metrics_bytes": peer.sink.bytes_written,
            **peer.progress.snapshot(), "adaptive": peer.adaptive.state() if peer.adaptive is not None else None,
            "deadlines": peer.exchange.deadlines.state(), "peer": peer.rank, "run_id": peer.run_id, "taken_at": time.time()}
    return Snapshot(r, tensors, meta, copier.wait)


def restore_peer(peer: NetworkPeer, checkpoint: Checkpoint) -> None:
    """Put a checkpoint's state into a freshly built peer of the same run (its algorithm, training progress,
    adaptive Mix2 and deadlines); ``NetworkPeer.resume`` then starts it at the checkpoint's round."""
    meta = checkpoint.meta
    if meta.get("workers") != [WORKER]:
        raise CheckpointError(f"{checkpoint.path} is not a network peer's checkpoint (workers {meta.get('workers')}); "
                              "a simulate run's checkpoint continues with `gossiploco simulate --resume`")
    if meta.get("run_id") != peer.run_id:
        raise CheckpointError(f"{checkpoint.path} belongs to run {meta.get('run_id')!r}, this peer joins {peer.run_id!r}")
    restore(peer.algo, WORKER, checkpoint.tensors, meta["worker_state"][WORKER])
    peer.progress.restore(meta)
    if peer.adaptive is not None and meta.get("adaptive") is not None:
        peer.adaptive.load_state(meta["adaptive"])
    peer.exchange.deadlines.load_state(meta.get("deadlines", {}))
    if peer.cfg.mode == "factored":  # others may ask for this state at once (a whole swarm restarting)
        peer.progress.set_round_start(checkpoint.round, peer.algo.z, peer.algo.momentum)
