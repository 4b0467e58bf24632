"""What the virtual swarm and the network peer share: building a worker, when to measure, the summary."""

from __future__ import annotations

import dataclasses
import math

import torch

from gossiploco.blocks import select_parameters
from gossiploco.checkpoint import Snapshot
from gossiploco.config import RunConfig
from gossiploco.data import Corpus, make_stream
from gossiploco.errors import ConfigError
from gossiploco.hf_checkpoint import check_data_tokenizer, init_model
from gossiploco.model import Transformer, build_model
from gossiploco.optim import InnerOptimizer
from gossiploco.tokenizer import data_tokenizer_file
from gossiploco.trainer import LocalTrainer


def build_trainer(cfg: RunConfig, corpus: Corpus, device: torch.device, worker: int) -> LocalTrainer:
    """Worker ``worker``'s model (identical init everywhere), inner optimizer and data stream.

    ``worker = -1`` builds a scratch model (for averaged parameters) with worker 0's stream; it only
    evaluates, so it is not compiled (compiling it would cost more than its few calls save).
    """
    model = initial_model(cfg, corpus.vocab_size, device)
    stream = make_stream(corpus, cfg.data, cfg.seed, max(worker, 0), cfg.workers)
    compute = cfg.compute if worker >= 0 else dataclasses.replace(cfg.compute, compile="off")
    return LocalTrainer(model, InnerOptimizer(model, cfg.inner, cfg.total_inner_steps), stream, cfg.model.precision,
                        compute)


def initial_model(cfg: RunConfig, vocab_size: int, device: torch.device) -> Transformer:
    """The model every worker starts from: the checkpoint ``model.init`` names (its weights, its shape), else
    ``model.size`` with deterministic weights for ``seed``. ``ConfigError`` when the data's ``vocab_size``
    ids do not fit the checkpoint's embedding, or when they come from another tokenizer than the checkpoint's."""
    if not cfg.model.init:
        return build_model(cfg.model.size, vocab_size, cfg.data.seq_len, cfg.seed, device)
    check_data_tokenizer(cfg.model.init, data_tokenizer_file(cfg.data.tokenizer, cfg.data.paths))
    model = init_model(cfg.model.init, cfg.data.seq_len, device)
    if vocab_size > model.args.vocab_size:
        raise ConfigError("model.init", f"the data has {vocab_size} token ids, the checkpoint's embedding only "
                                        f"{model.args.vocab_size}: tokenize with the checkpoint's tokenizer")
    return model


def mean_loss(losses: list[torch.Tensor | float]) -> float:
    """The mean of training losses as one number: inner steps return them as device tensors, so this
    reads them all at once (one wait for the device) instead of once per step."""
    values = [v.detach().double().reshape(()) if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64) for v in losses]
    devices = {v.device for v in values}
    if len(devices) > 1:
        values = [v.cpu() for v in values]
    return float(torch.stack(values).mean())


def monitor_reuses_mix1(cfg: RunConfig, names: list[str]) -> bool:
    """Whether a round's measurement at h = 0 takes its average from Mix1 instead of an all-reduce of its own.

    At h = 0 of round r every worker holds z_{m,r}, and a global Mix1 of all the parameters averages
    exactly that: its result x_{m,r} is the average the monitors need (the compressed mean, with
    ``mix1.compression``). The measurement then waits for Mix1 (a peer measures at the round's end, when
    Mix1 is done anyway) and sends no parameters: only the per-peer terms (a few floats)."""
    return (cfg.mode == "factored" and cfg.mix1.kind == "global"
            and set(select_parameters(names, cfg.mix1.blocks, "mix1.blocks")) == set(names))


def measure_due(cfg: RunConfig, h: int) -> tuple[bool, bool]:
    """(measure consensus, also measure validation loss) before inner step ``h`` of a round.

    Every round is measured at h = 0 (with the validation loss when ``monitor.val_loss``) and
    every ``monitor.every`` steps; the runtimes add one final measurement after the last round
    (the only one when ``monitor.enabled`` is false). With a time budget (``round.budget = "time"``) only at
    h = 0: the workers run different numbers of steps, so a mid-round measurement (a collective on real
    peers) would make the fast wait for the slow, what the budget is there to avoid.
    """
    if not cfg.monitor.enabled:
        return False, False
    every = cfg.monitor.every if cfg.round.budget == "steps" else 0
    due = h == 0 or bool(every and h % every == 0)
    return due, due and h == 0 and cfg.monitor.val_loss


def round_reached(records: list[dict], snapshot: Snapshot | None, start_round: int) -> int:
    """The round a stopped run was in: the newest of its records and of the round start it snapshotted (a stop
    just after a round's start has no record of that round yet, but its checkpoint has the round)."""
    started = snapshot.round if snapshot is not None else start_round
    return max([started, *(r["round"] for r in records)])


def merge_stats(pending: dict, stats: dict) -> None:
    """Add a round's stats to those waiting for the next record: failure counts add up (rounds
    between two records all count), everything else is the latest round's."""
    for key, value in stats.items():
        pending[key] = pending.get(key, 0) + value if key.endswith("_failures") else value


def make_summary(cfg: RunConfig, records: list[dict], final_val_loss: float | None, wall_s: float) -> dict:
    cd_l2 = [r["cd_l2"] for r in records if "cd_l2" in r]
    cd_js = [r["cd_js"] for r in records if "cd_js" in r]
    # A network peer's records count the group each measurement averaged over; the run's workers are the most that
    # took part at once (the configured number is only what the peers waited for at the start)
    members = [r["members"] for r in records if isinstance(r.get("members"), int)]
    return {
        "config": cfg.name,
        "mode": cfg.mode,
        "model": cfg.model.describe(),  # its size, or "from CHECKPOINT"
        "seed": cfg.seed,
        "workers": max(members) if members else cfg.workers,
        "configured_workers": cfg.workers,
        "inner_steps": cfg.inner_steps,
        "rounds": cfg.rounds,
        "final_val_loss": final_val_loss,
        "final_val_ppl": math.exp(min(final_val_loss, 50.0)) if final_val_loss is not None else None,
        "max_cd_l2": max(cd_l2, default=0.0),
        "max_cd_js": max(cd_js, default=0.0),
        "mix1_failures": sum(r.get("mix1_failures", 0) for r in records),
        "mix1_again": sum(r.get("mix1_again", 0) for r in records),
        "mix2_failures": sum(r.get("mix2_failures", 0) for r in records),
        "grad_failures": sum(r.get("grad_failures", 0) for r in records),
        "wall_s": wall_s,
    }


def robust_summary(algo: object) -> dict:
    """The summary's ``security`` entries of robust mixing (``gossiploco.mixing.screen``): whether it ran, the
    members' screen failures and whom this worker excluded, and why."""
    robust = getattr(algo, "robust", None)
    if robust is None:
        return {"robust": False}
    return {"robust": True, **robust.ledger.summary()}
