"""Link probes run inside the namespaces that ``bench/netem.py`` builds (one process per namespace).

``ring``: time the project's own ring all-reduce (``ZmqExchange.all_reduce_mean``, the code Mix1
and DiLoCo's Mix2 run) of ``--numel`` fp32 values among the peers, ``--repeats`` times, each
after a tiny barrier all-reduce so every peer starts together. Writes the seconds per repeat to
``--out`` (JSON). The effective rate is ``2 (M - 1) / M * 4 * numel * 8 / seconds`` bit/s of
payload, to compare with the shaped rate of the link.

``sample`` (in the switch namespace): the byte counters of every switch port every
``--interval-s`` (JSON lines), to see when each link is busy during a run.

``tcp-server`` / ``tcp-client``: one raw TCP stream (no ZeroMQ, no Python tensors) for
``--seconds``; the server writes the goodput it received to ``--out``. It shows what a single
TCP flow can get out of the shaped link (at MTU 1500 at most 1448 / 1514 = 95.6% of the rate
that tc enforces on whole Ethernet frames).

    python bench/netem_probe.py ring --rank 0 --peers tcp://10.77.0.1:6900,... --numel 1672896 --out r0.json
    python bench/netem_probe.py tcp-server --host 10.77.0.2 --port 6800 --out tcp.json
    python bench/netem_probe.py tcp-client --host 10.77.0.2 --port 6800 --seconds 4
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def ring(args: argparse.Namespace) -> int:
    import torch

    from gossiploco.config import TransportConfig
    from gossiploco.transport.zmq_exchange import ZmqExchange

    torch.set_num_threads(1)
    endpoints = args.peers.split(",")
    transport = TransportConfig(chunk_mb=args.chunk_mb)  # messages up to the peers' default 64 MiB
    chunk = int(transport.chunk_mb * (1 << 20)) // 4 * 4
    ex = ZmqExchange(args.rank, endpoints, "netem-ring", args.timeout_s,
                     max_message_bytes=int(transport.max_message_mb * (1 << 20)), chunk_bytes=chunk)
    members = list(range(len(endpoints)))
    seconds: list[float] = []
    trace: list[tuple[str, int, float]] = []
    if args.trace:  # when each message of the timed all-reduces was sent and arrived (per-step timing)
        send, take = ex._send, ex._take_data

        def traced_send(peer, key, chunk, *a, **kw):
            trace.append(("send", chunk, time.perf_counter()))
            return send(peer, key, chunk, *a, **kw)

        def traced_take(key, sender, chunk, *a, **kw):
            out = take(key, sender, chunk, *a, **kw)
            trace.append(("recv", chunk, time.perf_counter()))
            return out

        ex._send, ex._take_data = traced_send, traced_take
    try:
        if not ex.wait_connected(args.timeout_s):
            print(f"rank {args.rank}: peers not connected after {args.timeout_s}s", file=sys.stderr)
            return 1
        flat = torch.full((args.numel,), float(args.rank + 1))
        tiny = torch.zeros(1)
        for k in range(args.repeats):
            ex.all_reduce_mean(f"barrier/{k}", tiny, members)
            t = time.perf_counter()
            trace.append(("start", k, t))
            out = ex.all_reduce_mean(f"mix1/{k}", flat, members)
            seconds.append(time.perf_counter() - t)
            expected = sum(range(1, len(endpoints) + 1)) / len(endpoints)
            if abs(float(out[0]) - expected) > 1e-4 or abs(float(out[-1]) - expected) > 1e-4:
                print(f"rank {args.rank}: wrong all-reduce result {float(out[0])} != {expected}", file=sys.stderr)
                return 1
        ex.all_reduce_mean("barrier/end", tiny, members)
    finally:
        ex.close(linger_s=0.5)
    Path(args.out).write_text(json.dumps({"rank": args.rank, "numel": args.numel, "workers": len(endpoints),
                                          "seconds": seconds, "trace": trace}))
    return 0


def tcp_server(args: argparse.Namespace) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((args.host, args.port))
    srv.listen(1)
    srv.settimeout(args.timeout_s)
    conn, _ = srv.accept()
    conn.settimeout(args.timeout_s)
    received, first, last = 0, None, None
    with conn, srv:
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                received += len(data)  # bytes after the first read, over the time after it
            last = now
    if first is None or last is None or last <= first:
        print("tcp-server: nothing received", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps({"bytes": received, "seconds": last - first,
                                          "mbps": received * 8 / (last - first) / 1e6}))
    return 0


def tcp_client(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout_s
    while True:  # the server may not listen yet
        try:
            conn = socket.create_connection((args.host, args.port), timeout=2.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    buf = b"\0" * (1 << 16)
    conn.settimeout(args.timeout_s)
    start = time.monotonic()
    with conn:
        while time.monotonic() - start < args.seconds:
            conn.sendall(buf)
        conn.shutdown(socket.SHUT_WR)  # the server's byte count ends when the queued data has arrived
        conn.recv(1)
    return 0


def sample(args: argparse.Namespace) -> int:
    """Every ``--interval-s``, the byte counters of every interface of this namespace (the switch's
    veths: rx = what the peer sent, tx = what it received), one JSON line per sample, until killed."""
    net = Path("/sys/class/net")
    devs = sorted(d.name for d in net.iterdir() if d.name not in ("lo", "br0"))
    with open(args.out, "w") as out:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            row = {"t": time.time()}
            for dev in devs:
                stats = net / dev / "statistics"
                row[dev] = [int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())]
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(args.interval_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ring")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", required=True)
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-mb", type=float, default=4.0, help="transport.chunk_mb (the peers' must match).")
    p.add_argument("--trace", action="store_true", help="Record when each message was sent and taken.")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("tcp-server")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=6800)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("tcp-client")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=6800)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p = sub.add_parser("sample")
    p.add_argument("--interval-s", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return {"ring": ring, "tcp-server": tcp_server, "tcp-client": tcp_client, "sample": sample}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
