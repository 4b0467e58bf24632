"""The main job: a whole swarm on this machine, found through a real DHT, with live progress.

``LocalSwarm`` starts a bootstrap DHT node (``membership.bootstrap``) and ``count`` peer
processes (``gossiploco peer --join BOOTSTRAP``), what users on separate machines run, only on
loopback, with one difference by default: the peers share the bootstrap's DHT node
(``--dht-node``, ``membership.shared_node``) instead of each starting a DHT process and a ``p2pd``
(at 32 peers on two cores those starved each other), and skip the dial-back check (on loopback
they reach each other: ``--reachability public``), running nicer than the node's process
(``PEER_NICENESS``). ``dht_per_peer`` gives each its own node and check. With more peers than cores,
each peer gets one torch thread (``peer_environment``). It follows each peer's ``metrics.jsonl``
as it grows and reports the latest
record of every peer (round, loss, CD_L2, CD_JS) to a callback. When every peer has exited it
writes ``OUT/summary.json``: the peers' own summaries side by side plus swarm-wide figures.
Ctrl+C (KeyboardInterrupt) stops every peer (SIGINT: each leaves the run gracefully), shuts the
DHT node down, writes the summary of what finished (``interrupted: true``) and re-raises.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossiploco.membership.bootstrap import beacon_keeper, start_bootstrap
from gossiploco.runtime.launch import LocalPeers

POLL_S = 0.5
"""How often the swarm reads the peers' metrics."""
PEER_NICENESS = 5
"""Peers sharing this process's DHT node run this much nicer than it, so that the node (and this process, which
serves it) answers them in time when they keep every core busy."""


def peer_environment(count: int, env: dict[str, str] | None) -> dict[str, str] | None:
    """The peers' extra environment: ``env``, and with more peers than cores, one torch thread each
    (``OMP_NUM_THREADS``, unless set) instead of every peer running a thread per core (``count`` x cores threads
    spinning on the same cores)."""
    cores = os.cpu_count() or 1
    if count <= cores or "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in (env or {}):
        return env
    return {**(env or {}), "OMP_NUM_THREADS": "1"}


@dataclass
class PeerProgress:
    rank: int
    record: dict = field(default_factory=dict)
    """The peer's latest metrics record."""
    exit_code: int | None = None
    offset: int = 0
    """Bytes of its metrics.jsonl read so far."""


