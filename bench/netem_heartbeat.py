"""Show the runtime's ZeroMQ heartbeat dropping a healthy connection on a slow link.

Two namespaces (``bench/netem.py``'s network, prefix ``glh``) joined by a link shaped to
``--bandwidth`` Mbit/s; rank 0 and rank 1 swap ``--mb`` MB with ``ZmqExchange.swap`` in chunks of
``--chunk-mb`` (``transport.chunk_mb``), once with the runtime's heartbeat timeout
(``HEARTBEAT_TIMEOUT_MS`` = 5 s) and, with ``--also-timeout-s``, once with a longer one. libzmq's
heartbeat timeout is cancelled only by a *complete* incoming message, so when one chunk takes more
than 5 s on the wire (4 MiB below 6.7 Mbit/s per flow) the receiver drops the connection in the
middle of the chunk and the swap fails, though every byte is flowing.

    sudo .venv/bin/python bench/netem_heartbeat.py                       # 5 Mbit/s, 8 MB in 4 MiB chunks
    sudo .venv/bin/python bench/netem_heartbeat.py --chunk-mb 1          # the same swap in 1 MiB chunks passes

Exit code 0 when it ran (whatever the swaps did), 2 when it cannot run here (see bench/netem.py).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import netem  # noqa: E402  (bench/netem.py)

PORT = 6950


def swap_side(args: argparse.Namespace) -> int:
    """One side of the swap (run inside a namespace); prints one JSON line."""
    import time

    import torch

    from gossiploco.errors import ExchangeError
    from gossiploco.transport import zmq_exchange

    if args.timeout_ms:
        zmq_exchange.HEARTBEAT_TIMEOUT_MS = args.timeout_ms
    endpoints = [f"tcp://{netem.SUBNET}.1:{PORT}", f"tcp://{netem.SUBNET}.2:{PORT}"]
    ex = zmq_exchange.ZmqExchange(args.rank, endpoints, "heartbeat-demo", 120.0,
                                  chunk_bytes=int(args.chunk_mb * (1 << 20)) // 4 * 4)
    out = {"rank": args.rank, "heartbeat_timeout_ms": zmq_exchange.HEARTBEAT_TIMEOUT_MS, "chunk_mb": args.chunk_mb}
    try:
        if not ex.wait_connected(60):
            out["result"] = "never connected"
        else:
            start = time.perf_counter()
            try:
                ex.swap("mix2/0", 1 - args.rank, torch.ones(int(args.mb * 1e6 / 4)))
                out["result"] = "ok"
                out["seconds"] = round(time.perf_counter() - start, 2)
                # The swap returns once the partner's data is in; wait until the partner has ours too.
                ex.all_reduce_mean("done", torch.zeros(1), [0, 1])
            except ExchangeError as exc:
                out["result"] = f"failed: {type(exc).__name__}: {exc}"
                out["seconds"] = round(time.perf_counter() - start, 2)
    finally:
        ex.close(linger_s=1.0)
    print(json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bandwidth", type=float, default=5.0, help="Link rate, Mbit/s each way.")
    parser.add_argument("--mb", type=float, default=8.0, help="Payload of the swap, MB.")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="transport.chunk_mb (the runtime's default is 4).")
    parser.add_argument("--also-timeout-s", type=float, default=60.0, help="Swap again with this heartbeat timeout (0: not).")
    parser.add_argument("--prefix", default="glh")
    parser.add_argument("--side", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    parser.add_argument("--timeout-ms", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side is not None:
        args.rank = args.side
        return swap_side(args)

    problem = netem.preflight()
    if problem:
        print(f"bench/netem_heartbeat.py cannot run here: {problem}", file=sys.stderr)
        return netem.EXIT_UNAVAILABLE
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in previous:
        signal.signal(s, netem._on_signal)
    net = netem.Network(args.prefix, 2)
    try:
        with netem.prefix_lock(args.prefix):
            netem.remove_namespaces(args.prefix)
            try:
                net.build()
                cc = net.set_congestion_control("auto")
                net.shape(args.bandwidth)
                print(f"2 namespaces, {args.bandwidth:g} Mbit/s each way, TCP {cc}; swap of {args.mb:g} MB in "
                      f"{args.chunk_mb:g} MiB chunks ({args.chunk_mb * 8 * 1.049 / args.bandwidth:.1f} s per chunk at the link rate)")
                timeouts = [0] + ([round(1000 * args.also_timeout_s)] if args.also_timeout_s else [])
                for timeout_ms in timeouts:
                    group = netem.Group(Path("/tmp") / f"{args.prefix}-heartbeat")
                    try:
                        procs = [group.start([*net.exec_prefix(r), sys.executable, __file__, "--side", str(r),
                                              "--chunk-mb", str(args.chunk_mb), "--mb", str(args.mb),
                                              "--timeout-ms", str(timeout_ms)], f"side-{r}.log", netem.child_env())
                                 for r in range(2)]
                        codes = group.wait(180)
                    finally:
                        group.stop()
                    label = "runtime's 5 s" if not timeout_ms else f"{timeout_ms / 1000:g} s"
                    for r, proc in enumerate(procs):
                        line = netem.tail(group.out_dir / f"side-{r}.log", 1)
                        print(f"heartbeat timeout {label}: rank {r}: {line or f'exit {codes[r]}'}")
            finally:
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
                net.destroy()
    except netem.Unavailable as exc:
        print(f"bench/netem_heartbeat.py cannot run here: {exc}", file=sys.stderr)
        return netem.EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
