"""This peer's reachability: ask checkers for a dial-back (``gossiploco.reach.dialback``) until one gives a verdict.

``check_reachability`` opens a temporary listener on the data port that sends a fresh nonce to whoever
connects, and asks the ``--join`` nodes in order, then (if none gave a verdict) up to ``MAX_EXTRA_CHECKERS``
other nodes its libp2p daemon is connected to, until one gives a verdict. Only a checker that dialled
counts: a busy, refusing, unreachable or failing one means "ask another", and when none gives a verdict
the answer is ``reachable=None`` (unknown), never "behind NAT" (what a peer then does:
``runtime.dht_peer.find_reachability``). A ``REACHED`` claim counts only if the listener was indeed
connected to while that checker was asked (a lying node that never connects cannot make an unreachable
peer announce itself reachable; one that connects itself could still name a wrong address, so a verdict
of a node other than the ``--join`` ones is not taken as verified: ``runtime.dht_peer.verified_by_join``);
a lying ``UNREACHED`` can only do what no verdict does (the peer acts as behind NAT).
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from gossiploco.reach.dialback import (DIAL_S, DIALBACK_PROTOCOL, MAX_ANSWER_BYTES, NONCE_BYTES, REACHED, REFUSED,
                                       UNREACHED)

MAX_EXTRA_CHECKERS = 4
"""Nodes besides the ``--join`` ones that ``check_reachability`` asks when none of those gave a verdict."""


@dataclass(frozen=True)
class Reachability:
    """The outcome of a dial-back check."""

    reachable: bool | None
    """True: a checker reached our port; False: a checker dialled and could not; None: no checker gave
    a verdict (busy, refusing, unreachable: ``no_verdict`` of them), so nobody knows."""
    address: str | None
    """``tcp://IP:PORT`` as others reach this peer, when reachable."""
    observed_ip: str | None
    """The address the checker saw the request come from (our public address behind a NAT)."""
    detail: str
    checker: str | None
    """The libp2p peer id of the node that gave the verdict (or, without one, that reported its clock)."""
    clock_skew_s: float | None
    """The checker's wall clock minus ours (corrected by half the round trip)."""
    rtt_s: float | None
    no_verdict: int = 0
    """Checkers asked that gave no verdict (busy, refused, unreachable, broken answer)."""


def describe(r: Reachability) -> str:
    """One line for the user."""
    if r.reachable:
        return f"reachable at {r.address}"
    if r.reachable is False:
        return "behind NAT: using reverse connections and relays"
    return (f"reachability unknown ({r.no_verdict} checker{'s' if r.no_verdict != 1 else ''} busy or unreachable: "
            f"{r.detail}): assuming behind NAT, using reverse connections and relays")



class NonceListener:
    """A temporary TCP listener on the data port that sends ``nonce`` to whoever connects.
    ``accepted`` counts the connections it took (written by its own thread only; read by anyone)."""

    def __init__(self, host: str, port: int, nonce: bytes):
        self.nonce = nonce
        self.accepted = 0
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dialback-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1  # before the nonce goes out: a checker that read it finds this counted
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(self.nonce)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def peer_ids_of(join: Sequence[str]) -> list[str]:
    """The ``/p2p/<id>`` of each bootstrap multiaddr, in order, without repeats."""
    ids: list[str] = []
    for address in join:
        if "/p2p/" in address:
            pid = address.rsplit("/p2p/", 1)[1].strip("/")
            if pid and pid not in ids:
                ids.append(pid)
    return ids


def read_answer(raw: bytes) -> tuple[str, str | None, str, float | None]:
    """``(outcome, ip, detail, checker's time)`` of a checker's answer; ``ValueError`` for junk. An answer
    of the first version (no ``outcome``) counts as ``REACHED`` when it says so, else as ``REFUSED``: it
    also said "not reachable" when it was busy, so its "no" is no verdict."""
    if len(raw) > MAX_ANSWER_BYTES:
        raise ValueError(f"an answer of {len(raw)} bytes")
    answer = msgpack.unpackb(raw, raw=False)
    if not isinstance(answer, dict) or not isinstance(answer.get("reachable"), bool):
        raise ValueError("malformed answer")
    outcome = answer.get("outcome", REACHED if answer["reachable"] else REFUSED)
    if outcome not in (REACHED, UNREACHED, REFUSED):
        raise ValueError(f"unknown outcome {str(outcome)[:40]!r}")
    ip = answer.get("ip") if isinstance(answer.get("ip"), str) else None
    ip = ip if ip and _is_ip(ip) else None
    if outcome != REFUSED and ip is None:
        raise ValueError(f"a verdict ({outcome}) without the address it dialled")
    when = answer.get("time")
    when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None
    return outcome, ip, str(answer.get("detail", ""))[:200], when


def check_bound_s(timeout_s: float) -> float:
    """How long ``check_reachability`` may take at most (it returns what it found by then)."""
    return 3 * timeout_s + 2 * DIAL_S


