"""The attacks of bench/attacks.py: an outsider who knows the bootstrap address and the peers' ports against a
private run. Each mounts itself on a running ``Swarm`` and returns its ``Result`` with a verdict to take after
the run; ``INTRUSION`` are mounted together while the peers train, ``FLOOD`` while the last peer joins."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgpack
import torch
import zmq

from gossiploco.protocol.messages import LEAVING, PROBE, Data, Decision, Hello, Ready
from gossiploco.security.identity import curve_public_of, peer_id_of
from gossiploco.security.swarm_key import SwarmKey
from testbed.outsider import (IdleConnections, announced, close_outsider, handshake_outcome, listening_ports, local_items,
                              outsider_dht, outsider_socket, wire, zmtp_null_greeting, zmtp_raw_attack)
from testbed.processes import wait_until

if __package__:  # imported as a module of bench (the repository root on sys.path)
    from bench.attacks_swarm import RSS_SLACK_MIB, Result, Swarm, security
else:  # a bench script run as a file: bench/ is on sys.path
    from attacks_swarm import RSS_SLACK_MIB, Result, Swarm, security


def discovery(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
    res = Result("discovery", "an outsider DHT node finds no readable record of the run (old plain key, or "
                              "anything it stores or caches)")
    out = outsider_dht(sw.address)
    try:
        plain = out.get(f"gossiploco/{sw.run_id}/peers", latest=True)
        res.happened.append(f"get(plain key) = {plain}")
        if plain is not None:
            res.fail("the plain key holds the run's records")
        # Members re-publish every few seconds; a new node near the key gets replicas. Wait for them.
        wait_until(lambda: len(local_items(out)) >= len(ids), 8, 0.5)
        items = local_items(out)
        readable, seen_ids = [], set()
        for name, value in items:
            raw = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else b""
            if b"tcp://" in raw or b"endpoint" in raw:
                readable.append(name)
            seen_ids.update(p for p in ids.values() if name.endswith(f"/{p!r}"))  # a subkey naming a member
            try:
                envelope = msgpack.unpackb(raw)
                seen_ids.add(peer_id_of(curve_public_of(envelope[1])))  # a signer's key in clear
                learnt[peer_id_of(curve_public_of(envelope[1]))] = curve_public_of(envelope[1])
            except Exception:  # noqa: BLE001 - not an envelope with a key in clear: nothing learnt
                pass
        named = seen_ids & set(ids.values())
        res.happened.append(f"{len(items)} entries stored/cached by the outsider node, {len(readable)} with a "
                            f"readable endpoint; subkeys and envelopes name {len(named)} of {len(ids)} member ids")
        if readable:
            res.fail(f"readable records: {readable[:3]}")
        if named:
            res.fail(f"member ids (and their public keys) readable: {sorted(named)}")
    finally:
        out.shutdown()
    return res


def dht_overwrite(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
    res = Result("dht-overwrite", "an outsider DHT node (no validator) storing under the run's real DHT key "
                                  "fake records, tombstones and a regular value changes nobody's view")
    from hivemind.utils import get_dht_time

    out = outsider_dht(sw.address)
    key, exp = sw.key.dht_key(sw.run_id), get_dht_time() + 600
    stored = {f"tombstone {p}": out.store(key, None, exp, subkey=p) for p in ids.values()}
    stored["fake member"] = out.store(key, msgpack.packb({"peer": 7, "endpoint": "tcp://127.0.0.1:9"}), exp, subkey=7)
    stored["garbage x50"] = all(out.store(key, b"\xc1" * 40, exp, subkey=1000 + i) for i in range(50))
    stored["regular value"] = out.store(key, b"replaced", exp + 60)
    res.happened.append(f"store() said {stored} (True: at least its own node kept it)")

    def check(sw: Swarm) -> None:
        out.shutdown()
        for rank in range(sw.count):
            members = {r["members"] for r in sw.records(rank)}
            if members != {sw.count}:
                res.fail(f"peer {rank} saw member counts {members}")
        res.happened.append(f"members in every metrics record: {sw.count}; exit codes {sw.codes}")
    res.check = check
    return res


def uninvited_join(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
    res = Result("uninvited-join", "a peer with another swarm key exits non-zero saying so; an --open peer is "
                                   "never counted by the members")
    base = sw.peers.out_dir / "intruders"
    other = SwarmKey.generate().save(base / "other.key")
    cmd = [sys.executable, "-m", "gossiploco", "peer", "--join", sw.address, "--host", "127.0.0.1",
           "--workers", str(sw.count), "--rank", "0"]
    log = (base / "open.log").open("w")
    opened = subprocess.Popen([*cmd, "--open", "--identity", str(base / "o.key"), "--out", str(base / "open"), *sw.args],
                              stdout=log, stderr=subprocess.STDOUT, env=sw.peers.env, start_new_session=True)
    wrong = subprocess.Popen([*cmd, "--swarm-key", str(other), "--identity", str(base / "w.key"), "--out",
                              str(base / "wrong"), *sw.args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=sw.peers.env, start_new_session=True)
    up = wait_until(lambda: announced((base / "open.log").read_text(errors="replace")), 120, 0.5)
    res.happened.append(f"--open peer {'up' if up else 'NOT up'} by members' round {sw.round_of(0)}")

    def check(sw: Swarm) -> None:
        try:
            _, err = wrong.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            wrong.kill()
            _, err = wrong.communicate()
        said = [line for line in err.splitlines() if "does not know this peer's swarm key" in line][:1]
        res.happened.append(f"other key: exit {wrong.returncode}, {said[0][:160] if said else err[-300:]!r}")
        if wrong.returncode == 0 or not said:
            res.fail("the wrong-key peer did not fail clearly")
        if opened.poll() is None:
            opened.send_signal(signal.SIGINT)
            try:
                opened.wait(20)
            except subprocess.TimeoutExpired:
                opened.kill()
                opened.wait(10)
        counts = {r["members"] for rank in range(sw.count) for r in sw.records(rank)}
        own = [line for line in (base / "open.log").read_text(errors="replace").splitlines() if "peers found" in line]
        res.happened.append(f"--open peer (exit {opened.returncode}): {own[0][-90:] if own else 'found nobody'}; "
                            f"members' metrics count {counts} members")
        if counts != {sw.count}:
            res.fail("the open peer was counted")
    res.check = check
    return res


def _send_all(ctx, endpoint, rid, messages, server_key=None) -> str:
    sock, monitor = outsider_socket(ctx, endpoint, rid, server_key=server_key)
    for frames in messages:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            break
    seen = handshake_outcome(monitor, 3)
    close_outsider(sock, monitor)
    return seen


def _data_plane(name: str, expected: str, build: Callable[[dict, str], list[tuple[bytes, list]]]):
    """An attack that sends ``build(ids, run_id)`` = [(routing id, frames...)] to every peer, without
    CurveZMQ and with CurveZMQ and a random key (when the discovery attack learnt the server's key)."""
    def attack(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
        res = Result(name, expected)
        ctx = zmq.Context()
        try:
            for rank, (peer, endpoint) in sw.endpoints.items():
                for rid, messages in build(ids, sw.run_id):
                    seen = {_send_all(ctx, endpoint, rid, messages)}
                    if peer in learnt:
                        seen.add(_send_all(ctx, endpoint, rid, messages, server_key=learnt[peer]))
                    res.happened.append(f"to {rank} as {rid[:24]!r}: {sorted(seen)}")
                    if "handshake succeeded" in seen:
                        res.fail(f"handshake with peer {rank} succeeded")
        finally:
            ctx.destroy(linger=0)
        res.happened = [", ".join(sorted(set(res.happened)))[:400]]
        return res
    return attack


def _member(ids, rank):
    return ids[rank % len(ids)]


forged_leave = _data_plane(
    "forged-leave", "Hello(LEAVING) claiming a member is refused; nobody drops it",
    lambda ids, run: [(f"{_member(ids, 0)}.forged0leave".encode(), [wire(Hello(LEAVING, 1), _member(ids, 0), run)])])
fake_leader = _data_plane(
    "fake-leader", "a peer 0 (lowest id) sending Ready/Decision is refused; mixing goes on",
    lambda ids, run: [(b"0.evilleader/control", [wire(m, 0, run) for r in range(100) for m in (
        Decision(f"mix1/{r}", r, (0,)), Decision(f"mix2/{r}", r, (0, ids[1])), Ready(f"mix1/{r}", r))])])
forged_state = _data_plane(
    "forged-state", "two outsiders announcing round 11 (corroborating each other) make nobody download state",
    lambda ids, run: [(f"{p}.ahead".encode(), [wire(Hello(0, 11), p, run), wire(Hello(PROBE, 11, ask=1), p, run)])
                      for p in (1, 2)])


def routing_id_crash(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
    res = Result("routing-id-crash", "a member's routing id + 2,000 frames + hang-up (DEALER, and raw ZMTP NULL) "
                                     "kills nobody (no SIGABRT)")
    ctx = zmq.Context()
    try:
        for rank, (peer, endpoint) in sw.endpoints.items():
            other = _member(ids, rank + 1)
            for rid in (f"{other}.a1b2c3d4e5f6".encode(), f"{other}.a1b2c3d4e5f6/control".encode()):
                seen = _send_all(ctx, endpoint, rid, [[b"x" * 16] for _ in range(2000)])
                host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
                taken = zmtp_raw_attack(host, int(port), rid, frames=2000)
                res.happened.append(f"DEALER: {seen}; raw ZMTP: peer took {taken} bytes then hung up")
    finally:
        ctx.destroy(linger=0)
    res.happened = sorted(set(res.happened))

    def check(sw: Swarm) -> None:
        if any(code == -signal.SIGABRT for code in sw.codes.values()):
            res.fail(f"exit codes {sw.codes}")
        res.happened.append(f"exit codes {sw.codes}")
    res.check = check
    return res


def oversize(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
    res = Result("oversize-flood", f"a 576 MiB message and 4 MiB valid-looking chunks are refused at the handshake; "
                                   f"the victim's peak RSS stays within {RSS_SLACK_MIB} MiB + one model of a quiet peer's")
    victim = 1 % sw.count
    peer, endpoint = sw.endpoints[victim]
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    block = b"\0" * (4 << 20)
    # A raw stream announcing one 576 MiB frame, as fast as the victim reads it.
    import socket
    s = socket.create_connection((host, int(port)))
    s.settimeout(5)
    sent = 0
    try:
        s.sendall(zmtp_null_greeting(f"{_member(ids, 0)}.big".encode()) + bytes([2]) + (576 << 20).to_bytes(8, "big"))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            sent += s.send(block)
    except OSError as exc:
        res.happened.append(f"raw 576 MiB frame: hung up after {sent >> 20} MiB ({type(exc).__name__})")
    else:
        res.happened.append(f"raw 576 MiB frame: victim read {sent >> 20} MiB in 5 s")
    finally:
        s.close()
    ctx = zmq.Context()
    try:
        chunk = torch.zeros(1 << 20)
        flood = [wire(Data(f"mix2/{r}", c, (1 << 22, 0), chunk), _member(ids, 0), sw.run_id)
                 for r in range(3) for c in range(4)] * 10
        big = [[block] * 144]
        for label, key in (("no CURVE", None), ("random CURVE key", learnt.get(peer))):
            if label != "no CURVE" and key is None:
                continue
            seen = {_send_all(ctx, endpoint, f"{_member(ids, 0)}.big".encode(), big, key),
                    _send_all(ctx, endpoint, f"{_member(ids, 0)}.flood".encode(), flood, key)}
            res.happened.append(f"576 MiB multipart + 120 chunks of 4 MiB, {label}: {sorted(seen)}")
    finally:
        ctx.destroy(linger=0)

    def check(sw: Swarm) -> None:
        quiet = sw.baseline_hwm
        model = (sw.peers.peer_dir(victim) / "model.safetensors").stat().st_size >> 10
        got = sw.hwm.get(victim, 0)
        res.happened.append(f"victim peak RSS {got >> 10} MiB vs quiet {quiet >> 10} MiB (+{RSS_SLACK_MIB} MiB + "
                            f"model {model} KiB allowed); {security(sw.summary(victim))}")
        if quiet and got > quiet + (RSS_SLACK_MIB << 10) + model:
            res.fail("peak RSS over the bound")
    res.check = check
    return res


def connection_flood(sw: Swarm, ids: dict[int, int], learnt: dict) -> Result:
    """Mounted before the last peer starts (see ``run_flood``): it must join through the flood."""
    res = Result("connection-flood", "300 and 1,000 idle TCP connections (kept up all run) to two peers' data "
                                     "ports, 300 to a sealed port, 300 to a DHT port, 50 slowloris: idle ones "
                                     "dropped after 5 s, a new peer joins meanwhile, everyone finishes")
    targets = []
    for rank, count in ((0, 300), (1 % sw.count, 1000)):
        host, port = sw.endpoints[rank][1].removeprefix("tcp://").rsplit(":", 1)
        targets.append((f"data port of {rank}", host, int(port), count, False))
    own = listening_ports(sw.peers.procs[0].pid, tree=False)  # the peer process: its data and sealed ports
    for port in sorted(own - {int(sw.endpoints[0][1].rsplit(":", 1)[1])})[:1]:
        targets.append((f"sealed port of 0 ({port})", "127.0.0.1", port, 300, False))
    for port in sorted(listening_ports(sw.peers.procs[0].pid) - own)[:1]:  # its DHT node's processes
        targets.append((f"DHT port of 0 ({port})", "127.0.0.1", port, 300, False))
    host, port = sw.endpoints[0][1].removeprefix("tcp://").rsplit(":", 1)
    targets.append(("slowloris on 0", host, int(port), 50, True))
    floods = [(label, IdleConnections(h, p, n, trickle)) for label, h, p, n, trickle in targets]
    stop = threading.Event()
    opened = {label: len(f.socks) for label, f in floods}
    dropped = {label: 0 for label, _ in floods}

    def keep_up() -> None:
        while not stop.wait(1.0):
            for i, (label, f) in enumerate(floods):
                if f.trickle:
                    f.poke()
                closed = f.closed_by_peer()
                if closed >= len(f.socks) * 0.9:  # dropped: open a fresh set (a sustained flood)
                    dropped[label] += closed
                    count = len(f.socks)
                    f.close()
                    floods[i] = (label, IdleConnections(f"{targets[i][1]}", targets[i][2], count, f.trickle))
                    opened[label] += len(floods[i][1].socks)
    thread = threading.Thread(target=keep_up, daemon=True)
    thread.start()
    res.happened.append(f"opened {opened}")

    def check(sw: Swarm) -> None:
        stop.set()
        thread.join(5)
        for _, f in floods:
            f.close()
        res.happened.append(f"opened in all {opened}; closed by the victim {dropped}; exit codes {sw.codes}; "
                            f"peer 2 joined: members {sorted({r['members'] for r in sw.records(sw.count - 1)})}; "
                            f"victim 1: {security(sw.summary(1 % sw.count))}")
        if not any(dropped[label] for label in dropped if label.startswith("data")):
            res.fail("idle connections to a data port were never dropped")
        if not any(dropped[label] for label in dropped if label.startswith("sealed")):
            res.fail("idle connections to the sealed port were never dropped (or it was not found)")
    res.check = check
    return res


INTRUSION = {"discovery": discovery, "dht-overwrite": dht_overwrite, "uninvited-join": uninvited_join,
             "routing-id-crash": routing_id_crash, "forged-leave": forged_leave, "fake-leader": fake_leader,
             "forged-state": forged_state, "oversize-flood": oversize}
FLOOD = {"connection-flood": connection_flood}
ATTACKS = [*INTRUSION, *FLOOD]
