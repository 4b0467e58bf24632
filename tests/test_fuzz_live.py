"""Fuzzing the wire over live sockets (the codec's and messages' properties: ``test_fuzz.py``).

A raw CurveZMQ DEALER holding member 1's static key sends thousands of mutated messages to a
real ``ZmqExchange`` (rank 0); each is predicted locally (decode, ``from_wire``, the connection
checks), and the exchange must reject exactly the ones predicted, each counted with its reason,
stay alive, keep its memory bounded, and still swap with the real rank 1 afterwards. The seed is
printed; ``GOSSIPLOCO_FUZZ_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch
import zmq

from conftest import wait_until
from gossiploco.errors import ExchangeError, MalformedMessage
from gossiploco.protocol.messages import (CONTROL, LEAVING, PROBE, STEPPING_OUT, Abort, Data, Decision, Hello, Ready,
                                          StateRequest, from_wire, to_wire)
from gossiploco.runtime.launch import free_ports
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust, routing_id
from gossiploco.protocol.codec import decode, encode
from gossiploco.transport.zmq_exchange import ZmqExchange
from tests.test_fuzz import ODD_KEYS

RUN = "fuzz-run"

MAX_MESSAGE = 256 << 10
"""Rank 0's ``max_message_bytes``; zmq drops a connection for a frame over this plus a header
(``MAXMSGSIZE``), so the fuzzer's frames stay below that and oversized messages are multi-frame."""
FINAL_KEY = "fuzz-final/0"
MUTATIONS = ["valid", "bitflip", "truncate", "append", "drop_frame", "dup_frame", "reorder", "header_field",
             "drop_field", "extra_field", "huge_shape", "bad_dtype", "tensor_count", "non_finite", "wrong_sender",
             "wrong_channel", "run_id", "random", "header_bytes", "mixed_keys", "odd_key", "oversize"]
WEIGHTS = [6, 10, 8, 6, 4, 4, 4, 10, 4, 4, 6, 4, 4, 5, 3, 3, 2, 6, 6, 1, 2, 0.3]


REASONS = {
    "bitflip": ["not valid msgpack", "must be", "frame has", "non-finite", "unknown"],
    "truncate": ["frame has", "msgpack"], "append": ["frame has", "extra data"],
    "drop_frame": ["payload frame(s) for"], "dup_frame": ["payload frame(s) for"],
    "reorder": ["frame has", "not valid msgpack", "not a map", "meta vector"], "header_field": ["must be"],
    "drop_field": ["missing field"], "extra_field": ["unknown field"], "huge_shape": ["elements", "shape must be"],
    "bad_dtype": ["unknown dtype"], "tensor_count": ["payload frame(s) for"], "non_finite": ["non-finite"],
    "wrong_sender": ["arrived on connection"], "wrong_channel": ["arrived on connection"], "run_id": ["run id"],
    "random": ["msgpack"], "header_bytes": ["msgpack", "must be", "missing", "unknown"], "oversize": ["max_bytes"],
    "mixed_keys": ["unknown field"]}
"""Mutation kind -> reasons (substrings) at least one of which its rejections must show."""


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def base_messages(rng: random.Random) -> list[tuple[dict, list[bytes]]]:
    """Valid messages from member 1 (header map, payload frames), one of each kind and a few sizes."""
    chunk = lambda n: torch.tensor([rng.uniform(-5, 5) for _ in range(n)], dtype=torch.float32)
    pool = [Data("mix1/3", 0, (300, 0, 0), chunk(300)), Data("mix2/4", 2, (10, 1, 0), chunk(7)),
            Data("grad/9", 0, (1,), chunk(1)), Data("state/rep/abc", 0, (10, 0, 123), chunk(0)),
            Data("monitor/2", 1, (64, 5), chunk(64)),
            Hello(0, 3), Hello(PROBE, 2, ask=5), Hello(LEAVING, 1), Hello(STEPPING_OUT, 1), Hello(7, 7, echo=1),
            Ready("mix1/3", 3), Decision("mix1/3", 3, (0, 1)), Decision("mix2/4", 4, ()), Abort("mix2/4"),
            StateRequest("n0nce")]
    out = []
    for message in pool:
        header, tensors = to_wire(message, 1, RUN)
        frames = encode(header, tensors)
        out.append((msgpack.unpackb(frames[0], raw=False), [bytes(f) for f in frames[1:]]))
    return out


