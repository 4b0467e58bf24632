"""A DHT-joined network peer's discovery: at its start, the checks (the swarm key, the run's settings, its own
reachability), its announcement, and the wait for the run's peers (saying who is here and who is missing);
afterwards, every ``timeouts.discovery_s`` on a thread of its own, new peers found and connected and its own
round and tokens published. ``Discovery`` owns that thread and the event that stops it; ``NetworkPeer``
(``runtime.peer``) builds one when it joins through a directory."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from gossiploco.config import RunConfig
from gossiploco.errors import DirectoryClosed, ExchangeError
from gossiploco.membership.directory import Directory
from gossiploco.membership.read_pacing import ReadPacing
from gossiploco.membership.record import PeerRecord
from gossiploco.reach.paths import Reach
from gossiploco.runtime.path_planner import PathPlanner
from gossiploco.reach.tunnel import serve_tunnel
from gossiploco.runtime.run_match import RunWatch
from gossiploco.runtime.waiting_line import WaitingReport
from gossiploco.security.trust import Trust
from gossiploco.transport.zmq_auth import STRANGER_REFUSAL
from gossiploco.transport.zmq_exchange import ZmqExchange

log = logging.getLogger("gossiploco.runtime.peer")

RUN_WATCH_EVERY = 5
"""A running peer reads the swarm's list of runs every this many ``discovery_s`` (a run started beside it)."""


