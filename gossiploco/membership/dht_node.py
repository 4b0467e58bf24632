"""One hivemind DHT node of a run: its addresses (validated), starting it tied to this process,
and the calls that run inside its process (its visible addresses, re-dialing known peers).

Length prefixes on the node's streams: hivemind's DHT RPCs (``DHTProtocol.rpc_ping``/``rpc_store``/
``rpc_find``) are *unary* handlers: p2pd itself reads each request (varint-delimited; its control
connection to this process carries at most ``persistentConnMaxMsgSize``, hivemind's ``DEFAULT_MAX_MSG_SIZE``
= 4 MiB, far above a DHT message: a record envelope is at most ``record_validator.MAX_ENVELOPE_BYTES``)
before handing it to this process; ``P2P.receive_raw_data`` is never on their path. Measured
(``bench/attacks_relay.py``): a stream announcing a 1 TiB request is reset by p2pd after at most 512 KiB,
and neither p2pd nor this process grows. The node's own
stream handlers (``reach.relay``, ``reach.tunnel``, ``reach.dialback``) check every prefix themselves.

``membership.dht_directory`` keeps a run's records in such a node; ``membership.bootstrap`` runs one
for others to join through.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gossiploco.errors import ConfigError, DirectoryError

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)

TIMEOUTS = (TimeoutError, concurrent.futures.TimeoutError)  # the same class from Python 3.11 on


def host_maddr(host: str, port: int) -> str:
    """``/ip4/HOST/tcp/PORT`` (or ``/ip6/...``) for a numeric ``host`` (``ConfigError`` otherwise)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError("host", f"must be a numeric IPv4 or IPv6 address such as 127.0.0.1 or 0.0.0.0, "
                                  f"got {host!r}") from None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError("port", f"must be in 0..65535 (0: any free port), got {port!r}")
    return f"/ip{address.version}/{address}/tcp/{port}"


