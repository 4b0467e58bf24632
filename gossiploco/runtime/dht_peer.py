"""A network peer that finds its run through the hivemind DHT: its reachability, its directory, the
addresses it advertises (data plane and DHT node), and the ``NetworkPeer`` itself (what
``gossiploco peer --join`` runs)."""

from __future__ import annotations

import logging

from gossiploco.config import RunConfig
from gossiploco.errors import AddressInUse, ConfigError
from gossiploco.membership.dht_node import check_initial_peers
from gossiploco.membership.dht_directory import DhtDirectory
from gossiploco.reach.reachability import Reachability, check_reachability, describe, peer_ids_of
from gossiploco.reach.paths import Reach
from gossiploco.runtime.launch import free_ports
from gossiploco.runtime.peer import NetworkPeer
from gossiploco.runtime.run_match import RunWatch
from gossiploco.security.trust import Trust
from gossiploco.transport.fault_injection import SendHook

log = logging.getLogger(__name__)

REACHABILITY_CHOICES = ("auto", "public", "nat")


def find_reachability(mode: str, join: list[str], host: str, port: int, timeout_s: float) -> Reachability:
    """``auto``: the dial-back check (``reach.reachability``); ``public``/``nat``: as the user says."""
    if mode not in REACHABILITY_CHOICES:
        raise ConfigError("--reachability", f"must be one of {', '.join(REACHABILITY_CHOICES)}, got {mode!r}")
    if mode != "auto":
        return Reachability(mode == "public", None, None, f"--reachability {mode}", None, None, None)
    return check_reachability(join, port, timeout_s=timeout_s, host=host)


def reachable_as(found: Reachability, announce: str | None) -> tuple[bool, str]:
    """Whether to act as reachable, and the line that tells the user so. A verdict is followed. Without one
    (``found.reachable is None``: every checker busy, refusing or unreachable) the peer takes the safe path:
    behind NAT (reverse connections and relays work from anywhere; a wrong "reachable" would leave the
    others dialling an address that does not answer), unless ``--announce`` names the address to be
    reached at, which the user then vouches for (the peer still checks it answers a handshake before it
    announces itself, ``runtime.peer_discovery``). Either way the user is told why, and how to skip the check."""
    if found.reachable is not None:
        return found.reachable, describe(found) + (f" ({found.detail})" if found.detail else "")
    why = f"no checker gave a verdict ({found.no_verdict} busy or unreachable: {found.detail})"
    if announce:
        return True, (f"reachability unknown: {why}; acting as reachable at --announce {announce}, unverified "
                      "(--reachability public skips the check)")
    return False, (f"reachability unknown: {why}; acting as behind NAT, using reverse connections and relays. If "
                   "this machine is reachable, --reachability public --announce HOST[:PORT] skips the check")


def verified_by_join(found: Reachability, join: list[str]) -> bool:
    """Whether a ``--join`` node found this peer reachable. A verdict of another node (one the check found
    connected, when the ``--join`` nodes gave none) may come from a stranger, who can name a wrong
    address: it is followed, but the peer then checks its advertised endpoint answers before announcing
    it (``runtime.peer_discovery``), as for a declared one."""
    return found.reachable is True and found.checker is not None and found.checker in peer_ids_of(join)


def _check_host(host: str) -> str:
    """Where this peer's ports are probed and its dial-back check listens: every interface for a wildcard host."""
    return "0.0.0.0" if host in ("0.0.0.0", "::") else host


PORT_PICKS = 3
"""Ports a peer picks for itself (``--port 0``) before it gives up: another process may bind the one it picked first
(several peers started at once on one machine pick from the same ports)."""


def joined_peer(cfg: RunConfig, trust: Trust, stream: int | None, join: list[str], host: str, port: int,
                announce: str | None, run_id: str, dht_port: int = 0, **kwargs) -> NetworkPeer:
    """``joined_node`` (its arguments), on ``port`` or, when it is 0, on a port it picks, picked again should another
    process take that one first (``PORT_PICKS``): the reachability check dials the port the data plane binds, so the
    whole start is made again on the new one."""
    if port:
        return joined_node(cfg, trust, stream, join, host, port, announce, run_id, dht_port, **kwargs)
    for pick in range(1, PORT_PICKS + 1):
        picked = free_ports(1, _check_host(host))[0]
        try:
            return joined_node(cfg, trust, stream, join, host, picked, announce, run_id, dht_port, **kwargs)
        except AddressInUse as exc:
            if pick == PORT_PICKS:
                raise
            log.warning("peer %d: port %d was taken before this peer could bind it (%s); picking another",
                        trust.peer_id, picked, exc)
    raise AssertionError("unreachable")


