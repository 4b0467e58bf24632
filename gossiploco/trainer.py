"""One peer's single-device training: its model, inner optimizer and data stream.

Knows nothing about mixing, peers or networks (those wrap it from outside). The model lives on
the compute device; ``params_cpu``/``load_params`` move fp32 copies to and from the CPU.

How it computes (``[compute]``, none of it changes the math): the model may be compiled
(torch.compile), a batch may run as several micro-batches whose gradients add up to the whole
batch's, layers may recompute their activations in the backward pass. An inner step never waits
for the device: it returns the loss as a device tensor, and the caller reads losses when it
records them (``synchronize`` marks where compute ends, for timing).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F

from gossiploco.config import ComputeConfig
from gossiploco.data import TokenStream
from gossiploco.errors import ConfigError
from gossiploco.model import Transformer
from gossiploco.optim import InnerOptimizer

log = logging.getLogger(__name__)
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

    def __init__(self, model: Transformer, inner_opt: InnerOptimizer, stream: TokenStream, precision: str = "fp32",
                 compute: ComputeConfig | None = None):
        compute = compute or ComputeConfig()
        self.model = model
        self.inner_opt = inner_opt
        self.stream = stream
        self.device = next(model.parameters()).device
        self.names = [n for n, _ in model.named_parameters()]
        self._params = dict(model.named_parameters())
        self._bf16 = precision == "bf16" and self.device.type == "cuda"
        self._cuda = self.device.type == "cuda"
        self.micro_batch_size = compute.micro_batch_size
        model.checkpoint_activations = compute.checkpoint_activations
        model.use_flash_gqa()
        self._compile = compute.compile
        self.compiled = compute.compile == "on" or (compute.compile == "auto" and self._cuda)
        # The compiled module runs the training passes; evaluation (rare, other shapes) stays eager.
        # Parameter names (the blocks) are the model's own either way.
        self._train_forward = torch.compile(model) if self.compiled else model

    def _autocast(self):
        if self._bf16:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._cuda:  # from page-locked memory the copy is asynchronous: the host does not wait for the GPU
            tokens = tokens.pin_memory()
        return tokens.to(self.device, non_blocking=True)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        forward = self._train_forward if self.model.training else self.model
        with self._autocast():
            logits = self._compiled_or_eager(forward, self._to_device(inputs))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), self._to_device(targets).flatten())

    def _compiled_or_eager(self, forward, inputs: torch.Tensor) -> torch.Tensor:
        """``forward(inputs)``; with ``compute.compile = "auto"`` a compiler failure (no Triton for an old
        GPU, no C++ compiler) is logged with its cause and this trainer goes on uncompiled."""
        if forward is self.model:
            return forward(inputs)
        try:
            return forward(inputs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch.compile raises many kinds; "on" re-raises them all
            if self._compile != "auto":
                raise
            log.warning("torch.compile failed (%s: %s); training without it (set compute.compile = \"off\" to skip "
                        "the attempt, or \"on\" to make this an error)", type(exc).__name__, " ".join(str(exc).split())[:400])
            self._train_forward, self.compiled = self.model, False
            return self.model(inputs)

    def forward_backward(self) -> torch.Tensor:
        """Sample the next batch, compute the loss and accumulate its gradient (eq. 22), in micro-batches
        of ``micro_batch_size`` sequences when set: each micro-batch's mean loss is weighted by its share of
        the batch, so the gradients add up to the whole batch's. Returns the batch's mean loss (a 0-d
        tensor on the device; reading it waits for the device)."""
        self.model.train()
        inputs, targets = self.stream.next_batch()  # (B, T) each
        size = self.micro_batch_size or inputs.shape[0]
        total = None
        for x, y in zip(inputs.split(size), targets.split(size)):
            part = self.loss(x, y) * (x.shape[0] / inputs.shape[0])
            part.backward()
            total = part.detach() if total is None else total + part.detach()
        assert total is not None
        return total

    def inner_step(self) -> torch.Tensor:
        """One full inner step: gradient and AdamW update (eqs. 22-23). Returns the loss (see forward_backward)."""
        loss = self.forward_backward()
        self.inner_opt.step()
        return loss

    def warm_up(self) -> float:
        """Compile now (a compiled trainer): one forward and backward pass of a batch of zeros of the
        training shape, gradients dropped. Parameters, optimizer and data stream are untouched, so the
        run is the same; only its first inner step is no longer minutes long (a peer that compiled
        during its first round would fall behind the others and catch up again). Returns the seconds."""
        if not self.compiled:
            return 0.0
        start = time.perf_counter()
        self.model.train()
        rows = self.micro_batch_size or self.stream.batch_size
        zeros = torch.zeros(rows, self.stream.seq_len, dtype=torch.long)
        self.loss(zeros, zeros).backward()
        self.model.zero_grad(set_to_none=True)
        self.synchronize()
        return time.perf_counter() - start

    def synchronize(self) -> None:
        """Wait until the device has done all the work queued so far (a no-op on the CPU)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def gradients_cpu(self) -> TensorDict:
        return {n: p.grad.detach().to("cpu", torch.float32) for n, p in self._params.items()}

    def load_gradients(self, grads: TensorDict) -> None:
        with torch.no_grad():
            for n, p in self._params.items():
                p.grad.copy_(grads[n])

    def params_cpu(self) -> TensorDict:
        """fp32 CPU copies of the current parameters (from a GPU: into page-locked memory, one wait)."""
        if not self._cuda:
            return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in self._params.items()}
        out = {n: torch.empty(p.shape, dtype=torch.float32, pin_memory=True).copy_(p.detach(), non_blocking=True)
               for n, p in self._params.items()}
        self.synchronize()
        return out

    def params(self) -> TensorDict:
        """The live parameters (no copies: they change with the next inner step or ``load_params``)."""
        return {n: p.detach() for n, p in self._params.items()}

    def load_params(self, values: TensorDict) -> None:
        with torch.no_grad():
            torch._foreach_copy_(list(self._params.values()), [values[n] for n in self._params])

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
