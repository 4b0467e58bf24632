"""The attack suite's fast attacks (``bench/attacks.py`` runs them all against real peer processes).

Live ``ZmqExchange`` pairs (``Trust.static``) against outsiders' sockets: routing-id takeovers with
floods and hang-ups (the victim in a subprocess, so a libzmq abort shows as SIGABRT), forged leave,
a fake leader, forged rounds, oversize messages (RSS bound), a connection flood, a replayed CurveZMQ
session; real DHT nodes against an outsider's node that has no record validator; and an uninvited
``gossiploco peer``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import zmq

from conftest import wait_until
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.membership.dht_directory import DhtDirectory
from gossiploco.membership.record import PeerRecord
from gossiploco.protocol.messages import LEAVING, PROBE, Data, Decision, Hello, Ready
from gossiploco.runtime.launch import free_ports
from gossiploco.security.identity import Identity
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust, routing_id
from gossiploco.transport.zmq_exchange import ZmqExchange
from testbed import outsider as common

ROOT = Path(__file__).resolve().parent.parent

RUN = "run"


@pytest.fixture
def pair():
    key = SwarmKey.generate()
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    exchanges = [ZmqExchange(r, endpoints, RUN, 5.0, trust=Trust.static(key, r, 2)) for r in range(2)]
    assert exchanges[0].wait_connected(10) and exchanges[1].wait_connected(10)
    yield key, endpoints, exchanges
    for ex in exchanges:
        ex.close()


def swap_both(exchanges, key: str) -> dict[int, list[float]]:
    """Both sides of one swap, concurrently; each side's result (or the exception's name)."""
    out: dict[int, object] = {}

    def one(r: int) -> None:
        try:
            out[r] = exchanges[r].swap(key, 1 - r, torch.full((5,), float(r))).tolist()
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            out[r] = type(exc).__name__
    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def refused(ex) -> int:
    return sum(ex.security_counts()["refused_connections"].values())


def outsiders(ctx, endpoint: str, rid: bytes, messages, server_key: bytes) -> list[str]:
    """Send ``messages`` as an outsider without CurveZMQ and with a random CurveZMQ key (given the real
    server key: stronger than any outsider); what each of the attacker's sockets saw."""
    seen = []
    for key in (None, server_key):
        sock, monitor = common.outsider_socket(ctx, endpoint, rid, server_key=key)
        for frames in messages:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # nothing connected (refused): nowhere to queue
                break
        seen.append(common.handshake_outcome(monitor, 5))
        common.close_outsider(sock, monitor)
    return seen


# -- forged protocol messages from outsiders -----------------------------------------------------------


def test_a_forged_leave_claiming_a_member_is_refused_and_nobody_is_dropped(pair):
    key, endpoints, exchanges = pair
    ctx = zmq.Context()
    try:
        seen = outsiders(ctx, endpoints[0], routing_id(1, "forged", False),
                         [common.wire(Hello(LEAVING, 0), 1, RUN)], key.static_identity(0).curve_public)
        assert "handshake succeeded" not in seen and wait_until(lambda: refused(exchanges[0]) >= 2, 10)
        assert exchanges[0].members(0) == [0, 1]
        assert exchanges[0].security_counts()["rejected_messages"] == {}  # never even decoded
        assert swap_both(exchanges, "k/0") == {0: [1.0] * 5, 1: [0.0] * 5}
    finally:
        ctx.destroy(linger=0)


