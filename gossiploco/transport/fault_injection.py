"""Fault injection for tests: a process that signals itself in the middle of a real exchange.

``GOSSIPLOCO_FAULT=SIGNAL:KEY:CHUNK`` (``KILL:mix1/2:3``) makes a peer send itself SIGNAL just
before it sends chunk CHUNK of exchange KEY. Unset in normal use: ``Fault.from_env()`` is then
None and the send path pays one ``is None`` check.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from gossiploco.protocol.messages import Data, Message

log = logging.getLogger(__name__)

FAULT_ENV = "GOSSIPLOCO_FAULT"


def parse_fault(spec: str | None) -> tuple[int, str, int] | None:
    """(signal number, exchange key, chunk) of a ``FAULT_ENV`` value; None when unset."""
    if not spec:
        return None
    try:
        name, key, chunk = spec.rsplit(":", 2)
        return int(getattr(signal, f"SIG{name.upper()}")), key, int(chunk)
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected SIGNAL:KEY:CHUNK, e.g. KILL:mix1/2:3") from exc


@dataclass(frozen=True)
class Fault:
    signum: int
    key: str
    chunk: int

    @classmethod
    def from_env(cls) -> Fault | None:
        parsed = parse_fault(os.environ.get(FAULT_ENV))
        return cls(*parsed) if parsed is not None else None

    def before_send(self, rank: int, message: Message) -> None:
        """Signal this process if ``message`` is the chunk the fault names."""
        if isinstance(message, Data) and (message.key, message.chunk) == (self.key, self.chunk):
            log.warning("rank %d: %s: raising signal %d before chunk %d of %r", rank, FAULT_ENV, self.signum,
                        message.chunk, message.key)
            os.kill(os.getpid(), self.signum)
