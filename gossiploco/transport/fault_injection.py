"""Fault injection for tests: a process that signals itself in the middle of a real exchange.

``GOSSIPLOCO_FAULT=SIGNAL:KEY:CHUNK`` (``KILL:mix1/2:3``) makes a peer send itself SIGNAL just
before it sends chunk CHUNK of exchange KEY. The variable is read once, where the peer process is
built (``gossiploco peer``: ``Fault.from_env()``), and the fault goes down to the exchange as its
``fault`` hook (a ``SendHook``: ``Fault.before_send``); nothing below reads the environment. Unset in
normal use: there is no hook and the send path pays one ``is None`` check.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from gossiploco.errors import ConfigError
from gossiploco.protocol.messages import Data, Message

log = logging.getLogger(__name__)

FAULT_ENV = "GOSSIPLOCO_FAULT"

SendHook = Callable[[int, Message], None]
"""Called by an exchange as ``hook(its rank, message)`` on the sending thread just before each message
is encoded and sent; it may act on the process (a signal) but must not block."""


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
        """The fault ``FAULT_ENV`` names in this process's environment (None when unset); ``ValueError`` if malformed."""
        parsed = parse_fault(os.environ.get(FAULT_ENV))
        return cls(*parsed) if parsed is not None else None

    def before_send(self, rank: int, message: Message) -> None:
        """Signal this process if ``message`` is the chunk the fault names."""
        if isinstance(message, Data) and (message.key, message.chunk) == (self.key, self.chunk):
            log.warning("rank %d: %s: raising signal %d before chunk %d of %r", rank, FAULT_ENV, self.signum,
                        message.chunk, message.key)
            os.kill(os.getpid(), self.signum)


def hook_from_env() -> SendHook | None:
    """The ``SendHook`` of the fault ``FAULT_ENV`` names (None when unset), for the code that builds a peer
    process (``gossiploco peer``). Raises ``ConfigError`` for a malformed value."""
    try:
        fault = Fault.from_env()
    except ValueError as exc:
        raise ConfigError(FAULT_ENV, str(exc)) from None
    return fault.before_send if fault is not None else None
