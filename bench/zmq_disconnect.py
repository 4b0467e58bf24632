"""Does libzmq stop redialing an endpoint after ``zmq_disconnect``? It depends on whether the socket is used after.

    python -m bench.zmq_disconnect

For a ROUTER and a DEALER (libzmq's default reconnect settings): connect to a listening DEALER, close the listener
(the connection drops and libzmq starts redialing), ``disconnect`` the endpoint, then count for 2 s the TCP
connections made to that port (a plain listener there accepts and closes them), once with the socket left idle and
once with it polled every millisecond (as the receiving thread polls the ROUTER). libzmq carries out a disconnect
when the socket's thread next processes commands, which any call on the socket does. Prints one line per case.
"""

from __future__ import annotations

import socket
import time

import zmq


def _count(port: int, seconds: float, poke: zmq.Socket | None) -> int:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    server.settimeout(0.05)
    count, end = 0, time.monotonic() + seconds
    with server:
        while time.monotonic() < end:
            if poke is not None:
                poke.poll(1)
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            count += 1
            conn.close()
    return count


def attempts_after_disconnect(kind: int, polled: bool, seconds: float = 2.0) -> int:
    ctx = zmq.Context.instance()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    listener = ctx.socket(zmq.DEALER)
    listener.setsockopt(zmq.LINGER, 0)
    listener.bind(endpoint)
    sock.connect(endpoint)
    time.sleep(0.3)
    listener.close()
    time.sleep(0.3)
    sock.disconnect(endpoint)
    try:
        return _count(port, seconds, sock if polled else None)
    finally:
        sock.close()


def main() -> None:
    print(f"libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}")
    for kind, name in ((zmq.ROUTER, "ROUTER"), (zmq.DEALER, "DEALER")):
        for polled in (False, True):
            print(f"{name}, {'polled' if polled else 'idle'} after disconnect: "
                  f"{attempts_after_disconnect(kind, polled)} connection attempts in 2 s")


if __name__ == "__main__":
    main()