def test_a_fake_leader_is_refused_and_group_agreement_still_works(pair):
    key, endpoints, exchanges = pair
    decisions = [common.wire(m, 0, RUN) for r in range(5) for m in (Decision(f"mix1/{r}", r, (0,)),
                                                                      Ready(f"mix1/{r}", r))]
    ctx = zmq.Context()
    try:
        seen = outsiders(ctx, endpoints[1], routing_id(0, "evil", True), decisions, key.static_identity(1).curve_public)
        assert "handshake succeeded" not in seen and wait_until(lambda: refused(exchanges[1]) >= 2, 10)
        groups: dict[int, object] = {}
        threads = [threading.Thread(target=lambda r=r: groups.update({r: exchanges[r].group("mix1/0", 0)}))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert groups == {0: [0, 1], 1: [0, 1]}
    finally:
        ctx.destroy(linger=0)


def test_outsiders_claiming_a_later_round_are_never_reported(pair):
    key, endpoints, exchanges = pair
    ctx = zmq.Context()
    try:
        for fake in (2, 3):  # two outsiders corroborating each other's "round 11"
            seen = outsiders(ctx, endpoints[0], routing_id(fake, "ahead", False),
                             [common.wire(Hello(0, 11), fake, RUN), common.wire(Hello(PROBE, 11, ask=1), fake, RUN)],
                             key.static_identity(0).curve_public)
            assert "handshake succeeded" not in seen
        assert wait_until(lambda: refused(exchanges[0]) >= 4, 10)
        exchanges[1].current_round = 0
        assert exchanges[0].ask_rounds(5) == {1: 0}
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_replayed_curve_session_is_refused(pair):
    """Bytes of a member's recorded session (handshake and a message), replayed on a new connection:
    the server's fresh cookie makes the recorded handshake worthless."""
    key, endpoints, exchanges = pair
    recorded = bytearray()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    target = endpoints[0].removeprefix("tcp://").rsplit(":", 1)

    def proxy() -> None:
        client, _ = listener.accept()
        server = socket.create_connection((target[0], int(target[1])))
        for a, b, keep in ((client, server, True), (server, client, False)):
            def pump(a=a, b=b, keep=keep):
                try:
                    while data := a.recv(65536):
                        if keep:
                            recorded.extend(data)
                        b.sendall(data)
                except OSError:
                    pass
            threading.Thread(target=pump, daemon=True).start()
    threading.Thread(target=proxy, daemon=True).start()
    member = Trust.static(key, 1, 2).identity
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, routing_id(1, "recorded", False))
        sock.curve_secretkey, sock.curve_publickey = member.curve_secret, member.curve_public
        sock.curve_serverkey = key.static_identity(0).curve_public
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(common.wire(Hello(PROBE, 0, ask=7), 1, RUN))
        assert wait_until(lambda: len(recorded) > 400, 10)  # greeting, HELLO, INITIATE, the message
        before = refused(exchanges[0])
        replay = socket.create_connection((target[0], int(target[1])))
        replay.sendall(bytes(recorded))
        assert wait_until(lambda: refused(exchanges[0]) > before, 10), exchanges[0].security_counts()
        replay.close()
    finally:
        ctx.destroy(linger=0)
        listener.close()


# -- routing-id takeovers, floods and hang-ups: the victim in a subprocess ---------------------------


VICTIM = """
import json, sys, torch
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust
from gossiploco.transport.zmq_exchange import ZmqExchange
key, endpoints = SwarmKey.parse(sys.argv[1]), sys.argv[2].split(",")
ex = ZmqExchange(0, endpoints, "run", 10.0, trust=Trust.static(key, 0, 2))
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "swap":
        try:
            print("swapped", ex.swap(cmd[1], 1, torch.zeros(5)).tolist(), flush=True)
        except Exception as exc:
            print("failed", type(exc).__name__, flush=True)
    elif cmd[0] == "counts":
        print(json.dumps(ex.security_counts()), flush=True)
ex.close()
"""


