"""The attack suite: what an outsider who knows only the bootstrap address (plus, as a port scanner
would find them, the peers' data-plane and DHT ports) can do to a private run of real peer processes.

    python bench/attacks.py [--peers 3] [--rounds 60] [--only NAME ...] [--out DIR]
    python bench/attacks.py --all      # this suite, then every companion suite below

The companion suites, each its own script with its own results file (``--all`` runs them in turn, each in its
own process, and fails when any of them does):

* ``bench/attacks_relay.py``: strangers against the relay (free proxy, slot flood, 1 TiB length prefixes),
  private and open bootstrap (``bench/results/attacks-relay.md``);
* ``bench/attacks_surface.py``: dial-back jamming and oversized prefixes, the dashboard's Host check
  (``bench/results/attacks-surface.md``);
* ``bench/attacks_open.py``: strangers and members against an open run (DHT storage flood, a conflicting
  run entry, a state-request flood) (``bench/results/attacks-open.md``);
* ``bench/attacks_members.py --variant robust``: dishonest members of an open run, 1 of 4 real peers and
  2 of 8 virtual workers (``bench/results/attacks-members.md``).

Runs (each with a new swarm key and bootstrap node started here, ``start_bootstrap(swarm=key)``, and
``--peers`` real ``gossiploco peer --join`` processes of the tests' tiny config, ``globalm1-localm2``):

1. ``baseline``: no attack; gives each peer's final validation loss and a quiet peer's peak RSS;
2. ``intrusion``: every attack below but the floods, mounted concurrently (one thread each) once the
   peers have announced themselves, while they train;
3. ``flood``: connection floods against two peers while the last peer joins, and for the whole run.

Each attack returns a ``Result`` whose verdict is taken after the run: what a private swarm should do,
what happened (the attacker's own observations, the victims' ``summary.json`` "security" counters,
exit codes, RSS), and the honest peers' mean final validation loss against the baseline's. The swarm
must finish every round. Exit status 1 if any attack succeeded (or could not be mounted while the
swarm ran). Results go to ``--out`` (default ``runs/attacks``) and ``bench/results/attacks.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch
import zmq

from gossiploco.config import TINY_OVERRIDES
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.protocol.messages import LEAVING, PROBE, Data, Decision, Hello, Ready
from gossiploco.runtime.launch import LocalPeers
from gossiploco.security.identity import curve_public_of, peer_id_of
from gossiploco.security.swarm_key import SwarmKey
from testbed.outsider import (ENV, IdleConnections, announced, close_outsider, handshake_outcome, listening_ports,
                              local_items, memory_kib, outsider_dht, outsider_socket, wire, zmtp_null_greeting,
                              zmtp_raw_attack)
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


# -- the attacks (each mounts itself and returns its Result with a verdict to take later) -----------------


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


# -- runs ------------------------------------------------------------------------------------------------


def finish(sw: Swarm, results: list[Result], baseline: dict | None, timeout_s: float) -> None:
    sw.codes = sw.peers.wait(timeout_s)
    time.sleep(0.3)  # the sampler's last look
    for res in results:
        if res.check is not None:
            try:
                res.check(sw)
            except Exception as exc:  # noqa: BLE001 - a broken verdict is a failed attack check
                res.fail(f"verdict raised {type(exc).__name__}: {exc}")
    summaries = [sw.summary(r) for r in range(sw.count)]
    losses = [s.get("final_val_loss") for s in summaries]
    for rank, s in enumerate(summaries):
        if sw.codes.get(rank) != 0 or s.get("rounds") != sw.rounds:
            for res in results:
                res.fail(f"peer {rank} exit {sw.codes.get(rank)}, rounds {s.get('rounds')}: {sw.peers.log(rank)[-300:]!r}")
    failures = sum(s.get(k, 0) for s in summaries for k in ("mix1_failures", "mix2_failures"))
    catchups = sum(s.get("catchups", 0) for s in summaries)
    for res in results:
        mean = sum(x for x in losses if x is not None) / max(1, sum(x is not None for x in losses))
        res.loss = f"{mean:.4f}"
        if baseline:
            base = sum(baseline["losses"]) / len(baseline["losses"])
            res.loss += f" (baseline {base:.4f})"
            if abs(mean - base) > LOSS_REL_TOL * base:
                res.fail(f"final loss {mean:.4f} vs baseline {base:.4f}")
        res.happened.append(f"mix failures {failures}, catch-ups {catchups}")
        if failures > len(summaries) or catchups:
            res.fail("the swarm's mixing was disturbed")


def run_baseline(out: Path, args) -> dict:
    sw = Swarm("baseline", out / "baseline", args.peers, args.rounds)
    try:
        sw.peers.start()
        sw.codes = sw.peers.wait(args.timeout)
        summaries = [sw.summary(r) for r in range(sw.count)]
        if any(code != 0 for code in sw.codes.values()):
            raise RuntimeError(f"the attack-free run failed: {sw.codes}")
        return {"losses": [s["final_val_loss"] for s in summaries], "hwm": max(sw.hwm.values()),
                "security": [s["security"] for s in summaries], "wall_s": max(s["wall_s"] for s in summaries)}
    finally:
        sw.close()


def run_group(name: str, attacks: dict, out: Path, args, baseline: dict, late: bool) -> list[Result]:
    """Start the swarm (``late``: all but the last peer first), mount ``attacks`` concurrently once the
    first peers announced themselves, start the last peer, and take each verdict after the run."""
    sw = Swarm(name, out / name, args.peers, args.rounds)
    sw.baseline_hwm = baseline["hwm"] if baseline else 0
    results: dict[str, Result] = {}
    try:
        first = list(range(args.peers - 1)) if late else list(range(args.peers))
        sw.peers.start(first)
        sw.endpoints = sw.wait_announced(first)
        ids = {r: p for r, (p, _) in sw.endpoints.items()}
        learnt: dict[int, bytes] = {}
        if "discovery" in attacks:  # first: a stronger attacker then knows the servers' keys
            time.sleep(1.0)
            results["discovery"] = attacks["discovery"](sw, ids, learnt)

        def mount(attack_name: str) -> None:
            try:
                results[attack_name] = attacks[attack_name](sw, ids, learnt)
            except Exception as exc:  # noqa: BLE001 - an attack that cannot be mounted is reported
                results[attack_name] = Result(attack_name, "")
                results[attack_name].fail(f"could not be mounted: {type(exc).__name__}: {exc}")
            results[attack_name].happened.append(f"mounted by round {sw.round_of(0)} of {sw.rounds}")
            if sw.peers.procs[0].poll() is not None:
                results[attack_name].fail("the swarm had finished before the attack was over (use more --rounds)")
        threads = [threading.Thread(target=mount, args=(n,)) for n in attacks if n != "discovery"]
        for t in threads:
            t.start()
        if late:
            for t in threads:
                t.join(60)
            sw.peers.start([args.peers - 1])
            sw.endpoints.update(sw.wait_announced([args.peers - 1]))
        for t in threads:
            t.join(240)
        finish(sw, list(results.values()), baseline, args.timeout)
        for rank in range(sw.count):
            print(f"[{name}] peer {rank}: exit {sw.codes.get(rank)}, {security(sw.summary(rank))}", flush=True)
    finally:
        sw.close()
    return [results[n] for n in attacks if n in results]


def write_results(path: Path, command: str, baseline: dict | None, results: list[Result], wall: float) -> None:
    lines = ["# Attack suite: outsiders against a private swarm", "",
             "Produced by `bench/attacks.py` (the project's own attack suite; see its docstring).", "",
             "```", command, "```", "",
             f"Machine: 2 shared CPU cores, loopback. Bench wall time {wall:.0f} s. Runs: one attack-free baseline, "
             "then `intrusion` (every attack but the floods, mounted concurrently while the peers train) and "
             "`flood` (floods up before the last peer starts, kept up all run); each run has its own swarm key "
             "and bootstrap node, and the same config (so the same final loss when nothing interferes)."]
    if baseline:
        lines += ["", f"Baseline: final val loss per peer {[round(x, 4) for x in baseline['losses']]}, quiet peak RSS "
                      f"{baseline['hwm'] >> 10} MiB, wall {baseline['wall_s']:.0f} s, security counters "
                      f"{baseline['security']} (joins race the members' record reads: a few refusals are expected)."]
    lines += ["", "| Attack | A private swarm should | What happened (evidence) | Honest peers' final val loss | Verdict |",
              "|---|---|---|---|---|"]
    for res in results:
        happened = "; ".join(res.happened).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {res.attack} | {res.expected} | {happened} | {res.loss} | {'held' if res.ok else 'SUCCEEDED'} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--only", nargs="+", choices=ATTACKS, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "attacks")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "attacks.md")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--all", action="store_true", help="then run every companion suite (module docstring)")
    args = ap.parse_args()
    if args.peers < 2:
        ap.error("--peers must be at least 2")
    chosen = args.only or ATTACKS
    started = time.monotonic()
    baseline = run_baseline(args.out, args)
    print(f"baseline: losses {baseline['losses']}, peak RSS {baseline['hwm'] >> 10} MiB", flush=True)
    results = []
    intrusion = {n: a for n, a in INTRUSION.items() if n in chosen}
    if intrusion:
        results += run_group("intrusion", intrusion, args.out, args, baseline, late=False)
    flood = {n: a for n, a in FLOOD.items() if n in chosen}
    if flood:
        results += run_group("flood", flood, args.out, args, baseline, late=True)
    command = "python bench/attacks.py " + " ".join(sys.argv[1:])
    write_results(args.results, command.strip(), baseline, results, time.monotonic() - started)
    for res in results:
        print(f"{'held     ' if res.ok else 'SUCCEEDED'} {res.attack}: {'; '.join(res.happened)}", flush=True)
    failed = [] if all(res.ok for res in results) else ["bench/attacks.py"]
    if args.all:
        failed += run_companions()
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


COMPANIONS = (["bench/attacks_relay.py"], ["bench/attacks_surface.py"], ["bench/attacks_open.py"],
              ["bench/attacks_members.py", "--variant", "robust"])


def run_companions() -> list[str]:
    """Each companion suite in its own process (they start their own bootstrap nodes and peers), one after
    another; the ones that failed (an attack that succeeded, or a suite that could not run), by command."""
    failed = []
    for argv in COMPANIONS:
        command = " ".join(["python", *argv])
        print(f"== {command}", flush=True)
        if subprocess.run([sys.executable, *argv], cwd=ROOT).returncode != 0:
            failed.append(command)
    return failed


if __name__ == "__main__":
    sys.exit(main())
