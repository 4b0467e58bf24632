"""A local TCP port that accepts any number of connections and keeps what each sends (the far end of relayed
streams in ``tests/test_relay.py`` and ``bench/attacks_relay.py``)."""

from __future__ import annotations

import socket
import threading

from gossiploco.runtime.launch import free_ports


class Sink:
    """A local port accepting any number of connections and keeping what each sends."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", free_ports(1)[0]))
        self.port = self.server.getsockname()[1]
        self.received: list[bytearray] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            data = bytearray()
            self.received.append(data)
            threading.Thread(target=self._read, args=(conn, data), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, data: bytearray) -> None:
        with conn:
            while chunk := conn.recv(1 << 16):
                data.extend(chunk)

    def close(self) -> None:
        self.server.close()
