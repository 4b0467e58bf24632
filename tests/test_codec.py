"""The wire codec: round trips, zero-copy encoding, every rejection reason, and a header fuzz loop."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import torch

from gossiploco.errors import PeerFailed
from gossiploco.protocol.codec import DTYPES, PROTOCOL_VERSION, Header, MalformedMessage, TensorSpec, decode, encode

RUN = "run-a"
LIMIT = 1 << 20


def header(**overrides) -> Header:
    fields = {"run": RUN, "round": 12, "op": "mix1", "chunk": 0, "sender": 3, "key": "mix1/12"}
    fields.update(overrides)
    return Header(**fields)


def payload(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 200, shape, generator=gen).to(dtype)


def valid_frames() -> list:
    return encode(header(), [payload(torch.float32, (2, 3)), payload(torch.int64, (4,), seed=1)])


def with_header(frames: list, edit) -> list:
    """``frames`` with the header map unpacked, changed by ``edit(map)`` and packed again."""
    wire = msgpack.unpackb(frames[0], raw=False)
    edit(wire)
    return [msgpack.packb(wire, use_bin_type=True), *frames[1:]]


def assert_rejected(frames, match: str, **kwargs) -> None:
    kwargs.setdefault("expect_run", RUN)
    kwargs.setdefault("max_bytes", LIMIT)
    with pytest.raises(MalformedMessage, match=match):
        decode(frames, **kwargs)


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0), (2, 3, 4)])
def test_round_trip_every_dtype_and_shape(name, shape):
    tensor = payload(DTYPES[name], shape)
    got_header, (got,) = decode(encode(header(), [tensor]), expect_run=RUN, max_bytes=LIMIT)
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)
    assert got_header.tensors == (TensorSpec(name, shape),)


def test_round_trip_multiple_tensors_and_header_fields():
    tensors = [payload(DTYPES[name], (3, 2), seed=i) for i, name in enumerate(sorted(DTYPES))]
    sent = header(op="mix2", round=7, chunk=2, sender=5, key="mix2/7")
    frames = encode(sent, tensors)
    assert len(frames) == 1 + len(tensors)
    got_header, got = decode(frames, expect_run=RUN, max_bytes=LIMIT)
    assert got_header.to_dict() == {**sent.to_dict(), "tensors": [{"dtype": t, "shape": [3, 2]} for t in sorted(DTYPES)]}
    assert got_header.v == PROTOCOL_VERSION
    assert all(torch.equal(a, b) for a, b in zip(got, tensors))


def test_round_trip_without_tensors():
    got_header, got = decode(encode(header(op="hello"), []), expect_run=RUN, max_bytes=LIMIT)
    assert got == [] and got_header.op == "hello" and got_header.tensors == ()


def test_encode_replaces_caller_tensor_specs():
    stale = header(tensors=(TensorSpec("uint8", (99,)),))
    got_header, _ = decode(encode(stale, [torch.zeros(2)]), expect_run=RUN, max_bytes=LIMIT)
    assert got_header.tensors == (TensorSpec("float32", (2,)),)


def test_non_contiguous_tensor_round_trips():
    tensor = payload(torch.float32, (4, 3)).t()
    _, (got,) = decode(encode(header(), [tensor]), expect_run=RUN, max_bytes=LIMIT)
    assert torch.equal(got, tensor)


def test_frames_with_buffer_attribute_are_accepted():
    class FakeFrame:  # like zmq.Frame: the bytes are in .buffer
        def __init__(self, data):
            self.buffer = memoryview(bytes(data))

    tensor = payload(torch.float32, (5,))
    _, (got,) = decode([FakeFrame(f) for f in encode(header(), [tensor])], expect_run=RUN, max_bytes=LIMIT)
    assert torch.equal(got, tensor)


# -- copies ---------------------------------------------------------------------------------------


def test_encode_does_not_copy_a_contiguous_tensor():
    tensor = payload(torch.float32, (8,))
    frame = encode(header(), [tensor])[1]
    assert np.shares_memory(np.frombuffer(frame, dtype=np.uint8), tensor.numpy())
    tensor[0] = 42.0
    assert np.frombuffer(frame, dtype=np.float32)[0] == 42.0


def test_decoded_tensors_do_not_alias_the_receive_buffer():
    tensor = payload(torch.float32, (8,))
    frames = [bytearray(f) for f in encode(header(), [tensor])]
    _, (got,) = decode(frames, expect_run=RUN, max_bytes=LIMIT)
    frames[1][:] = bytes(len(frames[1]))  # the transport reuses its buffer
    assert torch.equal(got, tensor)


# -- encode misuse --------------------------------------------------------------------------------


def test_encode_rejects_non_cpu_tensor():
    with pytest.raises(ValueError, match="only encodes CPU tensors"):
        encode(header(), [torch.empty(2, device="meta")])


def test_encode_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        encode(header(), [torch.zeros(2, dtype=torch.float64)])


def test_encode_rejects_invalid_header():
    with pytest.raises(ValueError, match="unknown op"):
        encode(header(op="bogus"), [])


# -- rejections, in the order decode checks them ---------------------------------------------------


def test_malformed_message_is_a_remote_fault():
    assert issubclass(MalformedMessage, PeerFailed)


def test_rejects_no_frames():
    assert_rejected([], "no frames")


def test_oversize_is_checked_before_the_header():
    assert_rejected([b"\xc1 not msgpack", bytes(2048)], "exceeds max_bytes=1024", max_bytes=1024)


def test_rejects_garbage_header():
    assert_rejected([b"\xc1\xc1\xc1"], "not valid msgpack")


def test_rejects_header_that_is_a_list():
    assert_rejected([msgpack.packb([1, 2, 3])], "msgpack list, not a map")


def test_rejects_missing_field():
    assert_rejected(with_header(valid_frames(), lambda h: h.pop("key")), r"missing field\(s\) \['key'\]")


def test_rejects_extra_field():
    assert_rejected(with_header(valid_frames(), lambda h: h.update(x=1)), r"unknown field\(s\) \['x'\]")


def test_rejects_bool_for_int_field():
    assert_rejected(with_header(valid_frames(), lambda h: h.update(round=True)), "'round' must be int, got bool")


def test_rejects_wrong_version():
    assert_rejected(with_header(valid_frames(), lambda h: h.update(v=2)), "protocol version 2, expected 1")


def test_rejects_wrong_run():
    assert_rejected(valid_frames(), "run id 'run-a', expected 'run-b'", expect_run="run-b")


def test_rejects_unknown_op():
    assert_rejected(with_header(valid_frames(), lambda h: h.update(op="steal")), "unknown op 'steal'")


def test_rejects_negative_round():
    assert_rejected(with_header(valid_frames(), lambda h: h.update(round=-1)), "'round' must be >= 0, got -1")


def test_rejects_extra_payload_frame():
    assert_rejected([*valid_frames(), b"\x00" * 4], r"3 payload frame\(s\) for 2 tensor\(s\)")


def test_rejects_unknown_dtype():
    def edit(h):
        h["tensors"][0]["dtype"] = "float64"

    assert_rejected(with_header(valid_frames(), edit), "tensor 0: unknown dtype 'float64'")


@pytest.mark.parametrize("shape, reason", [
    ([-4], "shape must be a list"),
    ([True], "shape must be a list"),
    ("4", "shape must be a list"),
    ([1] * 9, "shape must be a list of at most 8"),
    ([0, 2**40, 2**40], r"shape .* exceeds \d+ elements"),  # zero elements, but its strides would overflow int64
    ([2**64 - 1], r"shape .* exceeds \d+ elements"),
])
def test_rejects_bad_shape(shape, reason):
    def edit(h):
        h["tensors"][1]["shape"] = shape

    assert_rejected(with_header(valid_frames(), edit), f"tensor 1: {reason}")


def test_rejects_truncated_payload_frame():
    frames = valid_frames()
    frames[2] = bytes(frames[2])[:-1]
    assert_rejected(frames, "tensor 1: frame has 31 bytes, int64 of shape \\[4\\] needs 32")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rejects_non_finite_payload(bad, dtype):
    tensor = torch.tensor([1.0, bad, 2.0], dtype=dtype)
    assert_rejected(encode(header(), [tensor]), "tensor 0: non-finite values")


def test_accepts_nan_when_allowed():
    tensor = torch.tensor([1.0, float("nan"), float("inf")])
    _, (got,) = decode(encode(header(), [tensor]), expect_run=RUN, max_bytes=LIMIT, allow_non_finite=True)
    assert torch.equal(got.isnan(), tensor.isnan()) and got[2] == float("inf")


# -- fuzz -----------------------------------------------------------------------------------------


def test_mutated_headers_decode_or_raise_malformed_only():
    rng = random.Random(0)
    frames = valid_frames()
    original = bytes(frames[0])
    outcomes = {"decoded": 0, "rejected": 0}
    for _ in range(500):
        mutated = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["replace", "insert", "delete"])
            pos = rng.randrange(len(mutated) + (kind == "insert")) if mutated else 0
            if kind == "replace" and mutated:
                mutated[pos] = rng.randrange(256)
            elif kind == "insert":
                mutated.insert(pos, rng.randrange(256))
            elif mutated:
                del mutated[pos]
        try:
            got_header, got = decode([bytes(mutated), *frames[1:]], expect_run=RUN, max_bytes=LIMIT)
        except MalformedMessage:
            outcomes["rejected"] += 1
            continue
        outcomes["decoded"] += 1
        assert [(DTYPES[s.dtype], s.shape) for s in got_header.tensors] == [(t.dtype, tuple(t.shape)) for t in got]
    assert outcomes["rejected"] > 0
