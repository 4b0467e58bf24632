"""A peer's identity: one Ed25519 key pair, its Curve25519 twin, and the peer id derived from it.

The Ed25519 key signs the peer's DHT records (``gossiploco.membership.record_validator``); its Curve25519
conversion (libsodium's ``crypto_sign_ed25519_*_to_curve25519``, through PyNaCl) is the peer's
CurveZMQ key on the data plane. The peer id is a hash of the Curve25519 public key, so nobody can
claim an id without the key behind it, and a receiver checks any connection's id from the key the
CURVE handshake proved (``peer_id_of``).

The key file holds the 32-byte Ed25519 seed, base64 on one line with a header, mode 0600, written
atomically (``gossiploco.security.key_files.write_secret_file``), created on first use. A file that
exists but cannot be read as a key is an error, never silently replaced: that would change the
peer's id. A key file tracked by git or accessible by group or others is refused
(``key_files.check_key_file``), with the fix in the error.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import nacl.exceptions
import nacl.signing

from gossiploco.errors import ConfigError
from gossiploco.protocol.messages import MAX_PEER_ID
from gossiploco.security.key_files import check_key_file, write_secret_file

KEY_HEADER = "gossiploco-identity-v1"
_ID_PERSON = b"gossiploco-peer"


def peer_id_of(curve_public: bytes) -> int:
    """The peer id of the holder of ``curve_public`` (a 32-byte Curve25519 public key)."""
    digest = hashlib.blake2b(curve_public, digest_size=8, person=_ID_PERSON).digest()
    return int.from_bytes(digest, "big") % MAX_PEER_ID


def curve_public_of(sign_public: bytes) -> bytes:
    """The Curve25519 public key of an Ed25519 public key; ``ValueError`` if it is not one."""
    try:
        return bytes(nacl.signing.VerifyKey(sign_public).to_curve25519_public_key())
    except (nacl.exceptions.CryptoError, TypeError, ValueError) as exc:
        raise ValueError(f"not an Ed25519 public key: {exc}") from None


def verify(sign_public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``sign_public``'s Ed25519 signature of ``message``."""
    try:
        nacl.signing.VerifyKey(sign_public).verify(message, signature)
        return True
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError, TypeError, ValueError):
        return False


class Identity:
    """One peer's key pair. ``Identity.generate()``, ``from_seed(seed)`` or ``load_or_create(path)``."""

    def __init__(self, seed: bytes):
        if len(seed) != 32:
            raise ValueError(f"an identity seed has 32 bytes, got {len(seed)}")
        self.seed = bytes(seed)
        self._signing = nacl.signing.SigningKey(self.seed)
        self.sign_public = bytes(self._signing.verify_key)
        self.curve_secret = bytes(self._signing.to_curve25519_private_key())
        self.curve_public = bytes(self._signing.verify_key.to_curve25519_public_key())
        self.peer_id = peer_id_of(self.curve_public)

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(32))

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(seed)

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """The identity kept in ``path``, created there (mode 0600) if the file does not exist. ``UnsafeKeyFile``
        for a file tracked by git or accessible by others; ``ConfigError`` for one that holds no identity."""
        path = Path(path)
        if not path.exists():
            identity = cls.generate()
            try:
                write_secret_file(path, identity._file_text(), exclusive=True)
                return identity
            except FileExistsError:  # another process made it a moment ago: that one is the identity
                pass
        check_key_file(path, "--identity")
        try:
            header, body = path.read_text().split()
            if header != KEY_HEADER:
                raise ValueError(f"first line is not {KEY_HEADER!r}")
            return cls(base64.b64decode(body, validate=True))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError("--identity", f"{path} is not a gossiploco identity key file ({exc}); "
                                            "move it away to create a new identity (a new peer id)") from None

    def save(self, path: str | Path) -> Identity:
        """Write the key file (mode 0600, atomically); returns this identity."""
        write_secret_file(Path(path), self._file_text())
        return self

    def _file_text(self) -> str:
        return f"{KEY_HEADER}\n{base64.b64encode(self.seed).decode()}\n"

    def sign(self, message: bytes) -> bytes:
        return self._signing.sign(message).signature

    def __reduce__(self):  # rebuilt from the seed where a DHT process is spawned rather than forked
        return Identity, (self.seed,)

    def __repr__(self) -> str:
        return f"Identity(peer {self.peer_id})"
