"""Outsiders against the dial-back checker and the dashboard (issue 25, part 1b).

    python -m bench.attacks_surface [--seconds 8] [--only CASE ...] [--results bench/results/attacks-surface.md]

(from the repository root: ``bench`` imports as a package, for ``bench.attacks_swarm.Result``). Against a real
private bootstrap node (``start_bootstrap(swarm=key)``: a hivemind DHT process with its p2pd, serving the
dial-back checker as every node does) and a real dashboard server (uvicorn on 127.0.0.1), an outsider who
knows only their addresses:

1. ``dialback-jam``: a stranger's libp2p node (at 127.0.0.2) keeps 32 dial-back requests going at once
   (each re-opened as soon as it ends; each held as long as the checker waits for a request); after
   ``--seconds`` of it, and while it goes on, an honest peer (127.0.0.1) checks its reachability. It must be
   reachable.
2. ``dialback-jam-same-address``: the same from the honest peer's own address (a stranger behind the same
   NAT, or on loopback here), so the per-address share is the stranger's: the honest check must be
   reachable, or "unknown" and ask another checker (with a second bootstrap: reachable through it) —
   never "behind NAT"; ``doctor`` must say "unknown", not "behind NAT".
3. ``dialback-1tib``: 8 streams at a time announce a 1 TiB request (the 8-byte length prefix) and then send
   junk as fast as they can, for ``--seconds``: the bootstrap's DHT process and its p2pd must stay within
   ``RSS_SLACK_MIB`` of their size before.
4. ``dashboard-rebinding``: ``Host: attacker.example:PORT`` (what a browser sends after DNS rebinding) on every
   route of a dashboard holding a run's state: refused (421), nothing of the run in the answer; the
   dashboard's own Host gets the state (control). Served beyond loopback: the same routes without the token
   get 401.

Each case: what the run should do, what happened (evidence), and a verdict. Exit status 1 if any attack
succeeded. Results: ``--results`` (markdown, with the exact command).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack

from bench.attacks_swarm import Result
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.reach.dialback import DIALBACK_PROTOCOL, dialback_stats
from gossiploco.runtime.launch import free_ports
from gossiploco.security.swarm_key import SwarmKey
from testbed.outsider import memory_kib
from testbed.processes import descendants, process_table

ROOT = Path(__file__).resolve().parent.parent
RSS_SLACK_MIB = 64
JAM_STREAMS = 32


class Stranger:
    """A libp2p node with no swarm key (a real p2pd at ``host``), driven from an event loop on its own thread."""

    def __init__(self, host: str, bootstrap: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stranger", daemon=True)
        self.thread.start()
        self.target = bootstrap.rsplit("/p2p/", 1)[1]
        self.p2p = self.run(self._create(host, bootstrap))

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @staticmethod
    async def _create(host: str, bootstrap: str):
        from hivemind.p2p import P2P

        return await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=[bootstrap])

    async def _open(self):
        from hivemind.p2p import PeerID

        return await self.p2p.call_binary_stream_handler(PeerID.from_base58(self.target), DIALBACK_PROTOCOL)

    async def jam(self, streams: int, seconds: float, stop: threading.Event) -> Counter:
        """``streams`` dial-back requests kept in flight for ``seconds`` or until ``stop`` is set: each opened,
        silent until the checker answers or hangs up, then opened again. Counts what the checker answered."""
        seen: Counter = Counter()
        end = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < end and not stop.is_set():
                try:
                    _, reader, writer = await asyncio.wait_for(self._open(), 5)
                except Exception as exc:  # noqa: BLE001 - counted
                    seen[f"open failed: {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                try:
                    header = await asyncio.wait_for(reader.readexactly(8), max(0.1, end - time.monotonic() + 5))
                    answer = msgpack.unpackb(await reader.readexactly(int.from_bytes(header, "big")), raw=False)
                    seen[f"{answer.get('outcome')}: {answer.get('detail', '').split(' (')[0][:60]}"] += 1
                except Exception as exc:  # noqa: BLE001 - the checker hung up (or our deadline): counted
                    seen[f"no answer: {type(exc).__name__}"] += 1
                finally:
                    writer.close()
                await asyncio.sleep(0.02)  # a refused stream comes back at once: do not spin

        await asyncio.gather(*(worker() for _ in range(streams)))
        return seen

    async def announce_huge(self, streams: int, seconds: float) -> tuple[int, int]:
        """``streams`` at a time: a 1 TiB length prefix, then junk as fast as it goes, re-opened when cut.
        Returns (streams opened, bytes written)."""
        opened, sent = 0, 0
        end = time.monotonic() + seconds
        junk = b"\0" * (1 << 16)

        async def worker() -> None:
            nonlocal opened, sent
            while time.monotonic() < end:
                try:
                    _, _, writer = await asyncio.wait_for(self._open(), 5)
                except Exception:  # noqa: BLE001 - the daemon is busy tearing streams down: try again
                    await asyncio.sleep(0.05)
                    continue
                opened += 1
                try:
                    writer.write((1 << 40).to_bytes(8, "big"))
                    while time.monotonic() < end:
                        writer.write(junk)
                        await asyncio.wait_for(writer.drain(), 2)
                        sent += len(junk)
                except Exception:  # noqa: BLE001 - cut by the checker: open another
                    pass
                finally:
                    writer.close()

        await asyncio.gather(*(worker() for _ in range(streams)))
        return opened, sent

    def close(self) -> None:
        try:
            self.run(self.p2p.shutdown(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def in_background(call):
    """Run ``call()`` on a thread; ``join()`` returns its result."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=call()), daemon=True)
    thread.start()

    def join(timeout_s: float = 180.0):
        thread.join(timeout_s)
        return box.get("value")
    return join


