"""What the metric sinks cost a run: seconds per record written through ``MetricsSink`` (metrics.jsonl) alone, with
TensorBoard, and with TensorBoard and W&B (offline), for a record shaped like a 125m peer's (12 layers: 27 blocks of
CD_L2, the peer's timing, byte and mix fields, 4 workers' steps and tokens). Each configuration writes the same
records into a fresh directory; the time includes opening the sinks (at the first record) and closing them (flush).

    python bench/metric_sinks.py --records 200 --repeats 3 --out bench/results/metric-sinks.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gossiploco.metric_sinks import LoggingConfig, MetricSinks, SinkTarget
from gossiploco.metrics import MetricsSink

CONFIGS = {"jsonl": [], "jsonl+tensorboard": ["tensorboard"], "jsonl+tensorboard+wandb": ["tensorboard", "wandb"]}


def record(step: int) -> dict:
    blocks = ["embed", *(f"layers.{i}.{part}" for i in range(12) for part in ("attention", "mlp")), "lm_head", "norm"]
    r = {"round": step // 50, "h": step % 50, "step": step, "cd_l2": 1e-3 * step, "cd_l2_sq": 1e-6 * step,
         "cd_js": 1e-4 * step, "cd_l2_blocks": {b: 1e-4 * step * (i + 1) for i, b in enumerate(blocks)},
         "loss": 5.0 - 1e-3 * step, "val_loss": 5.1 - 1e-3 * step, "members": 4, "steps": [50] * 4,
         "tokens": [50 * 64 * 1024] * 4, "bytes_sent": 1000 * step, "bytes_received": 1000 * step,
         "wire_bytes_sent": 1000 * step}
    r.update({name: 0.01 for name in ("compute_s", "delta_s", "mix1_s", "mix1_wait_s", "mix2_s", "monitor_s", "other_s",
                                      "outer_s")})
    r.update(mix1_bytes=500_000_000, mix2_bytes=250_000_000, mix1_failures=0, mix2_failures=0)
    return r


def run_once(kinds: list[str], records: int, directory: Path) -> tuple[float, float, float]:
    """Seconds the caller spent on the first record, on each later record (mean), and in ``close`` (which waits
    for the sinks' thread to write what is queued)."""
    cfg = LoggingConfig(sinks=list(kinds), wandb_mode="offline")
    forward = MetricSinks(cfg, SinkTarget(directory, group="bench", name="bench", config={})) if kinds else None
    sink = MetricsSink(directory, forward=forward)
    t0 = time.perf_counter()
    sink.write(record(0))
    t1 = time.perf_counter()
    for i in range(1, records):
        sink.write(record(i * 10))
    t2 = time.perf_counter()
    sink.close()
    t3 = time.perf_counter()
    return t1 - t0, (t2 - t1) / (records - 1), t3 - t2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true", WANDB_DISABLE_CODE="true")
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # interleaved: each repeat runs every configuration once
            for name, kinds in CONFIGS.items():
                times[name].append(run_once(kinds, args.records, Path(tmp) / f"{name}-{repeat}"))
    scalars = len(__import__("gossiploco.metric_sinks", fromlist=["scalars"]).scalars(record(0))[0])
    base = statistics.median(t[1] for t in times["jsonl"])
    lines = ["# Metric sinks: cost per record", "",
             f"Regenerate: `python bench/metric_sinks.py --records {args.records} --repeats {args.repeats}"
             f"{f' --out {args.out}' if args.out else ''}`", "",
             f"{args.records} records of {scalars} scalars each (a 125m peer's record), written through MetricsSink; "
             f"medians of {args.repeats} interleaved repeats. The sinks are written by their own thread "
             "(``MetricSinks``): the training thread's cost is the caller's (the record turned into scalars and "
             "queued, plus the line of metrics.jsonl); close waits for the thread to open the sinks (TensorBoard's "
             "writer; wandb.init, which starts W&B's service: the first repeat also imports torch.utils.tensorboard "
             "and wandb), write every queued record (TensorBoard flushed at each) and close them (wandb finish); "
             "the thread's time per record is the whole (first write to closed) over the records. CPU, this "
             "machine (2 cores shared with other work).",
             "", "| sinks | caller ms per record | vs jsonl only | close ms | thread ms per record (whole / records) |",
             "|---|---:|---:|---:|---:|"]
    for name in CONFIGS:
        first, per, close = (statistics.median(t[i] for t in times[name]) for i in range(3))
        whole = statistics.median(a + b * (args.records - 1) + c for a, b, c in times[name])
        lines.append(f"| {name} | {1000 * per:.3f} | {per / base:.1f}x | {1000 * close:.1f} | "
                     f"{1000 * whole / args.records:.2f} |")
    lines += ["", "All runs (first, per record, close; ms): " + "; ".join(
        f"{n}: " + ", ".join(f"({1000 * a:.1f}, {1000 * b:.2f}, {1000 * c:.1f})" for a, b, c in ts) for n, ts in times.items())]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
