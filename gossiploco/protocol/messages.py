"""The protocol's messages, the actions it asks a driver to perform, and their wire mapping.

Every message between two peers is one of six kinds (the data plane's chunks, and five control
messages); ``to_wire`` / ``from_wire`` map them onto the codec's header plus two tensors (an
int64 ``meta`` vector and a float32 or uint8 payload), so the bytes on the wire are the codec's
(``gossiploco.protocol.codec``), validated before anything is decoded.

    message        header op            key                  meta
    Data           mix1|mix2|grad|      the exchange key     [total, tag, digest?, ...]; payload: the chunk
                   monitor|state
    Hello          hello                hello/<join>         [join round, current round, ask id, echoed id,
                                                             ms left in the sender's round (optional)]
    Ready          group                the exchange key     [0, round]
    Decision       group                the exchange key     [1, leader round, digest, *group]  (or [2, leader round]:
                                                             "I do not lead it", an empty group)
    Leading        group                the exchange key     [3, leader round]
    Abort          abort                the exchange key     [0, 0]
    StateRequest   state                state/req/<nonce>    [0, 0]

``Ready``, ``Decision``, ``Leading`` and ``Abort`` travel on each peer pair's control connection (they must
not queue behind megabytes of data); the others on the data connection, so a peer's ``leave``
hello arrives after its last data chunk.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gossiploco.errors import MalformedMessage
from gossiploco.protocol import codec

MAX_PEER_ID = 2**31
MAX_GROUP = 1000
"""Most members one group decision may list."""
LEAVING = -2
"""Join round of the hello a peer sends when it leaves gracefully."""
PROBE = -1
"""Join round of a hello that changes no membership and only asks for a reply."""
STEPPING_OUT = 2**62
"""Join round of a peer that stays connected but takes no part for now (it is catching up): the
others leave it out of their views at once instead of waiting a grace window for it per exchange."""
MAX_ENDS_IN_MS = 7 * 24 * 3600 * 1000
"""The most milliseconds a hello may say are left in (or past) its sender's round, or that it began its round (a week:
no round is that long)."""
MAX_KEY_ROUND = 2**63 - 1
"""The largest round a message's key may name: replies (a ``Decision`` to a ``Ready``) carry it in their header."""
NO_CLOCK = MAX_ENDS_IN_MS + 1
"""A hello's ``ends_in_ms`` entry on the wire when it has none but ``began_ms_ago`` follows."""
_READY, _DECISION, _NOT_LEADING, _LEADING = 0, 1, 2, 3
_EMPTY = torch.empty(0, dtype=torch.float32)
DATA_OPS = ("mix1", "mix2", "grad", "state")
PAYLOAD_DTYPES = (torch.float32, torch.uint8)
"""A data chunk holds fp32 values or the bytes of a compressed payload (``gossiploco.mixing.compression``)."""


def digest(members: Sequence[int]) -> int:
    """A short fingerprint of a member list *in its order* (a ring's order matters; fits an int64 meta entry)."""
    return zlib.crc32(",".join(map(str, members)).encode())


@dataclass(frozen=True)
class Data:
    """Chunk ``chunk`` of exchange ``key``'s payload; ``meta[0]`` is the payload's total element count."""

    key: str
    chunk: int
    meta: tuple[int, ...]
    data: torch.Tensor = field(repr=False)

    @property
    def total(self) -> int:
        return self.meta[0]

    @property
    def tag(self) -> int:
        return self.meta[1] if len(self.meta) > 1 else 0


