"""Algorithm 1 (paper appendix A): one worker of Factored Gossip DiLoCo, backend-agnostic.

Per round r, for worker m:

    3:  launch x_{m,r} <- Mix1_r(z_{m,r}) asynchronously        begin_round   (background thread)
    4:  y_{m,r,0} <- z_{m,r}                                     (the model already holds z)
    5-8: H inner AdamW steps                                     inner_step
    10: Delta_{m,r} <- y_{m,r,H} - y_{m,r,0}                     end_round
    11: Delta_hat_{m,r} <- Mix2_r(Delta_{m,r})                   (blocking)
    12: wait for Mix1_r; x_{m,r} is its result
    13: z_{m,r+1} <- OuterOpt(x_{m,r}, -Delta_hat_{m,r})         (eq. 26)

The same class runs in the one-process virtual swarm (``MemoryExchange``) and in a network
peer (a ZeroMQ exchange): only the ``Exchange`` differs. z and the momentum live where
``gossiploco.outer_state`` puts them (on the GPU when it has room: the pseudo-gradient and the
outer step are then device work, Mix1's copies run on a side stream beside the inner steps).
With ``round.weights = "tokens"`` both mixes are means weighted by the tokens each worker processed
(Decoupled DiLoCo), in units of a full round's tokens (inner_steps steps: 1.0 each when every worker
ran them all, which is then the unweighted mean bit for bit). Mix2 weights Delta_{m,r} by this round's
tokens: they are what Delta_{m,r} was computed from. Mix1 is launched at the round's start, before this
round's tokens are known, so it weights z_{m,r} by the previous round's, the work that moved z_{m,r}
last (round 0: equal, and every z_{m,0} is x_0 anyway).
A global Mix1 whose group lost a member mid-exchange runs once more among the survivors while the round has time
for it (``mix1.again``, ``gossiploco.mixing.again``): line 3's result is then their mean, not identity.
``SyncDP`` is the synchronous data-parallel baseline (gradient all-reduce every inner step) over
the same interface.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gossiploco.adversary import Adversary
from gossiploco.blocks import select_parameters, split_fragments
from gossiploco.config import RunConfig
from gossiploco.mixing import Exchange, GlobalMix, MixResult, build_mixer
from gossiploco.mixing.again import RunAgain
from gossiploco.mixing.mix_result import NON_FINITE
from gossiploco.mixing.robust import RobustSettings
from gossiploco.mixing.robust_mean import Robust
from gossiploco.mixing.screen import Ledger
from gossiploco.mixing.weighted import MAX_WEIGHT
from gossiploco.optim import outer_step_on_delta
from gossiploco.outer_state import SideStream, state_device, to_device
from gossiploco.trainer import LocalTrainer

log = logging.getLogger(__name__)

TensorDict = dict[str, torch.Tensor]


@dataclass
class RoundReport:
    """What one round's communication did on one worker."""

    round: int
    mix1: MixResult
    mix2: MixResult
    mix1_wait_s: float
    """Seconds the worker blocked waiting for Mix1 after Mix2 (0 when fully overlapped)."""
    mix2_s: float
    """Seconds blocked in Mix2."""
    outer_s: float
    """Seconds in the outer step (including loading z into the model)."""
    delta_s: float = 0.0
    """Seconds computing the pseudo-gradient before Mix2 (with the outer state in host memory: copying
    the parameters off the GPU)."""
    steps: int = 0
    """Inner steps this worker ran in the round."""
    tokens: int = 0
    """Tokens those steps processed (Mix2's weight with ``round.weights = "tokens"``)."""


def merge_fragments(results: list[MixResult], names: list[list[str]]) -> MixResult:
    """One ``MixResult`` of Mix1's fragments: each fragment's parameters from its own result."""
    if len(results) == 1:
        return results[0]
    values = [dict(d) for d in results[0].values]
    for result, part in zip(results[1:], names[1:]):
        for merged, mixed in zip(values, result.values):
            merged.update({n: mixed[n] for n in part})
    causes = [f"fragment {j}: {r.cause}" for j, r in enumerate(results) if not r.ok]
    return MixResult(values, ok=not causes, cause="; ".join(causes) or None,
                     partner=next((r.partner for r in results if r.partner is not None), None),
                     seconds=sum(r.seconds for r in results), bytes=sum(r.bytes for r in results),
                     again=any(r.again for r in results))


