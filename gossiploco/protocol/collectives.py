"""The data calls: a pairwise swap, the ring all-reduce, and the state download (plus its upload).

Each is a ``DataCall`` (see ``call``): it sends chunks of at most ``chunk_elems`` float32 values
and consumes the chunks it needs in a fixed order, validating each (size, member-list digest,
hash) before using it. The mixing math (the ring's sums) runs in ``feed``, i.e. in whatever
driver runs the call: the same code in a real peer and in the simulator.
"""

from __future__ import annotations

import hashlib
import math

import torch

from gossiploco.errors import PeerFailed
from gossiploco.protocol.call import DataCall
from gossiploco.protocol.messages import Data, Send, StateRequest, digest
from gossiploco.protocol.ring import chunks_per_segment, ring_steps, segment_bounds


def chunk_hash(chunk: torch.Tensor) -> int:
    """A 64-bit BLAKE2b digest of a float32 chunk's bytes, as a signed int64 (state transfers verify every chunk)."""
    raw = hashlib.blake2b(chunk.contiguous().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _check(message: Data, total: int, numel: int, what: str, sender: int) -> None:
    if message.total != total or message.data.numel() != numel:
        raise PeerFailed(f"{what}: peer {sender} sent chunk {message.chunk} of {message.data.numel()} elements "
                         f"(of {message.total}); expected {numel} (of {total})")


class Swap(DataCall):
    """Send ``mine`` to ``partner`` and receive the partner's payload of the same size.

    Every chunk carries the partner it is meant for (``meta[2]``) so a peer that receives chunks
    from someone who is not its partner refuses them at once (see ``PeerNode``)."""

    def __init__(self, key: str, me: int, partner: int, mine: torch.Tensor, chunk_elems: int, began: float,
                 deadline: float):
        super().__init__(key, began, deadline, [partner])
        self.me, self.partner, self.mine, self.per = me, partner, mine, chunk_elems
        self.total = mine.numel()
        self.n_chunks = max(1, math.ceil(self.total / chunk_elems))
        self.out = torch.empty(self.total, dtype=torch.float32)
        self.got = 0
        self.what = f"swap {key!r} with {partner}"

    def expected_senders(self) -> set[int]:
        return {self.partner}

    def start(self, node) -> list[Send]:
        sends = super().start(node)
        return sends + [Send(self.partner, Data(self.key, c, (self.total, 0, self.partner),
                                                self.mine[c * self.per:(c + 1) * self.per]))
                        for c in range(self.n_chunks)]

    def need(self):
        return (self.partner, self.got) if self.got < self.n_chunks else None

    def feed(self, message: Data) -> list[Send]:
        part = self.out[self.got * self.per:(self.got + 1) * self.per]
        _check(message, self.total, part.numel(), self.what, self.partner)
        part.copy_(message.data)
        self.got += 1
        return []

    def outcome(self) -> torch.Tensor:
        return self.out


class RingAllReduce(DataCall):
    """Mean of ``acc`` over ``members`` by the ring of ``ring``; reduces in ``acc`` itself and returns it divided.

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
            part += message.data
        else:
            part.copy_(message.data)
        self.chunk += 1
        if self.chunk < self.cps:
            return []
        self.step, self.chunk = self.step + 1, 0
        return self._sends(self.step) if self.step < len(self.steps) else []

    def outcome(self) -> torch.Tensor:
        return self.acc.div_(self.n)


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
        return super().start(node) + [Send(self.peer, StateRequest(self.nonce))]

    def need(self):
        if self.total is not None and self.got >= max(1, math.ceil(self.total / self.per)):
            return None
        return self.peer, self.got

    def feed(self, message: Data) -> list[Send]:
        if self.total is None:
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
        part.copy_(message.data)
        self.got += 1
        return []

    def outcome(self) -> tuple[int, torch.Tensor]:
        return self.round, self.out


def state_chunks(nonce: str, state: tuple[int, torch.Tensor] | None, chunk_elems: int) -> list[Data]:
    """The answer to a ``StateRequest``: the state in hash-carrying chunks, or one "none yet" chunk."""
    key = f"state/rep/{nonce}"
    if state is None:
        return [Data(key, 0, (0, -1), torch.empty(0, dtype=torch.float32))]
    round_index, flat = state
    flat = flat.detach().reshape(-1).to(torch.float32)
    total = flat.numel()
    chunks = []
    for c in range(max(1, math.ceil(total / chunk_elems))):
        part = flat[c * chunk_elems:(c + 1) * chunk_elems]
        chunks.append(Data(key, c, (total, round_index, chunk_hash(part)), part))
    return chunks