@dataclass(frozen=True)
class Hello:
    """"I take part from round ``join_round`` on, and I am in round ``current_round``" (``PROBE``:
    only asking; ``LEAVING``: I leave now). ``ask`` > 0 asks for a reply that echoes it (``echo``),
    so the asker counts only answers to its latest question, never an older message that crossed it.
    ``ends_in_ms``: milliseconds until the sender's current round's training ends on a shared round clock
    (``round_clock``; negative: it ended that long ago and the sender is in its exchanges), None when it has none or
    does not say (then the entry is left out, or ``NO_CLOCK`` stands in for it where ``began_ms_ago`` follows).
    ``began_ms_ago``: milliseconds since the sender began its current round (``PeerNode.begin_round``), None when it
    does not say: a joiner tells from it whether the round it would join is too far along (``lifecycle.join``)."""

    join_round: int
    current_round: int
    ask: int = 0
    echo: int = 0
    ends_in_ms: int | None = None
    began_ms_ago: int | None = None

    @property
    def ask_reply(self) -> bool:
        return self.ask > 0


@dataclass(frozen=True)
class Ready:
    """A follower to the leader: I am ready for exchange ``key`` of round ``round``."""

    key: str
    round: int


@dataclass(frozen=True)
class Decision:
    """The leader's answer: the group of exchange ``key`` (empty: the sender does not lead it)."""

    key: str
    leader_round: int
    group: tuple[int, ...]


@dataclass(frozen=True)
class Leading:
    """The leader to a follower that asked again: I lead exchange ``key`` and am waiting for its group; my decision
    comes within my grace window (``agreement.Follow`` then waits for it longer than for a leader not there)."""

    key: str
    leader_round: int


@dataclass(frozen=True)
class Abort:
    """The sender abandoned exchange ``key`` (or refuses it: it is not the sender's partner)."""

    key: str


@dataclass(frozen=True)
class StateRequest:
    """Send me your state as ``Data`` chunks of key ``state/rep/<nonce>``."""

    nonce: str


Message = Data | Hello | Ready | Decision | Leading | Abort | StateRequest
CONTROL = (Ready, Decision, Leading, Abort)
"""Messages sent on the control connection."""


@dataclass(frozen=True)
class Send:
    """Action: send ``message`` to ``peer``. ``segment`` (ring all-reduce only) names the part of the
    caller's buffer the payload is a view of, for drivers that send without copying."""

    peer: int
    message: Message
    segment: int | None = None


@dataclass(frozen=True)
class ServeState:
    """Action: ``peer`` asked for this peer's state; answer with ``state_chunks`` (off the receive path)."""

    peer: int
    nonce: str


Action = Send | ServeState


def op_and_round(key: str) -> tuple[str, int]:
    """Header ``op`` and ``round`` of a data key: ``"mix1/12"`` gives ``("mix1", 12)``; unknown prefixes are "monitor"."""
    prefix, _, rest = key.partition("/")
    op = prefix if prefix in DATA_OPS else "monitor"
    number = rest.split("/", 1)[0]
    return op, int(number) if number.isascii() and number.isdigit() else 0  # not "²": isdigit alone admits it


def to_wire(message: Message, sender: int, run_id: str) -> tuple[codec.Header, list[torch.Tensor]]:
    """The codec header and tensors of ``message``."""
    if isinstance(message, Data):
        op, round_index = op_and_round(message.key)
        key, chunk, meta, data = message.key, message.chunk, list(message.meta), message.data
    else:
        data, chunk, round_index = _EMPTY, 0, 0
        if isinstance(message, Hello):
            op, key = "hello", "hello/leave" if message.join_round == LEAVING else f"hello/{message.join_round}"
            meta = [message.join_round, message.current_round, message.ask, message.echo]
            if message.ends_in_ms is not None or message.began_ms_ago is not None:
                meta.append(NO_CLOCK if message.ends_in_ms is None else message.ends_in_ms)
            if message.began_ms_ago is not None:
                meta.append(message.began_ms_ago)
        elif isinstance(message, Ready):
            op, key, meta = "group", message.key, [_READY, message.round]
        elif isinstance(message, Decision):
            op, key = "group", message.key
            if message.group:
                meta = [_DECISION, message.leader_round, digest(message.group), *message.group]
            else:
                meta = [_NOT_LEADING, message.leader_round]
        elif isinstance(message, Leading):
            op, key, meta = "group", message.key, [_LEADING, message.leader_round]
        elif isinstance(message, Abort):
            op, key, meta = "abort", message.key, [0, 0]
        else:
            op, key, meta = "state", f"state/req/{message.nonce}", [0, 0]
        if op != "hello":
            round_index = op_and_round(key)[1]
    header = codec.Header(run=run_id, round=round_index, op=op, chunk=chunk, sender=sender, key=key)
    return header, [torch.tensor(meta, dtype=torch.int64), data]


