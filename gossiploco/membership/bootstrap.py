"""A bootstrap node: the one well-known address through which peers join a run's DHT.

Peers find each other through a hivemind DHT (``gossiploco.membership.dht_directory``). To join it,
a new node needs the multiaddr of one node already in it, including that node's libp2p peer id:
``/ip4/203.0.113.7/tcp/31337/p2p/QmXyz...``. A bootstrap node is a plain DHT node started for
that purpose (``gossiploco dht``): it announces no peer record, it only answers DHT
requests and stores its share of the records like every other node.

The bootstrap node is not a single point of failure for a running swarm: every peer's
``DhtDirectory`` is a full DHT node, so peers that already joined keep finding each other while
the bootstrap node is down. It is needed only by peers joining while it is down.

Stable address across restarts: the multiaddr holds the node's peer id, which hivemind derives
from a private key that is random per start. With ``identity_file`` the key is kept in that file
(created with mode 0600 when missing, reused after), so a restarted bootstrap node on the same
port has the same multiaddr and peers' ``--join`` lines stay valid. Its Kademlia node id is then
derived from the peer id too, so the rest of the swarm sees the restarted node as the same node.

Reconnecting after a restart: a restarted node knows nobody, and the peers that tried to reach
it while it was down have stopped trying for a while (libp2p's dial backoff, up to 5 minutes), so
a peer joining through it right after the restart would find nobody. With ``identity_file``,
``serve_bootstrap`` therefore saves the multiaddrs of the DHT nodes it is connected to in
``<identity_file>.peers`` (JSON, mode 0600, every ``PEERS_SAVE_S`` and at shutdown), and
``start_bootstrap`` pings the saved peers first thing; the running swarm is reconnected within a
second of the restart. The file is only ever read as a list of multiaddr strings.

A bootstrap node that is killed, even by SIGKILL, takes its DHT process and p2pd with it
(``gossiploco.membership.lifeline``) instead of leaving them running on its port.

Printed addresses: listening on 0.0.0.0 makes the daemon report one address per interface;
unroutable ones (0.0.0.0, ::) are dropped and non-loopback ones are listed first. If nothing
usable remains, 127.0.0.1 is substituted with a warning (the node is then reachable from this
machine only; pass ``announce`` with the public address).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gossiploco.errors import ConfigError, DirectoryError
from gossiploco.security.key_files import check_key_file, write_secret_file
from gossiploco.membership.dht_node import (
    check_announce_maddrs,
    check_initial_peers,
    host_maddr,
    reconnect,
    start_dht,
    visible_maddrs,
)
from gossiploco.membership.beacon import BEACON_TTL_S, BeaconKeeper, store_beacon

if TYPE_CHECKING:
    import hivemind

    from gossiploco.security.swarm_key import SwarmKey

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 15.0
"""Deadline for the bootstrap node to start."""
RECONNECT_TIMEOUT_S = 5.0
"""Deadline for pinging the saved peers after a restart."""
PEERS_SAVE_S = 10.0
"""How often ``serve_bootstrap`` saves the peers it is connected to."""
MAX_SAVED_PEERS = 1024
"""Most multiaddrs kept in the peers file."""
LIVENESS_POLL_S = 0.5
"""How often ``serve_bootstrap`` checks the stop event and that the DHT process is alive."""


def load_or_create_identity(identity_file: Path) -> str:
    """The base58 libp2p peer id of the private key in ``identity_file``, generating the key if missing.

    A new file is created with mode 0600 (never readable by others, not even for an instant).
    Raises ``UnsafeKeyFile`` when the file is tracked by git or accessible by group or others,
    ``DirectoryError`` when it exists but holds no libp2p private key, and ``ConfigError`` when its
    directory does not exist.
    """
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    path = Path(identity_file)
    if path.exists():
        check_key_file(path, "--identity")
        try:
            peer_id = PeerID.from_identity(path.read_bytes())
        except Exception as exc:  # protobuf and cryptography raise various types on garbage
            raise DirectoryError(f"identity file {path} does not hold a libp2p private key ({exc!r}); "
                                 "delete it to generate a new identity (the peer id will change)") from exc
        return peer_id.to_base58()
    if not path.parent.is_dir():
        raise ConfigError("identity_file", f"directory {path.parent} does not exist")
    key = RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    try:
        write_secret_file(path, data, exclusive=True)
    except FileExistsError:  # another start made it a moment ago: use that one
        return load_or_create_identity(path)
    peer_id = PeerID.from_identity(data)
    log.info("generated a new bootstrap identity %s in %s", peer_id.to_base58(), path)
    return peer_id.to_base58()


def peers_file_for(identity_file: Path) -> Path:
    """Where the bootstrap node with ``identity_file`` keeps the multiaddrs of its peers."""
    identity_file = Path(identity_file)
    return identity_file.with_name(identity_file.name + ".peers")


async def _connected_dht_peers(_dht: hivemind.DHT, node) -> list[str]:
    """Runs in the DHT process: multiaddrs (with /p2p/) of connected peers that are in the routing table."""
    addresses = []
    for info in await node.p2p.list_peers():
        if node.protocol.routing_table.get(peer_id=info.peer_id) is not None:
            addresses += [f"{address}/p2p/{info.peer_id.to_base58()}" for address in info.addrs]
    return addresses[:MAX_SAVED_PEERS]


def save_known_peers(dht: hivemind.DHT, path: Path, timeout_s: float = RECONNECT_TIMEOUT_S) -> int:
    """Write the multiaddrs of the DHT nodes ``dht`` is connected to into ``path`` (atomically, mode 0600).

    Keeps the previous file when there are none (a node that just restarted knows nobody yet).
    Returns how many were saved; failures are logged, never raised.
    """
    try:
        addresses = dht.run_coroutine(_connected_dht_peers, return_future=True).result(timeout=timeout_s)
        if not addresses:
            return 0
        write_secret_file(path, json.dumps(sorted(set(addresses)), indent=0))
        return len(addresses)
    except Exception as exc:  # a full disk or a dying DHT process must not stop the node
        log.warning("could not save the bootstrap node's peers to %s: %r", path, exc)
        return 0


def load_saved_peers(path: Path) -> list[str]:
    """The valid multiaddrs in a peers file (none when it is missing or unreadable; bad entries skipped)."""
    try:
        entries = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring the unreadable peers file %s: %r", path, exc)
        return []
    if not isinstance(entries, list):
        log.warning("ignoring the peers file %s: it does not hold a list", path)
        return []
    valid = []
    for entry in entries[:MAX_SAVED_PEERS]:
        try:
            valid += check_initial_peers([entry])
        except ConfigError:
            log.warning("ignoring %r in the peers file %s: not a multiaddr with /p2p/", entry, path)
    return valid


def usable_maddrs(addresses: Sequence[str]) -> list[str]:
    """Drop unroutable (0.0.0.0, ::) addresses and list non-loopback ones first; substitute 127.0.0.1 if none remain."""
    usable, loopback, unspecified = [], [], []
    for address in addresses:
        parts = address.split("/")  # "", "ip4", HOST, "tcp", PORT, "p2p", ID
        try:
            ip = ipaddress.ip_address(parts[2]) if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None
        except ValueError:
            ip = None
        if ip is not None and ip.is_unspecified:
            unspecified.append(address)
        elif ip is not None and ip.is_loopback:
            loopback.append(address)
        else:
            usable.append(address)
    if usable or loopback:
        return usable + loopback
    substituted = [address.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/", 1).replace("/ip6/::/", "/ip6/::1/", 1)
                   for address in unspecified]
    log.warning("the DHT node reports only unspecified addresses %s; printing loopback ones instead, which work "
                "from this machine only (pass announce=/ip4/PUBLIC_IP/tcp/PORT for other machines)", unspecified)
    return substituted


def start_bootstrap(host: str = "0.0.0.0", port: int = 0, announce: Sequence[str] | None = None,
                    identity_file: Path | None = None, *, timeout_s: float = STARTUP_TIMEOUT_S,
                    swarm: SwarmKey | None = None, open_run: bool = False,
                    join: Sequence[str] = (), relay_limits: tuple[float, float] | None = None
                    ) -> tuple[hivemind.DHT, list[str]]:
    """Start a bootstrap DHT node without blocking on it; return it and its multiaddrs for ``--join``.

    The caller owns the returned ``hivemind.DHT`` and must ``shutdown()`` it. ``port`` 0 picks a
    free port (give a fixed one for an address that survives restarts). ``announce`` replaces the
    advertised multiaddrs (``/ip4/PUBLIC_IP/tcp/PORT``, behind NAT or port forwarding). Raises
    ``ConfigError`` for bad arguments and ``DirectoryError`` when the node does not start within
    ``timeout_s`` (port taken, address not of this machine, bad identity file). With
    ``identity_file``, the peers saved by the previous run (``serve_bootstrap``) are pinged before
    returning, for at most ``RECONNECT_TIMEOUT_S``.

    ``swarm``: the node stores only records signed by their peer and sealed with this key
    (``SwarmRecordValidator``) and publishes the swarm's beacon (``store_beacon``), by which a peer
    that joins with another key learns at once that its key is wrong. ``open_run``: only signed
    records. Neither: any record (unit tests of the DHT mechanics). ``join``: bootstrap multiaddrs of
    a running swarm, for a second bootstrap node (and relay, ``gossiploco.reach.tunnel``).
    ``relay_limits``: (bytes per direction, seconds) per relayed connection.
    """
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID

    listen = host_maddr(host, port)
    announce = check_announce_maddrs(announce)
    node_id = identity_path = None
    if identity_file is not None:
        peer_id = load_or_create_identity(Path(identity_file))
        identity_path = str(identity_file)
        node_id = DHTID.generate(source=PeerID.from_base58(peer_id).to_bytes())
    started = time.monotonic()
    from gossiploco.security.identity import Identity
    from gossiploco.membership.record_validator import SwarmRecordValidator

    signer = Identity.generate() if swarm is not None else None  # signs this node's beacon
    validator = SwarmRecordValidator(signer, swarm) if swarm is not None or open_run else None
    dht = start_dht(initial_peers=check_initial_peers(join) if join else [], host_maddrs=[listen], relay_limits=relay_limits, announce_maddrs=announce, timeout_s=timeout_s,
                    identity_path=identity_path, node_id=node_id, record_validator=validator)
    try:
        addresses = usable_maddrs(visible_maddrs(dht, timeout_s))
    except BaseException:
        dht.shutdown()
        raise
    if swarm is not None and signer is not None:
        dht.gossiploco_beacon = (swarm, signer.peer_id)  # for ``beacon_keeper``: the node's server refreshes it
        store_beacon(dht, swarm, signer.peer_id, timeout_s)
    log.info("bootstrap DHT node up in %.2f s at %s", time.monotonic() - started, ", ".join(addresses))
    if identity_file is not None:
        _reconnect_saved_peers(dht, peers_file_for(Path(identity_file)))
    return dht, addresses


def beacon_keeper(dht: hivemind.DHT, lock: threading.Lock, every_s: float = BEACON_TTL_S / 4) -> BeaconKeeper | None:
    """What keeps the beacon of a node ``start_bootstrap`` started with a swarm key published, every ``every_s``
    (None without a key)."""
    beacon = getattr(dht, "gossiploco_beacon", None)
    if beacon is None:
        return None
    return BeaconKeeper(dht, *beacon, lock=lock, timeout_s=STARTUP_TIMEOUT_S, every_s=every_s)


def _reconnect_saved_peers(dht: hivemind.DHT, path: Path) -> None:
    """Ping the peers saved in ``path`` so the running swarm learns this node is back (bounded, logged)."""
    from functools import partial

    saved = load_saved_peers(path)
    if not saved:
        return
    future = dht.run_coroutine(partial(reconnect, addresses=saved, timeout_s=RECONNECT_TIMEOUT_S), return_future=True)
    try:
        answered = future.result(timeout=RECONNECT_TIMEOUT_S + 1.0)
        log.info("reconnected to %d of the %d saved peer address(es) in %s", answered, len(saved), path)
    except Exception as exc:
        log.warning("reconnecting to the saved peers in %s failed: %r", path, exc)


def serve_bootstrap(host: str = "0.0.0.0", port: int = 0, announce: Sequence[str] | None = None,
                    identity_file: Path | None = None, *, on_ready: Callable[[list[str]], None],
                    stop: threading.Event | None = None, swarm: SwarmKey | None = None,
                    open_run: bool = False, join: Sequence[str] = (),
                    relay_limits: tuple[float, float] | None = None, local_peers: Path | None = None) -> None:
    """Run a bootstrap node until ``stop`` is set or Ctrl+C; always shut it down before returning.

    ``local_peers``: also serve the peers of this machine the node (``membership.shared_node``), on a socket in
    that directory (made private, mode 0700); ``on_ready`` then gets the socket's address as well.

    ``on_ready(addresses)`` is called once the node is up, with multiaddrs ready to paste into
    ``--join`` (with ``local_peers``, ``on_ready(addresses, socket_address)``). With ``identity_file``, the
    peers the node is connected to are saved in
    ``peers_file_for(identity_file)`` every ``PEERS_SAVE_S`` and at shutdown, for the next start to
    reconnect to. Raises what ``start_bootstrap`` raises, and ``DirectoryError`` if the DHT process
    dies while serving. Ctrl+C (KeyboardInterrupt) propagates once the node is shut down.
    """
    dht, addresses = start_bootstrap(host, port, announce, identity_file, swarm=swarm, open_run=open_run, join=join,
                                     relay_limits=relay_limits)
    lock = threading.Lock()  # the node's pipe is not thread-safe: the service and this loop take turns
    service = None
    if local_peers is not None:
        from gossiploco.membership.shared_node import NodeService

        try:
            service = NodeService(dht, lock=lock, directory=str(local_peers), signed_only=swarm is not None or open_run)
        except BaseException:
            dht.shutdown()
            raise
        service.describe(addresses, dht.peer_id.to_base58())
    stop = stop if stop is not None else threading.Event()
    peers_file = peers_file_for(Path(identity_file)) if identity_file is not None else None
    next_save = time.monotonic() + PEERS_SAVE_S
    beacon = beacon_keeper(dht, lock)
    try:
        if service is None:
            on_ready(addresses)
        else:
            on_ready(addresses, service.address)
        while not stop.wait(LIVENESS_POLL_S):
            if not dht.is_alive():
                raise DirectoryError(f"the bootstrap DHT process exited unexpectedly (exit code {dht.exitcode})")
            if beacon is not None:
                beacon.tick()
            if peers_file is not None and time.monotonic() >= next_save:
                with lock:
                    save_known_peers(dht, peers_file)
                next_save = time.monotonic() + PEERS_SAVE_S
    finally:
        if service is not None:
            service.close()
        if peers_file is not None and dht.is_alive():
            save_known_peers(dht, peers_file)
        dht.shutdown()