async def _ask_one(p2p: Any, pid: str, port: int, nonce: bytes, timeout_s: float,
                   remaining_s: float) -> tuple[str, str | None, str, float | None, float]:
    """One checker's ``read_answer`` and the round trip; raises for a checker that does not answer."""
    from hivemind.p2p import PeerID

    from gossiploco.reach.framing import receive_frame, send_frame

    sent = time.time()
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(pid), DIALBACK_PROTOCOL), min(timeout_s, remaining_s))
    try:
        await send_frame(msgpack.packb({"port": port, "nonce": nonce}), writer)
        raw = await asyncio.wait_for(receive_frame(reader, MAX_ANSWER_BYTES),
                                     max(0.1, min(2 * DIAL_S + timeout_s, remaining_s - (time.time() - sent))))
    finally:
        writer.close()
    outcome, ip, detail, when = read_answer(raw)
    now = time.time()
    skew = when - (sent + now) / 2 if when is not None else None
    return outcome, ip, detail, skew, now - sent


async def _ask(join: Sequence[str], listener: NonceListener, nonce: bytes, timeout_s: float) -> Reachability:
    from hivemind.p2p import P2P

    loop = asyncio.get_running_loop()
    deadline = loop.time() + check_bound_s(timeout_s)
    candidates = peer_ids_of(join)
    if not candidates:
        return Reachability(None, None, None, "no bootstrap address with a /p2p/ id", None, None, None)
    p2p = await asyncio.wait_for(P2P.create(initial_peers=list(join), host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                                            dht_mode="client", auto_nat=False, nat_port_map=False,
                                            startup_timeout=timeout_s), timeout_s + 5)
    notes: list[str] = []
    clock: tuple[str, float | None, float | None] | None = None  # a refusing checker still tells its clock
    looked_further = False
    try:
        index = 0
        while True:
            if index == len(candidates) and not looked_further:  # the --join nodes gave no verdict: ask others
                looked_further = True
                try:
                    connected = [info.peer_id.to_base58() for info in await asyncio.wait_for(p2p.list_peers(), 5)]
                except Exception as exc:  # noqa: BLE001 - no others to ask, said so
                    notes.append(f"listing other nodes failed: {type(exc).__name__}")
                    connected = []
                candidates += [pid for pid in connected if pid not in candidates][:MAX_EXTRA_CHECKERS]
            if index >= len(candidates):
                break
            pid = candidates[index]
            remaining = deadline - loop.time()
            if remaining <= 0.5:
                notes.append(f"out of time with {len(candidates) - index} checker(s) not asked")
                break
            index += 1
            seen_before = listener.accepted
            try:
                outcome, ip, detail, skew, rtt = await _ask_one(p2p, pid, listener.port, nonce, timeout_s, remaining)
            except Exception as exc:  # noqa: BLE001 - no verdict from this one: ask the next, say why at the end
                notes.append(f"{pid[-8:]}: {type(exc).__name__}: {exc}"[:160])
                continue
            clock = clock or (pid, skew, rtt)
            if outcome == REACHED and listener.accepted == seen_before:
                notes.append(f"{pid[-8:]}: claimed to reach this port, but nothing connected to it: ignored")
                continue
            if outcome == REFUSED:
                notes.append(f"{pid[-8:]}: {detail}")
                continue
            reachable = outcome == REACHED
            return Reachability(reachable=reachable, address=f"tcp://{ip}:{listener.port}" if reachable else None,
                                observed_ip=ip, detail=detail, checker=pid, clock_skew_s=skew, rtt_s=rtt,
                                no_verdict=len(notes))
        checker, skew, rtt = clock or (None, None, None)
        return Reachability(None, None, None, "; ".join(notes) or "no checker answered", checker, skew, rtt,
                            no_verdict=sum(1 for n in notes if not n.startswith(("out of time", "listing"))))
    finally:
        await p2p.shutdown()


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def check_reachability(join: Sequence[str], port: int, *, timeout_s: float, host: str = "0.0.0.0") -> Reachability:
    """Ask the nodes at ``join`` (bootstrap multiaddrs with ``/p2p/<id>``), in order, then a few other nodes
    connected to, to dial back ``port`` (on which a temporary listener runs meanwhile: nothing else may
    hold it), until one gives a verdict. Bounded by about ``check_bound_s(timeout_s)``. Never raises for
    network trouble: ``reachable=None`` (unknown) says why no checker gave a verdict."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        listener = NonceListener(host, port, nonce)
    except OSError as exc:
        return Reachability(None, None, None, f"cannot listen on {host}:{port}: {exc.strerror or exc}", None, None,
                            None)
    try:
        return asyncio.run(asyncio.wait_for(_ask(join, listener, nonce, timeout_s), check_bound_s(timeout_s) + 10))
    except Exception as exc:  # noqa: BLE001 - the daemon did not start, or the whole check hung
        return Reachability(None, None, None, f"{type(exc).__name__}: {exc}"[:200], None, None, None)
    finally:
        listener.close()
