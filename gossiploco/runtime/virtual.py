"""The virtual swarm: M workers of Algorithm 1 in one process, mixing over an in-memory exchange.

Workers advance in lockstep: inner steps run one worker after another on the main thread (so
each step gets the whole machine), Mix1 runs on each worker's background thread, and the
blocking end of a round (Mix2, outer step) runs for all workers at once on a thread pool,
because a worker's Mix2 waits for its partners. Consensus is measured with every worker's
parameters in hand; the network peer computes the same quantities from per-worker terms.

With ``round.budget = "time"`` a simulated clock (no sleeping) decides each worker's inner steps: a
worker whose step takes ``round.step_time_factors[m]`` base steps runs ``floor(inner_steps / factor)``
of them (``round_budget.RoundBudget``). Inner step h of the round runs on the workers that still have an
h-th step; a worker done early waits for the round's end. The inner schedule follows the rounds, not the
steps each worker ran (``InnerOptimizer.start_round``): every worker's round r starts at the rate of step
r * inner_steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from gossiploco import consensus
from gossiploco.adaptive import AdaptiveMix2
from gossiploco.adversary import Adversary
from gossiploco.checkpoint import Checkpoint, CheckpointWriter, Snapshot
from gossiploco.blocks import group_by_block
from gossiploco.config import RunConfig
from gossiploco.data import Corpus, heldout_batch, load_corpus, validation_batches
from gossiploco.factored import FactoredDiLoCo, RoundReport, SyncDP
from gossiploco.metrics import MetricsSink
from gossiploco.mixing import MemoryHub
from gossiploco.protocol.groups import bucket_count
from gossiploco.round_budget import RoundBudget
from gossiploco.runtime.common import (build_trainer, make_summary, mean_loss, measure_due, merge_stats, monitor_reuses_mix1, robust_summary,
                                       round_reached)
from gossiploco.runtime.stopping import raise_if_stopped
from gossiploco.runtime.worker_state import Copier, capture, restore
from gossiploco.trainer import resolve_device

TensorDict = dict[str, torch.Tensor]


@dataclass
class SwarmResult:
    final_params: TensorDict
    """The final model: the average of the workers' z (Algorithm 1, line 15)."""
    summary: dict
    records: list[dict] = field(default_factory=list)


