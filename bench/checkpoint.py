"""What checkpointing every round costs the training: gossiploco's writer thread against writing in the training
thread (our format, and plain ``torch.save`` as a simple trainer would), and against no checkpoints.

A virtual swarm (``gossiploco.runtime.virtual``) trains ``--workers`` workers of ``--model`` for ``--rounds``
rounds of ``--inner-steps`` steps, checkpointing every round, once per mode; the modes run one after another
in ``--reps`` alternating repetitions (same seed and data, same machine load). Timed through the progress
callback: every inner step's wall time, and each *boundary* (from a round's last inner step to the next
round's first: Mix2, the outer step, the measurement and, with checkpoints, the snapshot or the write).

Modes:
* ``none``: no checkpoints (``checkpoint.enabled = false``);
* ``thread``: ``CheckpointWriter`` (snapshot on the training thread, safetensors + SHA-256 + fsync on its own);
* ``inline``: the same files written on the training thread (``write_checkpoint`` where the snapshot is taken);
* ``torch-save``: ``torch.save`` of the same tensors plus fsync, on the training thread.

    python bench/checkpoint.py --model small --workers 4 --inner-steps 10 --rounds 8 --reps 2 --out bench/results/checkpoint.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gossiploco.checkpoint import CheckpointWriter, Snapshot, write_checkpoint
from gossiploco.config import TINY_OVERRIDES, load_config
from gossiploco.metrics import MetricsSink
from gossiploco.runtime.virtual import VirtualSwarm

MODES = ("none", "thread", "inline", "torch-save")


class InlineWriter:
    """``CheckpointWriter``'s interface, writing on the caller's thread (``torch.save`` or our format)."""

    def __init__(self, directory: Path, config: dict, torch_save: bool):
        self.directory, self.config, self.torch_save = directory, config, torch_save
        self.last_submitted, self.written, self.write_s = -1, [], 0.0
        directory.mkdir(parents=True, exist_ok=True)

    def submit(self, snapshot: Snapshot) -> None:
        start = time.perf_counter()
        self.last_submitted = snapshot.round
        if self.torch_save:
            path = self.directory / f"round-{snapshot.round:06d}.pt"
            torch.save(snapshot.tensors, path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
        else:
            write_checkpoint(self.directory, snapshot, self.config)
        self.written.append(snapshot.round)
        self.write_s += time.perf_counter() - start

    def close(self, timeout_s=None) -> bool:
        return True

    def stats(self) -> dict:
        return {"checkpoints_written": len(self.written), "checkpoint_write_s": self.write_s}


def run_mode(mode: str, args, workdir: Path) -> dict:
    cfg = load_config("globalm1-localm2", {**TINY_OVERRIDES, "model.size": args.model, "workers": args.workers,
                                           "inner_steps": args.inner_steps, "rounds": args.rounds,
                                           "data.seq_len": 64, "data.batch_size": 8, "monitor.every": 0})
    out = workdir / mode
    writer = None
    if mode == "thread":
        writer = CheckpointWriter(out / "checkpoints", cfg.to_dict(), keep=2)
    elif mode in ("inline", "torch-save"):
        writer = InlineWriter(out / "checkpoints", cfg.to_dict(), torch_save=mode == "torch-save")
    swarm = VirtualSwarm(cfg)
    stamps: list[tuple[float, int]] = []  # (time, inner steps done) at every callback

    def on_step(advance: int, record) -> None:
        if advance:
            stamps.append((time.perf_counter(), len(stamps) + 1))

    start = time.perf_counter()
    swarm.run(MetricsSink(None), on_step, writer)
    if writer is not None:
        writer.close()
    wall = time.perf_counter() - start
    stats = writer.stats() if writer is not None else {}
    files = sorted((out / "checkpoints").glob("round-*.[ps][ta]*"))  # .pt or .safetensors
    steps, boundaries = [], []
    for (t0, n0), (t1, _) in zip(stamps, stamps[1:]):
        (boundaries if n0 % args.inner_steps == 0 else steps).append(t1 - t0)
    return {"mode": mode, "wall_s": wall, "step_s": statistics.median(steps), "boundary_s": statistics.median(boundaries),
            "snapshot_s": swarm.checkpoint_s / (args.rounds + 1), "write_s": stats.get("checkpoint_write_s", 0.0),
            "written": stats.get("checkpoints_written", 0), "bytes": files[-1].stat().st_size if files else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core trains, the other is free for the writer thread (as on a GPU machine's host)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    began, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in MODES:
                runs[mode].append(run_mode(mode, args, Path(tmp) / f"{rep}"))
                print(mode, {k: round(v, 4) if isinstance(v, float) else v for k, v in runs[mode][-1].items()}, flush=True)
    base = {k: statistics.median(r[k] for r in runs["none"]) for k in ("wall_s", "step_s", "boundary_s")}
    lines = ["# Checkpoint cost", "", f"Regenerate: `python {' '.join(shlex.quote(a) for a in sys.argv)}`", "",
             f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, 1 torch thread; {args.workers} workers of "
             f"`{args.model}` in one virtual swarm, {args.rounds} rounds x {args.inner_steps} inner steps, a checkpoint "
             f"every round (the whole swarm's state); {args.reps} alternating repetitions, medians; whole run "
             f"{time.perf_counter() - began:.0f} s; 1-minute load average at the start {load:.2f} (other work on the "
             "machine shows as noise between repetitions).", "",
             "| mode | checkpoint MB | inner step s | vs none | round boundary s | vs none | training-thread s per checkpoint | write s per checkpoint | run wall s | vs none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0] if k != "mode"}
        per = max(med["written"], 1)
        blocking = med["snapshot_s"] + (med["write_s"] / per if mode in ("inline", "torch-save") else 0.0)
        lines.append(f"| {mode} | {med['bytes'] / 1e6:.1f} | {med['step_s']:.4f} | {med['step_s'] / base['step_s'] - 1:+.1%} | "
                     f"{med['boundary_s']:.3f} | {med['boundary_s'] / base['boundary_s'] - 1:+.1%} | {blocking:.3f} | "
                     f"{med['write_s'] / per:.3f} | {med['wall_s']:.1f} | {med['wall_s'] / base['wall_s'] - 1:+.1%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