def random_value(rng: random.Random):
    return rng.choice([
        lambda: rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)]),
        lambda: rng.random() < 0.5, lambda: rng.choice([float("nan"), float("inf"), 1.5]), lambda: None,
        lambda: rng.randbytes(rng.randrange(8)),
        lambda: "".join(rng.choice("ab/0é\x00") for _ in range(rng.randrange(6))),
        lambda: [rng.randrange(9)] * rng.randrange(4), lambda: {"dtype": "float32"}])()


def mutate(rng: random.Random, kind: str, wire: dict, payload: list[bytes]) -> list[bytes]:
    """The frames of a valid message (header map and payload frames) damaged as ``kind`` says
    ("wrong_channel" leaves them alone: the caller sends them on the other connection)."""
    wire = {k: ([dict(e, shape=list(e["shape"])) for e in v] if k == "tensors" else v) for k, v in wire.items()}
    frames = [msgpack.packb(wire, use_bin_type=True), *payload]

    def pick() -> int:
        return rng.randrange(len(frames))

    if kind == "bitflip":
        for _ in range(rng.randint(1, 8)):
            i = pick()
            if frames[i]:
                b = bytearray(frames[i])
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                frames[i] = bytes(b)
    elif kind == "truncate":
        i = pick()
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    elif kind == "append":
        i = pick()
        frames[i] += rng.randbytes(rng.randint(1, 64))
    elif kind == "drop_frame" and len(frames) > 1:
        frames.pop(pick())
    elif kind == "dup_frame":
        i = pick()
        frames.insert(rng.randrange(len(frames) + 1), frames[i])
    elif kind == "reorder":
        rng.shuffle(frames)
    elif kind == "header_bytes":
        b = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        frames[0] = bytes(b)
    elif kind == "random":
        frames = [rng.randbytes(rng.choice([0, 1, 5, 40, 300])) for _ in range(rng.randint(1, 4))]
    elif kind == "oversize":  # over max_message_bytes in all, each frame below zmq's MAXMSGSIZE
        frames[1] = bytes(MAX_MESSAGE // 2 + 1024) * 1
        frames.insert(2, bytes(MAX_MESSAGE // 2 + 1024))
    else:
        if kind == "header_field":
            wire[rng.choice(sorted(wire))] = random_value(rng)
        elif kind == "drop_field":
            wire.pop(rng.choice(sorted(wire)))
        elif kind == "extra_field":
            wire[rng.choice(["x", "tensors2", "V", ""])] = random_value(rng)
        elif kind == "mixed_keys":  # a str and a bytes unknown key (see the regression test above)
            wire.update({"x": 1, b"": 2})  # bin keys pass the unpacker only when empty (max_bin_len=0)
        elif kind == "huge_shape":
            wire["tensors"][rng.randrange(2)]["shape"] = rng.choice(
                [[2**40], [2**40 + 1], [2**62], [2**64 - 1], [2**31] * 8, [0, 2**40], [2**20, 2**20], [-1], [1] * 9])
        elif kind == "bad_dtype":
            wire["tensors"][rng.randrange(2)]["dtype"] = rng.choice(["float64", "int32", "bool", "", 4, None])
        elif kind == "tensor_count":
            if rng.random() < 0.5:
                wire["tensors"].pop()
            else:
                wire["tensors"].append({"dtype": "float32", "shape": [0]})
        elif kind == "non_finite":
            bad = rng.choice([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff"])
            at = 4 * rng.randrange(max(1, len(payload[1]) // 4))  # an empty chunk gets a value it has no room for
            frames[2] = payload[1][:at] + bad + payload[1][at + 4:]
        elif kind == "wrong_sender":
            wire["sender"] = rng.choice([0, 2, 7, 2**40])
        elif kind == "odd_key":
            wire["key"] = rng.choice(ODD_KEYS)
        elif kind == "run_id":
            wire["run"] = rng.choice(["other-run", "", RUN + " "])
        frames[0] = msgpack.packb(wire, use_bin_type=True)
    return frames


def predict(frames: list[bytes], control: bool) -> tuple[str | None, object]:
    """What rank 0 must do with ``frames`` from member 1 on that connection: the reason it rejects
    them (as counted in ``security_counts()["rejected_messages"]``), or None and the message when it takes it."""
    identity = routing_id(1, "fuzz", control)
    try:
        header, tensors = decode(frames, expect_run=RUN, max_bytes=MAX_MESSAGE)
        message = from_wire(header, tensors)
        if header.sender != 1 or isinstance(message, CONTROL) != control:
            raise MalformedMessage(f"sender {header.sender} arrived on connection {identity[:32]!r}")
    except MalformedMessage as exc:
        return exc.reason, None
    return None, message


class Fuzzer:
    """Member 1's key in a process of its own: data and control DEALERs to rank 0, and a ROUTER at
    member 1's endpoint (rank 0's connections to "member 1" land there and are drained)."""

    def __init__(self, key: SwarmKey, endpoints: list[str]):
        me = key.static_identity(1)
        self.ctx = zmq.Context()
        self.server = self.ctx.socket(zmq.ROUTER)
        self.server.setsockopt(zmq.LINGER, 0)
        self.server.curve_server = True
        self.server.curve_secretkey, self.server.curve_publickey = me.curve_secret, me.curve_public
        self.server.bind(endpoints[1])
        self.sockets = {}
        for control in (False, True):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a stuck receiver fails the test instead of hanging it
            sock.setsockopt(zmq.ROUTING_ID, routing_id(1, "fuzz", control))
            sock.curve_secretkey, sock.curve_publickey = me.curve_secret, me.curve_public
            sock.curve_serverkey = key.static_identity(0).curve_public
            sock.connect(endpoints[0])
            self.sockets[control] = sock
        self.drained = 0

    def send(self, frames: list[bytes], control: bool) -> None:
        self.sockets[control].send_multipart(frames, copy=len(frames[0]) < 4096 and all(len(f) < 4096 for f in frames))

    def drain(self) -> None:
        while True:
            try:
                self.server.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.drained += 1

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def start_exchange(rank: int, endpoints: list[str], key: SwarmKey) -> ZmqExchange:
    deadline = time.monotonic() + 10
    while True:  # rank 1's port was the fuzzer's a moment ago
        try:
            return ZmqExchange(rank, endpoints, RUN, 5.0, max_message_bytes=MAX_MESSAGE, chunk_bytes=64 << 10,
                               mailbox_bytes=8 << 20, grace_s=2.0, trust=Trust.static(key, rank, 2))
        except ExchangeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_live_fuzz(count: int) -> None:
    seed = int(os.environ.get("GOSSIPLOCO_FUZZ_SEED", random.SystemRandom().randrange(2**32)))
    print(f"live fuzz seed: {seed} (replay: GOSSIPLOCO_FUZZ_SEED={seed})")
    rng = random.Random(seed)
    key = SwarmKey.generate()
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    target = start_exchange(0, endpoints, key)
    fuzzer = Fuzzer(key, endpoints)
    plain_ctx = zmq.Context()
    made = [target]
    try:
        assert wait_until(lambda: target.connected() == [1], 10), "rank 0 never reached the fuzzer's ROUTER"
        bases = base_messages(rng)
        expected: Counter[str] = Counter()
        by_kind: dict[str, Counter[str]] = {}
        sent = accepted = frames_sent = 0
        unexpected: list[str] = []
        rss_before = peak = rss_bytes()
        alive = lambda: all(thread.is_alive() for thread in target.threads)  # noqa: E731
        rejections = lambda: Counter(target.security_counts()["rejected_messages"])  # noqa: E731
        # A stranger without CURVE at all, sending meanwhile: refused at the handshake, never heard.
        plain = plain_ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.setsockopt(zmq.ROUTING_ID, routing_id(1, "plain", False))
        plain.connect(endpoints[0])
        began = time.monotonic()
        for i in range(count):
            kind = rng.choices(MUTATIONS, WEIGHTS)[0]
            wire, payload = rng.choice(bases)
            frames = mutate(rng, kind, wire, payload)
            try:  # the connection its kind goes on (a random one when it is no message at all)
                header, tensors = decode(frames, expect_run=RUN, max_bytes=MAX_MESSAGE)
                channel = isinstance(from_wire(header, tensors), CONTROL) != (kind == "wrong_channel")
            except MalformedMessage:
                channel = rng.random() < 0.5
            except Exception as exc:  # noqa: BLE001 - a codec bug: sent anyway, to see what the receiver does
                unexpected.append(f"message {i} ({kind}): local decode raised {type(exc).__name__}: {exc}")
                channel = False
            try:
                reason, message = predict(frames, channel)
            except Exception:  # noqa: BLE001 - already noted above
                reason, message = "<crash>", None
            if isinstance(message, Data) and message.key == FINAL_KEY:
                continue  # would pre-empt the final swap's chunks
            fuzzer.send(frames, channel)
            sent += 1
            frames_sent += len(frames)
            if reason is None:
                accepted += 1
                reason = "accepted"
            else:
                expected[reason] += 1
            by_kind.setdefault(kind, Counter())[reason] += 1
            if i % 8 == 0:
                try:
                    plain.send_multipart(encode(*to_wire(Hello(LEAVING, 0), 1, RUN)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # its queue is full: it never got past the handshake
            if i % 256 == 0:
                fuzzer.drain()
                peak = max(peak, rss_bytes())
                if not alive():
                    break
        sending_s = time.monotonic() - began
        total_expected = sum(expected.values())
        rejected = lambda: sum(rejections().values())  # noqa: E731
        done = wait_until(lambda: rejected() >= total_expected or not alive(), 30)
        peak = max(peak, rss_bytes())
        print(f"sent {sent} messages ({frames_sent} frames) in {sending_s:.1f} s; accepted {accepted}, "
              f"rejected {rejected()} (expected {total_expected}); RSS {rss_before >> 20} -> peak {peak >> 20} MiB")
        print(f"{len(rejections())} distinct rejection reasons; the commonest:",
              dict(rejections().most_common(12)))
        print("security counts:", target.security_counts()["refused_connections"])
        print("protocol state:", target.protocol_state())
        assert alive() and target.broken is None, \
            f"seed {seed}: rank 0 broke: {target.broken}; " + "; ".join(unexpected[:3])
        assert not unexpected, f"seed {seed}: " + "; ".join(unexpected[:5])
        assert done, f"seed {seed}: rank 0 counted {rejected()} rejections of the {total_expected} expected"
        assert sent >= count * 0.99 and frames_sent >= 10_000
        # Each rejection counted once, with the reason predicted for it; every other message was taken.
        assert rejections() == expected, f"seed {seed}: {rejections() - expected} vs {expected - rejections()}"
        assert target.malformed_messages == total_expected == sent - accepted
        print("outcomes by mutation:", {kind: len(reasons) for kind, reasons in sorted(by_kind.items())})
        for kind, marks in REASONS.items():  # each kind of corruption refused, for the reason it deserves
            reasons = by_kind.get(kind, Counter())
            if sum(reasons.values()) >= 30:
                assert any(mark in r for r in reasons for mark in marks), f"seed {seed}: {kind}: {reasons}"
        for kind in ("wrong_channel", "wrong_sender", "run_id", "oversize", "huge_shape", "non_finite", "random",
                     "bad_dtype", "tensor_count", "drop_field", "extra_field"):
            assert "accepted" not in by_kind.get(kind, {}), f"seed {seed}: {kind} got through: {by_kind[kind]}"
        assert peak - rss_before < 64 << 20, f"seed {seed}: RSS grew by {(peak - rss_before) >> 20} MiB"
        state = target.protocol_state()
        assert state.pop("mailbox_bytes") <= 8 << 20 and max(state.values()) <= 4096, state
        refused = target.security_counts()["refused_connections"]
        assert sum(refused.values()) >= 1, refused
        # Member 1 "restarts": the fuzzer's process goes, the real one comes and swaps within its deadline.
        fuzzer.close()
        plain_ctx.destroy(linger=0)
        assert wait_until(lambda: target.connected() == [], 10)
        real = start_exchange(1, endpoints, key)
        made.append(real)
        assert wait_until(lambda: target.connected() == [1] and real.connected() == [0], 10)
        assert wait_until(lambda: target.members(0) == [0, 1] and real.members(0) == [0, 1], 10)
        with ThreadPoolExecutor(2) as pool:
            began = time.monotonic()
            mine = pool.submit(target.swap, FINAL_KEY, 1, torch.arange(5.0))
            theirs = pool.submit(real.swap, FINAL_KEY, 0, -torch.arange(5.0))
            assert mine.result(15).tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0]
            assert theirs.result(15).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert time.monotonic() - began < 5.0
        assert alive() and rejected() == total_expected
    finally:
        fuzzer.close()
        plain_ctx.destroy(linger=0)
        for ex in made:
            ex.close()


@pytest.mark.slow  # every mutation against live sockets (4 s): the fast subset stays under 2 minutes
@pytest.mark.timeout(60)
def test_live_fuzz_rejects_each_mutation_with_its_reason_and_survives():
    run_live_fuzz(15_000)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_live_fuzz_long():
    run_live_fuzz(100_000)
