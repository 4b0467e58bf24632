"""The attack suite's swarm (bench/attacks.py): one private run of real peer processes with its own swarm key
and bootstrap node, sampled for peak RSS, and the ``Result`` each attack returns with its verdict."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gossiploco.config import TINY_OVERRIDES
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.runtime.launch import LocalPeers
from gossiploco.security.swarm_key import SwarmKey
from testbed.outsider import ENV, announced, memory_kib
from testbed.overrides import peer_args
from testbed.processes import wait_until

ROOT = Path(__file__).resolve().parent.parent
LOSS_REL_TOL = 1e-3
"""An attack that moves the honest peers' final loss more than this (relative) changed the training."""
RSS_SLACK_MIB = 64


@dataclass
class Result:
    attack: str
    expected: str
    happened: list[str] = field(default_factory=list)
    ok: bool = True
    check: Callable[[Swarm], None] | None = None  # the verdict, once the swarm has finished
    loss: str = ""

    def fail(self, why: str) -> None:
        self.ok = False
        self.happened.append(f"**FAILED: {why}**")


class Swarm:
    """One private run: a bootstrap node and ``count`` peer processes; peak RSS sampled all along."""

    def __init__(self, name: str, out: Path, count: int, rounds: int):
        self.name, self.count, self.rounds = name, count, rounds
        self.key = SwarmKey.generate()
        shutil.rmtree(out, ignore_errors=True)  # logs are appended to, identities kept: start clean
        out.mkdir(parents=True, exist_ok=True)
        key_file = self.key.save(out / "swarm.key")
        self.dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=self.key)
        self.address = addresses[0]
        self.args = peer_args("globalm1-localm2", {**TINY_OVERRIDES, "rounds": rounds, "inner_steps": 8})
        self.peers = LocalPeers(count, out, self.args, env=ENV, join=self.address, swarm_key=key_file)
        self.hwm: dict[int, int] = {}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            for rank, proc in list(self.peers.procs.items()):
                self.hwm[rank] = max(self.hwm.get(rank, 0), memory_kib(proc.pid))

    def announced(self, rank: int) -> tuple[int, str] | None:
        return announced(self.peers.log(rank))

    def wait_announced(self, ranks, timeout_s: float = 120) -> dict[int, tuple[int, str]]:
        if not wait_until(lambda: all(self.announced(r) for r in ranks), timeout_s, 0.2):
            raise RuntimeError(f"{self.name}: peers did not start: {[self.peers.log(r)[-800:] for r in ranks]}")
        return {r: self.announced(r) for r in ranks}

    @property
    def run_id(self) -> str:
        head = " ".join(self.peers.log(0).split())
        return head.split(" run ", 1)[1].split()[0]

    def round_of(self, rank: int) -> int:
        path = self.peers.peer_dir(rank) / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-1])["round"] if lines else -1

    def summary(self, rank: int) -> dict:
        path = self.peers.peer_dir(rank) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def records(self, rank: int) -> list[dict]:
        path = self.peers.peer_dir(rank) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def close(self) -> None:
        self._stop.set()
        self.peers.stop()
        self.dht.shutdown()


def security(s: dict) -> str:
    sec = s.get("security", {})
    return f"refused {sec.get('refused_connections', {})}, rejected {sec.get('rejected_messages', {})}"
