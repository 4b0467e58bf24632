"""A network peer's measurements and its metrics records (the consensus monitors over the network; the module
docstring of ``runtime.peer`` tells how they are computed).

A record carries what happened since the previous one (``TrainingProgress.take``), the seconds the peer's clock
ticked, its byte counters and, when a measurement is due, the swarm-wide CD_L2, CD_L2^2 and CD_JS (eqs. 34, 40,
46) and the validation loss. When the monitor reuses Mix1's average (``monitor_reuses_mix1``), the round's
h = 0 record waits for that average at the round's end (``defer``, then ``record_deferred``) and the records
after it are held, so records are still written in (round, h) order.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from gossiploco import consensus
from gossiploco.adaptive import AdaptiveMix2
from gossiploco.blocks import group_by_block
from gossiploco.config import RunConfig
from gossiploco.errors import ExchangeClosed, ExchangeError
from gossiploco.factored import FactoredDiLoCo
from gossiploco.mixing.compression import Float32Codec
from gossiploco.mixing.packing import pack, unpack
from gossiploco.mixing.robust_mean import Robust, robust_group_mean
from gossiploco.tensor_checks import all_finite
from gossiploco.runtime.common import monitor_reuses_mix1
from gossiploco.runtime.peer_clock import PeerClock
from gossiploco.runtime.peer_progress import TrainingProgress
from gossiploco.trainer import LocalTrainer
from gossiploco.transport.zmq_exchange import ZmqExchange

log = logging.getLogger("gossiploco.runtime.peer")
TensorDict = dict[str, torch.Tensor]


class PeerMonitor:
    """Makes a peer's records and measures consensus with its group; hands each finished record, in order, to
    ``publish``. Used by the peer's main thread only; every measurement blocks on the exchange (its deadlines).

    ``trainer``: the peer's model (its parameters are what is measured); ``eval_trainer``: a scratch model
    (the averaged parameters' logits, the validation loss); ``heldout``: the shared held-out batch of the JS
    term; ``val_batches``: the validation loss's batches."""

    def __init__(self, cfg: RunConfig, rank: int, exchange: ZmqExchange, trainer: LocalTrainer,
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
        """The round's h = 0 measurement uses Mix1's average instead of an all-reduce of its own."""
        self._round_js: list[float] = []
        """CD_JS measured during the current round (adaptive Mix2's signal)."""
        self._deferred: dict | None = None
        """The round's h = 0 record while it waits for Mix1's average."""
        self._held: list[dict] = []
        """Later records of that round, written after it."""
        self._final_params: TensorDict | None = None

    @property
    def final_params(self) -> TensorDict | None:
        """The averaged model of the final measurement (None until it succeeded)."""
        return self._final_params

    @property
    def deferring(self) -> bool:
        """Whether the round's h = 0 record waits for Mix1's average."""
        return self._deferred is not None

    def take_round_js(self) -> list[float]:
        """The CD_JS values measured this round; the next round starts an empty list."""
        taken, self._round_js = self._round_js, []
        return taken

    # -- records -----------------------------------------------------------------------------------

    def record(self, r: int, h: int, *, val_loss: bool, final: bool = False) -> dict:
        """Measure now (the group's all-reduce of parameters) and write the record; returns it. ``final``: the
        averaged model is kept (``final_params``)."""
        record = self._record_start(r, h, val_loss)
        t = time.perf_counter()
        record.update(self._measure(r, h, val_loss=val_loss, final=final))
        self.clock.tick("monitor_s", time.perf_counter() - t)
        return self._record_end(record)

    def defer(self, r: int, h: int, *, val_loss: bool) -> None:
        """Round ``r``'s h = 0 record, measured against Mix1's average at the round's end (``record_deferred``).
        Its group is agreed now, beside Mix1's, as an undeferred measurement's is (a round waits no longer for a
        missing peer than before)."""
        self._deferred = self._record_start(r, h, val_loss)
        self._deferred["group"] = self._monitor_group(r, h)  # ExchangeClosed: write_held still writes the record

    def record_deferred(self, algo: FactoredDiLoCo) -> None:
        """The round's h = 0 measurement against Mix1's average, then the records held behind it."""
        record, self._deferred = self._deferred, None
        assert record is not None
        mix1 = algo.mix1_result()  # the wait counts as the round's Mix1 wait (RoundReport.mix1_wait_s)
        t = time.perf_counter()
        own = {n: v.detach().to("cpu", torch.float32) for n, v in algo.z.items()}  # z_{m,r}: the parameters at h = 0
        avg = {n: v.detach().to("cpu", torch.float32) for n, v in mix1.values[0].items()} if mix1.ok else None
        record.update(self._measure(record["round"], 0, val_loss=record["val_loss_due"], final=False, at=(own, avg),
                                    group=record["group"]))
        self.clock.tick("monitor_s", time.perf_counter() - t)
        self._record_end(record)

    def write_held(self, cause: str) -> None:
        """The run stopped: write a deferred record unmeasured (saying why), and the records held behind it."""
        if self._deferred is not None:
            record, self._deferred = self._deferred, None
            record["monitor_cause"] = cause
            self._record_end(record)

    def _record_start(self, r: int, h: int, val_loss: bool) -> dict:
        """A record's bookkeeping as of now (the losses and stats since the last one), before its measurement."""
        record: dict = {"round": r, "h": h, "step": r * self.cfg.inner_steps + h, "val_loss_due": val_loss}
        record["members"] = len(self.exchange.members(r))  # the group this measurement averages over
        record.update(self.progress.take())
        return record

    def _monitor_group(self, r: int, h: int) -> list[int] | ExchangeError:
        try:
            return self.exchange.group(f"monitor/{r}/{h}", r)
        except ExchangeClosed:
            raise
        except ExchangeError as exc:
            return exc

    def _record_end(self, record: dict) -> dict:
        record.pop("val_loss_due")
        record.pop("group", None)
        record.update(self.clock.take_record())
        record["bytes_sent"] = self.exchange.bytes_sent
        record["wire_bytes_sent"] = self.exchange.wire_bytes_sent
        record["bytes_received"] = self.exchange.bytes_received
        if self._deferred is not None:  # written after the round's h = 0 record
            self._held.append(record)
            return record
        done, self._held = [record, *self._held], []
        for finished in done:
            self.publish(finished)
        return record

    # -- the measurement ---------------------------------------------------------------------------

    def _mean(self, key: str, flat: torch.Tensor, members: list[int], r: int) -> torch.Tensor:
        """The members' mean of ``flat`` (handed over): the exchange's all-reduce, or robust (``self.robust``)."""
        if self.robust is None:
            return self.exchange.all_reduce_mean(key, flat, members, inplace=True)
        # A measurement convicts nobody: parameters in mid-round differ by each peer's inner progress, and judging
        # them struck honest peers of a 4-peer open run (at 4 to 11 median distances) until they were excluded.
        return robust_group_mean(key, flat, members, self.exchange, Float32Codec(), self.robust.settings,
                                 self.robust.ledger, r, judge=False)[0]

    def _measure(self, r: int, h: int, *, val_loss: bool, final: bool,
                 at: tuple[TensorDict, TensorDict | None] | None = None,
                 group: list[int] | ExchangeError | None = None) -> dict:
        """Swarm-wide consensus from per-peer terms (``runtime.peer``'s docstring); own values if the group fails.

        ``at``: this peer's parameters and the average to measure them against (Mix1's; None when this
        peer's Mix1 failed): no parameters are exchanged, and the group's terms average over the peers that
        had an average (each sends a validity weight with its terms). ``group``: the members agreed earlier (or
        why that failed)."""
        ex = self.exchange
        params = self.trainer.params_cpu() if at is None else at[0]
        out: dict = {}
        try:
            if isinstance(group, ExchangeError):
                raise group
            members = ex.group(f"monitor/{r}/{h}", r) if group is None else group
            if at is None:
                flat = self._mean(f"monitor/{r}/{h}", pack([params], self.names), members, r)
                if not all_finite(flat):
                    raise ExchangeError("non-finite average")
                avg = unpack(flat, [params], self.names)[0]
            else:
                avg = at[1]
            valid = avg is not None
            terms = consensus.l2_term(params, avg if valid else params, self.groups)
            if at is not None:  # the model now holds y_{m,r,H}: the scratch model gives z_{m,r}'s logits
                self.eval_trainer.load_params(params)
            own_logits = (self.trainer if at is None else self.eval_trainer).logits(self.heldout)
            self.eval_trainer.load_params(avg if valid else params)
            js = consensus.js_term(own_logits, self.eval_trainer.logits(self.heldout), self.cfg.monitor.js_top_k)
            blocks = list(terms)
            total = sum(terms.values())
            extra = [float(self.adaptive.size)] if self.adaptive is not None else []
            weight = float(valid)
            mine = torch.tensor([weight] + [weight * v for v in [math.sqrt(total), total, js]
                                            + [math.sqrt(terms[b]) for b in blocks]] + extra, dtype=torch.float32)
            mean = self._mean(f"monitor/{r}/{h}/terms", mine, members, r).tolist()
            if mean[0] <= 0:
                raise ExchangeError("no peer of the group had Mix1's average to measure against")
            mean = [mean[0]] + [v / mean[0] for v in mean[1:4 + len(blocks)]] + mean[4 + len(blocks):]
            out.update(cd_l2=mean[1], cd_l2_sq=mean[2], cd_js=mean[3],
                       cd_l2_blocks={b: mean[4 + i] for i, b in enumerate(blocks)})
            self._round_js.append(mean[3])
            if self.adaptive is not None:
                # Every member sees the same mean, so all adopt the same prefix (a late joiner, or
                # a peer that missed a measurement, realigns here).
                self.adaptive.adopt(int(math.floor(mean[-1] + 0.5)))
            if final:
                self._final_params = {n: v.clone() for n, v in avg.items()}
        except ExchangeClosed:
            raise
        except ExchangeError as exc:
            self.progress.count("monitor_failures")
            out["monitor_cause"] = f"{type(exc).__name__}: {exc}"
            log.warning("rank %d: monitor average at round %d h %d failed: %s", self.rank, r, h, exc)
            self.eval_trainer.load_params(params)  # validation loss of this peer's own model
        if val_loss:
            out["val_loss"] = self.eval_trainer.evaluate(self.val_batches)
        return out
