"""One peer's single-device training: its model, inner optimizer and data stream.

Knows nothing about mixing, peers or networks (those wrap it from outside). The model lives on
the compute device; ``params_cpu``/``load_params`` move fp32 copies to and from the CPU, where
the outer step and mixing work.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from gossiploco.data import TokenStream
from gossiploco.errors import ConfigError
from gossiploco.model import Transformer
from gossiploco.optim import InnerOptimizer

TensorDict = dict[str, torch.Tensor]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} requested but CUDA is not available")
    return device


class LocalTrainer:
    """Inner steps (paper eqs. 22-23) of one worker."""

    def __init__(self, model: Transformer, inner_opt: InnerOptimizer, stream: TokenStream, precision: str = "fp32"):
        self.model = model
        self.inner_opt = inner_opt
        self.stream = stream
        self.device = next(model.parameters()).device
        self.names = [n for n, _ in model.named_parameters()]
        self._params = dict(model.named_parameters())
        self._bf16 = precision == "bf16" and self.device.type == "cuda"

    def _autocast(self):
        if self._bf16:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs.to(self.device, non_blocking=True))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.to(self.device, non_blocking=True).flatten())

    def forward_backward(self) -> float:
        """Sample the next batch, compute the loss and accumulate gradients (eq. 22). Returns the loss."""
        self.model.train()
        inputs, targets = self.stream.next_batch()
        loss = self.loss(inputs, targets)
        loss.backward()
        return float(loss.detach())

    def inner_step(self) -> float:
        """One full inner step: gradient and AdamW update (eqs. 22-23). Returns the loss."""
        loss = self.forward_backward()
        self.inner_opt.step()
        return loss

    def gradients_cpu(self) -> TensorDict:
        return {n: p.grad.detach().to("cpu", torch.float32) for n, p in self._params.items()}

    def load_gradients(self, grads: TensorDict) -> None:
        with torch.no_grad():
            for n, p in self._params.items():
                p.grad.copy_(grads[n])

    def params_cpu(self) -> TensorDict:
        """fp32 CPU copies of the current parameters."""
        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self._params.items()}

    def load_params(self, values: TensorDict) -> None:
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(values[n])

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        with self._autocast():
            return self.model(inputs.to(self.device)).float()

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean cross-entropy over fixed batches."""
        self.model.eval()
        return sum(float(self.loss(x, y)) for x, y in batches) / len(batches)
