"""Strangers and members against an *open* run (issue 25, part 1c): DHT storage, the run-entry lock-out and
the state-request flood, against a real open bootstrap node and real ``gossiploco peer --open`` processes.

    python bench/attacks_open.py [--records 10000] [--rounds 12] [--out DIR]

1. ``storage``: a throwaway identity stores ``--records`` signed records under distinct keys on an open
   bootstrap node (``start_bootstrap(open_run=True)``), first with a one-year expiry, then with 60 s; the
   node's DHT process RSS before and after, what it accepted (``dht_storage.storage_counts``), and whether a
   member still announces and reads its record and run entry.
2. ``run entry``: 3 honest peers of a 4-peer open run start; a stranger publishes a copy of their run entry
   with one field changed (its own identity, no member record); the 4th peer, with the run's exact
   settings, starts: it must join (not exit 2) and warn about the stranger's entry. This run is also the
   flood-free reference of 3.
3. ``state flood``: the same run again with one member started with ``GOSSIPLOCO_ATTACK=state_flood:5`` (5
   state requests to every member per round); the honest peers' uploaded bytes against the reference.

Writes ``bench/results/attacks-open.md`` (expectation, evidence, verdict per attack, with this command).
Exit status 1 if any attack succeeded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from attacks_swarm import Result, security  # a sibling module: bench/ is on sys.path when a bench script runs

from gossiploco.config import TINY_OVERRIDES
from gossiploco.membership.bootstrap import start_bootstrap
from gossiploco.membership.dht_directory import DhtDirectory
from gossiploco.membership.dht_entries import dht_time
from gossiploco.membership.dht_storage import MAX_KEYS_PER_WRITER, storage_counts
from gossiploco.membership.record import PeerRecord
from gossiploco.membership.runs import RunEntry
from gossiploco.protocol.state_limit import BURST, REFILL_ROUNDS
from gossiploco.runtime.launch import LocalPeers
from gossiploco.security.identity import Identity
from gossiploco.security.trust import Trust
from testbed.outsider import ENV, memory_kib, store_signed, stranger_dht
from testbed.overrides import peer_args
from testbed.processes import wait_until

ROOT = Path(__file__).resolve().parent.parent
PEERS = 4
FLOOD = 5
RSS_BOUND_MIB = 64
"""The DHT process may grow at most this much under the storage flood."""


class OpenPeers(LocalPeers):
    """``LocalPeers`` of an open run: ``--open`` instead of ``--swarm-key``."""

    def command(self, rank: int) -> list[str]:
        cmd = super().command(rank)
        at = cmd.index("--swarm-key")
        return cmd[:at] + ["--open"] + cmd[at + 2:]


def storage(address: str, dht, records: int) -> Result:
    res = Result("storage flood (one throwaway identity)",
                 f"the open bootstrap keeps at most {MAX_KEYS_PER_WRITER} of its records, none expiring far ahead; "
                 f"its DHT process grows < {RSS_BOUND_MIB} MiB; members still announce and read")
    identity = Identity.generate()
    stranger = stranger_dht(address, identity)
    directory = None
    try:
        rss0 = memory_kib(dht.pid, "VmRSS")
        started = time.monotonic()
        year = store_signed(stranger, [f"junk/year/{i}" for i in range(min(records, 2000))], identity.peer_id,
                            {"junk": "y" * 200}, dht_time() + 365 * 86400)
        batch, short = 1000, 0
        for i in range(0, records, batch):
            short += store_signed(stranger, [f"junk/{j}" for j in range(i, min(records, i + batch))], identity.peer_id,
                                  {"junk": "y" * 200}, dht_time() + 60)
        took = time.monotonic() - started
        rss1 = memory_kib(dht.pid, "VmRSS")
        counts = dht.run_coroutine(storage_counts)
        member = Trust(Identity.generate(), None)
        directory = DhtDirectory("run-open-bench", initial_peers=[address], ttl_s=20, heartbeat_s=5, timeout_s=10,
                                 trust=member)
        directory.announce_run(RunEntry(member.peer_id, "run-open-bench", {"workers": 1}))
        directory.announce(PeerRecord(member.peer_id, "tcp://127.0.0.1:9", round=-1, tokens=0,
                                      key=member.identity.curve_public))
        works = member.peer_id in directory.peers() and member.peer_id in directory.runs()
        res.happened += [f"{min(records, 2000)} records with a one-year expiry: {year} accepted",
                         f"{records} records with a 60 s expiry in {took:.0f} s: {short} accepted",
                         f"bootstrap storage {counts['storage']}",
                         f"DHT process RSS {rss0 >> 10} -> {rss1 >> 10} MiB",
                         f"a member announced and read its record and run entry: {works}"]
        if year or short > MAX_KEYS_PER_WRITER:
            res.fail(f"accepted {year} far-expiring and {short} short records")
        if (rss1 - rss0) >> 10 > RSS_BOUND_MIB:
            res.fail(f"the DHT process grew {(rss1 - rss0) >> 10} MiB")
        if not works:
            res.fail("a member could not announce or read")
    finally:
        if directory is not None:
            directory.close()
        stranger.shutdown()
    return res


def swarm_run(name: str, out: Path, address: str, rounds: int, flooder: int | None,
              forge: bool) -> tuple[LocalPeers, dict[int, int], dict[int, dict], list[str]]:
    """A 4-peer open run; ``forge``: a stranger publishes a changed copy of the run's entry before the last peer
    starts; ``flooder``: that rank floods state requests. Returns the peers, exit codes, summaries, notes."""
    shutil.rmtree(out / name, ignore_errors=True)
    args = peer_args("globalm1-localm2", {**TINY_OVERRIDES, "rounds": rounds, "inner_steps": 8})
    peers = OpenPeers(PEERS, out / name, args, env=ENV, join=address)
    notes: list[str] = []
    stranger = None
    try:
        env = {flooder: {"GOSSIPLOCO_ATTACK": f"state_flood:{FLOOD}"}} if flooder is not None else None
        peers.start(range(PEERS - 1), env=env)
        if forge:
            stranger = DhtDirectory("forger", initial_peers=[address], ttl_s=20, heartbeat_s=5, timeout_s=10,
                                    trust=Trust(Identity.generate(), None))
            if not wait_until(lambda: len(stranger.runs()) >= PEERS - 1, 120, 0.5):
                raise RuntimeError(f"the members' run entries did not appear: {stranger.runs()}")
            real = next(iter(stranger.runs().values()))
            config = json.loads(json.dumps(real.config))
            config["rounds"] = int(config.get("rounds", rounds)) + 1  # one field changed
            forged = RunEntry(stranger.trust.peer_id, real.run_id, config)
            stranger.announce_run(forged)
            notes.append(f"stranger {forged.peer} published run {real.run_id}'s entry with rounds "
                         f"{config['rounds']} (theirs {real.config.get('rounds')})")
        peers.start([PEERS - 1], env=env)
        codes = peers.wait(300)
    finally:
        if stranger is not None:
            stranger.close()
        peers.stop()
    summaries = {}
    for rank in range(PEERS):
        path = peers.peer_dir(rank) / "summary.json"
        summaries[rank] = json.loads(path.read_text()) if path.exists() else {}
    return peers, codes, summaries, notes


def run_entry(peers: LocalPeers, codes: dict[int, int], summaries: dict[int, dict], notes: list[str]) -> Result:
    res = Result("conflicting run entry from a stranger",
                 "the newcomer with the run's exact settings joins (exit 0, all rounds), warned about the entry "
                 "with its signer; counted in security.conflicting_run_entries")
    last = PEERS - 1
    log = peers.log(last)
    warned = "ignoring a conflicting entry" in log
    res.happened += notes + [f"exit codes {codes}", f"newcomer rounds {summaries[last].get('rounds')}",
                             f"newcomer warned: {warned}",
                             f"conflicting_run_entries {summaries[last].get('security', {}).get('conflicting_run_entries')}"]
    if codes.get(last) != 0 or not warned or not summaries[last].get("security", {}).get("conflicting_run_entries"):
        res.fail(f"newcomer exit {codes.get(last)}: {' '.join(log.split())[-400:]!r}")
    return res


def state_flood(reference: dict[int, dict], flooded: dict[int, dict], codes: dict[int, int], flooder: int,
                rounds: int, log: str) -> Result:
    bound = BURST + rounds // REFILL_ROUNDS + 1
    res = Result(f"state-request flood ({FLOOD} per member per round, 1 member of {PEERS})",
                 f"each honest peer serves the flooder at most {bound} states over {rounds} rounds (not "
                 f"{FLOOD * rounds}); honest uploads close to the flood-free run; refusals counted")
    honest = [r for r in range(PEERS) if r != flooder]
    sent_ref = sum(reference[r].get("bytes_sent", 0) for r in honest) / len(honest)
    sent = sum(flooded[r].get("bytes_sent", 0) for r in honest) / len(honest)
    refused = {r: flooded[r].get("security", {}).get("refused_state_requests", {}) for r in honest}
    over = [line for line in log.splitlines() if "state flood over" in line]
    res.happened += [f"exit codes {codes}",
                     f"honest peers' mean bytes sent {sent / 2**20:.1f} MiB vs {sent_ref / 2**20:.1f} MiB without "
                     f"the flood ({sent / max(1, sent_ref):.2f}x)",
                     f"refused state requests by honest peer {refused}",
                     f"flooder: {over[-1].split('state flood over: ')[-1] if over else '(no tally)'}",
                     f"honest security {[security(flooded[r]) for r in honest]}"]
    served = None
    if over:
        served = int(over[-1].split("state flood over: ")[-1].split()[0])
        if served > bound * len(honest):
            res.fail(f"{served} states served to the flooder, bound {bound * len(honest)}")
    if not all(sum(v.values()) for v in refused.values()):
        res.fail("an honest peer refused nothing")
    if any(codes.get(r) != 0 for r in honest):
        res.fail("an honest peer did not finish")
    return res


def write_results(path: Path, command: str, results: list[Result], wall: float) -> None:
    lines = ["# Attack suite: strangers and members against an open run", "",
             "Produced by `bench/attacks_open.py` (see its docstring).", "", "```", command, "```", "",
             f"Machine: 2 shared CPU cores, loopback. Bench wall time {wall:.0f} s. An open bootstrap node "
             f"(`start_bootstrap(open_run=True)`), and {PEERS} real `gossiploco peer --open` processes of the tests' "
             "tiny config (`globalm1-localm2`, 8 inner steps) per run.", "",
             "| Attack | An open run should | What happened (evidence) | Verdict |", "|---|---|---|---|"]
    for res in results:
        happened = "; ".join(res.happened).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {res.attack} | {res.expected} | {happened} | {'held' if res.ok else 'SUCCEEDED'} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "attacks-open")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "attacks-open.md")
    args = ap.parse_args()
    started = time.monotonic()
    dht, addresses = start_bootstrap("127.0.0.1", 0, open_run=True)
    results = []
    try:
        results.append(storage(addresses[0], dht, args.records))
        peers, codes, reference, notes = swarm_run("reference", args.out, addresses[0], args.rounds, None, True)
        results.append(run_entry(peers, codes, reference, notes))
        flooder = 0
        peers, codes, flooded, _ = swarm_run("flood", args.out, addresses[0], args.rounds, flooder, False)
        results.append(state_flood(reference, flooded, codes, flooder, args.rounds, peers.log(flooder)))
    finally:
        dht.shutdown()
    wall = time.monotonic() - started
    command = "python " + " ".join(["bench/attacks_open.py", *sys.argv[1:]])
    write_results(args.results, command, results, wall)
    for res in results:
        print(f"{'held' if res.ok else 'SUCCEEDED'}: {res.attack}: {'; '.join(res.happened)}")
    print(f"wall {wall:.0f} s; results in {args.results}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
