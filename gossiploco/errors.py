"""The one error tree of gossiploco.

    GossiplocoError                 base of everything raised on purpose
    ├── ConfigError                 a config field or CLI flag is wrong (the message names the field)
    │   ├── RunMismatch             a run with other settings is going in the swarm this peer joins
    │   └── UnsafeKeyFile           a key file is tracked by git or readable by others (refused, with the fix)
    ├── DataError                   the corpus is missing, empty, unreadable or too short
    ├── DirectoryError              the peer directory (hivemind DHT) cannot start or be joined
    │   └── DirectoryClosed         this side's directory was closed
    └── ExchangeError               a collective with other peers did not complete
        ├── ExchangeTimeout         a peer did not answer within its deadline (remote fault: "broken")
        ├── PeerFailed              a peer is known to be gone or sent something invalid (remote fault)
        │   └── MalformedMessage    a message failed wire-format validation (gossiploco.protocol.codec)
        └── ExchangeClosed          this side's exchange was closed (local misuse or shutdown)
            └── ExchangeBroken      this side's transport died (a driver thread crashed): the peer must stop
                └── CompanionDied   the companion process running this peer's exchange is gone (or its trainer)

Remote faults (``ExchangeTimeout``, ``PeerFailed``) are expected in a decentralized run: the
mixing layer records them and falls back to identity for that exchange, so they never
propagate through the training loop. ``ExchangeClosed`` means we were shutting down or
misused the object; it is raised, not swallowed.
"""

from __future__ import annotations

import re

_PARTICULARS = re.compile(r"0x[0-9a-fA-F]+|\\x[0-9a-fA-F]{2}|-?[0-9]+|'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|b'[^']*'")


class GossiplocoError(Exception):
    """Base class of every error gossiploco raises on purpose."""


class ConfigError(GossiplocoError, ValueError):
    """A configuration field or command-line flag has an invalid value."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class UnsafeKeyFile(ConfigError):
    """A secret key file that may not be used: tracked by git, or accessible by group or others
    (``gossiploco.security.key_files.check_key_file``). ``fix`` says what to do about it."""

    def __init__(self, field: str, problem: str, fix: str):
        self.fix = fix
        super().__init__(field, f"{problem}. Fix: {fix}")


class RunMismatch(ConfigError):
    """The swarm a peer joins already runs a run with other settings than the peer's (the message names
    every differing field and how to fix it; ``runtime.run_match``)."""

    def __init__(self, message: str):
        super().__init__("run", message)


class DataError(GossiplocoError):
    """The training data is missing, empty or unusable."""


class DirectoryError(GossiplocoError):
    """The peer directory could not be started or joined (the message says what to check)."""


class DirectoryClosed(DirectoryError):
    """The directory was closed; the call cannot proceed."""


class ExchangeError(GossiplocoError):
    """A collective exchange with other peers did not complete."""


class AddressInUse(ExchangeError):
    """The address a peer's exchange binds is taken by another process (its ``--port``, or a port it picked for itself
    that another process took first)."""


class ExchangeTimeout(ExchangeError):
    """A peer did not answer before the exchange's deadline."""


class NoDecision(ExchangeTimeout):
    """A follower heard no decision from its group's leader within its wait (``protocol.agreement.Follow``): the
    leader is dead, frozen or late, and every member of its bucket that followed it fails alike."""


class PeerFailed(ExchangeError):
    """A peer is gone, or sent something that failed validation."""


class MalformedMessage(PeerFailed):
    """A peer sent a message that failed validation (remote fault: the exchange falls back to identity)."""

    @property
    def reason(self) -> str:
        """The message without its particulars (numbers, quoted values, lists), to count alike rejections together."""
        return _PARTICULARS.sub("#", str(self))[:80]


class ExchangeClosed(ExchangeError):
    """The local exchange was closed; the call cannot proceed."""


class ExchangeBroken(ExchangeClosed):
    """The local transport died (one of its threads crashed); no exchange can work, so the peer stops
    with this error instead of training on with silent identity mixing."""


class CompanionDied(ExchangeBroken):
    """The other side of a trainer-companion channel is gone, or stopped answering (``gossiploco.companion``):
    no later exchange can succeed without it, so the peer stops with this error."""
