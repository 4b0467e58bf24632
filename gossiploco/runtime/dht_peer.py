"""A network peer that finds its run through the hivemind DHT: its directory, the addresses it
advertises (data plane and DHT node), and the ``NetworkPeer`` itself (what ``gossiploco peer
--join`` runs)."""

from __future__ import annotations

import logging

from gossiploco.config import RunConfig
from gossiploco.membership.directory import DhtDirectory
from gossiploco.runtime.peer import NetworkPeer
from gossiploco.security.trust import Trust

log = logging.getLogger(__name__)


def joined_peer(cfg: RunConfig, trust: Trust, stream: int | None, join: list[str], host: str, port: int,
                announce: str | None, run_id: str, dht_port: int = 0) -> NetworkPeer:
    """A ``NetworkPeer`` that finds its run through the DHT at ``join`` (bootstrap multiaddrs), listens
    on ``host:port``, and tells the others ``announce`` (``HOST`` or ``HOST:PORT``); ``dht_port``
    fixes its DHT node's port. ``stream``: its data stream (default: its peer id)."""
    # Port 0 in the advertised address becomes the port the OS picks for the bind.
    if announce:
        advertise = f"tcp://{announce}" if ":" in announce else f"tcp://{announce}:{port}"
    elif host in ("0.0.0.0", "::"):
        advertise = f"tcp://127.0.0.1:{port}"
        log.warning("no --announce: telling the others 127.0.0.1, so only peers on this machine can reach this one "
                    "(pass --announce with your LAN or public address)")
    else:
        advertise = f"tcp://{host}:{port}"
    t = cfg.timeouts
    announce_host = announce.rsplit(":", 1)[0] if announce and ":" in announce else announce
    dht_announce = [f"/ip4/{announce_host}/tcp/{dht_port}"] if announce_host and dht_port else None
    directory = DhtDirectory(run_id, initial_peers=[a for item in join for a in item.split(",") if a.strip()],
                             host="127.0.0.1" if host in ("127.0.0.1", "localhost") else host, port=dht_port,
                             announce_maddrs=dht_announce, ttl_s=t.announce_ttl_s, heartbeat_s=t.discovery_s,
                             timeout_s=t.hello_s + 5, trust=trust)
    try:
        return NetworkPeer(cfg, trust.peer_id, directory=directory, bind=f"tcp://{host}:{port}", advertise=advertise,
                           run_id=run_id, trust=trust, stream=stream)
    except BaseException:
        directory.close()
        raise
