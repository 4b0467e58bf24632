"""Real peers on shaped links: measured compute utilization against the simulator's prediction.

For each bandwidth B this benchmark builds a small private network out of Linux network
namespaces, runs M real ``gossiploco peer`` processes on it (one per namespace), and compares each
peer's measured compute utilization with ``gossiploco utilization``'s prediction for the same step
time, payload and bandwidth.

Topology (every name starts with ``--prefix``, default ``gln``; nothing is added to the root
namespace)::

    namespace PREFIX-sw:  bridge br0 with ports p0 .. p{M-1}          (the "switch")
    namespace PREFIX-pI:  eth0 = 10.77.0.{I+1}/24, veth peer of PREFIX-sw's pI   (peer I)

Each peer's access link is shaped to B in both directions with ``tc``: an HTB class of rate B on
the egress of the peer-side veth (upload) and on the egress of the switch-side veth (download),
so a peer has B up and B down (full duplex, the simulator's link). Under each class a FIFO of
``--queue-packets`` (1000, Linux's default queue length); ``--delay-ms`` / ``--loss-pct`` put a
netem qdisc there instead (both directions, so the round trip is twice the delay; needs sch_netem
in the kernel, else exit 2). tc counts whole Ethernet frames: at MTU 1500 a TCP flow carries at
most 1448 / 1514 = 95.6% of B as payload, which the simulator does not model (it sends payload at
exactly B); the table also shows the simulator fed with the measured TCP goodput, for comparison.

TCP congestion control in the peer namespaces (``--congestion-control``): ``auto`` takes cubic
(Linux's default) when the host allows it, else reno. BBR, the host's default on the machine the
results were taken on, gets only about 72% of B for the project's ring all-reduce on these links
(each ring step is a short burst that BBR paces below the link rate; reno gets 95%), so it is not
the default here; ``--congestion-control inherit`` measures with it.

ZeroMQ heartbeats (``--heartbeat-timeout-s``): the runtime drops a connection when no whole
message arrives within ``timeouts.heartbeat_s`` (5 s) of a heartbeat (libzmq counts complete
messages, not bytes). On these slow shared links a 4 MiB chunk, or a TCP flow stalled by drops, can
take longer, so healthy connections are dropped and exchanges fail (results/utilization.md has the
evidence). The option sets ``timeouts.heartbeat_s`` for the peers (and the swap probe), as a user on
such a link would; 0 (default) keeps the runtime's default. ``--swap-mb`` shows the drop in isolation.

Discovery (``--discovery``): ``dht`` (default) runs a bootstrap node (``gossiploco dht``) in peer 0's
namespace and starts every peer with ``--join`` it, as users do; ``static`` gives them the list.
Peers are always encrypted (CurveZMQ): each run gets a fresh swarm key (``RUN/swarm.key``, passed
with ``--swarm-key`` to the peers and to the bootstrap node) and, with ``dht``, identity files
``RUN/peer-I/identity.key`` whose peer ids increase with I (``--identity``).

Per bandwidth it runs, in order:

1. a raw TCP stream p0 -> p1 (probe ``tcp-server`` / ``tcp-client``): the goodput one flow gets;
2. the ring all-reduce of the model's payload among the M peers (probe ``ring``, the project's
   ``ZmqExchange.all_reduce_mean``): effective rate ``2 (M-1)/M * bytes * 8 / seconds`` against B.
   ``--ring-security plain,curve`` times it over both transports, alternating repeat by repeat in the
   same processes: ``plain`` is ``ZmqExchange(trust=None)`` (plaintext, kept for benchmarks), ``curve``
   is ``trust=Trust.static(swarm key, rank, M)`` (CurveZMQ, what ``gossiploco peer`` always runs);
   the table then compares the two (what encryption costs on the link);
3. with ``--swap-mb MB``, the heartbeat check (probe ``swap``): p0 and p1 swap MB with
   ``ZmqExchange.swap`` in ``--chunk-mb`` chunks, with the peers' heartbeat timeout
   (``--heartbeat-timeout-s``, else the runtime's). It shows whether a healthy connection survives
   one chunk's time on the wire: ``--bandwidths 5 --swap-mb 8`` fails with the runtime's 5 s and
   passes with ``--heartbeat-timeout-s 60`` or ``--chunk-mb 1`` (see "ZeroMQ heartbeats" above);
4. every preset (``--presets``, default all of ``peers/``): M peers, each started as
   ``ip netns exec PREFIX-pI python -m gossiploco peer --rank I --join BOOTSTRAP --swarm-key RUN/swarm.key
   --identity RUN/peer-I/identity.key --host 10.77.0.I+1``.
   By default an inner step is a sleep of ``--step-time`` seconds (``inner.synthetic_step_s``: the
   machine's CPU may be shared, a sleep is not slowed down by it; the communication is real).
   ``--real-compute`` runs the model's real inner steps instead, and the prediction then uses the
   measured seconds per step. Training-time monitors are off (``monitor.enabled = false``) except
   for ``globalm1-adaptive``, which needs them (``monitor.every = 0``: one measurement, i.e. one
   blocking all-reduce of the parameters, per round; the simulator does not model it).

Measured utilization of a peer = ``round_utilization`` of its summary.json: seconds computing
inner steps / seconds of the training rounds (start-up and the final measurement excluded). The
table gives the median over the peers and their min-max; a row passes when the median is within
``--tolerance`` points (default 5) of the prediction. The prediction is
``gossiploco.utilization.simulate`` with N = the model's real parameter count, the preset's real
Mix1/Mix2 block fractions, M, H, T and B; outer-step time 0 (the simulator's default).

Safety: needs root (namespaces and tc need CAP_NET_ADMIN), ``ip`` and ``tc``; when it cannot run it
says why and exits 2. Only addresses in 10.77.0.0/24 inside its own namespaces are used. Namespaces
are removed on every exit path (try/finally; SIGINT, SIGTERM and SIGHUP are turned into a clean
stop; a second Ctrl+C during the clean-up is ignored), and leftovers of a crashed earlier run with the
same prefix are removed at start (their processes killed by pid first). A lock file keeps two runs
with the same prefix apart. Every wait has a deadline; peer processes get SIGINT, then SIGKILL.

    sudo .venv/bin/python bench/netem.py --heartbeat-timeout-s 60   # every preset at 16 and 60 Mbit/s
    sudo .venv/bin/python bench/netem.py --presets diloco,globalm1 --bandwidths 20 --rounds 3
    sudo .venv/bin/python bench/netem.py --real-compute --presets globalm1-localm2 --bandwidths 60
    sudo .venv/bin/python bench/netem.py --presets none --bandwidths 50,200,1000 --ring-security plain,curve \
        --ring-repeats 7                                       # what encryption costs on the link (ring probe)
    sudo .venv/bin/python bench/netem.py --workers 2 --bandwidths 5 --presets none --tcp-seconds 0 \
        --ring-repeats 0 --swap-mb 8                           # the heartbeat drop alone (then: --heartbeat-timeout-s 60)
    .venv/bin/python bench/netem.py --predict-only             # the predictions only (no root needed)
    sudo .venv/bin/python bench/netem.py --cleanup             # remove leftovers of a crashed run

Exit codes: 0 ran (misses are reported, not failures; ``--strict`` makes a miss exit 1), 1 a run
broke (a peer failed or timed out), 2 cannot run here, 130 interrupted. Output: ``--out``
(default runs/netem): results.json (everything, per peer), table.md, and per run the peers' logs,
metrics.jsonl and summary.json; ``--sample-links 0.1`` adds every switch port's byte counters
over time (links.jsonl).

The network is the test bed's (``testbed.netns.Star``, links shaped by ``testbed.links``). The
probes run as ``python -m testbed.probes KIND ...`` inside the namespaces, one process per namespace
(``python -m testbed.probes KIND --help``): ``ring``, ``swap``, ``tcp-server`` / ``tcp-client`` (one
raw TCP stream, no ZeroMQ: what a single flow gets out of the shaped link) and ``sample`` (in the
switch namespace: every port's byte counters at an interval, JSON lines).

Modules: this driver (options, set-up, the loop over bandwidths and presets); ``netem_network`` (the
network, its processes and link probes); ``netem_runs`` (a preset's peers on the network, measured);
``netem_report`` (the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from testbed.machine import cpu_model
from testbed.netns import PREFIX_RE, Unavailable, preflight, prefix_lock, remove_namespaces, sh

if __package__:  # imported as bench.netem (the repository root on sys.path, as under pytest)
    from bench.netem_network import ROOT, SECURITIES, Network, probe_ring, probe_swap, probe_tcp, ring_rate_mbps
    from bench.netem_report import markdown, swap_line
    from bench.netem_runs import make_plan, run_plan
else:  # run as a script (python bench/netem.py): bench/ is on sys.path
    from netem_network import ROOT, SECURITIES, Network, probe_ring, probe_swap, probe_tcp, ring_rate_mbps
    from netem_report import markdown, swap_line
    from netem_runs import make_plan, run_plan

DEFAULT_PREFIX = "gln"
PEER_PORT = 7100
EXIT_UNAVAILABLE = 2


# ---------------------------------------------------------------------------------------
# Main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Real gossiploco peers on tc-shaped links in network namespaces: "
                                     "measured compute utilization against the simulator.",
                                     epilog="`python -m testbed.probes KIND --help`: the link probes it runs inside the "
                                     "namespaces (ring, swap, tcp-server, tcp-client, sample).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--presets", default="all", help="Comma-separated preset names, 'all' (every file in peers/) or "
                        "'none' (only the link probes).")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="A config override for every preset's peers and its prediction (e.g. mix1.compression=4bit).")
    parser.add_argument("--bandwidths", default="16,60", help="Link rates in Mbit/s (each direction, per peer), comma-separated.")
    parser.add_argument("--workers", type=int, default=4, help="Peers M (one namespace each).")
    parser.add_argument("--model", default="small", help="Model size (payload: its real parameter count, fp32).")
    parser.add_argument("--step-time", type=float, default=0.3, help="Seconds of one synthetic inner step T.")
    parser.add_argument("--inner-steps", type=int, default=10, help="Inner steps H per round.")
    parser.add_argument("--rounds", type=int, default=4, help="Rounds R per run.")
    parser.add_argument("--sync-dp-inner-steps", type=int, default=5, help="sync-dp: steps per 'round' (its utilization does not depend on H).")
    parser.add_argument("--sync-dp-rounds", type=int, default=2, help="sync-dp: rounds.")
    parser.add_argument("--real-compute", action="store_true", help="Real inner steps of the model instead of sleeps; T is then measured.")
    parser.add_argument("--seq-len", type=int, default=64, help="Tokens per sequence (real compute).")
    parser.add_argument("--batch-size", type=int, default=4, help="Sequences per inner step (real compute).")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="netem delay on each direction of each link.")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="netem loss on each direction of each link.")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--queue-packets", type=int, default=1000,
                        help="FIFO length of each shaped direction, in packets (1000: Linux's default txqueuelen). "
                             "Short queues drop more and make TCP (Reno) flows stall and share unevenly.")
    parser.add_argument("--congestion-control", default="auto",
                        help="TCP congestion control in the peer namespaces: auto (cubic if the host allows it, else reno), "
                             "inherit (the host's default), or a name (reno, cubic, bbr).")
    parser.add_argument("--sample-links", type=float, default=0.0, metavar="SECONDS",
                        help="Record every switch port's byte counters at this interval during each run (links.jsonl; 0: off).")
    parser.add_argument("--tolerance", type=float, default=5.0, help="Points of utilization a median may differ from the prediction.")
    parser.add_argument("--ring-repeats", type=int, default=3, help="Ring all-reduce probes per bandwidth (0: skip).")
    parser.add_argument("--ring-security", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                        default=["plain"], metavar="plain[,curve]",
                        help="Transports the ring probe times: plain (ZmqExchange with trust=None) and/or curve "
                             "(CurveZMQ with Trust.static, what `gossiploco peer` runs); with both they alternate repeat "
                             "by repeat in the same processes and the table compares them. The main table's ring "
                             "column is the first one's.")
    parser.add_argument("--tcp-seconds", type=float, default=3.0, help="Raw TCP probe length per bandwidth (0: skip).")
    parser.add_argument("--swap-mb", type=float, default=0.0,
                        help="Heartbeat check per bandwidth: peers 0 and 1 swap this many MB in --chunk-mb chunks with "
                             "the peers' heartbeat timeout (--heartbeat-timeout-s, else the runtime's); 0: skip.")
    parser.add_argument("--chunk-mb", type=float, default=4.0,
                        help="transport.chunk_mb of the peers and the ring probe (the runtime's default). With the "
                             "runtime's 5 s heartbeat, a chunk that takes longer than 5 s on the wire drops the connection "
                             "(4 MiB: below 6.7 Mbit/s per flow).")
    parser.add_argument("--discovery", choices=("dht", "static"), default="dht",
                        help="How the peers find each other: a bootstrap DHT node in peer 0's namespace (--join), "
                             "or a static --peers list.")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=0.0,
                        help="Run the peers with timeouts.heartbeat_s set to this instead of the runtime's 5 s "
                             "(0: unchanged). libzmq counts only whole messages, so on a slow, congested link the "
                             "5 s timeout can drop healthy connections.")
    parser.add_argument("--exchange-timeout-s", type=float, default=120.0, help="timeouts.exchange_s of the peers.")
    parser.add_argument("--startup-allowance-s", type=float, default=240.0, help="Added to 3x the predicted run time for a run's deadline.")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="Name prefix of the namespaces this run makes (and cleans).")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "netem", help="Output directory (results.json, table.md, per-run logs).")
    parser.add_argument("--predict-only", action="store_true", help="Print the plans and predictions; run nothing (no root needed).")
    parser.add_argument("--cleanup", action="store_true", help="Only remove leftovers of an earlier run with --prefix.")
    parser.add_argument("--report", type=Path, metavar="RESULTS_JSON", help="Only rewrite the tables of an earlier run's results.json (no root needed).")
    parser.add_argument("--strict", action="store_true", help="Exit 1 when a row misses the tolerance or the ring rate is under 90%% of B.")
    return parser.parse_args(argv)


def presets_of(text: str) -> list[str]:
    from gossiploco.config import preset_names

    names = preset_names()
    if text == "all":
        return names
    if text == "none":
        return []
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in names]
    if unknown:
        raise SystemExit(f"error: unknown presets {unknown}; choose from {names}")
    return chosen


def machine_info() -> dict:
    import platform

    info = {"kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count()}
    info["cpu"] = cpu_model()
    with contextlib.suppress(OSError):
        info["loadavg_start"] = Path("/proc/loadavg").read_text().split()[:3]
    info["ip"] = sh(["ip", "-V"], check=False).stdout.strip() if shutil.which("ip") else None
    return info


class _Stop(KeyboardInterrupt):
    """A signal asked us to stop (SIGINT, SIGTERM, SIGHUP)."""


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["probe"]:  # the link probes' old entry point
        from testbed.probes import main as probe_main

        return probe_main(argv[1:])
    args = parse_args(argv)
    if not PREFIX_RE.match(args.prefix):
        print(f"error: --prefix must match {PREFIX_RE.pattern}, got {args.prefix!r}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    bandwidths = [float(b) for b in args.bandwidths.split(",") if b.strip()]
    presets = presets_of(args.presets)
    if not args.ring_security or any(m not in SECURITIES for m in args.ring_security):
        print(f"error: --ring-security takes a comma-separated list of {', '.join(SECURITIES)}", file=sys.stderr)
        return 1

    if args.report:
        table = markdown(json.loads(args.report.read_text()))
        (args.report.parent / "table.md").write_text(table + "\n")
        print(table)
        return 0

    if args.predict_only:
        for b in bandwidths:
            for preset in presets:
                plan = make_plan(preset, b, args)
                p = plan.prediction
                print(f"{preset:24s} {b:6g} Mbit/s  predicted {100 * p['compute_utilization']:5.1f}%  "
                      f"round {p['wall_s']:.2f} s (compute {p['compute_s']:.2f}, mix1 {p['mix1_attempt_s']:.2f}, "
                      f"mix2 {p['mix2_attempt_s']:.2f}, x{plan.cfg.rounds} rounds)")
        return 0

    if args.workers < 2 and not args.cleanup and (args.swap_mb > 0 or args.tcp_seconds > 0):
        print("error: the TCP probe and --swap-mb need --workers 2 or more (they run between peers 0 and 1)", file=sys.stderr)
        return 1
    problem = preflight()
    if problem:
        print(f"bench/netem.py cannot run here: {problem}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in previous:
        signal.signal(s, _on_signal)
    net: Network | None = None
    try:
        with prefix_lock(args.prefix):
            leftovers = remove_namespaces(args.prefix)
            if leftovers:
                print(f"removed leftovers of an earlier run: {', '.join(leftovers)}")
            if args.cleanup:
                return 0
            net = Network(args.prefix, args.workers, args.mtu)
            try:
                return run_all(net, args, presets, bandwidths)
            finally:
                # No second Ctrl+C may interrupt the clean-up.
                for s in previous:
                    signal.signal(s, signal.SIG_IGN)
                removed = net.destroy()
                print(f"removed namespaces: {', '.join(removed) if removed else 'none left'}")
    except Unavailable as exc:
        print(f"bench/netem.py cannot run here: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except RuntimeError as exc:  # a command of the set-up failed: already cleaned up
        print(f"bench/netem.py: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'SIGINT'}); peers stopped, namespaces removed", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_all(net: Network, args: argparse.Namespace, presets: list[str], bandwidths: list[float]) -> int:
    from gossiploco.utilization import block_sizes, default_vocab_size

    args.out.mkdir(parents=True, exist_ok=True)
    net.build()
    results: dict[str, Any] = {"machine": machine_info(), "argv": sys.argv, "args": {k: str(v) for k, v in vars(args).items()},
                               "links": [], "runs": []}
    results["machine"]["tcp_congestion_control"] = net.set_congestion_control(args.congestion_control)
    print(f"{net.peers} peer namespaces {net.ns(0)}..{net.ns(net.peers - 1)} on bridge {net.switch}/br0, "
          f"TCP congestion control {results['machine']['tcp_congestion_control']}", flush=True)
    path = args.out / "results.json"
    broken = False
    port = PEER_PORT
    for b in bandwidths:
        net.shape(b, args.delay_ms, args.loss_pct, args.queue_packets)
        link: dict[str, Any] = {"bandwidth_mbps": b, "tc": net.qdisc_text(0)}
        results["links"].append(link)
        link_dir = args.out / f"link-{b:g}mbit"
        if args.tcp_seconds > 0:
            link["tcp"] = probe_tcp(net, link_dir, args.tcp_seconds)
            print(f"[{b:g} Mbit/s] raw TCP p0->p1: {link['tcp']['mbps']:.2f} Mbit/s ({100 * link['tcp']['mbps'] / b:.1f}% of B)", flush=True)
        if args.ring_repeats > 0:
            from gossiploco.config import load_config

            cfg = load_config("globalm1", {"model.size": args.model})
            numel = sum(block_sizes(cfg.model.size, default_vocab_size(cfg)).values())
            link["ring"] = probe_ring(net, link_dir, numel, args.ring_repeats, args.exchange_timeout_s, chunk_mb=args.chunk_mb,
                                      security=args.ring_security)
            for mode, by in link["ring"]["by_security"].items():
                by["median_s"] = statistics.median(by["durations_s"])
                by["mbps"] = ring_rate_mbps(4 * numel, net.peers, by["median_s"])
                print(f"[{b:g} Mbit/s] ring all-reduce ({mode}) of {4 * numel / 1e6:.2f} MB among {net.peers}: "
                      f"{by['median_s']:.3f} s = {by['mbps']:.2f} Mbit/s ({100 * by['mbps'] / b:.1f}% of B)", flush=True)
            link["ring_mbps"] = link["ring"]["by_security"][args.ring_security[0]]["mbps"]
        if args.swap_mb > 0:
            link["swap"] = probe_swap(net, link_dir, args.swap_mb, args.chunk_mb, args.heartbeat_timeout_s,
                                      args.exchange_timeout_s)
            print(f"[{b:g} Mbit/s] {swap_line(link['swap'], b)}", flush=True)
        for preset in presets:
            plan = make_plan(preset, b, args)
            port += 1
            run = run_plan(net, plan, args, args.out / f"{preset}-{b:g}mbit", port, link.get("tcp", {}).get("mbps"))
            results["runs"].append(run)
            if "error" in run:
                broken = True
                print(f"[{b:g} Mbit/s] {preset}: ERROR {run['error']}", flush=True)
            else:
                print(f"[{b:g} Mbit/s] {preset:24s} predicted {run['predicted_pct']:5.1f}%  measured {run['measured_median_pct']:5.1f}% "
                      f"({run['measured_min_pct']:.1f}-{run['measured_max_pct']:.1f})  diff {run['diff_pts']:+.1f}  "
                      f"{'pass' if run['pass'] else 'MISS'}  ({run['wall_s']:.0f} s)", flush=True)
            path.write_text(json.dumps(results, indent=1, default=str))
    results["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    path.write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {path}  table: {args.out / 'table.md'}")
    if broken:
        return 1
    missed = [r for r in results["runs"] if not r.get("pass")]
    slow = [link for link in results["links"] if link.get("ring_mbps") and link["ring_mbps"] < 0.9 * link["bandwidth_mbps"]]
    return 1 if args.strict and (missed or slow) else 0


if __name__ == "__main__":
    sys.exit(main())
