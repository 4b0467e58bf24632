"""``gossiploco peer`` with a longer ZeroMQ heartbeat timeout (``bench/netem.py --heartbeat-timeout-s``).

The runtime drops a connection when no whole message arrives within
``zmq_exchange.HEARTBEAT_TIMEOUT_MS`` (5 s) of a heartbeat; libzmq counts complete messages, not
bytes, so on a congested slow link a healthy connection can be dropped in the middle of a chunk
(and the exchange then fails). This wrapper sets that constant from ``GOSSIPLOCO_NETEM_HEARTBEAT_MS``
before the CLI builds any socket; everything else is the unchanged ``gossiploco peer``.

    GOSSIPLOCO_NETEM_HEARTBEAT_MS=60000 python bench/netem_peer.py peer --rank 0 --peers ... (same arguments)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gossiploco.transport import zmq_exchange  # noqa: E402

value = os.environ.get("GOSSIPLOCO_NETEM_HEARTBEAT_MS")
if value:
    zmq_exchange.HEARTBEAT_TIMEOUT_MS = int(value)

from gossiploco.cli import app  # noqa: E402

app(prog_name="gossiploco")