class LocalSwarm:
    """``count`` peers of one run on this machine; ``peer_args`` go to every ``gossiploco peer``."""

    def __init__(self, count: int, out_dir: str | Path, peer_args: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 on_bootstrap: Callable[[list[str], Any], Any] | None = None, dht_per_peer: bool = False):
        if count < 1:
            raise ValueError(f"a swarm needs at least one peer, got {count}")
        self.count = count
        self.out_dir = Path(out_dir)
        self.peer_args = list(peer_args)
        self.env = env
        self.progress = {rank: PeerProgress(rank) for rank in range(count)}
        self.bootstrap: list[str] = []
        self.on_bootstrap = on_bootstrap
        """Called with the bootstrap addresses and the swarm key once the DHT is up (``swarm --dashboard``); what
        it returns is closed (``.close()``) when the swarm ends."""
        self.dht_per_peer = dht_per_peer
        self.node_service: Any = None
        """The bootstrap node's service to the peers (``membership.shared_node.NodeService``) while they run."""

    def run(self, on_progress: Callable[[dict[int, PeerProgress]], None] | None = None,
            timeout_s: float | None = None) -> dict:
        """Run to completion (or ``timeout_s``, then stop the peers); returns the swarm summary."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        from gossiploco.security.swarm_key import SwarmKey

        key_file = self.out_dir / "swarm.key"  # this local run's own key, made once (mode 0600), read on --resume
        if key_file.exists():
            key = SwarmKey.load(key_file)  # refused (UnsafeKeyFile) if tracked by git or readable by others
        else:
            key = SwarmKey.generate()
            key.save(key_file, exclusive=True)
        dht, self.bootstrap = start_bootstrap("127.0.0.1", 0, swarm=key)
        interrupted = False
        extra = None
        try:
            if self.on_bootstrap is not None:
                extra = self.on_bootstrap(self.bootstrap, key)
            peer_args = list(self.peer_args)
            niceness = 0
            lock = threading.Lock()  # the node's pipe is not thread-safe: its service and the beacon take turns
            beacon = beacon_keeper(dht, lock)  # a peer that joins this swarm later (``gossiploco peer``) must find it
            if not self.dht_per_peer:
                from gossiploco.membership.shared_node import NodeService

                self.node_service = NodeService(dht, lock=lock)
                self.node_service.describe(self.bootstrap, dht.peer_id.to_base58())
                peer_args += ["--dht-node", self.node_service.address, "--reachability", "public"]
                niceness = PEER_NICENESS
            with LocalPeers(self.count, self.out_dir, peer_args, join=self.bootstrap[0], env=peer_environment(
                    self.count, self.env), swarm_key=key_file, niceness=niceness) as peers:
                peers.start()
                try:
                    while True:
                        self._poll(peers)
                        if on_progress is not None:
                            on_progress(self.progress)
                        if all(p.exit_code is not None for p in self.progress.values()):
                            break
                        if timeout_s is not None and time.monotonic() - start > timeout_s:
                            break
                        if beacon is not None:
                            beacon.tick()
                        time.sleep(POLL_S)
                except KeyboardInterrupt:
                    interrupted = True
                    raise
                finally:
                    peers.stop()
                    self._poll(peers)
                    summary = self._summary(time.monotonic() - start, interrupted)
                    (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        finally:
            try:
                if extra is not None:
                    extra.close()
            finally:
                if self.node_service is not None:
                    self.node_service.close()
                dht.shutdown()
        return summary

    def _poll(self, peers: LocalPeers) -> None:
        for rank, progress in self.progress.items():
            proc = peers.procs.get(rank)
            if proc is not None and progress.exit_code is None:
                progress.exit_code = proc.poll()
            path = peers.peer_dir(rank) / "metrics.jsonl"
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(progress.offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
            progress.offset += len(complete)
            for line in complete.splitlines():
                try:
                    progress.record = json.loads(line)
                except json.JSONDecodeError:
                    continue

    def _summary(self, wall_s: float, interrupted: bool) -> dict:
        peers = []
        for rank in range(self.count):
            path = self.out_dir / f"peer-{rank}" / "summary.json"
            summary = json.loads(path.read_text()) if path.exists() else None
            peers.append({"rank": rank, "exit_code": self.progress[rank].exit_code, "summary": summary})
        # a peer stopped before its end writes a summary too (``interrupted``): only finished runs count here
        done = [p["summary"] for p in peers if p["summary"] is not None and not p["summary"].get("interrupted")]
        losses = [s["final_val_loss"] for s in done if s.get("final_val_loss") is not None]
        stopped = [p["summary"] for p in peers if p["summary"] is not None and p["summary"].get("interrupted")]
        stopped_losses = [s["final_val_loss"] for s in stopped if s.get("final_val_loss") is not None]
        first = done[0] if done else (stopped[0] if stopped else {})
        return {
            "config": first.get("config"),
            "run_id": first.get("run_id"),
            "peers": self.count,
            "workers": max((s.get("workers", 0) for s in done), default=None),  # the most that trained together
            "configured_workers": first.get("configured_workers"),
            "finished": len(done),
            "interrupted": interrupted,
            "bootstrap": self.bootstrap,
            "wall_s": wall_s,
            "final_val_loss": sum(losses) / len(losses) if losses else None,
            "final_val_loss_spread": max(losses) - min(losses) if losses else None,
            # a stopped swarm's model is in the peers' checkpoints; this is its last measured validation loss
            "val_loss_at_stop": sum(stopped_losses) / len(stopped_losses) if stopped_losses else None,
            "round_reached": max((s.get("round_reached", 0) for s in stopped), default=None),
            "max_cd_l2": max((s.get("max_cd_l2", 0.0) for s in done), default=None),
            "max_cd_js": max((s.get("max_cd_js", 0.0) for s in done), default=None),
            # tokens the swarm trained on: the sum of its peers' own counts (stopped peers' included)
            "swarm_tokens": sum(s.get("tokens", 0) for s in done + stopped),
            "compute_utilization": (sum(s.get("compute_utilization", 0.0) for s in done) / len(done)) if done else None,
            "per_peer": peers,
        }
