"""Where a worker's outer state (z and the outer momentum) lives, and the copies that keep it off the
critical path.

Algorithm 1 touches the outer state twice a round: Mix1 reads z at the start (on a background
thread, while the inner steps run), and the end of the round computes the pseudo-gradient
Delta = y - z, mixes it (Mix2) and applies the outer step. On a GPU with room for the state,
keeping z and the momentum on the device makes all of that device work (a few fused kernels)
instead of copies of every parameter to the host and an outer step on the CPU. The network needs
host bytes, so the mixed blocks still cross: Mix1's on a side stream, overlapped with the inner
steps; Mix2's (the pseudo-gradient) through page-locked memory at DMA speed.

On a CPU, or with ``compute.outer_state = "host"``, everything stays in host memory, as the
outer step and mixing always did. The same code runs both ways; ``SideStream`` is a no-op
without CUDA.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)
TensorDict = dict[str, torch.Tensor]

TRAINING_COPIES = 4
"""Parameter-sized fp32 tensors training needs on the device: the parameters, their gradients and
AdamW's two moments."""
OUTER_COPIES = 6
"""Parameter-sized tensors the outer state adds at the end of a round: z, the momentum, the
pseudo-gradient, Mix1's result x, and the new z and momentum (the outer step makes new tensors, so
a state download served meanwhile reads a consistent snapshot)."""
HEADROOM = 1.25
"""Room left for activations: ``auto`` keeps the state on the device when its free memory (the model
already on it) holds HEADROOM x (TRAINING_COPIES - 1 + OUTER_COPIES) more parameter-sized tensors."""


def state_device(setting: str, device: torch.device, param_bytes: int) -> torch.device:
    """The device the outer state lives on for ``compute.outer_state = setting`` (auto, device, host),
    training on ``device`` a model of ``param_bytes`` fp32 bytes."""
    cpu = torch.device("cpu")
    if setting == "host" or device.type != "cuda":
        return cpu
    if setting == "device":
        return device
    free, _ = torch.cuda.mem_get_info(device)  # what other processes sharing the GPU left, too
    need = HEADROOM * (TRAINING_COPIES - 1 + OUTER_COPIES) * param_bytes
    if free >= need:
        return device
    log.warning("outer state in host memory: %.1f GB of GPU memory free, training with the outer state on it "
                "would want %.1f GB (set compute.outer_state = \"device\" to try anyway)", free / 1e9, need / 1e9)
    return cpu


class SideStream:
    """A CUDA stream beside the compute stream, for copies that should not wait for (or hold up) the
    inner steps; on a CPU every method runs the work in place."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def mark(self) -> torch.cuda.Event | None:
        """An event at the current point of the compute stream (what the side stream must wait for)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def enter(self, after: torch.cuda.Event | None):
        """Context in which work runs on the side stream, after ``after``."""
        if self.stream is None:
            return contextlib.nullcontext()
        if after is not None:
            self.stream.wait_event(after)
        return torch.cuda.stream(self.stream)

    def done(self) -> torch.cuda.Event | None:
        """An event at the current point of the side stream."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def join(self, event: torch.cuda.Event | None, tensors: list[torch.Tensor]) -> None:
        """Make the compute stream wait for ``event`` and hand it ``tensors`` made on the side stream
        (their memory is not reused until the compute stream is done with them)."""
        if self.stream is None or event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            if t.device.type == "cuda":
                t.record_stream(current)


def to_device(values: TensorDict, device: torch.device) -> TensorDict:
    """``values`` on ``device`` in fp32 (entries already there are kept, not copied). From page-locked
    host memory the copies are asynchronous."""
    return {n: v if v.device == device and v.dtype == torch.float32 else v.to(device, torch.float32, non_blocking=True)
            for n, v in values.items()}
