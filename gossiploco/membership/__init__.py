"""Membership: finding the peers of a run (the only package that imports hivemind).

``record`` is what a peer tells its run about itself (``PeerRecord``, validated strictly), ``runs``
what it tells every run of the swarm (its run's id and settings, ``RunEntry``), ``status`` what it
shows observers (``StatusEntry``); ``record_validator`` is the hook every DHT node runs on every
record (signed, sealed; run and status entries checked against their formats). ``directory``
holds the ``Directory`` interface, ``memory_directory`` and ``dht_directory`` its in-memory and
hivemind-DHT implementations (``dht_entries``: how every kind of entry is stored in a DHT node and
read back validated); ``bootstrap`` starts the DHT node new peers join through, and in a private
swarm publishes its ``beacon``;
``lifeline`` makes the DHT's processes (hivemind's DHT process and its p2pd) die with the process
that started them, even when it is SIGKILLed. hivemind is imported on first use of the DHT, so importing this package is
cheap (``lifeline`` imports hivemind and is not imported here).
"""

from gossiploco.membership.bootstrap import load_or_create_identity, serve_bootstrap, start_bootstrap
from gossiploco.errors import DirectoryClosed, DirectoryError
from gossiploco.membership.dht_directory import DhtDirectory
from gossiploco.membership.directory import Directory
from gossiploco.membership.memory_directory import MemoryDirectory, MemoryDirectoryHub
from gossiploco.membership.record import PROTOCOL_VERSION, IncompatibleRecord, PeerRecord

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
