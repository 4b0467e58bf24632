"""What each path between peers costs, measured with real peers in the NAT testbed (testbed/nat.py).

For each shaped rate B (``--rates``; every host's access link shaped to B each way) and each path
(``gossiploco.reach.paths``) it runs two real peers, each a ``joined_peer(...)`` (tiny config,
``reachability="auto"``: the dial-back check decides) in its namespace, found through a bootstrap
``gossiploco dht`` on ``pub0`` (also the relay)::

    direct   pub1 <-> pub2        reverse  pub1 <-> home0        relayed  home0 <-> home1 (through pub0)

and measures, with ``ZmqExchange.swap`` over that path (probe ``bench/reach.py probe``):

1. goodput: median of ``--repeats`` swaps of ``--mb`` MiB (each side sends that much at once), Mbit/s per
   direction and as a fraction of B. Both directions of a relayed swap share the relay's download (and
   upload): its ceiling is B/2 per direction, and ``2 x goodput / B`` is the fraction of the relay's link;
2. round trip of a small message: median of ``--pings`` pairs of back-to-back 1 KiB swaps (both sides
   start a swap together, so one swap lasts one one-way trip); and the difference to direct;
3. CPU seconds per GB delivered (both directions' payload): utime + stime (/proc/PID/stat) of every
   process in the namespaces on the path (each peer's process, its DHT child and p2pd; for relayed the
   relay's too) between barrier swaps around the bulk swaps; also net of an idle window's rate.

Then (``--swarm-rate``) a 4-peer swarm, ``gossiploco peer --join`` on pub1, pub2, home0, home1 with the
bootstrap on pub0, synthetic inner steps (bench/netem.py's settings, ``testbed.peers.measured_overrides``),
against the simulator (see
``swarm_prediction`` for how the relay's constraint goes in); ``--ring-orders topology,id`` runs it once
per ``transport.ring_order`` (the effect of topology-aware rings), ``--relay-rate`` gives the relay a
slower link than the peers' (a relay shared by many). TCP congestion control: ``--cc`` in every
host namespace (reno by default, as bench/netem.py's ``auto`` picks here: BBR paces bursts below B).

Needs root (exit 2 otherwise); namespaces and processes go with the testbed's context manager; every
wait has a deadline. ``sudo .venv/bin/python bench/reach.py``: results.json and table.md in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from testbed.nat import NatTestbed, NatUnavailable, nat_preflight
from testbed.netns import sh
from testbed.overrides import set_args
from testbed.peers import measured_overrides, netns_peers, predict, read_peer
from testbed.processes import ProcessGroup, child_env, tail

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
PAIRS = {"direct": ("pub1", "pub2"), "reverse": ("pub1", "home0"), "relayed": ("home0", "home1")}
RELAY, PRESET = "pub0", "globalm1-localm2"
SWARM_HOSTS = ("pub1", "pub2", "home0", "home1")


# -- probe: one peer, in its namespace ---------------------------------------------------------


def namespace_cpu(names: list[str]) -> dict[str, float]:
    """utime + stime seconds of every process whose network namespace is one of ``names``: ``{"NS/NAME/PID": s}``."""
    tick = os.sysconf("SC_CLK_TCK")
    inode = {os.stat(f"/run/netns/{n}").st_ino: n for n in names}
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ns = inode.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
            if ns is None:
                continue
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{ns}/{stat[stat.index('(') + 1:stat.rindex(')')]}/{pid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}


def probe(args: argparse.Namespace) -> int:
    import torch

    from gossiploco.config import TINY_OVERRIDES, load_config
    from gossiploco.runtime.dht_peer import joined_peer
    from gossiploco.security.identity import Identity
    from gossiploco.security.options import peer_trust
    from gossiploco.security.swarm_key import SwarmKey

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(PRESET, {**TINY_OVERRIDES, "workers": 2, "monitor.enabled": False,
                               "timeouts.exchange_s": args.timeout_s, "timeouts.startup_s": args.timeout_s})
    trust = peer_trust(SwarmKey.load(args.swarm_key), identity_file=Path(args.identity))
    partner = Identity.load_or_create(Path(args.partner)).peer_id
    result: dict = {"peer": trust.peer_id, "partner": partner, "began": time.time()}
    node = joined_peer(cfg, trust, None, [args.join], args.host, 0, None, args.run_id, reachability="auto")
    try:
        node.discovery.discover_at_start()  # announce, find the partner, connect by the path the records give
        ex, deadline = node.exchange, time.monotonic() + args.timeout_s
        while partner not in ex.connected():
            if time.monotonic() > deadline:
                raise TimeoutError(f"partner {partner} not connected after {args.timeout_s:g} s")
            time.sleep(0.1)
        result.update(reachable=node.reach.reachable, path=node.paths.paths.get(partner),
                      connected_after_s=time.time() - result["began"])
        small = torch.zeros(256)  # 1 KiB
        ex.swap("ping/0", partner, small)  # warm-up
        rtts = []
        for i in range(args.pings):
            t = time.perf_counter()
            ex.swap(f"ping/{2 * i + 1}", partner, small)
            ex.swap(f"ping/{2 * i + 2}", partner, small)
            rtts.append(time.perf_counter() - t)
        mine, seconds = torch.full((int(args.mb * (1 << 20)) // 4,), float(trust.peer_id % 1000)), []
        # The mailbox is sized for the tiny model's exchanges; the payload here is far larger, and a partner
        # that starts a swap first may send it all before this side's swap begins (it would be dropped).
        ex.grow_mailbox(4 * mine.numel() * 4, 2 * mine.numel() * 4)
        ns = args.cpu_ns.split(",") if args.cpu_ns else []
        if ns:  # the idle baseline: both sides wait (the partner in its first barrier)
            idle0, t = namespace_cpu(ns), time.perf_counter()
            time.sleep(args.idle_s)
            result.update(idle_cpu=cpu_delta(idle0, namespace_cpu(ns)), idle_s=time.perf_counter() - t)
        cpu0, began = (namespace_cpu(ns) if ns else None), time.perf_counter()
        for i in range(args.repeats):
            ex.swap(f"barrier/{i}", partner, small)
            t = time.perf_counter()
            got = ex.swap(f"mix2/{i}", partner, mine)
            seconds.append(time.perf_counter() - t)
            if float(got[0]) != float(partner % 1000) or float(got[-1]) != float(partner % 1000):
                raise RuntimeError("the partner's payload arrived wrong")
        ex.swap("barrier/end", partner, small)
        if cpu0 is not None:
            result.update(cpu=cpu_delta(cpu0, namespace_cpu(ns)), cpu_window_s=time.perf_counter() - began)
        result.update(ok=True, rtt_s=rtts, seconds=seconds, bytes=mine.numel() * 4)
    except Exception as exc:  # noqa: BLE001 - reported in the output file, the run goes on
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        node.close(linger_s=1.0)
    Path(args.out).write_text(json.dumps(result))
    return 0


# -- orchestration -------------------------------------------------------------------------------


def measure_pair(bed: NatTestbed, out: Path, join: str, path: str, rate: float, args: argparse.Namespace) -> dict:
    from gossiploco.security.options import ordered_identities

    d = out / f"{path}-{rate:g}"
    ids = ordered_identities(2, d)
    hosts = [bed.host(h) for h in PAIRS[path]]
    cpu_ns = [h.ns for h in hosts] + [bed.host(RELAY).ns]
    mb = args.mb[args.rates.index(rate)]
    group, load0, t0 = ProcessGroup(env=child_env(), cwd=ROOT, ctrl_c=True, grace_s=10.0), os.getloadavg(), time.monotonic()
    for i, host in enumerate(hosts):
        cmd = [*host.exec_prefix(), sys.executable, "-m", "bench.reach", "probe", "--join", join, "--swarm-key", str(out / "swarm.key"),
               "--identity", str(ids[i]), "--partner", str(ids[1 - i]), "--host", host.address, "--mb", str(mb),
               "--repeats", str(args.repeats), "--pings", str(args.pings), "--run-id", f"reach-{path}-{rate:g}",
               "--out", str(d / f"probe-{i}.json"), "--timeout-s", str(args.probe_timeout_s)]
        cmd += ["--cpu-ns", ",".join(cpu_ns)] if i == 0 else []
        group.start(cmd, d / f"probe-{i}.log")
    try:
        codes = group.wait(3 * args.probe_timeout_s + 120)
    finally:
        group.stop()  # SIGINT, then SIGKILL; a peer's DHT child and p2pd follow it (membership.lifeline)
    files = [d / f"probe-{i}.json" for i in range(2)]
    sides = [json.loads(f.read_text()) if f.exists() else {"ok": False, "error": tail(f.with_suffix(".log"))} for f in files]
    res: dict = {"path": path, "rate_mbit": rate, "mb": mb, "hosts": PAIRS[path], "exit_codes": codes, "sides": sides,
                 "wall_s": time.monotonic() - t0, "load_before": load0, "load_after": os.getloadavg()}
    if not all(s.get("ok") for s in sides):
        res["error"] = "; ".join(f"{PAIRS[path][i]}: {s.get('error')}" for i, s in enumerate(sides) if not s.get("ok"))
        return res
    seconds = [max(a, b) for a, b in zip(sides[0]["seconds"], sides[1]["seconds"])]  # done when both have theirs
    goodput = sides[0]["bytes"] * 8 / statistics.median(seconds) / 1e6
    cpu, idle, window = sides[0]["cpu"], sides[0]["idle_cpu"], sides[0]["cpu_window_s"]
    on_path = [h.ns for h in hosts] + ([bed.host(RELAY).ns] if path == "relayed" else [])
    gb = 2 * sides[0]["bytes"] * len(seconds) / 1e9
    by_ns = {n: sum(v for k, v in cpu.items() if k.startswith(n + "/")) for n in cpu_ns}
    idle_by_ns = {n: sum(v for k, v in idle.items() if k.startswith(n + "/")) * window / sides[0]["idle_s"] for n in cpu_ns}
    res.update(paths_seen=[s["path"] for s in sides], reachable=[s["reachable"] for s in sides], seconds=seconds,
               goodput_mbit=goodput, goodput_frac=goodput / rate,
               relay_link_frac=2 * goodput / rate if path == "relayed" else None,
               rtt_ms=1e3 * statistics.median(sides[0]["rtt_s"] + sides[1]["rtt_s"]),
               cpu_s=sum(by_ns[n] for n in on_path), cpu_by_ns=by_ns, idle_cpu_by_ns=idle_by_ns, cpu_by_proc=cpu,
               cpu_window_s=window, gb=gb)
    res["cpu_s_per_gb"] = res["cpu_s"] / gb
    res["net_cpu_s_per_gb"] = (res["cpu_s"] - sum(idle_by_ns[n] for n in on_path)) / gb
    return res


def swarm_prediction(cfg, rate: float, step_s: float, ids: list[int]) -> dict:
    """The simulator's round (``testbed.peers.predict``: one link rate B for every peer), plus the relay.

    ``gossiploco.utilization`` has one bandwidth for every link; it cannot place a relay. What goes
    through the relay here: the ring (Mix1) never does (``agreement.ring_order`` puts NAT'd peers
    between reachable ones), a Mix2 gossip swap does when the round's matching pairs the two NAT'd
    peers. Both directions of that swap then share the relay's link (B each way), so it runs at B/2:
    Mix2 takes twice the simulator's ``a2``. The matching is known (``pair_matching`` of the seed, the
    round and the peers' ids), so per round: wall = the simulator's wall at B, plus ``a2`` in the
    rounds whose matching is relayed. A blocking Mix2 that ends late delays its pair's next round, and
    the next pairings pass the delay on, so the swarm is taken to move in step: every peer's
    utilization is sum(C) / sum(wall)."""
    from gossiploco.mixing.operators import pair_matching

    base = predict(cfg, rate, step_s)
    relayed = [r for r in range(cfg.rounds) if pair_matching(cfg.seed, r, "mix2", ids).get(ids[2]) == ids[3]]
    walls = [base["wall_s"] + (base["mix2_attempt_s"] if r in relayed else 0.0) for r in range(cfg.rounds)]
    return {"plain_pct": 100 * base["compute_utilization"], "relayed_rounds": relayed,
            "with_relay_pct": 100 * base["compute_s"] * cfg.rounds / sum(walls), "simulator": base,
            "expected_pct": 100 * base["compute_s"] / (base["wall_s"] + base["mix2_attempt_s"] / 3)}


def measure_swarm(bed: NatTestbed, out: Path, join: str, rate: float, args: argparse.Namespace,
                  goodput: float | None, ring_order: str = "topology") -> dict:
    overrides = measured_overrides(PRESET, model=args.model, workers=4, inner_steps=args.inner_steps, rounds=args.rounds,
                                   sync_dp_inner_steps=5, sync_dp_rounds=2, seq_len=64, batch_size=4,
                                   exchange_timeout_s=120.0, chunk_mb=4.0, step_time_s=args.step_time,
                                   sets={"transport.ring_order": ring_order})
    from gossiploco.config import load_config

    cfg = load_config(PRESET, overrides)
    sets = set_args(overrides, without=("workers",))
    d = out / f"swarm-{rate:g}-{ring_order}"
    load0, t0 = os.getloadavg(), time.monotonic()
    # --new-run: each measured swarm is a run of its own beside the earlier ones' entries, which may outlive them
    # (announce_ttl_s) where a tombstone did not get through a relay
    with netns_peers([bed.host(h) for h in SWARM_HOSTS], d, ["--config", PRESET, "--quiet", "--new-run", *sets], env=child_env(),
                    join=join, swarm_key=out / "swarm.key") as peers:
        peers.start()
        codes = peers.wait(args.swarm_timeout_s)
    res: dict = {"rate_mbit": rate, "ring_order": ring_order, "relay_rate_mbit": args.relay_rate or rate,
                 "exit_codes": codes, "wall_s": time.monotonic() - t0, "overrides": overrides,
                 "load_before": load0, "load_after": os.getloadavg()}
    if any(c != 0 for c in codes.values()):
        res["error"] = f"exit codes {codes}; " + "; ".join(peers.log(r)[-800:] for r, c in codes.items() if c != 0)
        return res
    ids = [peers.peer_id(r) for r in range(4)]
    res["peers"] = [read_peer(d, r) for r in range(4)]
    summaries = [json.loads((d / f"peer-{r}" / "summary.json").read_text()) for r in range(4)]
    res["reach"] = [s.get("reach") for s in summaries]
    res["prediction"] = swarm_prediction(cfg, rate, args.step_time, ids)
    if goodput:  # not the prediction: the simulator fed with the direct swap's measured goodput (framing, CURVE)
        res["prediction_at_goodput"] = swarm_prediction(cfg, goodput, args.step_time, ids)
    res["measured_pct"] = [100 * p["round_utilization"] for p in res["peers"]]
    res["measured_median_pct"] = statistics.median(res["measured_pct"])
    rows = [json.loads(x) for r in range(4) for x in (d / f"peer-{r}" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    res["mix1_wait_s_median"] = statistics.median([x["mix1_wait_s"] for x in rows if "mix1_wait_s" in x] or [0.0])
    last = [json.loads(x) for x in (d / "peer-2" / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
    from gossiploco.mixing.operators import pair_matching  # the check that the predicted matching is the run's

    res["last_round_partner_ok"] = last.get("mix2_partner") == pair_matching(cfg.seed, cfg.rounds - 1, "mix2", ids)[ids[2]]
    res["tunnel_bytes"] = sum(((r or {}).get("tunnels") or {}).get("bytes", 0) for r in res["reach"][2:])
    return res


def table(results: dict) -> str:
    lines = ["| path | B Mbit/s | paths seen | MiB | swap s (each) | goodput Mbit/s | % of B | % of relay link | RTT ms | "
             "+RTT vs direct ms | CPU s/GB (net of idle) | load before -> after |", "|" + "---|" * 12]
    for p in results["pairs"]:
        load = f"{p['load_before'][0]:.1f} -> {p['load_after'][0]:.1f}"
        if "error" in p:
            lines.append(f"| {p['path']} | {p['rate_mbit']:g} | FAILED: {p['error'][:200]} |||||||||| {load} |")
            continue
        direct = next((q for q in results["pairs"] if q["path"] == "direct" and q["rate_mbit"] == p["rate_mbit"]
                       and "rtt_ms" in q), None)
        added = f"{p['rtt_ms'] - direct['rtt_ms']:+.2f}" if direct else "-"
        relay = f"{100 * p['relay_link_frac']:.1f}" if p["relay_link_frac"] else "-"
        lines.append(f"| {p['path']} | {p['rate_mbit']:g} | {'/'.join(p['paths_seen'])} | {p['mb']:g} | "
                     f"{', '.join(f'{s:.2f}' for s in p['seconds'])} | {p['goodput_mbit']:.1f} | "
                     f"{100 * p['goodput_frac']:.1f} | {relay} | {p['rtt_ms']:.2f} | {added} | {p['cpu_s_per_gb']:.1f} ({p['net_cpu_s_per_gb']:.1f}) | {load} |")
    for s in results.get("swarms", []):
        lines.append("")
        if "error" in s:
            lines.append(f"swarm at {s['rate_mbit']:g} Mbit/s FAILED: {s['error'][:1500]}")
            continue
        pr = s["prediction"]
        lines.append(f"ring order {s['ring_order']}, relay link {s['relay_rate_mbit']:g} Mbit/s, median Mix1 wait "
                     f"{s['mix1_wait_s_median']:.2f} s per round")
        lines += ["| swarm B | measured median % (per peer) | simulator % (one link B) | simulator + relay % "
                  "(relayed Mix2 rounds) | E[...] at p=1/3 | same, at direct goodput | matching checked | load before -> after |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {s['rate_mbit']:g} | {s['measured_median_pct']:.1f} ({', '.join(f'{u:.1f}' for u in s['measured_pct'])}) "
                  f"| {pr['plain_pct']:.1f} | {pr['with_relay_pct']:.1f} ({pr['relayed_rounds']}) | {pr['expected_pct']:.1f} "
                  f"| {s['prediction_at_goodput']['with_relay_pct'] if 'prediction_at_goodput' in s else float('nan'):.1f} "
                  f"| {s['last_round_partner_ok']} "
                  f"| {s['load_before'][0]:.1f} -> {s['load_after'][0]:.1f} |"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    from gossiploco.security.swarm_key import SwarmKey

    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "pairs": [], "swarms": [],
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
                     "git": sh(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=False).stdout.strip(),
                     "dirty": sh(["git", "-C", str(ROOT), "status", "--short"], check=False).stdout.split("\n")}
    for rate in args.rates:
        with NatTestbed(public=3, homes=2, rate_mbit=rate, prefix=args.prefix) as bed:
            for host in bed.public_hosts + bed.home_hosts:
                sh([*host.exec_prefix(), "sysctl", "-q", "-w", f"net.ipv4.tcp_congestion_control={args.cc}"])
            out = args.out / f"rate-{rate:g}"
            out.mkdir(parents=True, exist_ok=True)
            (out / "swarm.key").unlink(missing_ok=True)  # an earlier run's
            SwarmKey.generate().save(out / "swarm.key")
            if args.relay_rate:  # a busy relay: its link slower than the peers'
                bed.shape(bed.host(RELAY), args.relay_rate)
            join = bed.start_dht_node(bed.host(RELAY), out, env=child_env())[1]
            for path in args.paths:
                print(f"[{time.strftime('%H:%M:%S')}] {path} at {rate:g} Mbit/s ...", flush=True)
                results["pairs"].append(measure_pair(bed, out, join, path, rate, args))
                print(table({"pairs": results["pairs"][-1:]}).splitlines()[-1], flush=True)
            if rate == args.swarm_rate:
                print(f"[{time.strftime('%H:%M:%S')}] 4-peer swarm at {rate:g} Mbit/s ...", flush=True)
                goodput = next((p["goodput_mbit"] for p in results["pairs"] if p["rate_mbit"] == rate
                                and p["path"] == "direct" and "goodput_mbit" in p), None)
                for order in args.ring_orders:
                    results["swarms"].append(measure_swarm(bed, out, join, rate, args, goodput, order))
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results["git_after"] = sh(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cd"], check=False).stdout.strip()
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv[:1] == ["probe"]:
        for name in ("--join", "--swarm-key", "--identity", "--partner", "--host", "--run-id", "--out"):
            parser.add_argument(name, required=True)
        parser.add_argument("--cpu-ns", default="", help="namespaces whose processes' CPU time to record")
        for name, kind, default in (("--mb", float, 16.0), ("--repeats", int, 3), ("--pings", int, 20),
                                    ("--timeout-s", float, 120.0), ("--idle-s", float, 3.0)):
            parser.add_argument(name, type=kind, default=default)
        return probe(parser.parse_args(argv[1:]))
    floats = lambda text: [float(x) for x in text.split(",") if x.strip()]  # noqa: E731
    parser.add_argument("--rates", type=floats, default=[50.0, 500.0], help="shaped link rates, Mbit/s")
    parser.add_argument("--paths", type=lambda t: [p for p in t.split(",") if p], default=list(PAIRS))
    parser.add_argument("--relay-rate", type=float, default=0.0, help="the relay's (pub0) link, Mbit/s (0: as --rates)")
    parser.add_argument("--ring-orders", type=lambda t: t.split(","), default=["topology"],
                        help="transport.ring_order of the swarm, one swarm each (topology,id compares them)")
    parser.add_argument("--mb", type=floats, default=[16.0, 64.0], help="swap payload (MiB) at each of --rates")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pings", type=int, default=20)
    parser.add_argument("--probe-timeout-s", type=float, default=120.0)
    parser.add_argument("--swarm-rate", type=float, default=50.0, help="rate of the 4-peer swarm (0: none)")
    for name, kind, default in (("--model", str, "small"), ("--step-time", float, 0.3), ("--inner-steps", int, 10),
                                ("--rounds", int, 8), ("--swarm-timeout-s", float, 420.0)):
        parser.add_argument(name, type=kind, default=default, help="the swarm's (bench/netem.py's settings)")
    parser.add_argument("--cc", default="reno", help="TCP congestion control in the host namespaces")
    parser.add_argument("--prefix", default="gnrch")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "reach")
    args = parser.parse_args(argv)
    if len(args.mb) != len(args.rates):
        parser.error("--mb needs one payload per rate of --rates")
    problem = nat_preflight()
    if problem is not None:
        print(f"bench/reach.py cannot run here: {problem}", file=sys.stderr)
        return 2

    def stop(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)
    began = time.monotonic()
    try:
        results = run(args)
    except NatUnavailable as exc:
        print(f"bench/reach.py cannot run here: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc}); namespaces and processes removed", file=sys.stderr)
        return 130
    results["wall_s"] = time.monotonic() - began
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(table(results) + "\n")
    print(table(results))
    print(f"{results['wall_s']:.0f} s; {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
