"""Fuzzing the wire: hypothesis properties of the codec and message layer, and a live-socket fuzzer.

Property: any list of frames either decodes to a valid message or raises ``MalformedMessage``:
never another exception, never an allocation beyond ``max_bytes`` (a header announcing a gigantic
shape is refused before anything is allocated); valid messages round-trip exactly.

Live: a raw CurveZMQ DEALER holding member 1's static key sends thousands of mutated messages to a
real ``ZmqExchange`` (rank 0); each is predicted locally (decode, ``from_wire``, the connection
checks), and the exchange must reject exactly the ones predicted, each counted with its reason,
stay alive, keep its memory bounded, and still swap with the real rank 1 afterwards. The seed is
printed; ``GOSSIPLOCO_FUZZ_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import wait_until
from gossiploco.errors import ExchangeError, MalformedMessage
from gossiploco.protocol import messages
from gossiploco.protocol.messages import (CONTROL, LEAVING, PROBE, STEPPING_OUT, Abort, Data, Decision, Hello, Ready,
                                          Send, ServeState, StateRequest, from_wire, to_wire)
from gossiploco.protocol.node import PeerNode
from gossiploco.runtime.launch import free_ports
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust, routing_id
from gossiploco.protocol import codec
from gossiploco.protocol.codec import DTYPES, OPS, Header, decode, encode
from gossiploco.transport.zmq_exchange import ZmqExchange

RUN = "fuzz-run"
LIMIT = 1 << 16
"""``max_bytes`` of the property tests."""
HYPOTHESIS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                      database=None)

ODD_KEYS = ["mix1/\u00b2", "grad/1\u00b2", "state/\u00b3", "mix1/\u0661\u0662", "mix1/" + "9" * 40, "mix2/-1",
            "mix1/3/\u00b2", "", "/", "state/req/", "hello/leave", "mix1/3" * 100]
"""Keys a receiver parses (``op_and_round``): unicode digits, huge and negative rounds, empty parts."""
INT64 = st.integers(-(2**63), 2**63 - 1)
MSGPACK_INT = st.one_of(st.integers(-(2**63), 2**64 - 1),
                        st.sampled_from([0, -1, 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1, -(2**63)]))
ANY_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), MSGPACK_INT, st.floats(), st.text(max_size=12), st.binary(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.one_of(st.text(max_size=6), st.binary(max_size=6)), inner, max_size=4)),
    max_leaves=12)
"""Any msgpack value (map keys: str or bytes, as ``strict_map_key`` allows)."""


# -- helpers ----------------------------------------------------------------------------------------


@contextmanager
def allocation_limit(limit: int):
    """Fail if ``torch.empty`` (the codec's only allocator) is asked for more than ``limit`` bytes."""
    real = torch.empty

    def guarded(*size, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if all(isinstance(d, int) for d in shape):
            nbytes = math.prod(shape) * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize
            assert nbytes <= limit, f"torch.empty{tuple(shape)} would allocate {nbytes} bytes > max_bytes={limit}"
        return real(*size, **kwargs)

    torch.empty = guarded
    try:
        yield
    finally:
        torch.empty = real


def check_decode(frames, max_bytes: int = LIMIT, copy: bool = True, allow_non_finite: bool = False):
    """Decode ``frames`` like a receiver; None when rejected (``MalformedMessage``), else (header,
    tensors, message or None when ``from_wire`` refused it). Any other exception escapes (a bug);
    a decoded message is checked against its header."""
    try:
        with allocation_limit(max_bytes):
            header, tensors = decode(frames, expect_run=RUN, max_bytes=max_bytes, copy=copy,
                                     allow_non_finite=allow_non_finite)
    except MalformedMessage:
        return None
    assert header.run == RUN and header.op in OPS and header.v == codec.PROTOCOL_VERSION
    assert min(header.round, header.chunk, header.sender) >= 0
    assert len(frames) == len(tensors) + 1 == len(header.tensors) + 1
    for spec, tensor in zip(header.tensors, tensors):
        assert tensor.dtype == DTYPES[spec.dtype] and tuple(tensor.shape) == spec.shape
        if tensor.is_floating_point() and not allow_non_finite:
            assert bool(torch.isfinite(tensor).all())
    assert sum(t.numel() * t.element_size() for t in tensors) <= max_bytes
    try:
        message = from_wire(header, tensors)
    except MalformedMessage:
        return header, tensors, None
    assert isinstance(message, (Data, Hello, Ready, Decision, Abort, StateRequest))
    return header, tensors, message


def valid_header(**overrides) -> Header:
    fields = {"run": RUN, "round": 3, "op": "mix1", "chunk": 0, "sender": 1, "key": "mix1/3"}
    fields.update(overrides)
    return Header(**fields)


# -- strategies ---------------------------------------------------------------------------------------


@st.composite
def tensors_(draw, max_tensors: int = 3, non_finite: bool = True) -> list[torch.Tensor]:
    """A few small tensors of any codec dtype; floats may hold NaN/Inf (drawn from raw bytes)."""
    out = []
    for _ in range(draw(st.integers(0, max_tensors))):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw else \
            torch.empty(shape, dtype=dtype)
        if not non_finite and tensor.is_floating_point():
            tensor = torch.nan_to_num(tensor, nan=0.0, posinf=1.0, neginf=-1.0)
        out.append(tensor)
    return out


headers = st.builds(
    Header, run=st.just(RUN), round=st.integers(0, 2**63 - 1), op=st.sampled_from(sorted(OPS)),
    chunk=st.integers(0, 2**63 - 1), sender=st.integers(0, 2**63 - 1), key=st.text(max_size=40))

keys = st.one_of(st.text(max_size=30), st.sampled_from(ODD_KEYS),
                 st.builds("{}/{}".format, st.sampled_from(["mix1", "mix2", "grad", "state", "monitor", "hello", "x"]),
                           st.text(max_size=6)))
data_keys = keys.filter(lambda k: not k.startswith("state/req/"))  # those keys are state requests on the wire
finite_chunks = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=40).map(
    lambda v: torch.tensor(v, dtype=torch.float32))
protocol_messages = st.one_of(
    st.builds(Data, key=data_keys, chunk=st.integers(0, 2**62), meta=st.lists(INT64, min_size=1, max_size=4).map(tuple),
              data=finite_chunks),
    st.builds(Hello, join_round=st.integers(LEAVING, 2**63 - 1), current_round=INT64,
              ask=st.integers(0, 2**63 - 1), echo=st.integers(0, 2**63 - 1)),
    st.builds(Ready, key=keys, round=INT64),
    st.builds(Decision, key=keys, leader_round=INT64,
              group=st.lists(INT64, max_size=20, unique=True).map(lambda g: tuple(sorted(g)))),
    st.builds(Abort, key=keys),
    st.builds(StateRequest, nonce=st.text(max_size=20)),
)


def encodable(message) -> bool:
    """Whether the sender side can encode ``message`` at all (keys naming a round beyond msgpack's
    ints, or with non-ASCII digits, cannot: see the encode tests below)."""
    try:
        encode(*to_wire(message, 0, RUN))
    except (ValueError, OverflowError):
        return False
    return True


wire_messages = protocol_messages.filter(encodable)


@st.composite
def near_valid_frames(draw) -> list:
    """A valid message (protocol-level or raw codec) whose header map and frames are then damaged."""
    if draw(st.booleans()):
        header, tensors = to_wire(draw(wire_messages), draw(st.integers(0, 2**40)), RUN)
    else:
        header, tensors = draw(headers), draw(tensors_())
    frames = encode(header, tensors)
    wire = msgpack.unpackb(frames[0], raw=False)
    payload = [bytes(f) for f in frames[1:]]
    fields = sorted(wire)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from([
            "set_field", "drop_field", "extra_field", "dtype", "shape", "huge_shape", "spec_entry", "tensor_list",
            "drop_frame", "dup_frame", "reorder", "truncate", "extend", "non_finite", "bitflip", "version_run_op"]))
        if kind == "set_field":
            wire[draw(st.sampled_from(fields))] = draw(ANY_VALUE)
        elif kind == "drop_field" and wire:
            wire.pop(draw(st.sampled_from(sorted(wire, key=repr))))
        elif kind == "extra_field":
            wire[draw(st.one_of(st.text(max_size=8), st.binary(max_size=8)))] = draw(ANY_VALUE)
        elif kind in ("dtype", "shape", "huge_shape", "spec_entry") and isinstance(wire.get("tensors"), list) \
                and wire["tensors"] and isinstance(wire["tensors"][0], dict):
            entry = wire["tensors"][draw(st.integers(0, len(wire["tensors"]) - 1))]
            if not isinstance(entry, dict):
                continue
            if kind == "dtype":
                entry["dtype"] = draw(st.one_of(st.sampled_from(sorted(DTYPES) + ["float64", "bool", "", "int32"]),
                                                ANY_VALUE))
            elif kind == "shape":
                entry["shape"] = draw(st.one_of(st.lists(MSGPACK_INT, max_size=10), ANY_VALUE))
            elif kind == "huge_shape":  # gigantic volumes: refused before any allocation
                entry["shape"] = draw(st.sampled_from([
                    [2**40], [2**40 + 1], [2**62], [2**64 - 1], [2**31] * 8, [0, 2**40], [0, 2**63 - 1],
                    [2**20, 2**20], [2**20, 2**20, 2**20], [-1], [-(2**63)], [1] * 9, [3, -3]]))
            else:
                entry[draw(st.one_of(st.text(max_size=6), st.binary(max_size=6)))] = draw(ANY_VALUE)
        elif kind == "tensor_list" and isinstance(wire.get("tensors"), list):
            if wire["tensors"] and draw(st.booleans()):
                wire["tensors"].pop()
            else:
                wire["tensors"].append({"dtype": draw(st.sampled_from(sorted(DTYPES))),
                                        "shape": draw(st.lists(st.integers(0, 3), max_size=2))})
        elif kind == "drop_frame" and payload:
            payload.pop(draw(st.integers(0, len(payload) - 1)))
        elif kind == "dup_frame" and payload:
            payload.insert(0, payload[draw(st.integers(0, len(payload) - 1))])
        elif kind == "reorder" and len(payload) > 1:
            payload = draw(st.permutations(payload))
        elif kind == "truncate" and payload:
            i = draw(st.integers(0, len(payload) - 1))
            payload[i] = payload[i][:draw(st.integers(0, max(0, len(payload[i]) - 1)))]
        elif kind == "extend" and payload:
            i = draw(st.integers(0, len(payload) - 1))
            payload[i] += draw(st.binary(min_size=1, max_size=16))
        elif kind == "non_finite" and payload:
            i = draw(st.integers(0, len(payload) - 1))
            bad = draw(st.sampled_from([b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff",  # fp32 NaN/+-Inf
                                        b"\x00\x7e", b"\x00\x7c", b"\xc0\x7f", b"\x80\x7f"]))  # fp16/bf16 NaN/Inf
            at = draw(st.integers(0, len(payload[i]))) & ~(len(bad) - 1)
            payload[i] = (payload[i][:at] + bad + payload[i][at + len(bad):])[:max(len(payload[i]), len(bad))]
        elif kind == "bitflip" and payload and any(payload):
            i = draw(st.sampled_from([j for j, p in enumerate(payload) if p]))
            b = bytearray(payload[i])
            b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
            payload[i] = bytes(b)
        elif kind == "version_run_op":
            field, value = draw(st.sampled_from([("v", 0), ("v", 2), ("v", True), ("run", "other"),
                                                 ("run", b"fuzz-run"),
                                                 ("op", "MIX1"), ("op", ""), ("round", -1), ("chunk", -5),
                                                 ("sender", -(2**63)), ("round", 2**64 - 1), ("key", b"mix1/3")]))
            wire[field] = value
    header_frame = msgpack.packb(wire, use_bin_type=True)
    if draw(st.booleans()) and header_frame:  # and sometimes a damaged header frame too
        cut = draw(st.integers(0, len(header_frame)))
        header_frame = header_frame[:cut] + draw(st.binary(max_size=4)) + header_frame[cut + 1:]
    return [header_frame, *payload]


