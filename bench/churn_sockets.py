"""What one long-lived peer holds while peers come and go (issue 26, item 3): its open file descriptors, DEALER
sockets and known peers after each batch of peers that joined and left, on this code and on another revision's,
side by side in one run.

    python -m bench.churn_sockets --peers 60 --every 10 --against HEAD~1 --out bench/results/churn-sockets.md

What runs (in one process per code version, ``python -m bench.churn_sockets one``): a peer A (``ZmqExchange``,
plaintext, loopback) with the runtime's path planner (``PathPlanner.sync``, called with the run's records as
discovery calls it) and, one after another, ``--peers`` peers B_i: B_i starts on a fresh port, its record appears
(``sync`` with A's and B_i's records: A connects to it) and B_i connects to A; once A sees it connected, B_i leaves
gracefully (``leave``: it tells A and closes) and its record goes (``sync`` with A's record alone, as after its
tombstone). Every ``--every`` peers: A's open file descriptors (``/proc/self/fd``, the whole process: B_i's are
closed by then), the peers A holds sockets for (a data and a control DEALER each, and a monitor) and ``known()``;
also the TCP connections A's sockets attempted to the departed peers' ports in a 1 s window (a listener on each of
the last ``--every`` ports counts them: libzmq redials a peer it was not told to forget).

Then the same with reverse connections (A behind NAT, every B_i reachable): B_i's DEALERs listen for A
(``add_peer(..., listen=True)``) and A's ROUTER dials them (``dial_reverse``, as the path planner does from B_i's
record's offers), A dials B_i directly too; once connected, B_i leaves and A forgets it (``forget_peer``, as the
planner does once its record is gone). Counted: connection attempts to the last ``--every`` departed peers' listening
ports in 1 s (the ROUTER's reverse dials of departed peers).

Last, a reverse endpoint that takes TCP connections but never completes a ZMTP handshake (a listener that accepts
and closes: a port some other program took over, a key refused there): A's ROUTER dials it, and the attempts it
makes from 2 s to 6 s after are counted.

``--against REV`` runs this same script on the code of a ``git worktree`` of REV (created under /tmp, removed after;
``PYTHONPATH`` points there), with this repository's ``.venv``; the revision must have ``PathPlanner``. Prints a
Markdown table; ``--out`` writes it with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def _attempts(ports: list[int], window_s: float) -> int:
    """TCP connections made to ``ports`` (nobody else listens there) within ``window_s``."""
    servers, count = [], [0]
    for port in ports:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        s.setblocking(False)
        servers.append(s)
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        for s in servers:
            try:
                conn, _ = s.accept()
            except BlockingIOError:
                continue
            count[0] += 1
            conn.close()
        time.sleep(0.005)
    for s in servers:
        s.close()
    return count[0]


def one(peers: int, every: int) -> list[dict]:
    """The scenario on the code importable here (see the module docstring); one row per ``every`` peers."""
    from gossiploco.membership.record import PeerRecord
    from gossiploco.reach.paths import Reach
    from gossiploco.runtime.path_planner import PathPlanner
    from gossiploco.transport.zmq_exchange import ZmqExchange

    run = "churn"
    a_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    a = ZmqExchange(1, {1: a_endpoint}, run, 10.0, grace_s=2.0)
    kwargs = {"forget_after_s": 0.0} if "forget_after_s" in PathPlanner.__init__.__code__.co_varnames else {}
    planner = PathPlanner(1, Reach(reachable=True), a, run_in_node=None, **kwargs)  # its reads miss nothing
    a_record = PeerRecord(1, a_endpoint, 0, 0)
    rows, recent = [], []
    try:
        planner.sync({1: a_record})
        for i in range(peers):
            rank, port = 100 + i, _free_port()
            endpoint = f"tcp://127.0.0.1:{port}"
            b = ZmqExchange(rank, {rank: endpoint}, run, 10.0, grace_s=2.0)
            try:
                planner.sync({1: a_record, rank: PeerRecord(rank, endpoint, 0, 0)})
                b.add_peer(1, a_endpoint)
                if not _wait(lambda: rank in a.connected(), 10.0):
                    raise RuntimeError(f"peer {rank} never connected")
            finally:
                b.leave(linger_s=0.1)
            _wait(lambda: rank not in a.connected(), 10.0)
            planner.sync({1: a_record})
            recent.append(port)
            if (i + 1) % every == 0:
                time.sleep(0.3)  # the receiving thread closes retired monitors on its next pass
                rows.append({"peers_seen": i + 1, "fds": len(os.listdir("/proc/self/fd")),
                             "dealers": len(a.sockets.dealers), "known": len(a.known()) - 1,
                             "attempts_1s": _attempts(recent, 1.0)})
                recent = []
    finally:
        a.close()
    return rows


def one_reverse(peers: int, every: int) -> list[dict]:
    """The reverse-connection scenario (module docstring): attempts to departed peers' listening ports, per ``every``."""
    from gossiploco.transport.zmq_exchange import ZmqExchange

    run = "churn-reverse"
    a_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    a = ZmqExchange(1, {1: a_endpoint}, run, 10.0, grace_s=2.0)
    rows, recent = [], []
    try:
        for i in range(peers):
            rank = 100 + i
            endpoint = f"tcp://127.0.0.1:{_free_port()}"
            b = ZmqExchange(rank, {rank: endpoint}, run, 10.0, grace_s=2.0)
            try:
                b.add_peer(1, a_endpoint, listen=True)
                offers = [ports for peer, *ports in b.reverse_offers() if peer == 1][0]
                a.add_peer(rank, endpoint)
                a.dial_reverse(rank, [f"tcp://127.0.0.1:{port}" for port in offers])
                if not _wait(lambda: rank in a.connected() and 1 in b.connected(), 10.0):
                    raise RuntimeError(f"peer {rank} never connected both ways")
            finally:
                b.leave(linger_s=0.1)
            _wait(lambda: rank not in a.connected(), 10.0)
            a.forget_peer(rank)
            recent += offers
            if (i + 1) % every == 0:
                time.sleep(0.3)
                rows.append({"reverse_attempts_1s": _attempts(recent, 1.0)})
                recent = []
    finally:
        a.close()
    return rows