def rss_mib(pid: int) -> dict[str, float]:
    """Resident MiB of ``pid`` and of each of its descendants (the DHT process and its p2pd)."""
    sizes = {"dht": memory_kib(pid, "VmRSS") / 1024}
    for info in descendants(process_table(), pid):
        try:
            name = Path(f"/proc/{info.pid}/comm").read_text().strip()
        except OSError:
            continue
        sizes[name if name not in sizes else f"{name} {info.pid}"] = memory_kib(info.pid, "VmRSS") / 1024
    return sizes


def verdict_of_check(found) -> str:
    return (f"reachable={found.reachable} checker={str(found.checker)[-8:]} no_verdict={found.no_verdict} "
            f"detail={found.detail[:160]!r}")


def dialback_jam(key: SwarmKey, seconds: float) -> Result:
    from gossiploco.reach.reachability import check_reachability

    res = Result("dialback-jam", f"{JAM_STREAMS} requests kept in flight by a stranger at another address: the "
                                 "checker admits 2 of them (its share per source) and the honest peer is reachable")
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    stranger = Stranger("127.0.0.2", addresses[0])
    try:
        stop = threading.Event()
        jam = in_background(lambda: stranger.run(stranger.jam(JAM_STREAMS, seconds + 60, stop), seconds + 120))
        time.sleep(seconds)  # the jam is up
        started = time.monotonic()
        found = check_reachability(addresses, free_ports(1)[0], timeout_s=5, host="127.0.0.1")
        took = time.monotonic() - started
        stop.set()
        answers = jam()
        stats = dht.run_coroutine(dialback_stats)
        res.happened += [f"stranger's answers {dict(answers)}", f"honest check in {took:.1f} s: {verdict_of_check(found)}",
                         f"checker's counters {stats}"]
        if found.reachable is not True:
            res.fail("the honest peer was not found reachable")
        if not any(k.startswith("refused: too many requests") for k in answers):
            res.fail("the stranger was never held to its share")
    finally:
        stranger.close()
        dht.shutdown()
    return res


