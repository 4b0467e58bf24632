"""Membership: finding the peers of a run (the only package that imports hivemind).

``directory`` holds the ``Directory`` interface with its in-memory and hivemind-DHT
implementations; ``bootstrap`` starts the DHT node new peers join through. hivemind is imported
on first use of the DHT, so importing this package is cheap.
"""

from gossiploco.membership.bootstrap import load_or_create_identity, serve_bootstrap, start_bootstrap
from gossiploco.membership.directory import (
    PROTOCOL_VERSION,
    DhtDirectory,
    Directory,
    DirectoryClosed,
    DirectoryError,
    IncompatibleRecord,
    MemoryDirectory,
    MemoryDirectoryHub,
    PeerRecord,
)

__all__ = [
    "PROTOCOL_VERSION",
    "DhtDirectory",
    "Directory",
    "DirectoryClosed",
    "DirectoryError",
    "IncompatibleRecord",
    "MemoryDirectory",
    "MemoryDirectoryHub",
    "PeerRecord",
    "load_or_create_identity",
    "serve_bootstrap",
    "start_bootstrap",
]
