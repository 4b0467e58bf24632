"""A network peer's measurements and its metrics records (the consensus monitors over the network; the module
docstring of ``runtime.peer`` tells how they are computed, ``consensus_sample`` what a group's measurement says
about the swarm).

A record carries what happened since the previous one (``TrainingProgress.take``), the seconds the peer's clock
ticked, its byte counters and, when a measurement is due, CD_L2, CD_L2^2 and CD_JS (eqs. 34, 40, 46: exact when
the measuring group is the peer's whole view, ``cd_scope = "swarm"``; estimated from its bucket above ``[groups]
size``, ``cd_scope = "group"``) and the validation loss.

**Off the critical path.** A measurement does not hold the peer's round back waiting for slower peers (up to the
bound below): the main
thread takes a snapshot of its parameters (one fp32 CPU copy) and hands it to a background thread
(``BackgroundSlot``), which agrees the group, all-reduces the snapshot, computes this peer's terms and the
averaged model's JS term and validation loss on the scratch model, and all-reduces the terms; the main thread goes
on training. One measurement runs at a time (its snapshot and the average: two parameter-sized buffers, what a
blocking measurement held). A measurement that comes due while another runs is **postponed**, not skipped: its
snapshot is taken at the first inner step after the running one finished (``poll``), and its record says so
(``cd_step``, the step the parameters are from; counted as ``monitor_late``). Postponing keeps every peer running
every measurement key in the same order: a peer that skipped one would leave its group's leader or members
waiting a grace window for it, in the background, so they would postpone or fail their next ones in turn (seen
on 4 tiny-model peers: a cascade of 21 s agreement timeouts). Queued measurements hold no parameters (the
snapshot is taken when one starts), so the queue costs no memory; it is bounded in time instead: at the end of
round r the main thread waits until every measurement of the rounds before r has started (``monitor_waits``, its
time in ``monitor_s``), because the exchange stops taking a measurement's early chunks three rounds later
(``protocol.node.MONITOR_ROUNDS_KEPT``). A fast peer under a
steps budget therefore waits in the monitor only when its measurements fall more than a round behind (it waits
for the slow ones at Mix2 anyway, while its measurements run), and under a time budget (measured at h = 0 only)
practically never. A measurement still queued two rounds later (after a wait timed out) is dropped
(``monitor_dropped``, logged).
Records are still written in (round, h) order: a record waits, in order, for its own
measurement, and finished measurements are applied on the main thread (``poll``, at every inner step and record),
so nothing else the peer owns is touched from the background thread.

When the monitor reuses Mix1's average (``monitor_reuses_mix1``, and the view is one group), the round's h = 0
measurement is taken at the round's end against that average (``defer``, then ``record_deferred``: the wait for
Mix1 counts as the round's Mix1 wait; the terms' all-reduce runs in the background). It holds z_{m,r} and Mix1's
average (no copies: the outer step makes new tensors), so when it waits behind a running measurement it measures
the same values, at the price of those two buffers kept until it ran; a round's end waits until the previous
round's such measurement has started, so at most one pair is held.

Two measurements still block, by design: the final one (``final=True``: the averaged model at the end of the run
is the run's result; it waits for the measurements in flight, at most ``grace_s + min_exchange_s``, then measures on
the main thread with the peer's own model, training being over; one still in flight then, stuck on a frozen peer,
ends when the peer closes its exchange, and ``write_held`` writes its record), and, with
adaptive Mix2, the round's measurements are awaited before the round's end (``take_round_js``) and never
postponed: every member of a group must decide Mix2's blocks from the same CD_JS values.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from gossiploco import consensus, consensus_sample
from gossiploco.adaptive import AdaptiveMix2
from gossiploco.blocks import group_by_block
from gossiploco.config import RunConfig
from gossiploco.errors import ExchangeClosed, ExchangeError
from gossiploco.factored import FactoredDiLoCo
from gossiploco.mixing.compression import Float32Codec
from gossiploco.mixing.exchange import Exchange
from gossiploco.mixing.packing import pack, unpack
from gossiploco.mixing.robust_mean import Robust, robust_group_mean
from gossiploco.runtime.background_slot import BackgroundSlot, Finished
from gossiploco.runtime.common import monitor_reuses_mix1
from gossiploco.runtime.peer_clock import PeerClock
from gossiploco.runtime.peer_progress import TrainingProgress
from gossiploco.tensor_checks import all_finite
from gossiploco.trainer import LocalTrainer

log = logging.getLogger("gossiploco.runtime.peer")
TensorDict = dict[str, torch.Tensor]


@dataclass
class Measurement:
    """What one measurement found (made on the background thread, applied on the main thread)."""

    values: dict = field(default_factory=dict)
    """The record's fields: the consensus values and their scope, the validation loss, or ``monitor_cause``."""
    js: float | None = None
    """CD_JS, for adaptive Mix2 (None when the measurement failed)."""
    adopt: int | None = None
    """The group's agreed adaptive Mix2 size (None without adaptive Mix2 or when it failed)."""
    average: TensorDict | None = None
    """The averaged parameters, kept for the final measurement only."""
    failure: str | None = None
    """Why the average failed (counted as ``monitor_failures``)."""