def dialback_jam_same_address(key: SwarmKey, seconds: float) -> Result:
    from gossiploco.reach.reachability import check_reachability
    from gossiploco.runtime import doctor

    res = Result("dialback-jam-same-address", f"{JAM_STREAMS} requests kept in flight by a stranger at the honest "
                                              "peer's own address: with two checkers reachable (it asks the other); "
                                              "with the jammed one alone reachable or unknown, never behind NAT; "
                                              "doctor says unknown, not behind NAT")
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    second, second_addresses = start_bootstrap("127.0.0.1", 0, swarm=key, join=addresses)
    stranger = Stranger("127.0.0.1", addresses[0])
    try:
        stop = threading.Event()
        jam = in_background(lambda: stranger.run(stranger.jam(JAM_STREAMS, seconds + 120, stop), seconds + 180))
        time.sleep(seconds)
        both = check_reachability([addresses[0], second_addresses[0]], free_ports(1)[0], timeout_s=5, host="127.0.0.1")
        alone = check_reachability([addresses[0]], free_ports(1)[0], timeout_s=5, host="127.0.0.1")
        told = {c.name: c for c in doctor.check_reachability([addresses[0]], free_ports(1)[0], 5.0)}["reachability"]
        stop.set()
        answers = jam()
        stats = dht.run_coroutine(dialback_stats)
        res.happened += [f"stranger's answers {dict(answers)}", f"two checkers: {verdict_of_check(both)}",
                         f"the jammed one alone: {verdict_of_check(alone)}",
                         f"doctor: {told.status} {told.detail[:200]!r}", f"jammed checker's counters {stats}"]
        if both.reachable is not True:
            res.fail("with a second checker the honest peer was not found reachable")
        if alone.reachable is False:
            res.fail("the jam made the honest peer 'behind NAT'")
        if alone.reachable is None and "behind NAT" in told.detail:
            res.fail("doctor said behind NAT")
    finally:
        stranger.close()
        second.shutdown()
        dht.shutdown()
    return res


def dialback_1tib(key: SwarmKey, seconds: float) -> Result:
    res = Result("dialback-1tib", f"8 streams at a time announcing a 1 TiB request, then junk at full speed: refused "
                                  f"on the prefix; the bootstrap's DHT process and p2pd grow < {RSS_SLACK_MIB} MiB")
    dht, addresses = start_bootstrap("127.0.0.1", 0, swarm=key)
    stranger = Stranger("127.0.0.2", addresses[0])
    try:
        before = rss_mib(dht.pid)
        peak = dict(before)
        flood = in_background(lambda: stranger.run(stranger.announce_huge(8, seconds), seconds + 60))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for name, size in rss_mib(dht.pid).items():
                peak[name] = max(peak.get(name, 0.0), size)
            time.sleep(0.2)
        opened, sent = flood() or (0, 0)
        stats = dht.run_coroutine(dialback_stats)
        res.happened += [f"{opened} streams opened, {sent / 2**20:.1f} MiB written by the stranger in {seconds:g} s",
                         "RSS before " + ", ".join(f"{k} {v:.0f} MiB" for k, v in before.items()),
                         "peak " + ", ".join(f"{k} {v:.0f} MiB" for k, v in peak.items()),
                         f"checker's counters {stats}"]
        grown = {k: peak[k] - before.get(k, 0.0) for k in peak}
        if any(g > RSS_SLACK_MIB for g in grown.values()):
            res.fail(f"grew {grown}")
        if not stats.get("refused", {}).get("malformed"):
            res.fail("no request was refused as malformed")
    finally:
        stranger.close()
        dht.shutdown()
    return res


def _http(port: int, path: str, host: str, headers: dict | None = None) -> tuple[int, str]:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Connection: close",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        conn.settimeout(2)
        raw = b""
        try:
            while chunk := conn.recv(65536):
                raw += chunk
                if path == "/events" and b"\r\n\r\n" in raw and b" 200 " in raw[:20]:
                    break  # an event stream never ends: its first bytes say enough
        except socket.timeout:
            pass
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode("utf-8", "replace")