@pytest.fixture
def victim():
    """Rank 0 in a subprocess (its ROUTER is the one attacked), rank 1 here."""
    key = SwarmKey.generate()
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, key.text, ",".join(endpoints)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    ex = ZmqExchange(1, endpoints, RUN, 10.0, trust=Trust.static(key, 1, 2))
    try:
        assert ex.wait_connected(10)
        yield key, endpoints, proc, ex
    finally:
        ex.close()
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def ask(proc, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def swap_with_victim(proc, ex, key: str) -> tuple[str, object]:
    mine: dict[str, object] = {}

    def local() -> None:
        try:
            mine["got"] = ex.swap(key, 0, torch.ones(5)).tolist()
        except Exception as exc:  # noqa: BLE001 - reported in the assertion
            mine["got"] = type(exc).__name__
    t = threading.Thread(target=local)
    t.start()
    theirs = ask(proc, f"swap {key}")
    t.join(20)
    return theirs, mine.get("got")


def assert_alive_and_mixing(proc, ex) -> None:
    # libzmq's abort came within about a heartbeat of the hang-up: give it that chance.
    assert not wait_until(lambda: proc.poll() is not None, 3.0), f"victim died: {proc.poll()} (SIGABRT = -6)"
    for attempt in range(3):  # a taken-over connection may cost the first swap
        theirs, mine = swap_with_victim(proc, ex, f"after/{attempt}")
        if theirs.startswith("swapped") and mine == [0.0] * 5:
            assert theirs == "swapped [1.0, 1.0, 1.0, 1.0, 1.0]"
            return
    pytest.fail(f"no swap after the attack: {theirs}, {mine}")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_outsiders_with_a_members_routing_id_flood_and_hang_up_without_killing_the_victim(victim):
    key, endpoints, proc, ex = victim
    rid = routing_id(1, ex.sockets.incarnation, False)  # the live member's own routing id
    host, port = endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    ctx = zmq.Context()
    try:
        for server_key in (None, key.static_identity(0).curve_public):
            sock, monitor = common.outsider_socket(ctx, endpoints[0], rid, server_key=server_key)
            for _ in range(2000):
                try:
                    sock.send_multipart([b"x" * 16], flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
            assert common.handshake_outcome(monitor, 5) != "handshake succeeded"
            common.close_outsider(sock, monitor)
        common.zmtp_raw_attack(host, int(port), rid, frames=2000)
        common.zmtp_raw_attack(host, int(port), rid + b"/control", frames=2000)
    finally:
        ctx.destroy(linger=0)
    assert_alive_and_mixing(proc, ex)
    counts = json.loads(ask(proc, "counts"))
    assert sum(counts["refused_connections"].values()) >= 3 and counts["rejected_messages"] == {}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_member_key_taking_over_a_routing_id_with_2000_frames_then_hanging_up_does_not_abort(victim):
    """A member's key (stolen, or a member misbehaving) passes ZAP: with ROUTER_HANDOVER it takes over
    the other member's routing id, floods, and hangs up, twice (the libzmq#4364 abort's recipe)."""
    key, endpoints, proc, ex = victim
    member = Trust.static(key, 1, 2).identity
    ctx = zmq.Context()
    try:
        for rid in (routing_id(1, ex.sockets.incarnation, False), routing_id(1, ex.sockets.incarnation, True)) * 2:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.ROUTING_ID, rid)
            sock.curve_secretkey, sock.curve_publickey = member.curve_secret, member.curve_public
            sock.curve_serverkey = key.static_identity(0).curve_public
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.connect(endpoints[0])
            assert monitor.poll(5000), "a member's key is admitted"
            for _ in range(2000):
                sock.send_multipart([b"x" * 16], flags=zmq.NOBLOCK)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)  # the hang-up, with its input possibly stopped
    finally:
        ctx.destroy(linger=0)
    assert_alive_and_mixing(proc, ex)
    counts = json.loads(ask(proc, "counts"))
    assert sum(counts["rejected_messages"].values()) >= 1  # garbage from an admitted key: decoded, refused


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_oversize_messages_and_a_chunk_flood_from_outsiders_stay_within_the_memory_bound(victim):
    key, endpoints, proc, ex = victim
    quiet = common.memory_kib(proc.pid, "VmHWM")
    host, port = endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    block = b"\0" * (4 << 20)
    raw = socket.create_connection((host, int(port)))  # one announced 576 MiB frame, streamed
    raw.settimeout(5)
    try:
        raw.sendall(common.zmtp_null_greeting(b"1.big") + bytes([2]) + (576 << 20).to_bytes(8, "big"))
        for _ in range(32):
            raw.sendall(block)
    except OSError:
        pass  # dropped: what should happen
    finally:
        raw.close()
    ctx = zmq.Context()
    try:
        chunks = [common.wire(Data("mix2/0", c, (1 << 22, 0), torch.zeros(1 << 20)), 1, RUN) for c in range(4)] * 30
        seen = outsiders(ctx, endpoints[0], b"1.big", [[block] * 144], key.static_identity(0).curve_public)
        seen += outsiders(ctx, endpoints[0], b"1.flood", chunks, key.static_identity(0).curve_public)
        assert "handshake succeeded" not in seen
    finally:
        ctx.destroy(linger=0)
    assert_alive_and_mixing(proc, ex)
    assert common.memory_kib(proc.pid, "VmHWM") - quiet <= 64 << 10


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_connection_flood_is_dropped_after_the_handshake_timeout_and_swaps_go_on(pair):
    key, endpoints, exchanges = pair
    host, port = endpoints[0].removeprefix("tcp://").rsplit(":", 1)
    flood = common.IdleConnections(host, int(port), 300)
    slow = common.IdleConnections(host, int(port), 20, trickle=True)
    try:
        assert len(flood.socks) == 300
        assert swap_both(exchanges, "k/flooded") == {0: [1.0] * 5, 1: [0.0] * 5}
        for _ in range(3):
            slow.poke()
        assert wait_until(lambda: flood.closed_by_peer() == 300, 15), "idle connections must be dropped (5 s)"
        assert wait_until(lambda: slow.closed_by_peer() == 20, 15), "slowloris connections too"
        assert swap_both(exchanges, "k/after") == {0: [1.0] * 5, 1: [0.0] * 5}
    finally:
        flood.close()
        slow.close()