def as_frame_type(frames: list, kind: str) -> list:
    if kind == "bytearray":
        return [bytearray(f) for f in frames]
    if kind == "memoryview":
        return [memoryview(bytes(f)) for f in frames]
    return [bytes(f) for f in frames]


frame_types = st.sampled_from(["bytes", "bytearray", "memoryview"])


# -- the properties --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(frames=st.lists(st.binary(max_size=64), max_size=5), frame_type=frame_types, copy=st.booleans())
def test_arbitrary_frames_decode_or_raise_malformed(frames, frame_type, copy):
    check_decode(as_frame_type(frames, frame_type), copy=copy)


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(header=ANY_VALUE, payload=st.lists(st.binary(max_size=32), max_size=3))
def test_any_msgpack_header_decodes_or_raises_malformed(header, payload):
    check_decode([msgpack.packb(header, use_bin_type=True), *payload])


@pytest.mark.slow  # 600 examples (2 s): the fast subset keeps its margin
@pytest.mark.timeout(60)
@settings(HYPOTHESIS, max_examples=600)
@given(frames=near_valid_frames(), frame_type=frame_types, copy=st.booleans())
def test_near_valid_messages_decode_or_raise_malformed(frames, frame_type, copy):
    check_decode(as_frame_type(frames, frame_type), copy=copy)


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(frames=near_valid_frames(), slack=st.integers(1, 64))
def test_a_message_over_max_bytes_is_refused_whatever_it_holds(frames, slack):
    total = sum(len(f) for f in frames)
    assume(total >= slack)
    with pytest.raises(MalformedMessage, match="exceeds max_bytes"):
        decode(frames, expect_run=RUN, max_bytes=total - slack)


