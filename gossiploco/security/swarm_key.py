"""A run's swarm key: the 32-byte secret that makes a run private.

Everything a private run protects is derived from it with keyed BLAKE2b (one label per use):

* the DHT key its records live under (``dht_key``), so the run cannot be found without it;
* the secret box (XSalsa20-Poly1305) its DHT records are sealed with (``seal``/``unseal``), so
  only key holders can read or write them;
* the identities of a static peer list's ranks (``static_identity``).

Text form: ``gsk1-`` followed by the key in unpadded base64url (48 characters in all), so it can
be pasted into a command line. ``gossiploco keygen`` writes a key file (that text, mode 0600 from
the start); ``--swarm-key`` takes a file or the text itself. A key file tracked by git or accessible
by group or others is refused (``gossiploco.security.key_files.check_key_file``). ``fingerprint`` is safe to print: it identifies
the key without revealing it (to compare keys across machines).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path

import nacl.exceptions
import nacl.secret

from gossiploco.errors import ConfigError, UnsafeKeyFile
from gossiploco.security.identity import Identity
from gossiploco.security.key_files import check_key_file, write_secret_file

TEXT_PREFIX = "gsk1-"


class SwarmKey:
    """A swarm key (see the module docstring). ``SwarmKey.generate()``, ``parse(text)``, ``load(file_or_text)``."""

    def __init__(self, secret: bytes):
        if len(secret) != 32:
            raise ValueError(f"a swarm key has 32 bytes, got {len(secret)}")
        self._secret = bytes(secret)
        self._box = nacl.secret.SecretBox(self.derive(b"records"))

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(os.urandom(32))

    @classmethod
    def parse(cls, text: str) -> SwarmKey:
        text = text.strip()
        if not text.startswith(TEXT_PREFIX):
            raise ValueError(f"a swarm key starts with {TEXT_PREFIX!r}")
        body = text[len(TEXT_PREFIX):]
        try:
            secret = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except ValueError as exc:
            raise ValueError(f"not base64url: {exc}") from None
        return cls(secret)

    @classmethod
    def load(cls, file_or_text: str | Path) -> SwarmKey:
        """The key in file ``file_or_text``, or the key text itself; ``ConfigError("--swarm-key")`` otherwise
        (``UnsafeKeyFile`` for a file tracked by git or accessible by group or others)."""
        text = str(file_or_text)
        try:
            if text.strip().startswith(TEXT_PREFIX):
                return cls.parse(text)
            path = Path(text)
            if not path.is_file():
                raise ValueError(f"no such file: {path} (give a key file from `gossiploco keygen` or the key "
                                 f"text, {TEXT_PREFIX}...)")
            check_key_file(path, "--swarm-key")
            return cls.parse(path.read_text())
        except UnsafeKeyFile:
            raise
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            raise ConfigError("--swarm-key", str(exc)) from None

    def save(self, path: str | Path, *, exclusive: bool = False) -> Path:
        """Write the key file (mode 0600 from the start, atomically); ``exclusive``: ``FileExistsError`` rather
        than replacing a file that exists."""
        path = Path(path)
        write_secret_file(path, self.text + "\n", exclusive=exclusive)
        return path

    @property
    def text(self) -> str:
        return TEXT_PREFIX + base64.urlsafe_b64encode(self._secret).decode().rstrip("=")

    @property
    def fingerprint(self) -> str:
        """8 hex digits naming the key without revealing it."""
        return self.derive(b"fingerprint", 4).hex()

    def derive(self, label: bytes, size: int = 32) -> bytes:
        """A subkey for one use, independent of every other label's."""
        return hashlib.blake2b(label, key=self._secret, digest_size=size, person=b"gossiploco-swarm").digest()

    def dht_key(self, run_id: str, name: str = "peers") -> str:
        """The DHT key of the run's ``name`` records: unguessable without the swarm key."""
        return "gossiploco/" + self.derive(f"dht-key/{run_id}/{name}".encode(), 20).hex()

    def seal(self, plaintext: bytes) -> bytes:
        return bytes(self._box.encrypt(plaintext))

    def unseal(self, sealed: bytes) -> bytes:
        """The plaintext of ``seal``'s output; ``ValueError`` if it was not sealed with this key or was altered."""
        try:
            return self._box.decrypt(sealed)
        except (nacl.exceptions.CryptoError, TypeError, ValueError) as exc:
            raise ValueError(f"not sealed with this swarm key: {exc}") from None

    def static_identity(self, rank: int) -> Identity:
        """The identity of rank ``rank`` of a static peer list (every member can derive every rank's key)."""
        return Identity.from_seed(self.derive(f"static-peer/{rank}".encode()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __reduce__(self):  # rebuilt from the secret where a DHT process is spawned rather than forked
        return SwarmKey, (self._secret,)

    def __repr__(self) -> str:
        return f"SwarmKey({self.fingerprint})"


OPEN_KEY = SwarmKey(bytes(32))
"""The well-known key of open runs (``--open``): its derivations keep the code paths uniform and
protect nothing, since everybody knows it."""
