"""The data calls: a pairwise swap (and the pair mean computed as it arrives), the ring all-reduce, the
all-to-all of the compressed collectives, and the state download (plus its upload).

Each is a ``DataCall`` (see ``call``): it sends chunks of at most ``chunk_elems`` float32 values (or
``4 * chunk_elems`` bytes of a compressed payload) and consumes the chunks it needs in a fixed order,
validating each (size, dtype, member-list digest, hash) before using it. The mixing math (the ring's sums) runs in ``feed``, i.e. in whatever
driver runs the call: the same code in a real peer and in the simulator.
"""

from __future__ import annotations

import hashlib
import math

import torch

from gossiploco.errors import PeerFailed
from gossiploco.protocol import chunk_math
from gossiploco.protocol.call import DataCall, Step
from gossiploco.protocol.messages import Data, Send, StateRequest, digest
from gossiploco.protocol.ring import chunks_per_segment, ring_steps, segment_bounds
from gossiploco.protocol.state_limit import NO_STATE, REFUSED


def chunk_hash(chunk: torch.Tensor) -> int:
    """A 64-bit BLAKE2b digest of a float32 chunk's bytes, as a signed int64 (state transfers verify every chunk)."""
    raw = hashlib.blake2b(chunk.contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _check(message: Data, total: int, numel: int, what: str, sender: int, dtype: torch.dtype = torch.float32) -> None:
    if message.total != total or message.data.numel() != numel or message.data.dtype != dtype:
        raise PeerFailed(f"{what}: peer {sender} sent chunk {message.chunk} of {message.data.numel()} "
                         f"{message.data.dtype} elements (of {message.total}); expected {numel} {dtype} (of {total})")


def chunk_size(chunk_elems: int, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` a chunk holds: as many bytes as ``chunk_elems`` float32 values."""
    return max(1, chunk_elems * 4 // dtype.itemsize)


class Swap(DataCall):
    """Send ``mine`` to ``partner`` and receive the partner's payload of the same size and dtype
    (fp32 values, or the uint8 bytes of a compressed payload).

    Every chunk carries the partner it is meant for (``meta[2]``) so a peer that receives chunks
    from someone who is not its partner refuses them at once (see ``PeerNode``)."""

    def __init__(self, key: str, me: int, partner: int, mine: torch.Tensor, chunk_elems: int, began: float,
                 deadline: float):
        super().__init__(key, began, deadline, [partner])
        self.me, self.partner, self.mine = me, partner, mine
        self.per = chunk_size(chunk_elems, mine.dtype)
        self.total = mine.numel()
        self.n_chunks = max(1, math.ceil(self.total / self.per))
        self.out = self._receive_into()
        self.got = 0
        self.what = f"swap {key!r} with {partner}"

    def _receive_into(self) -> torch.Tensor:
        return torch.empty(self.total, dtype=self.mine.dtype)

    def expected_senders(self) -> set[int]:
        return {self.partner}

    def start(self, node) -> list[Send]:
        return super().start(node) + [self._chunk(c) for c in range(self.n_chunks)]

    def _chunk(self, c: int) -> Send:
        values = self.mine[c * self.per:(c + 1) * self.per]
        return Send(self.partner, Data(self.key, c, (self.total, 0, self.partner), values))

    def need(self):
        return (self.partner, self.got) if self.got < self.n_chunks else None

    def feed(self, message: Data) -> list[Send]:
        part = self.out[self.got * self.per:(self.got + 1) * self.per]
        _check(message, self.total, part.numel(), self.what, self.partner, self.out.dtype)
        chunk_math.copy_(part, message.data)
        self.got += 1
        return []

    def outcome(self) -> torch.Tensor:
        return self.out


class PairMean(Swap):
    """A swap that leaves the pair's mean ``(mine + theirs) / 2`` in ``mine`` itself: each received chunk is added
    into this peer's own chunk and halved while it is in cache, so there is no receive buffer (fresh pages cost
    more than the copy into them) and no second pass over the vector. Both sides compute the same bits (IEEE
    addition commutes; halving is exact), so the pair's sum is kept. fp32 values only.

    The chunks are views of ``mine``, which ``feed`` overwrites: a driver must copy each as it sends it (the ZeroMQ
    driver does: ``ZmqExchange.swap_mean``)."""

    def __init__(self, key: str, me: int, partner: int, mine: torch.Tensor, chunk_elems: int, began: float,
                 deadline: float):
        if mine.dtype != torch.float32 or mine.dim() != 1 or not mine.is_contiguous():
            raise ValueError(f"a pair mean takes a contiguous 1-d float32 vector, not {mine.dtype} {tuple(mine.shape)}")
        super().__init__(key, me, partner, mine, chunk_elems, began, deadline)
        self.what = f"pair mean {key!r} with {partner}"

    def _receive_into(self) -> torch.Tensor:
        return self.mine

    def feed(self, message: Data) -> list[Send]:
        part = self.mine[self.got * self.per:(self.got + 1) * self.per]
        _check(message, self.total, part.numel(), self.what, self.partner)
        chunk_math.div_(chunk_math.add_(part, message.data), 2)
        self.got += 1
        return []


class RingAllReduce(DataCall):
    """Mean of ``acc`` over ``members`` by the ring of ``ring``; reduces in ``acc`` itself and returns it divided.
    Each member divides the segment it completes, chunk by chunk as the last addition leaves it in cache, and the
    all-gather carries means: the same bits as dividing the whole sum at the end (the sum's bits are the same on
    every member, and so is one division of them), without that last pass over the vector.

    The payload is sent as views of ``acc`` (``Send.segment`` names the segment), so a driver that
    sends without copying must not let ``feed`` overwrite a segment whose send is still queued:
    ``overwrites`` says which segment the next ``feed`` writes when it copies (all-gather)."""

    def __init__(self, key: str, me_id: int, members: list[int], acc: torch.Tensor, chunk_elems: int,
                 began: float, deadline: float):
        self.members = list(members)  # in the order agreed (``agreement.ring_order``): every member holds the same
        n = len(self.members)
        others = [m for m in self.members if m != me_id]
        super().__init__(key, began, deadline, others)
        self.n, self.acc, self.per = n, acc, chunk_elems
        me = self.members.index(me_id)
        self.left, self.right = self.members[(me - 1) % n], self.members[(me + 1) % n]
        self.total = acc.numel()
        self.bounds = segment_bounds(self.total, n)
        self.cps = chunks_per_segment(self.total, n, chunk_elems)
        self.steps = ring_steps(n, me)
        self.digest = digest(self.members)
        self.step, self.chunk = 0, 0  # position of the next chunk to receive
        self.what = f"all-reduce {key!r} over {self.members}"

    def expected_senders(self) -> set[int]:
        return {self.left}

    def _segment(self, k: int) -> torch.Tensor:
        return self.acc[self.bounds[k]:self.bounds[k + 1]]

    def _sends(self, s: int) -> list[Send]:
        step = self.steps[s]
        out = self._segment(step.send_segment)
        return [Send(self.right, Data(self.key, s * self.cps + c, (self.total, 0, self.digest),
                                      out[c * self.per:(c + 1) * self.per]), segment=step.send_segment)
                for c in range(self.cps)]

    def start(self, node) -> list[Send]:
        return super().start(node) + (self._sends(0) if self.steps else [])

    def need(self):
        if self.step >= len(self.steps):
            return None
        return self.left, self.step * self.cps + self.chunk

    def overwrites(self) -> int | None:
        """The segment the next ``feed`` copies into (all-gather), None when it adds (reduce-scatter) or is done."""
        if self.step >= len(self.steps) or self.steps[self.step].reduce:
            return None
        return self.steps[self.step].recv_segment

    def feed(self, message: Data) -> list[Send]:
        step = self.steps[self.step]
        if len(message.meta) < 3 or message.meta[2] != self.digest:
            raise PeerFailed(f"{self.what}: peer {self.left} runs this all-reduce over another member list")
        part = self._segment(step.recv_segment)[self.chunk * self.per:(self.chunk + 1) * self.per]
        _check(message, self.total, part.numel(), self.what, self.left)
        if step.reduce:
            chunk_math.add_(part, message.data)
            if self.step == self.n - 2:  # this segment's sum is complete: its mean, while the chunk is in cache
                self._divide(part)
        else:
            chunk_math.copy_(part, message.data)  # a mean already (its owner divided it)
        self.chunk += 1
        if self.chunk < self.cps:
            return []
        self.step, self.chunk = self.step + 1, 0
        return self._sends(self.step) if self.step < len(self.steps) else []

    def _divide(self, part: torch.Tensor) -> None:
        chunk_math.div_(part, self.n)

    def outcome(self) -> torch.Tensor:
        return self.acc  # every segment was divided by its owner before the all-gather: no pass over the whole


class AllToAll(DataCall):
    """Send ``parts[m]`` (uint8) to every other member ``m`` and receive ``sizes[m]`` bytes from each.

    Chunks carry the caller's ``tag`` (``meta[1]``: which reference the payload is encoded against) and
    the digest of the member list (``meta[2]``), so a peer running the exchange against another
    reference or over another list fails it at its first chunk. They are consumed sender by sender in
    member order (the others wait in the mailbox, which holds a few payloads: compressed parts are small)."""

    def __init__(self, key: str, me: int, members: list[int], parts: dict[int, torch.Tensor], sizes: dict[int, int],
                 chunk_elems: int, began: float, deadline: float, tag: int = 0):
        self.members = list(members)
        self.others = [m for m in self.members if m != me]
        super().__init__(key, began, deadline, self.others)
        self.parts, self.sizes, self.tag = parts, sizes, tag
        self.per = chunk_size(chunk_elems, torch.uint8)
        self.digest = digest(self.members)
        self.out = {m: torch.empty(sizes[m], dtype=torch.uint8) for m in self.others}
        self.sender, self.got = 0, 0  # position in ``others``, chunks taken from it
        self.what = f"all-to-all {key!r} over {self.members}"

    def _chunks(self, size: int) -> int:
        return max(1, math.ceil(size / self.per))

    def expected_senders(self) -> set[int]:
        return set(self.others)

    def start(self, node) -> list[Send]:
        sends = super().start(node)
        for m in self.others:
            part = self.parts[m]
            sends += [Send(m, Data(self.key, c, (part.numel(), self.tag, self.digest), part[c * self.per:(c + 1) * self.per]))
                      for c in range(self._chunks(part.numel()))]
        return sends

    def need(self):
        while self.sender < len(self.others) and self.got >= self._chunks(self.sizes[self.others[self.sender]]):
            self.sender, self.got = self.sender + 1, 0
        return None if self.sender >= len(self.others) else (self.others[self.sender], self.got)

    def feed(self, message: Data) -> list[Send]:
        m = self.others[self.sender]
        if len(message.meta) < 3 or message.meta[2] != self.digest:
            raise PeerFailed(f"{self.what}: peer {m} runs this exchange over another member list")
        if message.tag != self.tag:
            raise PeerFailed(f"{self.what}: peer {m} sent tag {message.tag}, this peer's is {self.tag} (another reference)")
        part = self.out[m][self.got * self.per:(self.got + 1) * self.per]
        _check(message, self.sizes[m], part.numel(), self.what, m, torch.uint8)
        chunk_math.copy_(part, message.data)
        self.got += 1
        return []

    def outcome(self) -> dict[int, torch.Tensor]:
        return self.out


class FetchState(DataCall):
    """Download ``(round, flat state)`` from ``peer``: one request, then hash-verified chunks."""

    def __init__(self, peer: int, nonce: str, chunk_elems: int, began: float, deadline: float):
        super().__init__(f"state/rep/{nonce}", began, deadline, [peer])
        self.peer, self.nonce, self.per = peer, nonce, chunk_elems
        self.total: int | None = None
        self.round = -1
        self.out: torch.Tensor | None = None
        self.got = 0
        self.what = f"state download from {peer}"

    def expected_senders(self) -> set[int]:
        return {self.peer}

    def start(self, node) -> list[Send]:
        # A request sent while the peer is unreachable (its connection dropped: a relay's reset, say) may go nowhere;
        # it is sent again once the peer is back, instead of the download waiting out its deadline
        self.unsent = self.peer in node.peers.failed
        return super().start(node) + [Send(self.peer, StateRequest(self.nonce))]

    def poll(self, node, now: float) -> Step:
        step = super().poll(node, now)
        if (self.unsent and step.wait_until is not None and not step.sends and self.total is None
                and self.peer in node.peers.connected and self.peer not in node.peers.failed):
            self.unsent = False  # the same nonce: a donor that had it already does not serve it twice
            node.note(f"{self.what}: peer {self.peer} is back; the request is sent again", routine=True)
            return Step(sends=[Send(self.peer, StateRequest(self.nonce))], wait_until=step.wait_until)
        return step

    def need(self):
        if self.total is not None and self.got >= max(1, math.ceil(self.total / self.per)):
            return None
        return self.peer, self.got

    def feed(self, message: Data) -> list[Send]:
        if self.total is None:
            if message.tag == REFUSED:
                raise PeerFailed(f"{self.what}: peer {self.peer} refused the request (this peer asked it for its "
                                 "state too often: protocol.state_limit)")
            if message.tag < 0:
                raise PeerFailed(f"{self.what}: peer {self.peer} has no state to give yet")
            if message.total < 0:
                raise PeerFailed(f"{self.what}: invalid total {message.total}")
            self.total, self.round = message.total, message.tag
            self.out = torch.empty(self.total, dtype=torch.float32)
        part = self.out[self.got * self.per:(self.got + 1) * self.per]
        if message.total != self.total or message.data.numel() != part.numel():
            raise PeerFailed(f"{self.what}: chunk {self.got} has {message.data.numel()} elements, expected {part.numel()}")
        if len(message.meta) < 3 or message.meta[2] != chunk_hash(message.data):
            raise PeerFailed(f"{self.what}: chunk {self.got} failed its hash check")
        chunk_math.copy_(part, message.data)
        self.got += 1
        return []

    def outcome(self) -> tuple[int, torch.Tensor]:
        return self.round, self.out


def state_chunks(nonce: str, state: tuple[int, torch.Tensor] | None, chunk_elems: int) -> list[Data]:
    """The answer to a ``StateRequest``: the state in hash-carrying chunks, or one "none yet" chunk."""
    key = f"state/rep/{nonce}"
    if state is None:
        return [Data(key, 0, (0, NO_STATE), torch.empty(0, dtype=torch.float32))]
    round_index, flat = state
    flat = flat.detach().reshape(-1).to(torch.float32)
    total = flat.numel()
    chunks = []
    for c in range(max(1, math.ceil(total / chunk_elems))):
        part = flat[c * chunk_elems:(c + 1) * chunk_elems]
        chunks.append(Data(key, c, (total, round_index, chunk_hash(part)), part))
    return chunks
