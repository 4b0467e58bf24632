"""gossiploco's own processes in the test bed: DHT nodes and peers in namespaces, and what a measured run reports.

- ``start_dht_node``: ``gossiploco dht`` (a bootstrap node and relay), anywhere (``where``: a namespace's
  ``ip netns exec`` prefix), returning its ``--join`` multiaddr once it prints it;
- ``netns_peers``: ``LocalPeers`` whose rank I runs in host I's namespace, on its address;
- ``run_swarm_key``: a fresh swarm key for one run;
- for runs measured against the simulator (bench/netem.py, bench/reach.py): ``measured_overrides`` (the
  settings every such run shares), ``predict`` (``gossiploco utilization``'s prediction for a config) and
  ``read_peer`` (what one peer's summary.json and metrics.jsonl say).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from testbed.processes import ProcessGroup, tail

DHT_START_S = 60.0
"""How long a DHT node may take to print its address (importing hivemind, starting p2pd)."""


class NetnsHost(Protocol):
    """A host of the test bed: a namespace to run in and an address there."""

    address: str

    def exec_prefix(self) -> list[str]: ...


def start_dht_node(group: ProcessGroup, log: Path, *, host: str, swarm_key: Path, port: int = 0,
                   where: Sequence[str] = (), join: str | None = None, extra: Sequence[str] = (),
                   env: dict[str, str] | None = None, timeout_s: float = DHT_START_S) -> tuple[subprocess.Popen, str]:
    """Start ``gossiploco dht --host HOST --port PORT --swarm-key KEY`` (after ``where``, e.g. ``ip netns exec
    NS``; with ``join`` a second node of the same DHT) in ``group``, appending to ``log`` (after a line with the
    command); returns the process and the multiaddr it prints for ``--join`` (``/ip4/HOST/tcp/PORT/p2p/ID``).
    Raises ``RuntimeError`` with the log's tail if it exits or prints none within ``timeout_s``."""
    cmd = [*where, sys.executable, "-m", "gossiploco", "dht", "--host", host, "--port", str(port),
           "--swarm-key", str(swarm_key), *extra, *(["--join", join] if join else [])]
    log = Path(log)
    start_at = log.stat().st_size if log.exists() else 0  # only this start's output counts
    proc = group.start(cmd, log, env=env, append=True, header=True)
    port_re = str(port) if port else r"\d+"
    pattern = re.compile(rf"/ip4/{re.escape(host)}/tcp/{port_re}/p2p/\w+")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with log.open("rb") as f:
            f.seek(start_at)
            text = f.read().decode(errors="replace")
        found = [m for line in text.splitlines() if not line.startswith("# ") for m in pattern.findall(line)]
        if found:
            return proc, found[-1]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"the DHT node on {host} printed no address within {timeout_s:g} s "
                       f"(exit code {proc.poll()}):\n{tail(log)}")


def netns_peers(hosts: Sequence[NetnsHost], out_dir: Path, args: list[str], *,
                extra: dict[int, list[str]] | None = None, **kwargs: Any):
    """``gossiploco.runtime.launch.LocalPeers`` whose peer ``rank`` runs in ``hosts[rank]``'s namespace,
    listening on its address; ``extra``: more ``gossiploco peer`` arguments per rank; ``kwargs`` go to
    ``LocalPeers`` (``join``, ``swarm_key``, ``env``)."""
    from gossiploco.runtime.launch import LocalPeers

    class NetnsPeers(LocalPeers):
        def command(self, rank: int) -> list[str]:
            return [*hosts[rank].exec_prefix(), *super().command(rank)]

    per_rank = {rank: ["--host", host.address, *(extra or {}).get(rank, [])] for rank, host in enumerate(hosts)}
    return NetnsPeers(len(hosts), out_dir, args, per_rank=per_rank, **kwargs)


def run_swarm_key(out_dir: Path) -> Path:
    """A fresh swarm key for one run, ``out_dir/swarm.key`` (replacing an earlier run's in a reused directory);
    its peers and bootstrap node all read this file."""
    from gossiploco.security.swarm_key import SwarmKey

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "swarm.key"
    path.unlink(missing_ok=True)
    return SwarmKey.generate().save(path)