def check_initial_peers(initial_peers: Sequence[str]) -> list[str]:
    """Validate bootstrap multiaddrs (``/ip4/HOST/tcp/PORT/p2p/PEER_ID``); ``ConfigError`` names a bad one."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    if isinstance(initial_peers, str):
        raise ConfigError("--join", f"must be a list of multiaddrs, got the single string {initial_peers!r}")
    checked = []
    for item in initial_peers:
        hint = "expected a multiaddr printed by `gossiploco dht`, like /ip4/203.0.113.7/tcp/31337/p2p/QmXyz..."
        if not isinstance(item, str):
            raise ConfigError("--join", f"{hint}; got {item!r}")
        try:
            address = Multiaddr(item)
            PeerID.from_base58(address["p2p"])
        except Exception:  # multiaddr raises a zoo of exception types on bad input
            raise ConfigError("--join", f"{hint}; got {item!r} (is the /p2p/<peer id> part complete?)") \
                from None
        checked.append(item)
    return checked


def check_announce_maddrs(announce_maddrs: Sequence[str] | None) -> list[str] | None:
    """Validate multiaddrs to advertise (``/ip4/PUBLIC_IP/tcp/PORT``); ``ConfigError`` names a bad one."""
    from hivemind.utils.multiaddr import Multiaddr

    if announce_maddrs is None:
        return None
    if isinstance(announce_maddrs, str):
        raise ConfigError("announce_maddrs", f"must be a list of multiaddrs, got the single string {announce_maddrs!r}")
    checked = []
    for item in announce_maddrs:
        try:
            port = Multiaddr(item)["tcp"]
        except Exception:  # multiaddr raises a zoo of exception types on bad input
            port = None
        if not isinstance(item, str) or port in (None, "0"):
            raise ConfigError("announce_maddrs", f"expected /ip4/PUBLIC_IP/tcp/PORT with an explicit port, "
                                                 f"got {item!r}")
        checked.append(item)
    return checked


def start_dht(*, initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str] | None,
              timeout_s: float, identity_path: str | None = None, node_id: Any = None,
              record_validator: Any = None, behind_nat: bool = False, relays: Sequence[str] = (),
              relay_limits: tuple[float, ...] | None = None, run: str | None = None) -> hivemind.DHT:
    """Start a hivemind DHT node in its background process and wait at most ``timeout_s`` for it.

    The process and its p2pd die with this process, even when it is SIGKILLed
    (``gossiploco.membership.lifeline``). Its storage is bounded per writer, in lifetime and in total
    (``gossiploco.membership.dht_storage``). ``record_validator``: the node's record validator
    (``gossiploco.membership.record_validator.SwarmRecordValidator``; None: every record is accepted). Every
    node answers dial-back checks (``gossiploco.reach.dialback``). ``behind_nat``: a DHT client that
    stays connected to ``relays`` (multiaddrs with ``/p2p/``), through which others reach it
    (``gossiploco.reach.relay``); any other node relays for members behind NAT, each relayed
    connection within ``relay_limits`` (``relay.Limits``' fields in order: bytes per direction, seconds,
    idle seconds, connections per asker, in all; the default for any left out), for the
    members of the swarm's runs only (``membership.relay_admission.RunMembers``, built from
    ``record_validator``; a node without one relays for nobody). ``run``: this node's run, whose
    membership its own relay requests prove.

    Raises ``DirectoryError`` saying what to check when the node cannot start or cannot reach
    any of ``initial_peers``; the half-started node is shut down first.
    """
    from gossiploco.membership.lifeline import TiedDHT
    from gossiploco.membership.shared_memory import start_helper

    start_helper()  # before the DHT shares its first tensor: a stop signal then cannot hang torch (shared_memory)
    options: dict[str, Any] = dict(host_maddrs=list(host_maddrs), client_mode=False, startup_timeout=timeout_s)
    if behind_nat:  # nobody can dial this node: a DHT client, reached through its relays (``reach.tunnel``)
        options.update(client_mode=True)
    if announce_maddrs:
        options["announce_maddrs"] = list(announce_maddrs)
    if identity_path is not None:
        options["identity_path"] = identity_path
    if node_id is not None:
        options["node_id"] = node_id
    if record_validator is not None:
        options["record_validators"] = [record_validator]
    dht = TiedDHT(initial_peers=list(initial_peers) or None, start=True, await_ready=False,
                  shutdown_timeout=min(3.0, timeout_s), **options)
    try:
        dht.wait_until_ready(timeout=timeout_s)
        from functools import partial

        from gossiploco.membership.dht_storage import install_storage_bounds
        from gossiploco.membership.record_validator import SwarmRecordValidator
        from gossiploco.membership.relay_admission import RunMembers
        from gossiploco.reach.relay import serve_reach

        dht.run_coroutine(install_storage_bounds, return_future=True).result(timeout=timeout_s)
        admission = RunMembers(record_validator.swarm) if isinstance(record_validator, SwarmRecordValidator) else None
        dht.run_coroutine(partial(serve_reach, behind_nat=behind_nat, relays=list(relays), relay_limits=relay_limits,
                                  admission=admission, run=run), return_future=True).result(timeout=timeout_s)
    except BaseException as exc:
        dht.shutdown()
        if isinstance(exc, KeyboardInterrupt):
            raise
        cause = "timed out" if isinstance(exc, TIMEOUTS) else f"{type(exc).__name__}: {exc}"
        if initial_peers:
            raise DirectoryError(
                f"could not join the DHT through {', '.join(initial_peers)} within {timeout_s:g} s ({cause}). "
                "Check that the bootstrap node is running (`gossiploco dht`), that each address is copied "
                "whole including /p2p/<peer id>, and that its host and TCP port are reachable from this "
                "machine (firewall, NAT, wrong IP)") from exc
        raise DirectoryError(f"could not start a DHT node listening on {', '.join(host_maddrs)} within "
                             f"{timeout_s:g} s ({cause}); is the port free and the address one of this "
                             "machine's?") from exc
    return dht


async def _visible_maddrs(_dht: hivemind.DHT, node: Any) -> list:
    return await node.get_visible_maddrs()


def visible_maddrs(dht: hivemind.DHT, timeout_s: float) -> list[str]:
    """The node's multiaddrs as others should dial them, with its ``/p2p/<peer id>`` (bounded wait)."""
    future = dht.run_coroutine(_visible_maddrs, return_future=True)
    try:
        return [str(address) for address in future.result(timeout=timeout_s)]
    except TIMEOUTS:
        raise DirectoryError(f"the DHT node did not report its addresses within {timeout_s:g} s") from None


async def reconnect(_dht: hivemind.DHT, node: Any, addresses: list[str], timeout_s: float) -> int:
    """Runs in the DHT process (``dht.run_coroutine``): dial and ping, all at once, each of
    ``addresses`` whose peer is not in this node's routing table; returns how many answered.

    A ping that is answered puts the two nodes in each other's routing tables, and each hands the
    other the records it should keep. hivemind has no public "connect" call, so the p2p daemon's
    client dials the address itself (its address book may have forgotten it after an outage).
    """
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(address: str) -> bool:
        try:
            maddr = Multiaddr(address)
            peer_id = PeerID.from_base58(maddr["p2p"])
            if peer_id == node.peer_id or node.protocol.routing_table.get(peer_id=peer_id) is not None:
                return False
            client = getattr(node.p2p, "_client", None)
            if client is not None:
                transport = maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))
                await asyncio.wait_for(client.connect(peer_id, [transport]), timeout_s)
            return await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout_s) is not None
        except Exception:  # unreachable for now (or a bad address): the caller tries again later
            return False

    return sum(await asyncio.gather(*(one(address) for address in addresses)))