@pytest.mark.parametrize("shape", [[2**40], [2**40, 1], [0, 2**40], [2**20, 2**20], [2**62], [2**64 - 1], [2**31] * 8])
@pytest.mark.parametrize("frame_bytes", [0, 8, 4096])
def test_a_gigantic_declared_shape_is_refused_before_allocating(shape, frame_bytes):
    wire = valid_header(op="state").to_dict()
    wire["tensors"] = [{"dtype": "int64", "shape": shape}]
    frames = [msgpack.packb(wire, use_bin_type=True), bytes(frame_bytes)]
    got = check_decode(frames, max_bytes=LIMIT)  # allocation_limit fails if it allocates beyond LIMIT
    if got is not None:  # only a zero-volume shape can match a frame (of 0 bytes): an empty tensor
        assert frame_bytes == 0 and 0 in shape and got[1][0].numel() == 0


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(header=headers, tensors=tensors_(), frame_type=frame_types, copy=st.booleans())
def test_codec_round_trips_exactly_and_refuses_exactly_the_non_finite(header, tensors, frame_type, copy):
    frames = as_frame_type(encode(header, tensors), frame_type)
    got_header, got = decode(frames, expect_run=RUN, max_bytes=LIMIT, allow_non_finite=True, copy=copy)
    assert got_header == Header(**{**header.__dict__, "tensors": got_header.tensors})
    assert [(DTYPES[s.dtype], s.shape) for s in got_header.tensors] == [(t.dtype, tuple(t.shape)) for t in tensors]
    for a, b in zip(got, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()  # bitwise
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    assert (check_decode(frames, copy=copy) is not None) == finite


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(message=wire_messages, sender=st.integers(0, messages.MAX_PEER_ID), frame_type=frame_types)
def test_protocol_messages_round_trip_exactly(message, sender, frame_type):
    header, tensors = to_wire(message, sender, RUN)
    frames = as_frame_type(encode(header, tensors), frame_type)
    got = check_decode(frames, copy=frame_type == "bytearray")
    assert got is not None and got[2] is not None, f"{message} did not decode"
    decoded = got[2]
    assert decoded.__class__ is message.__class__ and got[0].sender == sender
    if isinstance(message, Data):
        assert (decoded.key, decoded.chunk, decoded.meta) == (message.key, message.chunk, message.meta)
        assert torch.equal(decoded.data, message.data)
    else:
        assert decoded == message


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(message=protocol_messages, current_round=st.integers(-1, 100), join=st.integers(0, 3))
def test_a_peer_node_takes_any_valid_message_or_raises_malformed(message, current_round, join):
    """What a receiver does with a message that passed the codec: actions, or ``MalformedMessage``."""
    node = PeerNode(0, [0, 1, 2], grace_s=1.0, chunk_elems=16, mailbox_bytes=1 << 16)
    node.current_round = current_round
    node.peers.on_connected(1, 0.0)
    if join:
        node.announce(join)
    try:
        actions = node.receive(1, message, 10.0)
    except MalformedMessage:
        return
    assert all(isinstance(a, (Send, ServeState)) for a in actions)
    assert node.mailbox.bytes <= 1 << 16


def test_encode_refuses_an_unencodable_header_with_value_error():
    """``encode`` promises ``ValueError`` for an invalid header; a round beyond msgpack's 64-bit ints
    (a key such as "mix1/99999999999999999999") must not escape as ``OverflowError``."""
    with pytest.raises(ValueError):
        encode(valid_header(round=2**64), [])


def test_header_with_unknown_str_and_bytes_keys_is_malformed():
    """Regression: two unknown fields, one a str and one a bytes key (msgpack bin), must be a
    ``MalformedMessage``, not a ``TypeError`` from sorting them (which kills a receiver thread)."""
    wire = valid_header().to_dict()
    wire.update({"x": 1, b"": 2})  # bin keys pass the unpacker only when empty (max_bin_len=0)
    with pytest.raises(MalformedMessage):
        decode([msgpack.packb(wire, use_bin_type=True)], expect_run=RUN, max_bytes=LIMIT)


# -- the live-socket fuzzer ------------------------------------------------------------------------------

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