class VirtualSwarm:
    """M workers in one process. Build, then ``run()``."""

    def __init__(self, cfg: RunConfig, corpus: Corpus | None = None, device: str | None = None,
                 adversaries: dict[int, Adversary] | None = None):
        self.cfg = cfg
        self.device = resolve_device(device or cfg.device)
        self.corpus = corpus if corpus is not None else load_corpus(cfg.data)
        self.hub = MemoryHub(cfg.workers, cfg.timeouts.exchange_s, seed=cfg.seed, group_size=cfg.groups.size)
        self.trainers = [build_trainer(cfg, self.corpus, self.device, m) for m in range(cfg.workers)]
        algo = SyncDP if cfg.mode == "sync-dp" else FactoredDiLoCo
        self.algos = [algo(t, cfg, self.hub.exchange(m)) for m, t in enumerate(self.trainers)]
        self.adversaries = dict(adversaries or {})
        """Dishonest workers (the attack bench, ``gossiploco.adversary``): measured and averaged without them."""
        for m, adversary in self.adversaries.items():
            if cfg.mode != "factored":
                raise ValueError("adversaries attack Algorithm 1's mixes: mode must be factored")
            self.algos[m].adversary = adversary
        self.honest = [m for m in range(cfg.workers) if m not in self.adversaries]
        # A scratch model that holds averaged parameters for the JS monitor and validation.
        self.eval_trainer = build_trainer(cfg, self.corpus, self.device, -1)
        self.groups = group_by_block(self.trainers[0].names)
        # Mix1 in buckets (more workers than ``groups.size``) gives each worker its bucket's mean, not the average
        self.reuse_mix1 = (monitor_reuses_mix1(cfg, self.trainers[0].names)
                           and bucket_count(cfg.workers, cfg.groups.size) == 1)
        self.heldout = heldout_batch(self.corpus, cfg.data, cfg.seed)
        self.val_batches = validation_batches(self.corpus, cfg.data, cfg.seed)
        self.pool = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="virtual-worker")
        self.adaptive = AdaptiveMix2(cfg) if cfg.mix2.mode == "adaptive" and cfg.mode == "factored" else None
        self._round_js: list[float] = []  # CD_JS measured during the current round (the adaptive signal)
        self.sink = MetricsSink(None)
        self.on_step: Callable[[int, dict | None], None] | None = None
        self._pending: dict = {}  # last round's communication stats, attached to the next record
        self._losses: list[torch.Tensor | float] = []  # training losses since the last record
        self.start_round = 0
        """The round ``run`` starts with (a resumed run's checkpoint round)."""
        self._snapshot: Snapshot | None = None
        """The state at the start of the current round (what Ctrl+C saves)."""
        self.checkpoint_s = 0.0
        self._started = time.perf_counter()
        """Seconds the training thread spent taking snapshots (the writing happens on the writer's thread)."""
        self.round_steps = [RoundBudget(cfg, m, real_clock=False).fixed for m in range(cfg.workers)]
        """Inner steps each worker runs per round (every one ``inner_steps`` with a steps budget)."""
        self.worker_steps = [0] * cfg.workers
        self.worker_tokens = [0] * cfg.workers
        """Each worker's inner steps and tokens over the rounds this run ran (the summary's)."""

    # -- measurement --------------------------------------------------------------------------

    def measure(self, r: int, h: int, *, val_loss: bool) -> dict:
        """Consensus (CD_L2 eqs. 34/40 per block, CD_JS eq. 46) of the workers' current parameters: against
        their average or, at h = 0 of a round whose Mix1 is global (``monitor_reuses_mix1``) and one group (at most
        ``groups.size`` workers), against Mix1's result over the workers whose Mix1 succeeded, as network peers
        measure."""
        params = [t.params_cpu() for t in self.trainers]
        avg, measured = consensus.average([params[m] for m in self.honest]), list(self.honest)
        if h == 0 and r < self.cfg.rounds and self.reuse_mix1:
            for algo in self.algos:  # every worker's fragments first: each waits for the others' in the hub
                algo.start_all_mix1()
            mixes = [algo.mix1_result() for algo in self.algos]
            ok = [m for m, mix in enumerate(mixes) if mix.ok and m in self.honest]
            if ok:
                avg, measured = {n: v.cpu() for n, v in mixes[ok[0]].values[0].items()}, ok
        record: dict = {"round": r, "h": h, "step": r * self.cfg.inner_steps + h}
        l2 = consensus.aggregate_l2([consensus.l2_term(params[m], avg, self.groups) for m in measured])
        self.eval_trainer.load_params(avg)
        avg_logits = self.eval_trainer.logits(self.heldout)
        worker_logits = [self.trainers[m].logits(self.heldout) for m in measured]
        record.update(cd_l2=l2["cd_l2"], cd_l2_sq=l2["cd_l2_sq"])
        record["cd_js"] = consensus.consensus_js(worker_logits, avg_logits, self.cfg.monitor.js_top_k)
        record["cd_l2_blocks"] = l2["cd_l2_blocks"]
        if val_loss:
            record["val_loss"] = self.eval_trainer.evaluate(self.val_batches)
        return record

    # -- the run ------------------------------------------------------------------------------

    def run(self, sink: MetricsSink | None = None, on_step: Callable[[int, dict | None], None] | None = None,
            checkpoints: CheckpointWriter | None = None) -> SwarmResult:
        """All R rounds (from ``start_round``), then the final measurement (r = R, h = 0) and the final model's
        validation loss. With ``checkpoints``: a snapshot of every round's start, written every
        ``checkpoint.every`` rounds, at the end, and when the run is interrupted (KeyboardInterrupt: Ctrl+C,
        or SIGTERM where the caller turns it into one), which then propagates."""
        self.sink = sink or MetricsSink(None)
        self.on_step = on_step
        start = self._started = time.perf_counter()
        every = self.cfg.checkpoint.every
        try:
            for r in range(self.start_round, self.cfg.rounds + 1):
                if checkpoints is not None:
                    self._take_snapshot(r)
                    if r > self.start_round and (r == self.cfg.rounds or (every and r % every == 0)):
                        checkpoints.submit(self._snapshot)
                if r < self.cfg.rounds:
                    self.run_round(r)
            self._record(self.cfg.rounds, 0, val_loss=True)
        except KeyboardInterrupt:
            snapshot = self._snapshot  # the current round's start: what this run adds to the newest checkpoint
            if (checkpoints is not None and snapshot is not None and snapshot.round > self.start_round
                    and snapshot.round > checkpoints.last_submitted):
                checkpoints.submit(snapshot)
            raise
        finally:
            self.close()
        # The last record (r = R, h = 0) already holds the validation loss of the averaged model.
        final_val = self.sink.records[-1]["val_loss"]
        summary = make_summary(self.cfg, self.sink.records, final_val, time.perf_counter() - start)
        summary.update(resumed_from=self.start_round or None, checkpoint_s=self.checkpoint_s)
        summary.update(worker_steps=self.worker_steps, worker_tokens=self.worker_tokens,
                       swarm_tokens=sum(self.worker_tokens))  # tokens the swarm trained on in this run's rounds
        if any(getattr(a, "robust", None) is not None for a in self.algos) or self.adversaries:
            summary["security"] = {"adversaries": sorted(self.adversaries),
                                   "workers": {m: robust_summary(self.algos[m]) for m in self.honest}}
        return SwarmResult(final_params=self.final_params(), summary=summary, records=self.sink.records)

    def summary_so_far(self) -> dict:
        """The summary of a run stopped before its end (``interrupted``): what it measured until then."""
        val = next((r["val_loss"] for r in reversed(self.sink.records) if r.get("val_loss") is not None), None)
        summary = make_summary(self.cfg, self.sink.records, val, time.perf_counter() - self._started)
        summary.update(interrupted=True, round_reached=round_reached(self.sink.records, self._snapshot, self.start_round),
                       resumed_from=self.start_round or None)
        return summary

    # -- checkpoints ----------------------------------------------------------------------------

    def _take_snapshot(self, r: int) -> None:
        """Every worker's state at the start of round ``r``, and the run's own (pending metrics, adaptive Mix2)."""
        t = time.perf_counter()
        copier = Copier()
        tensors: dict[str, torch.Tensor] = {}
        workers: dict[str, dict] = {}
        for m, algo in enumerate(self.algos):
            state, meta = capture(algo, f"w{m}", copier)
            tensors.update(state)
            workers[f"w{m}"] = meta
        meta = {"workers": list(workers), "worker_state": workers, "metrics_bytes": self.sink.bytes_written,
                "pending": dict(self._pending), "losses": [float(v) for v in self._losses],
                "adaptive": self.adaptive.state() if self.adaptive is not None else None}
        self._snapshot = Snapshot(r, tensors, meta, copier.wait)
        self.checkpoint_s += time.perf_counter() - t

    def resume(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (its configuration checked by the caller): every worker's state, the
        pending metrics, adaptive Mix2; ``run`` then starts at the checkpoint's round."""
        meta = checkpoint.meta
        if len(meta["workers"]) != len(self.algos):
            from gossiploco.checkpoint import CheckpointError

            raise CheckpointError(f"{checkpoint.path}: {len(meta['workers'])} workers, this run has {len(self.algos)}")
        for algo, worker in zip(self.algos, meta["workers"]):
            restore(algo, worker, checkpoint.tensors, meta["worker_state"][worker])
        self._pending = dict(meta["pending"])
        self._losses = list(meta["losses"])
        if self.adaptive is not None and meta.get("adaptive") is not None:
            self.adaptive.load_state(meta["adaptive"])
        self.start_round = checkpoint.round

    def run_round(self, r: int) -> list[RoundReport]:
        """One round of every worker: Mix1 launched, H inner steps (measured every N), Mix2 and outer step."""
        cfg = self.cfg
        if cfg.mode == "factored":
            for algo in self.algos:
                algo.begin_round(r)
        for h in range(max(self.round_steps)):
            raise_if_stopped()  # a stop a finalizer swallowed (``runtime.stopping``)
            due, val_loss = measure_due(cfg, h)
            if due:
                self._record(r, h, val_loss=val_loss)
            self._losses += self._inner_step(r * cfg.inner_steps + h, h)
            if self.on_step:
                self.on_step(1, None)
        if cfg.mode != "factored":
            return []
        if self.adaptive is not None:
            decision = self.adaptive.decide(r, max(self._round_js, default=None))
            for algo in self.algos:
                algo.set_mix2_blocks(decision.blocks)
            merge_stats(self._pending, {"mix2_decision": decision.to_dict()})
        self._round_js = []
        if any(a.kind == "alie" for a in self.adversaries.values()):  # an omniscient attacker sees the honest updates
            honest = [self.algos[m].pseudo_gradient() for m in self.honest]
            for m in self.adversaries:
                self.algos[m].honest_deltas = honest
        reports = list(self.pool.map(lambda a: a.end_round(r), self.algos))
        for m, rep in enumerate(reports):
            self.worker_steps[m] += rep.steps
            self.worker_tokens[m] += rep.tokens
        merge_stats(self._pending, round_stats(reports))
        return reports

    def _record(self, r: int, h: int, *, val_loss: bool) -> None:
        record = self.measure(r, h, val_loss=val_loss)
        self._round_js.append(record["cd_js"])
        if self._losses:
            record["loss"] = mean_loss(self._losses)
        record.update(self._pending)
        self._pending, self._losses = {}, []
        self.sink.write(record)
        if self.on_step:
            self.on_step(0, record)

    def close(self) -> None:
        """Stop every worker. Closing the exchanges first wakes any thread still waiting in one
        (after Ctrl+C, say), so shutting the threads down never waits out a deadline. Idempotent."""
        for algo in self.algos:
            algo.exchange.close()
        for algo in self.algos:
            algo.close()
        self.pool.shutdown(wait=True)

    def _inner_step(self, step: int, h: int) -> list[torch.Tensor]:
        if self.cfg.mode == "factored":  # the workers whose budget has an h-th step this round
            return [algo.inner_step() for algo, steps in zip(self.algos, self.round_steps) if h < steps]
        # sync-dp: every worker's gradient first, then the all-reduce for all of them at once.
        losses = [algo.forward_backward() for algo in self.algos]
        results = list(self.pool.map(lambda a: a.reduce_and_step(step), self.algos))
        failures = sum(not res.ok for res in results)
        if failures:
            merge_stats(self._pending, {"grad_failures": failures})
        return losses

    def final_params(self) -> TensorDict:
        """Algorithm 1, line 15: the average of the (honest) workers' z (their current parameters)."""
        return consensus.average([self.trainers[m].params_cpu() for m in self.honest])


def round_stats(reports: list[RoundReport]) -> dict:
    """Swarm-wide communication figures of one round (sums and maxima over workers)."""
    return {
        "mix1_failures": sum(not rep.mix1.ok for rep in reports),
        "mix1_again": sum(rep.mix1.again for rep in reports),
        "mix2_failures": sum(not rep.mix2.ok for rep in reports),
        "mix1_bytes": sum(rep.mix1.bytes for rep in reports) // max(len(reports), 1),
        "mix2_bytes": sum(rep.mix2.bytes for rep in reports) // max(len(reports), 1),
        "mix1_wait_s": max(rep.mix1_wait_s for rep in reports),
        "mix2_s": max(rep.mix2_s for rep in reports),
        "steps": [rep.steps for rep in reports],
        "tokens": [rep.tokens for rep in reports],
    }