# -- the DHT against an outsider's node that stores anything ------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_outsider_dht_node_without_validator_can_neither_read_nor_erase_nor_replace_the_run():
    from hivemind.utils import get_dht_time

    key = SwarmKey.generate()
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    made, outsider = [], None
    try:
        for _ in range(2):
            made.append(DhtDirectory(RUN, initial_peers=addresses, ttl_s=30, heartbeat_s=1, timeout_s=5,
                                     trust=Trust(Identity.generate(), key)))
            t = made[-1].trust
            made[-1].announce(PeerRecord(t.peer_id, "tcp://127.0.0.1:5000", round=0, tokens=0, key=t.identity.curve_public))
        ids = sorted(d.trust.peer_id for d in made)
        assert wait_until(lambda: sorted(made[0].peers()) == ids, 20)
        outsider = common.outsider_dht(addresses[0])
        assert outsider.get(f"gossiploco/{RUN}/peers", latest=True) is None  # the old plain key: nothing
        # Members re-publish every second: whatever replicas reach the outsider hold no endpoint.
        wait_until(lambda: len(common.local_items(outsider)) >= 2, 5)
        assert not any(b"tcp://" in bytes(v) for _, v in common.local_items(outsider) if isinstance(v, bytes))
        # Knowing the real key (stronger than any outsider), it stores far-future tombstones, a fake
        # member and a regular value through the DHT (the members' nodes refuse them) and straight
        # into its own storage, which it serves to every search that reaches it.
        run_key, far = key.dht_key(RUN), get_dht_time() + 600
        for p in ids:
            outsider.store(run_key, None, far, subkey=p)
            assert common.poison(outsider, run_key, None, far + 1, subkey=p)
        outsider.store(run_key, b"fake", far, subkey=7)
        assert common.poison(outsider, run_key, b"fake", far + 1, subkey=7)
        outsider.store(run_key, b"replaced", far + 60)
        for directory in made:
            assert sorted(directory.peers()) == ids
        assert common.poison(outsider, run_key, b"replaced", far + 120)  # a regular value over the dictionary
        for directory in made:
            assert sorted(directory.peers()) == ids
        assert wait_until(lambda: all(sorted(d.peers()) == ids for d in made), 5)
    finally:
        if outsider is not None:
            outsider.shutdown()
        for d in made:
            d.close()
        dht.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_uninvited_peer_with_another_swarm_key_exits_with_a_clear_error(tmp_path, bootstrap):
    other = SwarmKey.generate().save(tmp_path / "other.key")
    run = subprocess.run([sys.executable, "-m", "gossiploco", "peer", "--join", bootstrap.address, "--host", "127.0.0.1",
                          "--swarm-key", str(other), "--identity", str(tmp_path / "id.key"), "--out", str(tmp_path / "o"),
                          "--config", "globalm1-localm2", "--quiet", "--set", 'model.size="tiny"'],
                         capture_output=True, text=True, timeout=100, env={**common.ENV, **dict(__import__("os").environ)})
    assert run.returncode != 0 and run.returncode != -signal.SIGABRT
    assert "does not know this peer's swarm key" in run.stderr, run.stderr[-2000:]