def from_wire(header: codec.Header, tensors: Sequence[torch.Tensor]) -> Message:
    """The message a decoded codec frame holds; raises ``MalformedMessage`` when it is not a valid one."""
    max_meta = 3 + MAX_GROUP if header.op == "group" else 6 if header.op == "hello" else 4
    if (len(tensors) != 2 or tensors[0].dtype != torch.int64 or tensors[0].dim() != 1
            or not 1 <= tensors[0].numel() <= max_meta or tensors[1].dtype not in PAYLOAD_DTYPES or tensors[1].dim() != 1):
        raise MalformedMessage(f"expected an int64 meta vector (1 to {max_meta} entries) and a 1-d float32 or uint8 chunk")
    meta = [int(v) for v in tensors[0].tolist()]
    op, key = header.op, header.key
    if op_and_round(key)[1] > MAX_KEY_ROUND:  # a reply's header carries it: it must fit one (seed 1928291242)
        raise MalformedMessage(f"key {key[:48]!r} names a round beyond {MAX_KEY_ROUND}")
    if op == "hello":
        if (len(meta) not in (4, 5, 6) or meta[0] < LEAVING or meta[2] < 0 or meta[3] < 0
                or (len(meta) >= 5 and not -MAX_ENDS_IN_MS <= meta[4] <= MAX_ENDS_IN_MS
                    and not (len(meta) == 6 and meta[4] == NO_CLOCK))
                or (len(meta) == 6 and not 0 <= meta[5] <= MAX_ENDS_IN_MS)):
            raise MalformedMessage(f"hello needs [join round >= {LEAVING}, current round, ask id >= 0, echo >= 0] and "
                                   f"optionally [ms left in the round, at most {MAX_ENDS_IN_MS} either way, or "
                                   f"{NO_CLOCK} for none before the next] and [ms since the round began, 0 to "
                                   f"{MAX_ENDS_IN_MS}], got {meta}")
        if len(meta) == 6:
            return Hello(*meta[:4], None if meta[4] == NO_CLOCK else meta[4], meta[5])
        return Hello(*meta)
    if op == "abort":
        return Abort(key)
    if op == "group":
        phase = meta[0]
        if phase == _READY:
            if len(meta) != 2:
                raise MalformedMessage(f"group ready needs [0, round], got {meta}")
            return Ready(key, meta[1])
        if phase == _NOT_LEADING:
            if len(meta) < 2:
                raise MalformedMessage(f"group reply without the leader's round: {meta}")
            return Decision(key, meta[1], ())
        if phase == _LEADING:
            if len(meta) != 2:
                raise MalformedMessage(f"group leading needs [3, leader round], got {meta}")
            return Leading(key, meta[1])
        if phase == _DECISION:
            group = tuple(meta[3:])
            if len(meta) < 4 or meta[2] != digest(group) or len(set(group)) != len(group):
                raise MalformedMessage(f"group decision with a bad member list or digest: {meta[:8]}")
            return Decision(key, meta[1], group)  # in the leader's order: the ring's (agreement.ring_order)
        raise MalformedMessage(f"unknown group phase {phase}")
    if key.startswith("state/req/"):
        return StateRequest(key.removeprefix("state/req/"))
    return Data(key, header.chunk, tuple(meta), tensors[1])
