"""Fuzzing the wire: hypothesis properties of the codec and message layer (the live-socket fuzzer:
``test_fuzz_live.py``).

Property: any list of frames either decodes to a valid message or raises ``MalformedMessage``:
never another exception, never an allocation beyond ``max_bytes`` (a header announcing a gigantic
shape is refused before anything is allocated); valid messages round-trip exactly.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gossiploco.errors import MalformedMessage
from gossiploco.protocol import messages
from gossiploco.protocol.messages import (LEAVING, Abort, Data, Decision, Hello, Ready,
                                          Send, ServeState, StateRequest, from_wire, to_wire)
from gossiploco.protocol.node import PeerNode
from gossiploco.protocol import codec
from gossiploco.protocol.codec import DTYPES, OPS, Header, decode, encode

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


def test_a_key_naming_a_round_beyond_int64_is_refused_so_that_no_reply_carries_it():
    """Live fuzz seed 1928291242 (``GOSSIPLOCO_FUZZ_SEED``): a forged ``Ready`` whose key named a round past 2**63 - 1 was
    answered, and the answer's header could not be encoded: the service thread died ("invalid header: OverflowError")
    and the peer with it. Such a key is malformed now, refused where it arrives."""
    from gossiploco.errors import MalformedMessage
    from gossiploco.protocol.messages import MAX_KEY_ROUND, from_wire, to_wire

    for key in (f"mix1/{MAX_KEY_ROUND + 1}", "mix2/" + "9" * 40, f"mix1/{2**64}/gather"):
        with pytest.raises(MalformedMessage, match="beyond"):
            from_wire(*to_wire(Ready(key, 3), sender=1, run_id="r"))
    assert from_wire(*to_wire(Ready(f"mix1/{MAX_KEY_ROUND}", 3), sender=1, run_id="r")) == Ready(f"mix1/{MAX_KEY_ROUND}", 3)