def dashboard_rebinding() -> Result:
    from gossiploco.dashboard.app import DashboardServer
    from gossiploco.dashboard.observer import SwarmState
    from gossiploco.membership.status import StatusEntry

    res = Result("dashboard-rebinding", "Host: attacker.example:PORT (DNS rebinding) on every route: 421 and nothing "
                                        "of the run; the dashboard's own Host reads the state (control); served "
                                        "beyond loopback, no token: 401")
    run = "run-secret-4f2a"
    state = SwarmState()
    state.update({7: StatusEntry(peer=7, run_id=run, round=3, h=1, step=25, members=2, time=1.0, loss=2.5, val_loss=2.6,
                                 cd_l2=0.1, cd_js=0.01, bytes_sent=1, bytes_received=1, rate=1.0, failures={},
                                 causes=[], paths={}, utilization=0.5, mix2=["*"], history=[[25, 2.5, 2.6, 0.1, 0.01]])},
                 {run: {"workers": 2}})
    routes = ("/", "/api/state", "/metrics", "/events", "/static/dashboard.js")
    open_server = DashboardServer(state, "127.0.0.1", free_ports(1)[0]).start()
    token_server = DashboardServer(state, "127.0.0.1", free_ports(1)[0], require_token=True).start()
    try:
        port = open_server.port
        rebound = {path: _http(port, path, f"attacker.example:{port}") for path in routes}
        own = _http(port, "/api/state", f"127.0.0.1:{port}")
        tport = token_server.port
        untokened = {path: _http(tport, path, f"127.0.0.1:{tport}")[0] for path in routes}
        bearer = _http(tport, "/metrics", f"127.0.0.1:{tport}", {"Authorization": f"Bearer {token_server.token}"})[0]
        res.happened += [f"attacker.example: {{{', '.join(f'{p}: {s}' for p, (s, _) in rebound.items())}}}",
                         f"own Host /api/state: {own[0]}, names the run: {run in own[1]}",
                         f"token required, none given: {untokened}; Bearer on /metrics: {bearer}",
                         f"refused {open_server.app.state.refused.counts()} and {token_server.app.state.refused.counts()}"]
        if any(s != 421 or run in body for s, body in rebound.values()):
            res.fail("a rebound name was answered")
        if own[0] != 200 or run not in own[1]:
            res.fail("the control request did not read the state (the test proves nothing)")
        if any(s != 401 for s in untokened.values()) or bearer != 200:
            res.fail("the token was not enforced")
    finally:
        open_server.close()
        token_server.close()
    return res


def write_results(path: Path, command: str, results: list[Result], wall: float) -> None:
    lines = ["# Attack suite: outsiders against the dial-back checker and the dashboard", "",
             "Produced by `bench/attacks_surface.py` (see its docstring; issue 25, part 1b).", "",
             "```", command, "```", "",
             f"Machine: 2 shared CPU cores, loopback (the stranger's libp2p node at 127.0.0.2 where it plays another "
             f"address). Bench wall time {wall:.0f} s. Each dial-back case has its own private bootstrap node.", "",
             "| Attack | Should | What happened (evidence) | Verdict |", "|---|---|---|---|"]
    for res in results:
        happened = "; ".join(res.happened).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {res.attack} | {res.expected} | {happened} | {'held' if res.ok else 'SUCCEEDED'} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


CASES = ("dialback-jam", "dialback-jam-same-address", "dialback-1tib", "dashboard-rebinding")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="How long each flood lasts.")
    ap.add_argument("--only", nargs="+", choices=CASES, default=None)
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "attacks-surface.md")
    args = ap.parse_args()
    started = time.monotonic()
    key = SwarmKey.generate()
    run = {"dialback-jam": lambda: dialback_jam(key, args.seconds),
           "dialback-jam-same-address": lambda: dialback_jam_same_address(key, args.seconds),
           "dialback-1tib": lambda: dialback_1tib(key, args.seconds),
           "dashboard-rebinding": dashboard_rebinding}
    results = []
    for name in args.only or CASES:
        try:
            results.append(run[name]())
        except Exception as exc:  # noqa: BLE001 - an attack that cannot be mounted is reported, not skipped
            results.append(Result(name, ""))
            results[-1].fail(f"could not be mounted: {type(exc).__name__}: {exc}")
        print(f"{'held     ' if results[-1].ok else 'SUCCEEDED'} {name}: {'; '.join(results[-1].happened)}", flush=True)
    command = "python -m bench.attacks_surface " + " ".join(sys.argv[1:])
    write_results(args.results, command.strip(), results, time.monotonic() - started)
    return 0 if all(res.ok for res in results) else 1


if __name__ == "__main__":
    sys.exit(main())
