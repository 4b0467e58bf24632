"""One worker's whole training state at a round boundary, as tensors and JSON, and back.

What continues a run exactly (Algorithm 1 at the start of round k): the outer parameters z and the
outer momentum; the inner AdamW moments, its step counts and the schedule's position; the data
stream's generator; a compressed Mix1's reference (the last mean, and its tag) and Mix2's error
feedback. The synchronous data-parallel baseline has no outer state: its model's parameters instead.
The data stream's generator is the only random state training has: the model is initialised from a
generator of its own seeded by the run's seed, gossip matchings are drawn from (seed, round), and
nothing draws from torch's global generators (tests/test_checkpoint.py checks that a run leaves them
as they were), so there is nothing else to save.

``capture`` copies what later steps change in place (the AdamW moments, a Mix1 reference); z, the
momentum and the error feedback are new tensors every round, so in host memory they are referenced
as they are. From a GPU everything is copied to page-locked host memory on the compute stream (the
host does not wait; ``Snapshot.ready`` does): one host copy of z, the momentum and the moments, four
times the fp32 model, per snapshot.
"""

from __future__ import annotations

import logging

import torch

from gossiploco.factored import FactoredDiLoCo, SyncDP
from gossiploco.mixing.operators import INITIAL_REFERENCE, GlobalMix
from gossiploco.trainer import LocalTrainer

log = logging.getLogger("gossiploco.runtime.worker_state")

TensorDict = dict[str, torch.Tensor]


class Copier:
    """Copies tensors to the host; on CUDA asynchronously into page-locked memory, ``wait`` waits."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []

    def __call__(self, t: torch.Tensor, immutable: bool = False) -> torch.Tensor:
        """A host copy of ``t`` as it is now; ``immutable``: nothing writes into ``t`` later (z, the momentum and
        the error feedback are new tensors every round), so in host memory it is taken as it is."""
        t = t.detach()
        if t.device.type != "cuda":
            return t if immutable else t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        self.events.append(event)
        return out

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()


def capture(algo: FactoredDiLoCo | SyncDP, prefix: str, copier: Copier | None = None) -> tuple[TensorDict, dict]:
    """Worker state under ``prefix/`` (tensors) and its JSON metadata."""
    copy = copier or Copier()
    trainer: LocalTrainer = algo.trainer
    tensors: TensorDict = {}
    meta: dict = {}
    if isinstance(algo, FactoredDiLoCo):
        tensors.update({f"{prefix}/z/{n}": copy(v, immutable=True) for n, v in algo.z.items()})
        tensors.update({f"{prefix}/momentum/{n}": copy(v, immutable=True) for n, v in algo.momentum.items()})
        tags, members = {}, {}
        for j, mixer in enumerate(algo.mix1):
            held = mixer.reference_state() if isinstance(mixer, GlobalMix) else None
            if held is not None:
                tensors[f"{prefix}/mix1_reference/{j}"] = copy(held[0])
                tags[str(j)], members[str(j)] = held[1], held[2]
        meta["mix1_reference_tags"] = tags
        meta["mix1_reference_members"] = members
        meta["last_round_tokens"] = algo.last_round_tokens  # Mix1's weight with round.weights = "tokens"
        tensors.update({f"{prefix}/mix2_residual/{n}": copy(v, immutable=True) for n, v in algo.mix2.residual.items()})
    else:
        tensors.update({f"{prefix}/params/{n}": copy(v) for n, v in trainer.params().items()})
    opt = trainer.inner_opt
    with opt.lock:
        for n, p in zip(trainer.names, opt.params):
            state = opt.opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    tensors[f"{prefix}/adam/{key}/{n}"] = copy(torch.as_tensor(state[key]))
        meta["inner_step"] = opt.step_index
    meta["stream"] = trainer.stream.state()
    return tensors, meta


def restore(algo: FactoredDiLoCo | SyncDP, prefix: str, tensors: TensorDict, meta: dict) -> None:
    """Put ``capture``'s state back into a freshly built worker of the same configuration."""
    trainer: LocalTrainer = algo.trainer
    names = trainer.names
    shapes = {n: p.shape for n, p in trainer.params().items()}

    def group(kind: str) -> TensorDict:
        start = f"{prefix}/{kind}/"
        return {k[len(start):]: v for k, v in tensors.items() if k.startswith(start)}

    if isinstance(algo, FactoredDiLoCo):
        z, momentum = group("z"), group("momentum")
        _check_names(prefix, "z", z, shapes)
        _check_names(prefix, "momentum", momentum, shapes)
        algo.set_state(z, momentum)  # also loads z into the model (y_{m,k,0} = z_{m,k}) and drops every Mix1 reference
        tags, members = meta.get("mix1_reference_tags", {}), meta.get("mix1_reference_members")
        for j, mixer in enumerate(algo.mix1):
            reference = tensors.get(f"{prefix}/mix1_reference/{j}")
            if reference is None or not isinstance(mixer, GlobalMix):
                continue
            tag = int(tags.get(str(j), 0))
            if members is None and tag != INITIAL_REFERENCE:
                # A checkpoint from before the members were kept: which group made this mean is unknown, and a group
                # with other members would compress against another reference (a failed mix); send fp32 once instead.
                log.info("%s: a Mix1 reference without its members (an older checkpoint): the next Mix1 sends fp32", prefix)
                continue
            mixer.restore_reference(reference.clone(), tag, None if members is None else members.get(str(j)))
        algo.mix2.residual = {n: v.clone() for n, v in group("mix2_residual").items()}
        algo.last_round_tokens = meta.get("last_round_tokens")
    else:
        params = group("params")
        _check_names(prefix, "params", params, shapes)
        trainer.load_params(params)
    opt = trainer.inner_opt
    with opt.lock:
        for n, p in zip(names, opt.params):
            saved = {key: tensors.get(f"{prefix}/adam/{key}/{n}") for key in ("exp_avg", "exp_avg_sq", "step")}
            if saved["exp_avg"] is None:
                continue
            step_device = p.device if opt.fused else "cpu"  # where AdamW itself keeps its step count
            opt.opt.state[p] = {"step": saved["step"].to(step_device, torch.float32).clone(),
                                "exp_avg": saved["exp_avg"].to(p.device, p.dtype).clone(),
                                "exp_avg_sq": saved["exp_avg_sq"].to(p.device, p.dtype).clone()}
        opt.step_index = int(meta["inner_step"])
    trainer.stream.load_state(meta["stream"])


def _check_names(prefix: str, kind: str, values: TensorDict, shapes: dict[str, torch.Size]) -> None:
    from gossiploco.checkpoint import CheckpointError

    names = list(shapes)
    if set(values) != set(names):
        missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
        raise CheckpointError(f"worker {prefix}: the checkpoint's {kind} does not fit this model "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    wrong = [f"{n} {tuple(values[n].shape)} vs {tuple(shapes[n])}" for n in names if tuple(values[n].shape) != tuple(shapes[n])]
    if wrong:
        raise CheckpointError(f"worker {prefix}: the checkpoint's {kind} has other shapes than this model "
                              f"(checkpoint vs now: {', '.join(wrong[:3])}; another vocabulary or model size?)")
