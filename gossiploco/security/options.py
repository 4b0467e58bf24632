"""From the command line's security options to a ``Trust`` (and back, for launchers).

``gossiploco peer`` takes ``--swarm-key FILE_OR_TEXT`` (a private run, the default and the only
kind a peer joins without saying otherwise) or ``--open`` (a public run: identities are still
authenticated and the data plane encrypted, but anyone can join and affect the model), and
``--identity FILE`` (created on first use) for peers found through the DHT. Giving neither
``--swarm-key`` nor ``--open`` is an error that says what to do.

``gossiploco dht`` makes the run's key (``bootstrap_swarm_key``): with ``--swarm-key FILE`` that
file (created when missing), with the gsk1-... text that key, and without the option the user's
own key in ``user_key_dir()/swarm.key`` (``~/.config/gossiploco/swarm.key``), created on the first
start and reused, saying so, on the next ones. It never takes a ``swarm.key`` from the current
directory: a checkout's copy would be a key everyone with the repository has.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gossiploco.errors import ConfigError
from gossiploco.security.identity import Identity
from gossiploco.security.key_files import commit_warning, user_key_dir
from gossiploco.security.swarm_key import SwarmKey
from gossiploco.security.trust import Trust

log = logging.getLogger(__name__)

OPEN_RUN_WARNING = ("open run (--open): anyone who reaches a peer can join this run and any member can affect the "
                    "model; identities are authenticated and traffic is encrypted, membership is not restricted")


def swarm_key_option(swarm_key: str | None, open_run: bool) -> SwarmKey | None:
    """The run's swarm key, or None for an open run; ``ConfigError`` when the two options disagree."""
    if swarm_key and open_run:
        raise ConfigError("--open", "give either --swarm-key (a private run) or --open (a public run), not both")
    if open_run:
        log.warning(OPEN_RUN_WARNING)
        return None
    if not swarm_key:
        raise ConfigError("--swarm-key", "runs are private: give the run's swarm key (the file `gossiploco dht` or "
                                         "`gossiploco keygen` wrote, or the gsk1-... text it printed), or --open "
                                         "to take part in a public run")
    return SwarmKey.load(swarm_key)


USER_SWARM_KEY = "swarm.key"
"""The name of the user's own swarm key in ``user_key_dir()``."""


def bootstrap_swarm_key(swarm_key: str | None) -> tuple[SwarmKey, str]:
    """The swarm key of ``gossiploco dht`` (see the module docstring) and a line saying where it came from
    (created, or which existing file it reuses); ``ConfigError`` for a key file that cannot be used."""
    if swarm_key and swarm_key.strip().startswith("gsk1-"):
        key = SwarmKey.load(swarm_key)
        return key, f"using swarm key {key.fingerprint} given as text (--swarm-key)"
    path = Path(swarm_key) if swarm_key else user_key_dir() / USER_SWARM_KEY
    if not path.exists():
        key = SwarmKey.generate()
        try:
            key.save(path, exclusive=True)
            note = (f"created a new {'per-user ' if not swarm_key else ''}swarm key {key.fingerprint} in {path}"
                    + ("; later starts without --swarm-key reuse it (delete it for a new one)" if not swarm_key else ""))
            warning = commit_warning(path)
            return key, note + (f"\nwarning: {warning}" if warning else "")
        except FileExistsError:  # another start made it a moment ago: fall through and use that one
            pass
    key = SwarmKey.load(path)
    if not swarm_key:
        return key, (f"reusing your per-user swarm key {key.fingerprint} from {path} (made by an earlier "
                     f"`gossiploco dht`; delete it for a new key, or pass --swarm-key FILE)")
    return key, f"using the existing swarm key {key.fingerprint} from {path} (--swarm-key)"


def peer_trust(swarm: SwarmKey | None, *, identity_file: Path | None = None,
               static_rank: int | None = None, static_count: int | None = None) -> Trust:
    """A static list's rank ``static_rank`` of ``static_count`` (identities derived from the key), or a
    DHT peer with the identity kept in ``identity_file``."""
    if static_count is not None:
        if static_rank is None or not 0 <= static_rank < static_count:
            raise ConfigError("--rank", f"must be in 0..{static_count - 1}, got {static_rank}")
        return Trust.static(swarm, static_rank, static_count)
    if identity_file is None:
        raise ConfigError("--identity", "a peer that joins through the DHT needs an identity key file")
    return Trust(Identity.load_or_create(identity_file), swarm)


def ordered_identities(count: int, directory: Path, name: str = "identity.key") -> list[Path]:
    """``count`` identity files ``directory/peer-I/name`` whose peer ids increase with I (for
    launchers and tests that compare a swarm with the virtual one, where order matters). When all
    of them exist they are kept (a restart keeps its peer id); otherwise all are made anew."""
    paths = [directory / f"peer-{i}" / name for i in range(count)]
    if all(p.exists() for p in paths):
        return paths
    identities = sorted((Identity.generate() for _ in range(count)), key=lambda identity: identity.peer_id)
    for path, identity in zip(paths, identities):
        identity.save(path)
    return paths