class Discovery:
    """Peer ``rank``'s discovery through ``directory`` (announced at ``endpoint``). ``discover_at_start`` runs once, on the peer's main
    thread, and starts the loop thread; ``stop`` (any thread, idempotent) ends both, ``join`` waits for the
    thread. ``tokens``: reads the peer's tokens processed so far (from the loop thread)."""

    def __init__(self, cfg: RunConfig, rank: int, run_id: str, endpoint: str, exchange: ZmqExchange,
                 directory: Directory, *, runs: RunWatch, reach: Reach, paths: PathPlanner, trust: Trust | None, tokens: Callable[[], int]):
        self.cfg = cfg
        self.rank = rank
        self.run_id = run_id
        self.endpoint = endpoint
        """The address this peer announces (others reach it there)."""
        self.exchange = exchange
        self.directory = directory
        self.runs = runs
        self.reach = reach
        self.paths = paths
        self.trust = trust
        self.tokens = tokens
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pacing = ReadPacing(cfg.timeouts.discovery_s, cfg.timeouts.discovery_records_per_s)
        """When the loop reads the run's records again (``membership.read_pacing``)."""

    def discover_at_start(self) -> float:
        """Check this peer's settings match the run going in the swarm (``RunMismatch`` if not) and that it
        is reachable, announce it, and wait (up to ``timeouts.startup_s``, saying so) until ``workers`` peers
        of the run are known or the run is found already going; then start the discovery loop. Returns that
        deadline (``time.monotonic``)."""
        ex, t, directory, endpoint = self.exchange, self.cfg.timeouts, self.directory, self.endpoint
        directory.confirm_swarm()  # a wrong swarm key stops here, with the reason
        # other settings than the run going here stop here, named; a twin entry no member backs is only warned about
        others = self.runs.check_start(directory.runs(), members=set(directory.peers()))
        for warning in self.runs.twin_warnings:
            log.warning("rank %d: %s", self.rank, warning)
        if others:
            log.info("rank %d: starting run %s beside the other runs of this swarm (--new-run): %s", self.rank,
                     self.run_id, "; ".join(run.label() for run in others))
        if self.reach.reachable and not self.reach.verified and not ex.check_reachable(t.hello_s):
            host_port = endpoint.removeprefix("tcp://")
            raise ExchangeError(
                f"peer {self.rank}: its advertised endpoint {endpoint} does not answer a ZeroMQ handshake "
                f"within {t.hello_s:.0f}s. Other peers connect to it: make sure {host_port} is this machine's "
                "address as others see it (pass --announce HOST with your public or LAN address), and that the "
                "TCP port is open in the firewall (or forwarded by the NAT router); see README, 'Running across the internet'.")
        taken = directory.peers().get(self.rank)
        if taken is not None and taken.endpoint != endpoint:
            log.warning("rank %d: peer id %d was announced by %s (a previous run of this peer?); taking it over. "
                        "If another live peer uses this identity, give one of them another --identity",
                        self.rank, self.rank, taken.endpoint)
        key = self.trust.identity.curve_public if self.trust is not None else b""
        reach = self.reach
        if not reach.reachable and self.paths.run_in_node is not None:  # others' relayed streams end at our ROUTER
            bind_host, port = ex.bound.removeprefix("tcp://").rsplit(":", 1)
            self.paths.run_in_node(partial(serve_tunnel, router_host=bind_host, router_port=int(port)))
        directory.announce_run(self.runs.entry)
        directory.announce(PeerRecord(self.rank, endpoint, round=-1, tokens=0, key=key, reachable=reach.reachable,
                                      p2p=reach.p2p, relays=reach.relays))
        deadline = time.monotonic() + t.startup_s
        waiting, runs_read = WaitingReport(self.cfg.workers, deadline), time.monotonic()
        while True:
            records = self.sync_peers()
            going = {p: r.round for p, r in records.items() if r.round >= 1}
            if going:
                log.info("rank %d: run %s is already going (%d peers, in round %d at most): joining it", self.rank,
                         self.run_id, len(going), max(going.values()))
            now = time.monotonic()
            if len(records) >= self.cfg.workers or going or now > deadline:
                break  # short of peers: one warning when the first round starts (peer_join.join)
            line = waiting.update(now, list(records))
            if line is not None:
                log.info("rank %d: %s", self.rank, line)
            if now - runs_read >= t.discovery_s:  # a run started beside this one at the same moment
                runs_read = now
                self.watch_runs()
            if self._stop.wait(0.25):
                break
        self._thread = threading.Thread(target=self._loop, name=f"discovery-{self.rank}", daemon=True)
        self._thread.start()
        return deadline

    def stop(self) -> None:
        """Stop waiting at the start and the loop (returns at once; ``join`` waits for the thread)."""
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the loop thread to end (after ``stop``); nothing to wait for if it never started."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def watch_runs(self) -> None:
        """Warn once about each run with other settings that started beside this one (``run_match``)."""
        for warning in self.runs.warnings(self.directory.runs(), members=set(self.directory.peers())):
            log.warning("rank %d: %s", self.rank, warning)

    def sync_peers(self, records: dict[int, PeerRecord] | None = None) -> dict[int, PeerRecord]:
        """The run's announced peers (read now, or ``records`` as last read); connects to new ones (or ones that
        moved), and runs the paths' timers (a reverse connection that did not come up in time is relayed)."""
        records = self.directory.peers() if records is None else records
        offers = self.paths.sync(records)
        if offers is not None:  # reverse connections for peers behind NAT: they dial the ports in our record
            self.directory.update(reverse=offers)
            self.directory.publish_now()
        return records

    def _knocks(self) -> int:
        """Connections refused so far because their key was of no member (``read_pacing``: a newcomer knocking)."""
        return self.exchange.security_counts()["refused_connections"].get(STRANGER_REFUSAL, 0)

    def _loop(self) -> None:
        """Every ``timeouts.discovery_s``: publish this one's round and tokens; find new peers when the records are due
        again (``read_pacing``: at most ``discovery_records_per_s`` records a second, sooner when a newcomer knocks or
        an offer of a reverse connection is awaited), else run the paths over the records last read."""
        ticks, records = 0, None
        while not self._stop.wait(self.cfg.timeouts.discovery_s):
            ticks += 1
            try:
                now, knocks = time.monotonic(), self._knocks()
                if records is None or self.pacing.due(now, knocks, urgent=self.paths.awaiting_offers()):
                    records = self.sync_peers()
                    self.pacing.read(now, len(records), knocks)
                else:
                    self.sync_peers(records)
                self.directory.update(round=max(self.exchange.current_round, -1), tokens=self.tokens(),
                                      joined=self.exchange.joined_round)
                if ticks % RUN_WATCH_EVERY == 0:
                    self.watch_runs()
            except DirectoryClosed:
                return
            except Exception:  # noqa: BLE001 - discovery must outlive surprises; they are logged
                log.exception("rank %d: peer discovery failed; retrying", self.rank)