def handshakeless(start_s: float = 2.0, window_s: float = 4.0) -> int:
    """Attempts A's ROUTER makes to a reverse endpoint that accepts and closes, from ``start_s`` for ``window_s``."""
    from gossiploco.transport.zmq_exchange import ZmqExchange

    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    server.setblocking(False)
    a = ZmqExchange(1, {1: f"tcp://127.0.0.1:{_free_port()}"}, "churn-handshakeless", 10.0, grace_s=2.0)
    count, began = 0, time.monotonic()
    try:
        a.dial_reverse(7, [f"tcp://127.0.0.1:{port}"])
        while time.monotonic() < began + start_s + window_s:
            try:
                conn, _ = server.accept()
            except BlockingIOError:
                time.sleep(0.005)
                continue
            count += time.monotonic() >= began + start_s
            conn.close()
    finally:
        a.close()
        server.close()
    return count


def _run(cwd: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "one", "--peers", str(ARGS.peers),
                          "--every", str(ARGS.every)], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the scenario failed in {cwd}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    current = _run(ROOT)
    former, rev = None, None
    if ARGS.against:
        rev = subprocess.run(["git", "rev-parse", "--short", ARGS.against], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        tree = Path(tempfile.mkdtemp(prefix="churn-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            (tree / ".venv").symlink_to(ROOT / ".venv")
            former = _run(tree)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    lines = ["| peers that came and went | open fds: current | former | peers it holds sockets for: current | former "
             "| peers known: current | former | connection attempts to the last departed ports in 1 s: current "
             "| former | attempts to their reverse ports in 1 s: current | former |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for index, row in enumerate(current):
        old = former[index] if former else {}
        lines.append(f"| {row['peers_seen']} | {row['fds']} | {old.get('fds', '-')} | {row['dealers']} | "
                     f"{old.get('dealers', '-')} | {row['known']} | {old.get('known', '-')} | {row['attempts_1s']} | "
                     f"{old.get('attempts_1s', '-')} | {row['reverse_attempts_1s']} | "
                     f"{old.get('reverse_attempts_1s', '-')} |")
    lines += ["", f"Attempts to a reverse endpoint that accepts TCP and never completes a handshake, from 2 s to 6 s "
              f"after it was dialed: current {current[-1]['handshakeless_attempts']}, former "
              f"{former[-1].get('handshakeless_attempts', '-') if former else '-'}."]
    table = "\n".join(lines)
    print(table)
    if ARGS.out:
        command = " ".join(["python -m bench.churn_sockets", *sys.argv[1:]])
        text = (f"# Sockets a peer holds while peers come and go\n\nProduced by `bench/churn_sockets.py` (see its "
                f"docstring).\n\n```\n{command}\n```\n\nMachine: {platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cores, Python {platform.python_version()}. current: {head} (working tree); "
                f"former: {rev or '-'}.\n\n{table}\n")
        Path(ARGS.out).write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "one"])
    parser.add_argument("--peers", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--against", default=None, help="a revision to run the same scenario on, side by side")
    parser.add_argument("--out", default=None)
    ARGS = parser.parse_args()
    if ARGS.mode == "one":
        rows = one(ARGS.peers, ARGS.every)
        for row, reverse in zip(rows, one_reverse(ARGS.peers, ARGS.every)):
            row.update(reverse)
        rows[-1]["handshakeless_attempts"] = handshakeless()
        print(json.dumps(rows))
    else:
        main()
