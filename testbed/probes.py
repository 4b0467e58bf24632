"""Link probes: one process per namespace, started by a benchmark (``python -m testbed.probes KIND --help``).

- ``ring``: times the project's ring all-reduce (``ZmqExchange.all_reduce_mean``, the code Mix1 and
  DiLoCo's Mix2 run) among every peer, per transport (plain: ``trust=None``; curve: CurveZMQ with
  ``Trust.static``), and checks the mean;
- ``swap``: the heartbeat check: ranks 0 and 1 swap a payload with ``ZmqExchange.swap`` in chunks, with
  a given heartbeat timeout, and report whether the connection survived;
- ``tcp-server`` / ``tcp-client``: one raw TCP stream (no ZeroMQ): what a single flow gets out of a link;
- ``sample``: every interface's byte counters of this namespace at an interval (JSON lines).

Each writes its result to ``--out`` (JSON) and exits 0, or exits non-zero when it cannot report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RING_PORT = 6900
TCP_PORT = 6800


def _exchange(rank: int, peers: str, run_id: str, timeout_s: float, chunk_mb: float, heartbeat_s: float | None = None,
              swarm_key: str | None = None):
    """A ``ZmqExchange`` among ``peers`` (comma-separated endpoints) with the peers' transport settings;
    plaintext, or CurveZMQ with a static list's identities when ``swarm_key`` (a key file) is given."""
    from gossiploco.config import TransportConfig
    from gossiploco.transport.zmq_exchange import ZmqExchange

    trust = None
    if swarm_key:
        from gossiploco.security.swarm_key import SwarmKey
        from gossiploco.security.trust import Trust

        trust = Trust.static(SwarmKey.load(swarm_key), rank, len(peers.split(",")))
    transport = TransportConfig(chunk_mb=chunk_mb)  # messages up to the peers' default 64 MiB
    return ZmqExchange(rank, peers.split(","), run_id, timeout_s, max_message_bytes=int(transport.max_message_mb * (1 << 20)),
                       chunk_bytes=int(transport.chunk_mb * (1 << 20)) // 4 * 4, heartbeat_s=heartbeat_s, trust=trust)


def ring_side(args: argparse.Namespace) -> int:
    """Time ``--repeats`` ring all-reduces of ``--numel`` fp32 (``ZmqExchange.all_reduce_mean``, the code
    Mix1 and DiLoCo's Mix2 run) per transport of ``--security``, each after a tiny barrier all-reduce on
    the same exchange so every peer starts together; check the mean; write the seconds per repeat to
    ``--out``. Transport i listens on ``--port`` + i; with several they alternate, the order swapping
    every repeat."""
    import torch

    torch.set_num_threads(1)
    security = [m for m in args.security.split(",") if m]
    if "curve" in security and not args.swarm_key:
        print("--security curve needs --swarm-key", file=sys.stderr)
        return 2
    hosts = args.hosts.split(",")
    members = list(range(len(hosts)))
    exchanges = {}
    seconds: dict[str, list[float]] = {mode: [] for mode in security}
    cpu: dict[str, list[float]] = {mode: [] for mode in security}  # this process's CPU seconds (all threads)
    try:
        for i, mode in enumerate(security):
            peers = ",".join(f"tcp://{h}:{args.port + i}" for h in hosts)
            exchanges[mode] = _exchange(args.rank, peers, f"netem-ring-{mode}", args.timeout_s, args.chunk_mb,
                                        swarm_key=args.swarm_key if mode == "curve" else None)
        for mode, ex in exchanges.items():
            if not ex.wait_connected(args.timeout_s):
                print(f"rank {args.rank}: peers not connected ({mode}) after {args.timeout_s}s", file=sys.stderr)
                return 1
        flat = torch.full((args.numel,), float(args.rank + 1))
        expected = sum(r + 1 for r in members) / len(members)
        tiny = torch.zeros(1)
        for k in range(args.repeats):
            for mode in (security if k % 2 == 0 else security[::-1]):
                ex = exchanges[mode]
                ex.all_reduce_mean(f"barrier/{k}", tiny, members)
                start, cpu0 = time.perf_counter(), time.process_time()
                out = ex.all_reduce_mean(f"mix1/{k}", flat, members)
                seconds[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - cpu0)
                if abs(float(out[0]) - expected) > 1e-4 or abs(float(out[-1]) - expected) > 1e-4:
                    print(f"rank {args.rank}: wrong all-reduce result ({mode}) {float(out[0])} != {expected}", file=sys.stderr)
                    return 1
        for ex in exchanges.values():
            ex.all_reduce_mean("barrier/end", tiny, members)
    finally:
        for ex in exchanges.values():
            ex.close(linger_s=0.5)
    Path(args.out).write_text(json.dumps({"rank": args.rank, "numel": args.numel, "workers": len(members),
                                          "seconds": seconds[security[0]], "seconds_by_security": seconds,
                                          "cpu_s_by_security": cpu}))
    return 0


def swap_side(args: argparse.Namespace) -> int:
    """One side of the heartbeat check: swap ``--mb`` MB with the other rank; write whether it worked
    (and how long it took, or why it failed) to ``--out``. Exit 0 either way: a failed swap is the
    measurement; only a probe that cannot report exits non-zero."""
    import torch

    from gossiploco.config import TimeoutConfig
    from gossiploco.errors import ExchangeError

    torch.set_num_threads(1)
    heartbeat_s = args.heartbeat_s or TimeoutConfig().heartbeat_s  # 0: what a peer runs with by default
    ex = _exchange(args.rank, args.peers, "netem-swap", args.timeout_s, args.chunk_mb, heartbeat_s)
    out: dict[str, Any] = {"rank": args.rank, "heartbeat_s": heartbeat_s, "chunk_mb": args.chunk_mb, "mb": args.mb}
    try:
        if not ex.wait_connected(args.timeout_s):
            out.update(ok=False, error=f"peers not connected after {args.timeout_s}s")
        else:
            start = time.perf_counter()
            try:
                ex.swap("mix2/0", 1 - args.rank, torch.ones(int(args.mb * 1e6 / 4)))
                out.update(ok=True, seconds=round(time.perf_counter() - start, 2))
            except ExchangeError as exc:
                out.update(ok=False, seconds=round(time.perf_counter() - start, 2), error=f"{type(exc).__name__}: {exc}")
            # A swap returns once the partner's data is in: wait until the partner has ours too before
            # closing. After a failed swap this barrier may fail too (at once, or at --timeout-s): the
            # result is already known.
            with contextlib.suppress(ExchangeError):
                ex.all_reduce_mean("done", torch.zeros(1), [0, 1])
    finally:
        ex.close(linger_s=1.0)
    Path(args.out).write_text(json.dumps(out))
    return 0


def tcp_server(args: argparse.Namespace) -> int:
    """Accept one TCP stream, count what arrives until the sender closes; write the goodput to ``--out``."""
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
    """Send zeros to the server as fast as TCP takes them for ``--seconds``."""
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


def sample_links(args: argparse.Namespace) -> int:
    """Every ``--interval-s``, the byte counters of every interface of this namespace (the switch's
    veths: rx = what the peer sent, tx = what it received), one JSON line per sample, until killed."""
    net = Path("/sys/class/net")
    devs = sorted(d.name for d in net.iterdir() if d.name not in ("lo", "br0"))
    with open(args.out, "w") as out:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            row: dict[str, Any] = {"t": time.time()}
            for dev in devs:
                stats = net / dev / "statistics"
                row[dev] = [int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())]
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(args.interval_s)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m testbed.probes KIND ...``: one probe process (a benchmark starts them in the namespaces)."""
    parser = argparse.ArgumentParser(prog="python -m testbed.probes", description="One link probe, run inside a "
                                     "namespace of a benchmark's network (bench/netem.py starts these itself).")
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("ring", help="time the project's ring all-reduce among all peers")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--hosts", required=True, help="Comma-separated addresses of every peer, in rank order.")
    p.add_argument("--port", type=int, default=RING_PORT, help="Port of the first transport of --security (the next: +1).")
    p.add_argument("--security", default="plain", help="Comma-separated transports to time, alternately: plain "
                   "(trust=None) and/or curve (CurveZMQ, Trust.static from --swarm-key).")
    p.add_argument("--swarm-key", help="Swarm key file (curve): the static identities derive from it.")
    p.add_argument("--numel", type=int, required=True, help="fp32 values to all-reduce.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-mb", type=float, default=4.0, help="transport.chunk_mb (every peer's must match).")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("swap", help="the heartbeat check: swap a payload between rank 0 and rank 1")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--peers", required=True, help="The two endpoints, tcp://HOST:PORT,tcp://HOST:PORT.")
    p.add_argument("--mb", type=float, default=8.0, help="Payload of the swap, MB.")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="transport.chunk_mb (both sides' must match).")
    p.add_argument("--heartbeat-s", type=float, default=0.0, help="Heartbeat timeout (0: the runtime's default).")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("tcp-server", help="receive one raw TCP stream, write its goodput")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=TCP_PORT)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("tcp-client", help="send one raw TCP stream")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, default=TCP_PORT)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p = sub.add_parser("sample", help="this namespace's byte counters at an interval (JSON lines)")
    p.add_argument("--interval-s", type=float, default=0.1)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return {"ring": ring_side, "swap": swap_side, "tcp-server": tcp_server, "tcp-client": tcp_client,
            "sample": sample_links}[args.kind](args)


if __name__ == "__main__":
    sys.exit(main())