def joined_node(cfg: RunConfig, trust: Trust, stream: int | None, join: list[str], host: str, port: int,
                announce: str | None, run_id: str, dht_port: int = 0, *, relays: list[str] | None = None,
                reachability: str = "auto", new_run: bool = False, fault: SendHook | None = None,
                shared_node: str | None = None, sealed_port: int = 0) -> NetworkPeer:
    """A ``NetworkPeer`` that finds its run through the DHT at ``join`` (bootstrap multiaddrs), listens
    on ``host:port``, and tells the others ``announce`` (``HOST`` or ``HOST:PORT``); ``dht_port``
    fixes its DHT node's port; ``sealed_port`` its sealed port's (``NetworkPeer``). ``stream``: its data stream
    (default: its peer id).

    First it finds out whether others can dial its data port (``reachability``: see
    ``find_reachability``; what it does when no checker gave a verdict: ``reachable_as``), prints it, and
    publishes it: a reachable peer without ``--announce``
    advertises the address the checker reached; a peer behind NAT runs its DHT node as a client
    connected to its ``relays`` (default: the ``join`` nodes) and is reached by reverse
    connections and relayed streams (``gossiploco.reach.paths``). ``new_run``: start this run even where
    the swarm runs another one (``runtime.run_match``). ``fault``: the exchange's fault-injection hook (tests).
    ``shared_node``: use the DHT node another process of this machine serves there (``ipc://PATH``,
    ``membership.shared_node``) instead of starting one; behind NAT such a peer is reached by reverse connections
    only (a shared node relays nothing for it), which is said."""
    t = cfg.timeouts
    join = [a.strip() for item in join for a in item.split(",") if a.strip()]
    relays = check_initial_peers(relays) if relays else []
    check_host = _check_host(host)
    found = find_reachability(reachability, join, check_host, port, t.hello_s)
    reachable, told = reachable_as(found, announce)
    behind_nat = not reachable
    # Behind NAT is worth a warning (it costs relays and reverse connections), and so is not knowing;
    # a verified reachable is just news
    log.log(logging.WARNING if behind_nat or found.reachable is None else logging.INFO, "peer %d: %s",
            trust.peer_id, told)
    if announce:
        advertise = f"tcp://{announce}" if ":" in announce else f"tcp://{announce}:{port}"
    elif found.reachable and found.address:
        advertise = found.address
    elif host in ("0.0.0.0", "::"):
        advertise = f"tcp://127.0.0.1:{port}"
        if not behind_nat:
            log.warning("no --announce: telling the others 127.0.0.1, so only peers on this machine can reach this "
                        "one (pass --announce with your LAN or public address)")
    else:
        advertise = f"tcp://{host}:{port}"
    announce_host = announce.rsplit(":", 1)[0] if announce and ":" in announce else announce
    dht_announce = [f"/ip4/{announce_host}/tcp/{dht_port}"] if announce_host and dht_port else None
    relay_list = relays or join
    if behind_nat and shared_node is not None:
        log.warning("peer %d: behind NAT on a shared DHT node: peers that can be dialled reach this one by reverse "
                    "connections; peers behind NAT too cannot reach it (a shared node relays for nobody; run this "
                    "peer without --dht-node to get relays)", trust.peer_id)
        relay_list = []
    directory = DhtDirectory(run_id, initial_peers=join, host="127.0.0.1" if host in ("127.0.0.1", "localhost") else host,
                             port=dht_port, announce_maddrs=dht_announce, ttl_s=t.announce_ttl_s,
                             heartbeat_s=t.discovery_s, timeout_s=t.hello_s + 5, trust=trust, behind_nat=behind_nat,
                             relays=relay_list, shared_node=shared_node)
    try:
        # Before the model is built (minutes, compiled): a wrong swarm key, or other settings than the run
        # going in the swarm, stop the peer at once (``NetworkPeer`` checks again before it announces itself)
        directory.confirm_swarm()
        RunWatch.for_config(cfg, run_id, trust.peer_id, new_run=new_run).check_start(directory.runs(),
                                                                                    members=set(directory.peers()))
        reach = Reach(reachable=not behind_nat, relays=tuple(relay_list) if behind_nat else (),
                      p2p=directory.p2p_id, verified=verified_by_join(found, join))
        return NetworkPeer(cfg, trust.peer_id, directory=directory, bind=f"tcp://{host}:{port}", advertise=advertise,
                           run_id=run_id, trust=trust, stream=stream, reach=reach, new_run=new_run, fault=fault,
                           sealed_port=sealed_port)
    except BaseException:
        directory.close()
        raise
