"""The network peer: one worker of Algorithm 1 in its own process, mixing over ZeroMQ.

The loop is the virtual swarm's, for one worker: ``FactoredDiLoCo`` (or ``SyncDP``) is the
same class, only the exchange is a ``ZmqExchange`` (on threads of this process, or in a companion process:
``compute.companion``, ``peer_exchange``). Inner steps run on the main thread (GPU when available), Mix1 on the
algorithm's background thread, Mix2 and the outer step block.

Finding the others: a static list of every peer's address, or a ``Directory`` (the hivemind
DHT, ``--join``): then the peer checks that its settings match the run going in the swarm
(``run_match``: refused, naming the differences, unless ``--new-run``) and that its advertised
endpoint answers, announces itself (endpoint, round, tokens; refreshed every ``timeouts.discovery_s``)
and its run's settings, connects to every peer of its run it finds (``ZmqExchange.add_peer``, again
every ``discovery_s``), and a fresh swarm starts round 0 together once ``workers`` peers are in (at
most ``startup_s``, saying meanwhile who is here and who is missing: ``waiting_line``). Closing
withdraws the announcement and tells the others it leaves.

Start-up and rejoining are the protocol's lifecycle programs (``protocol.lifecycle``, the code the
simulator runs), driven on the exchange by ``peer_join``. Start-up (``lifecycle.join``): wait up to ``timeouts.startup_s`` for every known peer to connect,
then ask the connected peers which round they are in (``timeouts.hello_s``). If one is already
in a round, this peer was restarted (or started late): it waits for the swarm's next round
boundary (polling the others' rounds), downloads that round's state (z, outer momentum, round k,
the donor's AdamW moments) from a live peer and trains round k in step with the others, taking
part in its exchanges (a peer that trained round k alone instead would trail the swarm by up to a
round for good, left out of every agreement whose grace window is shorter: found by the protocol
simulator). The same
catch-up runs at the start of any round in which this peer finds itself alone while others are
connected or were just lost (it was frozen and they went on without it), or learns from a group
leader that the swarm is already in a later round. Peers that never connected are left out until
they say hello.

Consensus monitors over the network (same schedule and definitions as the virtual swarm):
the peers of the group of exchange ``monitor/r/h`` all-reduce their parameters to get the average, each
computes its own terms (sqrt of its squared L2 distance in total and per block, the squared
distance, and its JS term against the averaged model's output on the shared held-out batch),
and a second, tiny all-reduce averages the terms: CD_L2 (eq. 34), CD_L2^2 (eq. 40) and CD_JS
(eq. 46) are exactly these means when the group is the whole view, and estimates of the swarm's from the
group above ``[groups] size`` (``consensus_sample``: the corrections and their stated error). Every peer of a
group logs the same values. The measurement runs on a background thread against a snapshot of the parameters,
so a peer never waits for slower peers to measure (``peer_monitor``). The averaged parameters after the last
round (a blocking measurement) are the final model (Algorithm 1, line 15).

A round runs H inner steps, or with ``round.budget = "time"`` as many as fit before the round's deadline
(``round_budget``; the deadline counts from the agreed start, where the previous Mix2 released every
member), so a slow peer does fewer steps and the others do not wait for it at Mix2; with ``round.weights =
"tokens"`` the mixes weigh each peer by the tokens it processed (``mixing.weighted``).

Per-peer metrics add to the virtual swarm's fields the seconds this peer computed, blocked on
Mix1 and in Mix2 and in the monitors, bytes sent and received, and each failure with its cause,
so compute utilization is measured, not estimated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from gossiploco.adaptive import AdaptiveMix2
from gossiploco.checkpoint import Checkpoint, CheckpointWriter, Snapshot, shared_config
from gossiploco.adversary import Adversary
from gossiploco.config import RunConfig
from gossiploco.data import Corpus, heldout_batch, load_corpus, validation_batches
from gossiploco.errors import ConfigError
from gossiploco.membership.directory import Directory
from gossiploco.factored import FactoredDiLoCo, RoundReport, SyncDP
from gossiploco.metrics import MetricsSink
from gossiploco.reach.paths import Reach
from gossiploco.reach.tunnel import tunnel_stats
from gossiploco.round_budget import RoundBudget
from gossiploco.runtime.common import build_trainer, make_summary, measure_due, robust_summary, round_reached
from gossiploco.runtime.path_planner import PathPlanner
from gossiploco.runtime.peer_checkpoint import peer_snapshot, restore_peer
from gossiploco.runtime.peer_clock import PeerClock
from gossiploco.runtime.peer_discovery import Discovery
from gossiploco.runtime.peer_exchange import open_exchange, uses_companion
from gossiploco.runtime.peer_join import join, maybe_catch_up, provide_state
from gossiploco.runtime.peer_monitor import PeerMonitor
from gossiploco.runtime.peer_progress import TrainingProgress
from gossiploco.runtime.peer_status import PeerStatus
from gossiploco.runtime.run_match import RunWatch
from gossiploco.runtime.state_flood import StateFlood
from gossiploco.runtime.stopping import raise_if_stopped
from gossiploco.security.trust import Trust
from gossiploco.trainer import resolve_device
from gossiploco.transport.fault_injection import SendHook
from gossiploco.transport.zmq_exchange import MAX_PEER_ID

log = logging.getLogger(__name__)
TensorDict = dict[str, torch.Tensor]

LEAVE_LINGER_S = 2.0
"""After its last exchange a finishing peer keeps its sockets this long so its final chunks arrive."""


def run_id_for(cfg: RunConfig) -> str:
    """Default run id: the preset name plus a digest of everything peers must agree on.

    Peers started with different settings (seed, model, mixing, data...) get different ids, so
    their messages are rejected instead of silently mixed. The device and how it computes
    (``[compute]``: compilation, micro-batches, checkpointing, where the outer state lives) may differ per peer.
    The tokenizer counts by its file's content, not its path (``checkpoint.shared_config``).
    """
    digest = hashlib.sha256(json.dumps(shared_config(cfg.to_dict()), sort_keys=True).encode()).hexdigest()[:12]
    return f"{cfg.name}-{digest}"


@dataclass
class PeerResult:
    final_params: TensorDict
    """The averaged model after the last round (this peer's own z if the final average failed)."""
    summary: dict
    records: list[dict] = field(default_factory=list)


class NetworkPeer:
    """Peer ``rank`` of a run, found either through a static list ``endpoints`` (``tcp://HOST:PORT``,
    one per rank) or through a ``directory`` (the hivemind DHT): then this peer binds ``bind``
    (``tcp://HOST:PORT``, port 0 for any), tells the others ``advertise`` (default: the bound
    address), and ``rank`` is its peer id (``trust.peer_id``: derived from its identity key).
    ``stream``: the index of its data stream (default ``rank``).

    ``trust`` (``gossiploco.security``): its identity and the run's swarm key; the data plane is
    encrypted and admits members only, and its DHT records are signed and sealed. ``gossiploco
    peer`` always gives it; None (plaintext, unauthenticated) is for in-process unit tests. ``sealed_port``: of
    AES-GCM sealed data (``transport.zmq_sealed``; 0: any, -1: none). ``fault``: the exchange's test hook.

    Built from parts with their own state: ``progress`` (``TrainingProgress``: what the next record carries,
    counters, tokens, the round's starting state given to peers catching up), ``monitor`` (``PeerMonitor``:
    measurements and records), ``discovery`` (``Discovery``, with a directory: its thread), ``clock``
    (``PeerClock``: where the seconds go). Build, then ``run()``. ``close()`` (idempotent) leaves the run and
    releases sockets and threads.
    """

    def __init__(self, cfg: RunConfig, rank: int, endpoints: Sequence[str] | None = None, *,
                 directory: Directory | None = None, bind: str | None = None, advertise: str | None = None,
                 run_id: str | None = None, corpus: Corpus | None = None, device: str | None = None,
                 trust: Trust | None = None, stream: int | None = None, reach: Reach | None = None,
                 new_run: bool = False, fault: SendHook | None = None, sealed_port: int = 0):
        if (endpoints is None) == (directory is None):
            raise ConfigError("peers", "give either a static peer list or a directory to join, not both or neither")
        if endpoints is not None:
            if len(endpoints) != cfg.workers:
                raise ConfigError("peers", f"{len(endpoints)} endpoints given but workers = {cfg.workers}")
            if not 0 <= rank < len(endpoints):
                raise ConfigError("rank", f"must be in 0..{len(endpoints) - 1}, got {rank}")
            known: Sequence[str] | dict[int, str] = endpoints
        else:
            if not 0 <= rank < MAX_PEER_ID:
                raise ConfigError("rank", f"peer id must be in 0..{MAX_PEER_ID - 1}, got {rank}")
            bind = bind or "tcp://127.0.0.1:0"
            known = {rank: advertise or bind}
        self.cfg = cfg
        self.rank = rank
        self.device = resolve_device(device or cfg.device)
        self.corpus = corpus if corpus is not None else load_corpus(cfg.data)
        self.stream = rank if stream is None else stream
        """The index of this peer's data stream (its rank in a static list; with a directory, its peer id unless given)."""
        self.budget = RoundBudget(cfg, self.stream, real_clock=True)
        """How many inner steps a round runs (round.budget: exactly H, or until the round's deadline)."""
        self.trainer = build_trainer(cfg, self.corpus, self.device, self.stream)
        # Compile before opening the data plane: the others wait (timeouts.startup_s) for this peer to
        # connect, so peers compiling at different speeds still start round 0 together, and none spends
        # its first round compiling while the others leave it behind.
        self.compile_s = self.trainer.warm_up()
        if self.compile_s:
            log.info("rank %d: compiled the model in %.1fs", rank, self.compile_s)
        eval_trainer = build_trainer(cfg, self.corpus, self.device, -1)  # the monitor's scratch model
        heldout = heldout_batch(self.corpus, cfg.data, cfg.seed)
        val_batches = validation_batches(self.corpus, cfg.data, cfg.seed)
        self.names = self.trainer.names
        self.run_id = run_id or run_id_for(cfg)
        t = cfg.timeouts
        self.runs = RunWatch.for_config(cfg, self.run_id, rank, new_run=new_run)
        """The other runs of the swarm (with a directory): ``new_run`` starts beside them on purpose."""
        self.directory = directory
        self.trust = trust
        model_bytes = sum(p.numel() * 4 for p in self.trainer.model.parameters())
        self.companion = uses_companion(cfg)
        """Whether the exchange runs in a companion process (``compute.companion``)."""
        self.exchange = open_exchange(cfg, rank, known, self.run_id, model_bytes=model_bytes, bind=bind, trust=trust,
                                      fault=fault, sealed_port=sealed_port, companion=self.companion)
        self.exchange.set_grouping(cfg.seed, cfg.groups.size, cfg.groups.paired({"mix1": cfg.mix1.kind,
                                                                                 "mix2": cfg.mix2.kind}),
                                   run_again={"mix1"} if cfg.mix1.again else ())
        self.endpoint = self.exchange.endpoints[rank]
        """The address other peers reach this one at."""
        self.reach = reach or Reach()
        self.paths = PathPlanner(rank, self.reach, self.exchange, getattr(directory, "run_in_node", None),
                                 topology_ring=cfg.transport.ring_order == "topology", reverse_wait_s=t.reverse_s)
        self.progress = TrainingProgress()
        """What the next record carries, the run's counters and tokens, the round's starting state."""
        self.discovery = Discovery(cfg, rank, self.run_id, self.endpoint, self.exchange, directory, runs=self.runs,
                                   reach=self.reach, paths=self.paths, trust=trust,
                                   tokens=lambda: self.progress.tokens) if directory is not None else None
        """Finding the run's peers through the directory (None with a static list)."""
        self.algo: FactoredDiLoCo | SyncDP
        if cfg.mode == "sync-dp":
            self.algo = SyncDP(self.trainer, cfg, self.exchange)
        else:
            self.algo = FactoredDiLoCo(self.trainer, cfg, self.exchange, open_run=trust is not None and trust.open)
        self.adversary: Adversary | None = None
        """Set only by the attack bench (``set_adversary``)."""
        self.exchange.serve_state(partial(provide_state, self))
        self.sink = MetricsSink(None)
        self.on_record: Callable[[dict], None] | None = None
        self.status = PeerStatus(rank, self.run_id, list(cfg.mix2.blocks)) if directory is not None else None
        """This peer's live status for observers (``gossiploco dashboard``), published with its record."""
        if self.status is not None:
            directory.set_status_source(self.status.wire)
        self.clock = PeerClock()
        self._closed = False
        self.adaptive = AdaptiveMix2(cfg) if cfg.mix2.mode == "adaptive" and cfg.mode == "factored" else None
        self.monitor = PeerMonitor(cfg, rank, self.exchange, self.trainer, eval_trainer, heldout, val_batches,
                                   clock=self.clock, progress=self.progress, adaptive=self.adaptive, publish=self._publish,
                                   robust=getattr(self.algo, "robust", None))
        """Measurements and metrics records (written through ``_publish``)."""
        self._started = time.perf_counter()
        self.start_round = 0
        """The round of the checkpoint this peer resumed from (0: a new peer)."""
        self._round_snapshot: Snapshot | None = None
        """The state at the start of the current round (what Ctrl+C saves)."""

    # -- the run ---------------------------------------------------------------------------------

    def run(self, sink: MetricsSink | None = None, on_record: Callable[[dict], None] | None = None,
            checkpoints: CheckpointWriter | None = None) -> PeerResult:
        """Join, train every round, measure the final model. Ctrl+C (KeyboardInterrupt) propagates after close().
        ``checkpoints``: the state at each round's start, written every ``checkpoint.every`` rounds, after the
        last round and when the run is interrupted (``gossiploco.runtime.peer_checkpoint``)."""
        self.sink = sink or MetricsSink(None)
        self.on_record = on_record
        start = self._started = time.perf_counter()
        try:
            self.clock.add("compile_s", self.compile_s)
            t = time.perf_counter()
            r = join(self)
            self.clock.add("startup_s", time.perf_counter() - t)
            cfg = self.cfg
            t = time.perf_counter()
            while r < cfg.rounds:
                r = maybe_catch_up(self, r)
                if r >= cfg.rounds:
                    break
                self._checkpoint(checkpoints, r)
                self._run_round(r)
                r += 1
            self._checkpoint(checkpoints, cfg.rounds)
            self.clock.add("rounds_s", time.perf_counter() - t)
            self.exchange.current_round = cfg.rounds
            final = self.monitor.record(cfg.rounds, 0, val_loss=True, final=True)
            reach = self._reach_summary()
        except BaseException as exc:
            self.monitor.write_held(f"the run stopped before its measurement ({type(exc).__name__})")
            self.close()
            if checkpoints is not None and isinstance(exc, KeyboardInterrupt):
                self._checkpoint_interrupted(checkpoints)
            raise
        self.close(linger_s=LEAVE_LINGER_S)
        self.monitor.write_held("the run ended before this measurement finished")  # one stuck on a frozen peer
        wall = time.perf_counter() - start
        summary = make_summary(self.cfg, self.sink.records, final.get("val_loss"), wall)
        summary.update(self._peer_summary(wall), reach=reach)
        final_params = self.monitor.final_params
        return PeerResult(final_params=final_params or self.trainer.params_cpu(), summary=summary,
                          records=self.sink.records)

    def _publish(self, record: dict) -> None:
        """A finished record: to the metrics file, the live status and the caller's ``on_record``."""
        self.sink.write(record)
        if self.status is not None:
            self.status.add(record, self.paths.paths, self.progress.tokens)
        if self.on_record:
            self.on_record(record)

    def _checkpoint(self, checkpoints: CheckpointWriter | None, r: int) -> None:
        """Snapshot the state at the start of round ``r`` (kept for Ctrl+C); hand it to the writer when due."""
        if checkpoints is None:
            return
        t = time.perf_counter()
        self._round_snapshot = peer_snapshot(self, r)
        every = self.cfg.checkpoint.every
        if r > self.start_round and (r == self.cfg.rounds or (every and r % every == 0)):
            checkpoints.submit(self._round_snapshot)
        self.clock.add("checkpoint_s", time.perf_counter() - t)

    def _checkpoint_interrupted(self, checkpoints: CheckpointWriter) -> None:
        """Interrupted: the start of the round it was in, unless a checkpoint has it already."""
        snapshot = self._round_snapshot
        if snapshot is not None and snapshot.round > max(self.start_round, checkpoints.last_submitted):
            checkpoints.submit(snapshot)

    def summary_so_far(self) -> dict:
        """The summary of a run that stopped before its end (``interrupted``): what it measured until then."""
        wall = time.perf_counter() - self._started
        val = next((r["val_loss"] for r in reversed(self.sink.records) if r.get("val_loss") is not None), None)
        summary = make_summary(self.cfg, self.sink.records, val, wall)
        summary.update(self._peer_summary(wall), interrupted=True,
                       round_reached=round_reached(self.sink.records, self._round_snapshot, self.start_round))
        return summary

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from this peer's ``checkpoint`` (configuration checked by the caller): ``run`` then starts at
        its round, or downloads a newer state if the swarm went on."""
        restore_peer(self, checkpoint)
        self.start_round = checkpoint.round

    def set_adversary(self, adversary: Adversary) -> None:
        """Make this peer dishonest (the attack bench; ``gossiploco.adversary``)."""
        log.warning("rank %s: DISHONEST PEER for the attack bench: %s", self.rank, adversary)
        if isinstance(self.algo, FactoredDiLoCo):
            self.algo.adversary = adversary
        self.adversary = adversary
        if adversary.state_requests_per_round():
            StateFlood(self.exchange, self.rank, adversary.state_requests_per_round()).start()

    def close(self, linger_s: float = 0.0) -> None:
        """Close the exchange first (wakes a Mix1 still waiting), then the algorithm's thread. Idempotent.
        ``linger_s``: after a finished run, time for this peer's last sends to reach the others."""
        if self._closed:
            return
        self._closed = True
        if self.discovery is not None:
            self.discovery.stop()
        self.exchange.leave(linger_s=linger_s)  # first: the others drop this peer at once, no deadline to wait out
        self.monitor.close()  # a measurement in flight ends with the exchange
        self.algo.close()
        if self.directory is not None:
            self.directory.close()  # withdraws this peer's announcement (bounded; it expires anyway)
        if self.discovery is not None:
            self.discovery.join(timeout_s=self.cfg.timeouts.discovery_s + 10)

    # -- one round -----------------------------------------------------------------------------

    def _run_round(self, r: int) -> None:
        """One round, timed: besides computing, blocking in Mix1 and Mix2 and measuring, whatever else
        it spent (the pseudo-gradient, the outer step, copies, bookkeeping) is its ``other_s``."""
        start = time.perf_counter()
        self.clock.begin_round()
        blocked = self._train_round(r)
        steps = getattr(self.algo, "round_steps", self.cfg.inner_steps)  # sync-dp: always H
        self.progress.merge({"other_s": self.clock.end_round(r, time.perf_counter() - start, blocked, steps)})

    def _train_round(self, r: int) -> dict[str, float]:
        """Returns the seconds blocked in Mix1 and in Mix2 (sync-dp: in gradient all-reduces)."""
        cfg = self.cfg
        factored = cfg.mode == "factored"
        grad_s = self.clock.totals["grad_s"]
        if factored:
            algo: FactoredDiLoCo = self.algo  # type: ignore[assignment]
            # Before telling anyone this round began: a peer that hears so may ask for this state at once.
            self.progress.set_round_start(r, algo.z, algo.momentum)  # outer_step makes new dicts: safe to hand out
        self.exchange.current_round = r
        if factored:
            algo.begin_round(r)
        self.budget.begin(time.monotonic(), r)  # start clock: the previous Mix2 released every member here
        if self.budget.clock is not None:  # a joiner asking this peer takes up the swarm's clock from its answer
            self.exchange.round_ends = (r, self.budget.round_ends_at)
            self.progress.merge({"round_ends_monotonic": self.budget.round_ends_at})
        h = 0
        while self.budget.another(h, time.monotonic()):
            raise_if_stopped()  # a stop a finalizer swallowed (``runtime.stopping``)
            self.monitor.poll(r, h)  # a measurement that finished is written; a postponed one starts
            due, val_loss = measure_due(cfg, h)
            measuring = time.perf_counter()
            if due and h == 0 and self.monitor.defers(r):
                self.monitor.defer(r, h, val_loss=val_loss)  # measured against Mix1's average at the round's end
            elif due:
                self._finish_compute()
                self.monitor.record(r, h, val_loss=val_loss)
            if due:  # the round's length is for training: the measurement's time moves its deadline
                self.budget.pause(time.perf_counter() - measuring)
            t = time.perf_counter()
            if factored:
                loss = self._inner_step()
                self._slow_down(t)
                self.clock.tick("compute_s", time.perf_counter() - t)
            else:
                loss = self._sync_dp_step(r * cfg.inner_steps + h, t)
            self.budget.step_took(time.perf_counter() - t)
            self.progress.add_loss(loss)
            h += 1
        self._finish_compute()
        # The parameters are now those after h steps: a postponed measurement that starts at the round's end
        # (below) must say so (``cd_step``), not pass for one of the step it was due at.
        self.monitor.poll(r, h)
        if factored:
            if self.monitor.deferring:
                self.monitor.record_deferred(algo)
            round_js = self.monitor.take_round_js()
            if self.adaptive is not None:
                decision = self.adaptive.decide(r, max(round_js, default=None))
                algo.set_mix2_blocks(decision.blocks)
                self.progress.merge({"mix2_decision": decision.to_dict()})
            rep = self.algo.end_round(r)
            self._round_done(rep)
            return {"mix1_wait_s": rep.mix1_wait_s, "mix2_s": rep.mix2_s}
        return {"grad_s": self.clock.totals["grad_s"] - grad_s}

    def _finish_compute(self) -> None:
        """Inner steps only queue work on a GPU: the wait for it to finish is compute time too."""
        t = time.perf_counter()
        self.trainer.synchronize()
        self.clock.tick("compute_s", time.perf_counter() - t)

    def _inner_step(self) -> torch.Tensor | float:
        self.progress.add_tokens(self.cfg.data.batch_size * self.cfg.data.seq_len)
        if self.cfg.inner.synthetic_step_s > 0:  # benchmarks: compute replaced by a fixed sleep
            time.sleep(self.cfg.inner.synthetic_step_s)
            self.algo.advance()
            return float("nan")
        return self.algo.inner_step()

    def _slow_down(self, start: float) -> None:
        """``compute.slowdown``: a stand-in for a slower machine. The step runs to its end (on a GPU: synchronized)
        and the peer then sleeps ``slowdown - 1`` times what it took. A real-clock time budget also times each
        step to its end (its deadline needs the steps' true cost, not the time to queue them)."""
        factor = self.cfg.compute.slowdown
        if factor > 1 or self.budget.real:
            self.trainer.synchronize()
        if factor > 1:
            time.sleep((factor - 1) * (time.perf_counter() - start))

    def _sync_dp_step(self, step: int, start: float) -> torch.Tensor | float:
        algo: SyncDP = self.algo  # type: ignore[assignment]
        if self.cfg.inner.synthetic_step_s > 0:  # benchmarks: a sleep and zero gradients, then the real exchange
            time.sleep(self.cfg.inner.synthetic_step_s)
            for param in self.trainer.model.parameters():
                param.grad = torch.zeros_like(param)
            loss = float("nan")
        else:
            loss = algo.forward_backward()
            self.trainer.synchronize()
        self.clock.tick("compute_s", time.perf_counter() - start)
        t = time.perf_counter()
        result = algo.reduce_and_step(step)
        self.clock.add("grad_s", time.perf_counter() - t)
        if not result.ok:
            self.progress.count("grad_failures")
            self.progress.merge({"grad_failures": 1, "grad_cause": result.cause})
        return loss

    def _round_done(self, rep: RoundReport) -> None:
        stats = {
            "mix1_failures": int(not rep.mix1.ok), "mix2_failures": int(not rep.mix2.ok),
            "mix1_bytes": rep.mix1.bytes, "mix2_bytes": rep.mix2.bytes, "mix1_again": int(rep.mix1.again),
            "mix1_s": rep.mix1.seconds, "mix1_wait_s": rep.mix1_wait_s, "mix2_s": rep.mix2_s, "outer_s": rep.outer_s,
            "delta_s": rep.delta_s, "steps": rep.steps, "tokens": rep.tokens,
        }
        for mix in ("mix1", "mix2"):
            res = getattr(rep, mix)
            if not res.ok:
                stats[f"{mix}_cause"] = res.cause
                self.progress.count(f"{mix}_failures")
            if res.partner is not None:
                stats[f"{mix}_partner"] = res.partner
        self.clock.add("mix1_wait_s", rep.mix1_wait_s)
        self.clock.add("mix2_s", rep.mix2_s)
        self.progress.merge(stats)

    # -- summaries -------------------------------------------------------------------------------

    def _reach_summary(self) -> dict:
        """Reachability, the path to each peer, and the tunnels' counters (from the DHT process, while it runs)."""
        reach = self.paths.summary()
        if self.paths.run_in_node is not None:
            try:
                reach["tunnels"] = self.paths.run_in_node(tunnel_stats)
            except Exception as exc:  # noqa: BLE001 - a summary without the counters, saying why
                reach["tunnels"] = {"error": str(exc)}
        return reach

    def _peer_summary(self, wall: float) -> dict:
        return {
            "rank": self.rank,
            "run_id": self.run_id,
            **self.clock.summary(wall),
            **{k: v for k, v in self.progress.counts.items() if k not in ("mix1_failures", "mix2_failures", "grad_failures")},
            "bytes_sent": self.exchange.bytes_sent,
            "wire_bytes_sent": self.exchange.wire_bytes_sent,
            "bytes_received": self.exchange.bytes_received,
            "malformed_messages": self.exchange.malformed_messages,
            "isolated_mixes": self.exchange.isolated_mixes,
            "exchange_process": "companion" if self.companion else "trainer",
            "security": {"private": self.trust is not None and not self.trust.open,
                         "encrypted": self.trust is not None, **self.exchange.security_counts(),
                         **self.exchange.sealed_counts(),
                         "conflicting_run_entries": self.runs.conflicting_entries, **robust_summary(self.algo)},
            "dropped_messages": self.exchange.dropped_messages,
            "unencodable_messages": self.exchange.unencodable_messages,
            "directory_reads": self.discovery.pacing.counts() if self.discovery is not None else None,
            "final_model": "averaged" if self.monitor.final_params is not None else "own",
            "resumed_from": self.start_round or None,
            "tokens": self.progress.tokens,  # this peer's training tokens over its whole run (a resumed one's included)
        }
