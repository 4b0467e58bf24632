"""Inner optimizer (AdamW, warmup + linear decay, clipping) and the outer Nesterov step.

The outer step works on fp32 tensors kept on the CPU: outer parameters, the pseudo-gradient
and the momentum buffer are plain ``dict[str, Tensor]``, so they can be mixed, sent and
checked without touching the model on the accelerator.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from gossiploco.config import InnerOptConfig, OuterOptConfig

TensorDict = dict[str, torch.Tensor]


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak rate at inner step ``step`` (0-based): linear warmup, then linear decay to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    return max(0.0, (total_steps - step) / decay_steps)


class InnerOptimizer:
    """AdamW with the warmup/decay schedule and global-norm clipping. Decay on matrices only.

    On CUDA it is PyTorch's fused AdamW (one kernel for every parameter's update); elsewhere the
    default multi-tensor implementation (``fused`` overrides the choice). A step never waits for the
    device: the learning rate is a Python number and the gradient norm stays a device tensor until
    someone reads it.
    """

    def __init__(self, model: nn.Module, cfg: InnerOptConfig, total_steps: int, fused: bool | None = None):
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.params = list(model.parameters())
        self.cfg = cfg
        self.total_steps = total_steps
        self.fused = fused if fused is not None else bool(self.params) and self.params[0].device.type == "cuda"
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=self.fused or None,
        )
        self.step_index = 0
        self.schedule_round: tuple[int, int] | None = None
        """With a time budget: (the first step of the current round, the steps of a full round). The schedule then
        follows the rounds, not the steps a worker happened to run: every round starts where a steps budget's
        would, and a fast worker's steps beyond a full round keep the round's last rate (otherwise a fast worker
        would decay its rate to 0 rounds early and a slow one would never finish its decay)."""
        self.lock = threading.Lock()

    def export_moments(self) -> torch.Tensor:
        """AdamW's first and second moments of every parameter, as one flat fp32 CPU vector
        (zeros before the first step). Safe to call from another thread while training: it takes
        ``lock``, which ``step`` holds, so the moments are those after one whole step."""
        with self.lock:
            parts = []
            for key in ("exp_avg", "exp_avg_sq"):
                for p in self.params:
                    value = self.opt.state.get(p, {}).get(key)
                    parts.append(torch.zeros(p.numel()) if value is None else value.detach().reshape(-1).to("cpu", torch.float32))
            return torch.cat(parts) if parts else torch.empty(0)

    def moments_size(self) -> int:
        return 2 * sum(p.numel() for p in self.params)

    def import_moments(self, flat: torch.Tensor, step_index: int) -> None:
        """Adopt moments from ``export_moments`` (another worker's: a joining peer's warm start) and
        continue the schedule at inner step ``step_index``."""
        if flat.numel() != self.moments_size():
            raise ValueError(f"optimizer state of {flat.numel()} values, expected {self.moments_size()}")
        with self.lock:
            offset = 0
            for key in ("exp_avg", "exp_avg_sq"):
                for p in self.params:
                    state = self.opt.state[p]
                    state[key] = flat[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype).clone()
                    # The fused kernel keeps its step count on the parameter's device (as AdamW creates it).
                    state["step"] = torch.tensor(float(step_index), dtype=torch.float32, device=p.device if self.fused else "cpu")
                    offset += p.numel()
            self.step_index = step_index

    def schedule_position(self) -> int:
        """The step of the schedule whose rate the next step takes (see ``schedule_round``)."""
        if self.schedule_round is None:
            return self.step_index
        first, length = self.schedule_round
        return first + min(max(self.step_index - first, 0), length - 1)

    def start_round(self, first: int, length: int) -> None:
        """A time-budget round begins: its steps take the schedule's rates from ``first`` on (at most ``length``)."""
        self.step_index, self.schedule_round = first, (first, length)

    def step(self) -> torch.Tensor:
        """Clip, apply one AdamW step at the scheduled rate, zero the gradients. Returns the pre-clip
        gradient norm as a 0-d tensor on the parameters' device (reading it waits for the device)."""
        with self.lock:
            return self._step()

    def _step(self) -> torch.Tensor:
        lr = self.cfg.lr * lr_factor(self.schedule_position(), self.cfg.warmup_steps, self.total_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.cfg.grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip).detach()
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params if p.grad is not None]))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_index += 1
        return norm


def outer_step(x: TensorDict, outer_grad: TensorDict, momentum: TensorDict, cfg: OuterOptConfig) -> tuple[TensorDict, TensorDict]:
    """OuterOpt(x, g) with state ``momentum``: SGD with Nesterov momentum as PyTorch implements it.

        v' = mu * v + g                          (paper eq. 36)
        z  = x - lr * (g + mu * v')              (eq. 37; heavy ball: z = x - lr * v')

    Returns the new parameters and the new momentum; inputs are not modified. It is
    ``outer_step_on_delta`` on -g (negation is exact, so the rounding is that of the formulas).
    """
    return outer_step_on_delta(x, {n: -g for n, g in outer_grad.items()}, momentum, cfg)


def outer_step_on_delta(x: TensorDict, delta_hat: TensorDict, momentum: TensorDict, cfg: OuterOptConfig) -> tuple[TensorDict, TensorDict]:
    """``OuterOpt(x, -delta_hat)`` with state ``momentum`` (Algorithm 1, line 13; ``outer_step`` with
    g = -delta_hat) in few passes over memory: two new tensors per parameter (the momentum, and the
    update that becomes the new x) and six in-place multi-tensor operations, so on a GPU a handful of
    kernels whatever the number of tensors. Exactness against eqs. 36-37: with
    g = -d, ``mu v + g`` is ``mu v - d``; ``g + mu v'`` is ``mu v' - d`` (IEEE addition commutes, negation
    is exact); ``x - lr u`` is ``(-lr) u + x``. Inputs are not modified."""
    names = list(delta_hat)
    d = [delta_hat[n] for n in names]
    v = torch._foreach_mul([momentum[n] for n in names], cfg.momentum)
    torch._foreach_sub_(v, d)  # v' = mu v + g
    if cfg.nesterov:
        update = torch._foreach_mul(v, cfg.momentum)
        torch._foreach_sub_(update, d)  # g + mu v'
    else:
        update = [t.clone() for t in v]
    torch._foreach_mul_(update, -cfg.lr)
    torch._foreach_add_(update, [x[n] for n in names])  # x - lr update
    return dict(zip(names, update)), dict(zip(names, v))