class FactoredDiLoCo:
    """Algorithm 1 for one worker. Not thread-safe: one caller drives begin/inner/end in order."""

    def __init__(self, trainer: LocalTrainer, cfg: RunConfig, exchange: Exchange, *, open_run: bool = False):
        self.trainer = trainer
        self.cfg = cfg
        self.exchange = exchange
        robust = cfg.robust
        self.robust = Robust(RobustSettings(robust.iterations, robust.radius_factor, robust.outlier_factor,
                                            robust.min_cosine, robust.weight_cap),
                             Ledger(robust.strikes, robust.window)) if robust.active(open_run) else None
        """Robust mixing (``[robust]``; an open run's default), shared by Mix1 and Mix2, or None."""
        names = trainer.names
        params = trainer.params()
        mix1_names = select_parameters(names, cfg.mix1.blocks, "mix1.blocks")
        parts = split_fragments(mix1_names, {n: params[n].numel() for n in names}, cfg.mix1.fragments, cfg.mix1.fragment_order)
        # Streaming: fragment j of Mix1 starts at inner step j H / F of the round (each its own exchange, so the
        # payload in flight at a time is 1/F of it); no error feedback: a global Mix1 compresses against a reference
        self.mix1 = [build_mixer(cfg.mix1.kind, "mix1", part, cfg.seed, cfg.mix1.codec(),
                                 key_suffix=f"/f{j}" if len(parts) > 1 else "") for j, part in enumerate(parts)]
        if self.robust is not None:
            for mixer in self.mix1:
                mixer.make_robust(self.robust)
        self._mix1_starts = [j * cfg.inner_steps // len(parts) for j in range(len(parts))]
        self.mix1_again = RunAgain(cfg.mix1.again and cfg.mix1.kind == "global", cfg.timeouts.grace_s)
        """When a failed Mix1 runs again among its group's survivors (``mixing.again``)."""
        self._again_by: float | None = None
        self.mix2 = self._mix2(select_parameters(names, cfg.mix2.blocks, "mix2.blocks"))
        for mix in (cfg.mix1, cfg.mix2):
            mix.codec().prepare()  # a compiled codec compiles now, before the first round's exchanges
        self.state_device = state_device(cfg.compute.outer_state, trainer.device, 4 * sum(p.numel() for p in params.values()))
        """Where z and the momentum live (gossiploco.outer_state)."""
        self._side = SideStream(self.state_device)
        # line 1: z_{m,0} <- x_0 (identical init on every worker)
        self.z: TensorDict = {n: p.to(self.state_device, torch.float32, copy=True) for n, p in params.items()}
        self.momentum: TensorDict = {n: torch.zeros_like(v) for n, v in self.z.items()}
        for mixer in self.mix1:  # every worker starts from x_0: a compressed Mix1's first reference
            mixer.start_reference([self.z, self.momentum] if cfg.mix1.state else [self.z])
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mix1-rank{exchange.rank}")
        self._mix1: list[Future[tuple[MixResult, object]]] = []
        self._round: tuple[int, list[TensorDict], object] | None = None
        """This round's index, Mix1's state and its readiness mark, while fragments are still to start."""
        self._step = 0
        self._mix1_done: MixResult | None = None
        self._mix1_wait_s = 0.0
        self.weighted = cfg.round.weights == "tokens"
        self.tokens_per_step = trainer.stream.batch_size * trainer.stream.seq_len
        self._round_unit = cfg.inner_steps * self.tokens_per_step
        """A full round's tokens: the unit of the mixes' weights."""
        self.round_steps = 0
        """Inner steps run in the current round so far."""
        self.last_round_tokens: int | None = None
        """Tokens of the previous round (Mix1's weight); None before the first one ends."""
        self.adversary: Adversary | None = None
        """A dishonest worker's behaviour (the attack bench; ``gossiploco.adversary``), None for an honest one."""
        self.honest_deltas: list[TensorDict] | None = None
        """This round's honest pseudo-gradients, where the caller knows them (an omniscient ``alie`` attacker)."""

    def set_state(self, z: TensorDict, momentum: TensorDict) -> None:
        """Adopt outer state from elsewhere (a catching-up peer's download) and load z into the model."""
        self.z = {n: v.to(self.state_device, torch.float32, copy=True) for n, v in z.items()}
        self.momentum = {n: v.to(self.state_device, torch.float32, copy=True) for n, v in momentum.items()}
        for mixer in self.mix1:  # the swarm's reference is a mean this peer did not take part in
            mixer.forget_reference()
        self.trainer.load_params(self.z)

    def set_mix2_blocks(self, patterns: list[str]) -> None:
        """Cover ``patterns`` in Mix2 from now on (adaptive Mix2; call between rounds)."""
        residual = self.mix2.residual
        self.mix2 = self._mix2(select_parameters(self.trainer.names, patterns, "mix2.blocks"))
        self.mix2.residual = residual  # a block that leaves Mix2 keeps its error feedback for when it returns

    def _mix2(self, names: list[str]):
        """Mix2 over ``names``: the pseudo-gradient, compressed as configured, with error feedback."""
        mix2 = self.cfg.mix2
        mixer = build_mixer(mix2.kind, "mix2", names, self.cfg.seed, mix2.codec(), mix2.error_feedback, mix2.feedback_decay)
        if self.robust is not None:
            mixer.make_robust(self.robust)
        return mixer

    def begin_round(self, r: int) -> None:
        """Line 3: launch Mix1 on z_{m,r} (and the outer momentum for GlobalM1S) in the background (with
        fragments: the first now, the others as the round's inner steps reach their start)."""
        state = [self.z, self.momentum] if self.cfg.mix1.state else [self.z]
        self._round, self._step, self._mix1 = (r, state, self._side.mark()), 0, []
        self.round_steps = 0
        if self.cfg.round.budget == "time":
            self.trainer.inner_opt.start_round(r * self.cfg.inner_steps, self.cfg.inner_steps)
        self._again_by = self.mix1_again.round_began(time.monotonic())
        self._launch_mix1()
        self.exchange.link_ahead(self.mix2.key(r), r)  # links on demand: Mix2's links open during the inner steps

    def _launch_mix1(self) -> None:
        """Queue the Mix1 fragments due by now (z does not change during the round: the same result, later)."""
        assert self._round is not None
        r, state, ready = self._round
        weight = self._weight(self.last_round_tokens)
        while len(self._mix1) < len(self.mix1) and self._mix1_starts[len(self._mix1)] <= self._step:
            self._mix1.append(self._pool.submit(self._run_mix1, self.mix1[len(self._mix1)], state, r, ready, weight,
                                                self._again_by))

    def _weight(self, tokens: int | None) -> float | None:
        """The mixes' weight for ``tokens`` (None: unknown yet, counted as a full round); None when unweighted."""
        if not self.weighted:
            return None
        return 1.0 if tokens is None else min(tokens / self._round_unit, MAX_WEIGHT)

    def _run_mix1(self, mixer, state: list[TensorDict], r: int, ready, weight: float | None,
                  again_by: float | None) -> tuple[MixResult, object]:
        """Mix1 (or one fragment of it) on the background thread; a failed exchange runs again among its group's
        survivors while ``again_by`` allows (``mixing.again``). With the state on a GPU its copies (the mixed
        blocks to the host and back) run on the side stream, after ``ready`` (z written), beside the inner
        steps; returns the result, its values on the state device, and the event the outer step waits for."""
        with self._side.enter(ready):
            result = mixer.mix(state, r, self.exchange, weight=weight, last_try=not self.mix1_again.enabled)
            self.mix1_again.ended(result.ok, result.seconds, again=False)
            why_not = None if result.ok or not self.mix1_again.enabled else self._why_not_again(result, again_by)
            if why_not:
                log.warning("mix1 round %d: identity this round (not run again: %s)", r, why_not)
            elif not result.ok and self.mix1_again.enabled:
                log.warning("mix1 round %d: running it again among the group's survivors, under a new leader", r)
                first = result
                result = mixer.mix(state, r, self.exchange, weight=weight, again=True)
                self.mix1_again.ended(result.ok, result.seconds, again=True)
                log.log(logging.INFO if result.ok else logging.WARNING, "mix1 round %d run again: %s", r,
                        "done" if result.ok else f"failed too ({result.cause}); identity this round")
                result.seconds += first.seconds
            result.values = [to_device(d, self.state_device) for d in result.values]
            return result, self._side.done()

    def _why_not_again(self, failed: MixResult, again_by: float | None) -> str | None:
        """Why a failed Mix1 is not run again (``mixing.again``), or None: it is."""
        if not failed.grouped and not failed.leaderless:
            return "no group was agreed"
        if failed.cause == NON_FINITE:
            return "a member sent non-finite values"
        if not self.mix1_again.wanted(again_by, time.monotonic()):
            return "no time left in the round" if again_by is not None else "no whole round to time it by yet"
        return None

    def inner_step(self) -> torch.Tensor:
        """Lines 6-8: one inner AdamW step on y. Returns the training loss (a device tensor: reading it waits)."""
        loss = self.trainer.inner_step()
        self.advance()
        return loss

    def advance(self) -> None:
        """One inner step is done (by ``inner_step``, or by a benchmark's stand-in for it): start the Mix1
        fragments due."""
        self._step += 1
        self.round_steps += 1
        if self._round is not None:
            self._launch_mix1()

    def pseudo_gradient(self) -> TensorDict:
        """Line 10: Delta_{m,r} = y_{m,r,H} - y_{m,r,0}, on the state device."""
        on_model = self.state_device == self.trainer.device
        y = self.trainer.params() if on_model else self.trainer.params_cpu()
        names = list(y)
        return dict(zip(names, torch._foreach_sub([y[n] for n in names], [self.z[n] for n in names])))

    def end_round(self, r: int) -> RoundReport:
        """Lines 10-13: pseudo-gradient, blocking Mix2, wait for Mix1, outer step at the mixed point."""
        start = time.perf_counter()
        delta = self.pseudo_gradient()  # line 10
        delta_s = time.perf_counter() - start

        start = time.perf_counter()
        steps, tokens = self.round_steps, self.round_steps * self.tokens_per_step
        claimed = tokens
        if self.adversary is not None:  # the attack bench's dishonest worker (gossiploco.adversary)
            delta = self.adversary.pseudo_gradient(delta, r, self.honest_deltas)
            claimed = self.adversary.claimed_tokens(tokens)
        # line 11: blocking (weighted by this round's tokens: what Delta_{m,r} was computed from)
        mix2 = self.mix2.mix([delta], r, self.exchange, weight=self._weight(claimed))
        self.last_round_tokens = claimed  # Mix1 of the next round weights z by it
        delta_hat = to_device(mix2.values[0], self.state_device)
        mix2_s = time.perf_counter() - start

        mix1 = self.mix1_result()  # line 12
        mix1_wait_s, self._mix1_wait_s = self._mix1_wait_s, 0.0
        self._round, self._mix1, self._mix1_done = None, [], None
        x = mix1.values[0]
        momentum = mix1.values[1] if self.cfg.mix1.state else self.momentum

        start = time.perf_counter()
        # line 13 (eq. 26): z = OuterOpt(x, -Delta_hat), bit for bit, without materialising -Delta_hat
        self.z, self.momentum = outer_step_on_delta(x, delta_hat, momentum, self.cfg.outer)
        self.trainer.load_params(self.z)  # y_{m,r+1,0} <- z_{m,r+1}
        self.trainer.synchronize()  # (on a GPU the step only queues work: time it to its end)
        return RoundReport(r, mix1, mix2, mix1_wait_s, mix2_s, time.perf_counter() - start, delta_s, steps, tokens)

    def start_all_mix1(self) -> None:
        """Start the Mix1 fragments not started yet (Mix1's result is wanted now)."""
        assert self._round is not None, "Mix1 asked for outside a round"
        self._step = self.cfg.inner_steps
        self._launch_mix1()

    def mix1_result(self) -> MixResult:
        """Wait for this round's Mix1 (starting any fragment not started yet) and return it, its values on
        the state device: x_{m,r}, the mean of z_{m,r} (the monitors measure against it). The seconds
        waited count as the round's Mix1 wait."""
        if self._mix1_done is None:
            start = time.perf_counter()
            self.start_all_mix1()
            done = [f.result() for f in self._mix1]
            for result, copied in done:
                self._side.join(copied, [v for d in result.values for v in d.values()])
            self._mix1_done = merge_fragments([result for result, _ in done], [m.names for m in self.mix1])
            self._mix1_wait_s += time.perf_counter() - start
        return self._mix1_done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class SyncDP:
    """Synchronous data parallel: all-reduce the gradient before every inner step."""

    def __init__(self, trainer: LocalTrainer, cfg: RunConfig, exchange: Exchange):
        self.trainer = trainer
        self.cfg = cfg
        self.exchange = exchange
        self.reducer = GlobalMix("grad", trainer.names, cfg.seed)

    def forward_backward(self) -> float:
        return self.trainer.forward_backward()

    def reduce_and_step(self, step: int) -> MixResult:
        """Average the gradients over the group (local gradients if the exchange fails), then AdamW."""
        result = self.reducer.mix([self.trainer.gradients_cpu()], step, self.exchange)
        if result.ok:
            self.trainer.load_gradients(result.values[0])
        self.trainer.inner_opt.step()
        return result

    def close(self) -> None:
        pass
