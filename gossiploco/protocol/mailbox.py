"""Bounded storage for data chunks that arrived before anyone waits for them.

Chunks are keyed by ``(exchange key, sender, chunk index)``; a duplicate replaces the earlier
copy (duplicates and reordering cost nothing). The total payload held is at most ``limit_bytes``:
past that, whole keys nobody is waiting on (not ``active``) are evicted, oldest arrival first,
and if that is not enough the incoming chunk is dropped. One sender holds at most
``sender_limit_bytes`` (so one peer cannot fill the mailbox and evict everyone else's chunks):
past that its incoming chunks are dropped. Both are counted and returned so the
owner can log them. Pure data structure: times are passed in, nothing blocks.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from gossiploco.protocol.messages import Data

@dataclass
class Mail:
    """One stored chunk."""

    message: Data
    arrived: float

    @property
    def nbytes(self) -> int:
        return self.message.data.numel() * self.message.data.element_size()


class Mailbox:
    """Chunks waiting for their taker; see the module docstring."""

    def __init__(self, limit_bytes: int, sender_limit_bytes: int | None = None):
        self.limit_bytes = limit_bytes
        self.sender_limit_bytes = limit_bytes if sender_limit_bytes is None else sender_limit_bytes
        self.bytes = 0
        self._by_sender: dict[int, int] = {}
        self.dropped = 0
        """Chunks dropped or evicted because the mailbox was full."""
        self._boxes: dict[str, dict[tuple[int, int], Mail]] = {}

    def put(self, sender: int, message: Data, now: float, active: Container[str]) -> list[str]:
        """File ``message``; returns a line per key evicted or chunk dropped to stay within the limit."""
        mail = Mail(message, now)
        notes: list[str] = []
        if self.bytes + mail.nbytes > self.limit_bytes:
            notes += self._evict(mail.nbytes, active)
        old = self._boxes.get(message.key, {}).get((sender, message.chunk))
        held = self._by_sender.get(sender, 0) - (old.nbytes if old is not None else 0)
        if held + mail.nbytes > self.sender_limit_bytes:
            self.dropped += 1
            notes.append(f"{sender} holds {held} bytes of early chunks already (at most {self.sender_limit_bytes}); "
                         f"dropped chunk {message.chunk} of {message.key!r}")
            return notes
        if self.bytes + mail.nbytes > self.limit_bytes:
            self.dropped += 1
            notes.append(f"mailbox full ({self.bytes} bytes); dropped chunk {message.chunk} of {message.key!r} from {sender}")
            return notes
        box = self._boxes.setdefault(message.key, {})
        old = box.pop((sender, message.chunk), None)
        if old is not None:
            self._forget(sender, old)
        box[(sender, message.chunk)] = mail
        self.bytes += mail.nbytes
        self._by_sender[sender] = self._by_sender.get(sender, 0) + mail.nbytes
        return notes

    def _forget(self, sender: int, mail: Mail) -> None:
        self.bytes -= mail.nbytes
        left = self._by_sender.get(sender, 0) - mail.nbytes
        if left > 0:
            self._by_sender[sender] = left
        else:
            self._by_sender.pop(sender, None)

    def take(self, key: str, sender: int, chunk: int) -> Data | None:
        """Remove and return chunk ``chunk`` of ``key`` from ``sender``, if it is here."""
        box = self._boxes.get(key)
        mail = box.pop((sender, chunk), None) if box else None
        if mail is None:
            return None
        self._forget(sender, mail)
        return mail.message

    def senders(self, key: str) -> set[int]:
        """Who has chunks of ``key`` waiting here."""
        return {sender for sender, _ in self._boxes.get(key, {})}

    def lists(self, key: str, senders: Container[int]) -> dict[int, object]:
        """The member-list digest (``meta[2]``) on a waiting chunk of ``key`` from each of ``senders`` that sent one."""
        return {sender: mail.message.meta[2] for (sender, _), mail in self._boxes.get(key, {}).items()
                if sender in senders and len(mail.message.meta) >= 3}

    def discard(self, key: str, senders: Container[int] | None = None) -> int:
        """Drop the chunks of ``key`` (only those from ``senders`` if given); returns how many."""
        box = self._boxes.get(key)
        if not box:
            return 0
        gone = [slot for slot in box if senders is None or slot[0] in senders]
        for slot in gone:
            self._forget(slot[0], box.pop(slot))
        if not box:
            del self._boxes[key]
        return len(gone)

    def __len__(self) -> int:
        return sum(len(box) for box in self._boxes.values())

    def _evict(self, needed: int, active: Container[str]) -> list[str]:
        idle = sorted((k for k in self._boxes if k not in active),
                      key=lambda k: min((m.arrived for m in self._boxes[k].values()), default=0.0))
        notes = []
        for key in idle:
            if self.bytes + needed <= self.limit_bytes:
                break
            count = self.discard(key)
            self.dropped += count
            notes.append(f"mailbox full; evicted {count} unclaimed chunk(s) of {key!r}")
        return notes