# -- runs measured against the simulator --------------------------------------------------------------


def measured_overrides(preset: str, *, model: str, workers: int, inner_steps: int, rounds: int,
                       sync_dp_inner_steps: int, sync_dp_rounds: int, seq_len: int, batch_size: int,
                       exchange_timeout_s: float, chunk_mb: float, step_time_s: float | None,
                       sets: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config overrides of a preset's peers in a run measured against the simulator (also what the
    prediction loads): a CPU run with a small corpus, no monitors (but the one adaptive Mix2 needs),
    ``step_time_s`` seconds of sleep per inner step (None: real inner steps), then ``sets``."""
    from gossiploco.config import load_config

    sync = load_config(preset).mode == "sync-dp"
    overrides: dict[str, Any] = {
        "model.size": model,
        "workers": workers,
        "inner_steps": sync_dp_inner_steps if sync else inner_steps,
        "rounds": sync_dp_rounds if sync else rounds,
        "seed": 0,
        "device": "cpu",
        "data.seq_len": seq_len,
        "data.batch_size": batch_size,
        "data.heldout_batch_size": 2,
        "data.val_batches": 1,
        "data.max_corpus_mb": 2.0,
        "inner.warmup_steps": 1,
        "monitor.enabled": False,
        "timeouts.exchange_s": exchange_timeout_s,
        "timeouts.startup_s": 120.0,
        "transport.chunk_mb": chunk_mb,
    }
    overrides.update(sets or {})  # e.g. mix1.compression=4bit: the peers run it, the prediction loads it
    if step_time_s is not None:
        overrides["inner.synthetic_step_s"] = step_time_s
    if load_config(preset).mix2.mode == "adaptive":
        # Adaptive Mix2 is driven by the monitors: one consensus measurement per round, at h = 0.
        overrides.update({"monitor.enabled": True, "monitor.every": 0, "monitor.val_loss": False})
    return overrides


def predict(cfg: Any, bandwidth_mbps: float, step_time_s: float) -> dict:
    """``gossiploco utilization`` for ``cfg``: the real parameter count and block fractions of its model."""
    from gossiploco import utilization as util

    vocab = util.default_vocab_size(cfg)
    plan = util.comm_plan(cfg, vocab, with_monitors=True)  # what the peers run, monitors included
    sc = util.resolve_scenario(cfg, bandwidth_mbps=bandwidth_mbps, vocab_size=vocab, step_time_s=step_time_s)
    return util.report(plan, sc, util.simulate(plan, sc))


def read_peer(out_dir: Path, rank: int) -> dict:
    """One peer's summary (``out_dir/peer-RANK``) plus the per-round fields of its last record (the last
    round's Mix timings)."""
    peer_dir = out_dir / f"peer-{rank}"
    summary = json.loads((peer_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (peer_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = records[-1] if records else {}
    rounds = summary["rounds"]
    # The final record's monitor_s is the final measurement (after the rounds): not round time.
    monitor_rounds = summary.get("total_monitor_s", 0.0) - last.get("monitor_s", 0.0)
    blocking = {
        "mix1_wait_s": summary.get("total_mix1_wait_s", 0.0),
        "mix2_s": summary.get("total_mix2_s", 0.0),
        "grad_s": summary.get("total_grad_s", 0.0),
        "monitor_s": monitor_rounds,
    }
    other = summary["total_rounds_s"] - summary["total_compute_s"] - sum(blocking.values())
    return {
        "rank": rank,
        "round_utilization": summary["round_utilization"],
        "compute_s": summary["total_compute_s"],
        "rounds_s": summary["total_rounds_s"],
        **blocking,
        "other_s": other,
        "per_round_s": summary["total_rounds_s"] / rounds,
        "last_round": {k: last.get(k) for k in ("mix1_s", "mix1_wait_s", "mix2_s", "outer_s", "mix1_bytes", "mix2_bytes")},
        "failures": {k: summary.get(k, 0) for k in ("mix1_failures", "mix2_failures", "grad_failures", "monitor_failures")},
        "bytes_sent": summary.get("bytes_sent"),
    }