@dataclass
class _Entry:
    """A record waiting, in order, for its measurement."""

    record: dict
    ready: bool = True
    """False: a deferred record waiting for Mix1's average (``record_deferred``)."""
    values: Callable[[], tuple[TensorDict, TensorDict | None]] | None = None
    """A deferred measurement's own parameters and average (None: a snapshot of the parameters when it starts)."""
    started: bool = False
    done: bool = False


class PeerMonitor:
    """Makes a peer's records and measures consensus with its group; hands each finished record, in order, to
    ``publish``. Called from the peer's main thread only; measurements run on its background thread (module
    docstring), the final one on the calling thread.

    ``trainer``: the peer's model (its parameters are what is measured); ``eval_trainer``: a scratch model
    (logits and validation loss of the snapshot and of the average; used by one measurement at a time);
    ``heldout``: the shared held-out batch of the JS term; ``val_batches``: the validation loss's batches."""

    def __init__(self, cfg: RunConfig, rank: int, exchange: Exchange, trainer: LocalTrainer,
                 eval_trainer: LocalTrainer, heldout: torch.Tensor,
                 val_batches: list[tuple[torch.Tensor, torch.Tensor]], *, clock: PeerClock,
                 progress: TrainingProgress, adaptive: AdaptiveMix2 | None, publish: Callable[[dict], None],
                 robust: Robust | None = None):
        self.cfg = cfg
        self.robust = robust
        """Robust mixing (an open run's): the monitors' averages, the final model's included, are robust means too,
        so a lying member neither spoils the model this peer keeps nor the consensus it reports."""
        self.rank = rank
        self.exchange = exchange
        self.trainer = trainer
        self.eval_trainer = eval_trainer
        self.names = trainer.names
        self.groups = group_by_block(self.names)
        self.heldout = heldout
        self.val_batches = val_batches
        self.clock = clock
        self.progress = progress
        self.adaptive = adaptive
        self.publish = publish
        self.reuses_mix1 = monitor_reuses_mix1(cfg, self.names)
        """The round's h = 0 measurement may use Mix1's average instead of an all-reduce of its own (``defers``)."""
        self.waits = adaptive is not None
        """Adaptive Mix2 decides from the round's CD_JS: measurements are awaited, never postponed (module docstring)."""
        self._round_js: list[float] = []
        """CD_JS measured during the current round (adaptive Mix2's signal)."""
        self._entries: list[_Entry] = []
        """Records not written yet, in (round, h) order."""
        self._queue: list[_Entry] = []
        """Measurements due and not started, in the order they came due (a deferred one at the round's end): the
        order every peer starts them in, whatever its timing, so no two peers wait for each other on different
        keys."""
        self._deferred: _Entry | None = None
        """The round's h = 0 record while it waits for Mix1's average."""
        self._at = (0, 0)
        """(round, h) of the main thread: the parameters a snapshot taken now holds."""
        self._slot = BackgroundSlot(f"monitor-{rank}")
        self._final_params: TensorDict | None = None

    @property
    def final_params(self) -> TensorDict | None:
        """The averaged model of the final measurement (None until it succeeded)."""
        return self._final_params

    @property
    def deferring(self) -> bool:
        """Whether the round's h = 0 record waits for Mix1's average."""
        return self._deferred is not None

    def defers(self, r: int) -> bool:
        """Whether round ``r``'s h = 0 measurement takes Mix1's average: Mix1 is global and this peer's view is one
        group (above ``[groups] size`` Mix1 averages another bucket than the monitor's, so the monitor averages
        its own group)."""
        return self.reuses_mix1 and len(self.exchange.members(r)) <= self.cfg.groups.size

    def take_round_js(self) -> list[float]:
        """The CD_JS values measured this round; the next round starts an empty list. With adaptive Mix2 it first
        waits for the measurements in flight."""
        t = time.perf_counter()
        if self.waits:
            self._drain()
        round_now = self._at[0]
        self._wait_until_started(lambda queued: queued.record["round"] < round_now)
        self._poll()
        self.clock.tick("monitor_s", time.perf_counter() - t)
        taken, self._round_js = self._round_js, []
        return taken

    # -- records -----------------------------------------------------------------------------------

    def record(self, r: int, h: int, *, val_loss: bool, final: bool = False) -> dict:
        """A measurement is due before inner step ``h`` of round ``r``: start it (or postpone it behind the one
        running) and write the record once measured, in order; returns the record (complete only when
        ``final``). ``final``: blocks; the averaged model is kept (``final_params``)."""
        t = time.perf_counter()
        self._at = (r, h)
        self._poll()
        if final:
            # The measurements in flight, for as long as a healthy group takes to agree and exchange: one stuck
            # on a frozen peer is left to end with the exchange (``write_held`` after ``close`` writes it).
            timeouts = self.cfg.timeouts
            self._drain(timeouts.grace_s + timeouts.min_exchange_s)
        elif self.waits:
            self._drain()
        entry = _Entry(self._record_start(r, h, val_loss))
        self._entries.append(entry)
        if final:  # on this thread, with the peer's own model (training is over; the scratch one may be in use)
            entry.started = True
            self._apply(entry, Finished(entry, value=self._measure(r, h, val_loss=val_loss, final=True,
                                                                   swarm=entry.record["members"],
                                                                   adaptive_size=self._adaptive_size(),
                                                                   model=self.trainer)))
        else:
            self._queue.append(entry)
            self._start_next()
        self.clock.tick("monitor_s", time.perf_counter() - t)
        self._stamp(entry.record)
        self._write_ready()
        return entry.record

    def defer(self, r: int, h: int, *, val_loss: bool) -> None:
        """Round ``r``'s h = 0 record, measured against Mix1's average at the round's end (``record_deferred``)."""
        t = time.perf_counter()
        self._at = (r, h)
        self._poll()
        self._deferred = _Entry(self._record_start(r, h, val_loss), ready=False)
        self._entries.append(self._deferred)
        self.clock.tick("monitor_s", time.perf_counter() - t)
        self._stamp(self._deferred.record)

    def record_deferred(self, algo: FactoredDiLoCo) -> None:
        """Start (or queue) the round's h = 0 measurement against Mix1's average."""
        entry, self._deferred = self._deferred, None
        assert entry is not None
        mix1 = algo.mix1_result()  # the wait counts as the round's Mix1 wait (RoundReport.mix1_wait_s)
        t = time.perf_counter()
        z = algo.z  # z_{m,r}: the parameters at h = 0 (the outer step replaces the dict, never changes it)

        def values() -> tuple[TensorDict, TensorDict | None]:
            own = {n: v.detach().to("cpu", torch.float32) for n, v in z.items()}
            avg = {n: v.detach().to("cpu", torch.float32) for n, v in mix1.values[0].items()} if mix1.ok else None
            return own, avg

        entry.values, entry.ready = values, True
        self._wait_until_started(lambda queued: queued.values is not None)  # one held pair of z and x at most
        self._queue.append(entry)
        if self.waits:
            self._drain()
        self._poll()
        self.clock.tick("monitor_s", time.perf_counter() - t)

    def poll(self, r: int | None = None, h: int | None = None) -> None:
        """Between inner steps (the main thread is before step ``h`` of round ``r``): apply the measurements that
        finished, start the next one due if none runs, write the records that are complete. Cheap when idle."""
        t = time.perf_counter()
        if r is not None and h is not None:
            self._at = (r, h)
        self._poll()
        self.clock.tick("monitor_s", time.perf_counter() - t)

    def write_held(self, cause: str) -> None:
        """The run stopped: write every record still waiting (deferred, queued or measuring) unmeasured, saying
        why."""
        self._deferred = None
        self._queue = []
        for finished in self._slot.take():
            self._apply(finished.tag, finished)
        for entry in self._entries:
            if not entry.done:
                entry.record["monitor_cause"] = cause
                entry.done = True
        self._write_ready()

    def close(self) -> None:
        """Stop the background thread (after the exchange closed, a measurement in flight ends at once). Idempotent."""
        bound = self.cfg.timeouts.exchange_s
        if not self._slot.close(bound):
            log.warning("rank %d: a measurement still runs %.0f s after close; left to end on its own", self.rank, bound)

    def _record_start(self, r: int, h: int, val_loss: bool) -> dict:
        """A record's bookkeeping as of now (the losses and stats since the last one), before its measurement."""
        record: dict = {"round": r, "h": h, "step": r * self.cfg.inner_steps + h, "run_s": round(self.clock.run_s(), 3)}
        record["members"] = len(self.exchange.members(r))  # this peer's view: M of the estimates
        record.update(self.progress.take())
        record["_val_loss_due"] = val_loss
        return record

    def _stamp(self, record: dict) -> None:
        """The seconds ticked and the bytes moved since the last record, as of now."""
        record.update(self.clock.take_record())
        record["bytes_sent"] = self.exchange.bytes_sent
        record["wire_bytes_sent"] = getattr(self.exchange, "wire_bytes_sent", self.exchange.bytes_sent)
        record["bytes_received"] = self.exchange.bytes_received

    def _write_ready(self) -> None:
        """Publish the leading records that are complete (a record waits for those before it)."""
        while self._entries and self._entries[0].done:
            record = self._entries.pop(0).record
            record.pop("_val_loss_due", None)
            self.publish(record)

    # -- the background measurement ----------------------------------------------------------------

    def _poll(self) -> None:
        for finished in self._slot.take():
            self._apply(finished.tag, finished)
        self._start_next()
        self._write_ready()

    def _adaptive_size(self) -> float | None:
        return float(self.adaptive.size) if self.adaptive is not None else None

    def _start_next(self) -> None:
        """Start the oldest measurement due (if none runs): a snapshot of the parameters now, or a deferred
        measurement's values. Drops those of rounds the exchange no longer serves (counted)."""
        if self._slot.busy:
            return
        r_now, h_now = self._at
        while self._queue:
            entry = self._queue.pop(0)
            record = entry.record
            if record["round"] < r_now - 1:
                cause = (f"dropped: not started before round {r_now} (the exchange no longer takes round "
                         f"{record['round']}'s chunks)")
                record["monitor_cause"] = cause
                entry.done = True
                self.progress.count("monitor_dropped")
                log.warning("rank %d: measurement of round %d h %d %s", self.rank, record["round"], record["h"], cause)
                continue
            given = entry.values is not None
            if given:
                own, avg = entry.values()
                entry.values = None
            else:
                own, avg = self.trainer.params_cpu(), None
                step = r_now * self.cfg.inner_steps + h_now
                if step != record["step"]:  # postponed: the parameters are those of a later step
                    record["cd_step"] = step
                    self.progress.count("monitor_late")
            job = partial(self._measure, record["round"], record["h"], val_loss=record["_val_loss_due"], final=False,
                          swarm=record["members"], adaptive_size=self._adaptive_size(),
                          at=(own, avg) if given else None, own=own)
            entry.started = True
            if not self._slot.submit(entry, job):
                record["monitor_cause"] = "not measured: the monitor is closed"
                entry.done = True
            return

    def _wait_until_started(self, behind: Callable[[_Entry], bool]) -> None:
        """Wait (counted once as ``monitor_waits``; the time is ``monitor_s``) for the running measurements until
        no queued one is ``behind``: every peer starts every measurement, in order, none dropped for being late."""
        t = self.cfg.timeouts
        bound = 2 * t.exchange_s + 2 * t.grace_s + 60.0
        counted = False
        while any(behind(queued) for queued in self._queue):
            if not counted:
                self.progress.count("monitor_waits")
                counted = True
            if not self._slot.wait_idle(bound):
                log.warning("rank %d: a measurement still runs after %.0f s", self.rank, bound)
                return
            self._poll()

    def _drain(self, bound_s: float | None = None) -> bool:
        """Wait until every measurement due has run and apply them, for at most ``bound_s`` in all (default: each
        bounded by its exchanges' deadlines); True when none is left."""
        t = self.cfg.timeouts
        step_bound = 2 * t.exchange_s + 2 * t.grace_s + 60.0
        end = None if bound_s is None else time.monotonic() + bound_s
        while self._queue or any(e.started and not e.done for e in self._entries):
            wait = step_bound if end is None else max(end - time.monotonic(), 0.0)
            if not self._slot.wait_idle(wait):
                log.warning("rank %d: a measurement still runs after %.0f s; its record waits", self.rank, wait)
                return False
            self._poll()
        return True

    def _apply(self, entry: _Entry, finished: Finished) -> None:
        """A finished measurement, on the main thread: into its record, the round's CD_JS and the counters."""
        if entry.done:  # written already (the run stopped)
            return
        record = entry.record
        if finished.error is not None:
            exc = finished.error
            self.progress.count("monitor_failures")
            record["monitor_cause"] = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ExchangeClosed):
                log.error("rank %d: measurement of round %d h %d raised", self.rank, record["round"], record["h"],
                          exc_info=exc)
        else:
            m: Measurement = finished.value
            record.update(m.values)
            if m.failure is not None:
                self.progress.count("monitor_failures")
                log.warning("rank %d: monitor average at round %d h %d failed: %s", self.rank, record["round"],
                            record["h"], m.failure)
            if m.js is not None:
                self._round_js.append(m.js)
            if m.adopt is not None and self.adaptive is not None:
                # Every member sees the same mean, so all adopt the same prefix (a late joiner, or
                # a peer that missed a measurement, realigns here).
                self.adaptive.adopt(m.adopt)
            if m.average is not None:
                self._final_params = m.average
        if finished.seconds:
            record["monitor_bg_s"] = finished.seconds
        entry.done = True

    def _mean(self, key: str, flat: torch.Tensor, members: list[int], r: int) -> torch.Tensor:
        """The members' mean of ``flat`` (handed over): the exchange's all-reduce, or robust (``self.robust``)."""
        if self.robust is None:
            return self.exchange.all_reduce_mean(key, flat, members, inplace=True)
        # A measurement convicts nobody: parameters in mid-round differ by each peer's inner progress, and judging
        # them struck honest peers of a 4-peer open run (at 4 to 11 median distances) until they were excluded.
        return robust_group_mean(key, flat, members, self.exchange, Float32Codec(), self.robust.settings,
                                 self.robust.ledger, r, judge=False)[0]

    def _measure(self, r: int, h: int, *, val_loss: bool, final: bool, swarm: int, adaptive_size: float | None,
                 at: tuple[TensorDict, TensorDict | None] | None = None, own: TensorDict | None = None,
                 model: LocalTrainer | None = None) -> Measurement:
        """Consensus of this peer's group from per-peer terms (``runtime.peer``'s docstring), as estimates of the
        swarm's (``consensus_sample``, M = ``swarm``); own values if the group fails. Runs on the background
        thread (the final measurement: on the main thread, nothing in flight); touches only the exchange and the
        scratch model.

        ``own``: this peer's parameters (a snapshot; None: read them now, the final measurement). ``at``: this
        peer's parameters and the average to measure them against (Mix1's; None when this peer's Mix1 failed): no
        parameters are exchanged, and the group's terms average over the peers that had an average (each sends a
        validity weight with its terms)."""
        ex = self.exchange
        model = model or self.eval_trainer
        params = at[0] if at is not None else own if own is not None else self.trainer.params_cpu()
        key = f"monitor/{r}/{h}"
        result = Measurement()
        out = result.values
        try:
            members = ex.group(key, r)
            if at is None:
                flat = self._mean(key, pack([params], self.names, ex.vector), members, r)
                if not all_finite(flat):
                    raise ExchangeError("non-finite average")
                avg = unpack(flat, [params], self.names)[0]
            else:
                avg = at[1]
            valid = avg is not None
            terms = consensus.l2_term(params, avg if valid else params, self.groups)
            model.load_params(params)
            own_logits = model.logits(self.heldout)
            model.load_params(avg if valid else params)
            js = consensus.js_term(own_logits, model.logits(self.heldout), self.cfg.monitor.js_top_k)
            blocks = list(terms)
            total = sum(terms.values())
            extra = [adaptive_size] if adaptive_size is not None else []
            weight = float(valid)
            mine = torch.tensor([weight] + [weight * v for v in [math.sqrt(total), total, js]
                                            + [math.sqrt(terms[b]) for b in blocks]] + extra, dtype=torch.float32)
            mean = self._mean(f"{key}/terms", mine, members, r).tolist()
            if mean[0] <= 0:
                raise ExchangeError("no peer of the group had Mix1's average to measure against")
            g = round(mean[0] * len(members))  # the members whose terms count
            means = [v / mean[0] for v in mean[1:4 + len(blocks)]]
            if g < 2 <= swarm:
                out.update(cd_scope="none", cd_group_size=g, cd_swarm_size=swarm,
                           monitor_cause=f"alone in its group of the monitor's exchange ({len(members)} members)")
            else:
                out.update(consensus_sample.estimate(means[1], means[0], dict(zip(blocks, means[3:])), g, swarm))
                out["cd_js"] = means[2]
                result.js = means[2]
            if adaptive_size is not None:
                result.adopt = int(math.floor(mean[-1] + 0.5))
            if final:
                result.average = {n: v.clone() for n, v in avg.items()}
        except ExchangeClosed:
            if final:
                raise
            out["monitor_cause"] = "the exchange closed"
            return result
        except ExchangeError as exc:
            result.failure = out["monitor_cause"] = f"{type(exc).__name__}: {exc}"
            model.load_params(params)  # validation loss of this peer's own model
        if val_loss:
            out["val_loss"] = model.evaluate(self.val_batches)
        return result
