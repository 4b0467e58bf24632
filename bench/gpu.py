"""GPU benchmark: how fast one peer's inner step is, and where 4 peers sharing the device spend a round.

1. Inner-step throughput, for each model size and token batch (``--shapes``): milliseconds per inner
   step, tokens/s, MFU and peak memory, side by side in one run for

   * ``eager``: the path before [compute] existed: no torch.compile, PyTorch's default (multi-tensor,
     not fused) AdamW, the whole batch in one pass;
   * ``tuned``: the defaults now (torch.compile on CUDA, fused AdamW on CUDA), plus the micro-batch
     size or activation checkpointing a shape names (``16x2048:ckpt``, ``64x1024:mb16``).

   Each figure is the median of ``--repeats`` timings of ``--steps`` inner steps (after ``--warmup``
   steps, which include compiling), timed to the device's completion. MFU counts 6 N FLOPs per token
   (N: parameters), against the device's dense bf16 peak (detected from its name, or ``--peak-tflops``);
   the column with attention adds 12 L T d per token. Out of memory is reported as such.

2. The end of a round outside the mixes (the pseudo-gradient, the outer step, loading z into the
   model) for the peers' model: ``FactoredDiLoCo.end_round`` with the outer state on the device and
   in host memory, beside the landed path (parameters copied to the host, the outer step tensor by
   tensor on the CPU). Median of ``--repeats`` rounds. On CUDA also a mix's host round trip (the peers'
   model packed into a host vector and back to the GPU) through the training process's pinned memory,
   the companion's registered shared vectors, and the companion's former path (``host_vector_rows``).

3. Four ``gossiploco peer`` processes on the one device (static list on loopback, bf16, monitors off)
   for each preset (``--presets``): per peer, the median over rounds 1.. (round 0 compiles) of the
   compute utilization, Mix1 wait, Mix2 seconds and the seconds outside compute and the blocking mixes
   (``other_s``: the pseudo-gradient, the outer step, copies, bookkeeping), and the simulator's
   prediction for the measured step time and link. The link is measured, not assumed: the
   ``diloco`` run's Mix2 is a global all-reduce of the whole model, so its median seconds give the
   loopback link's rate (``gossiploco.utilization.wire_factor``); without a ``diloco`` run, ``--link-mbps``.

    python bench/gpu.py                                  # CUDA: writes bench/results/gpu.md
    python bench/gpu.py --device cpu --sizes tiny --shapes 8x64 --presets diloco,globalm1-localm2 \\
        --rounds 3 --inner-steps 5 --out /tmp/gpu.md     # the same measurements on a CPU, in a minute
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gossiploco.config import ComputeConfig, InnerOptConfig, OuterOptConfig, load_config
from gossiploco.data import Corpus, TokenStream
from gossiploco.factored import FactoredDiLoCo
from gossiploco.mixing import MemoryHub
from gossiploco.runtime.common import build_trainer
from gossiploco.model import MODEL_SIZES, build_model, count_parameters
from gossiploco.optim import InnerOptimizer
from gossiploco.runtime.launch import LocalPeers
from gossiploco.trainer import LocalTrainer, resolve_device
from gossiploco.utilization import block_sizes, comm_plan, report, resolve_scenario, simulate, wire_factor
from testbed.overrides import set_args

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SHAPES = {"tiny": "8x128", "small": "8x128", "125m": "16x256,64x1024", "1.5b": "8x1024,16x2048:ckpt"}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
                    "A10": 125.0, "L4": 121.0, "4090": 165.0, "3090": 71.0, "V100": 125.0}
"""Dense bf16 (V100: fp16) tensor-core peaks from the vendors' data sheets; the first name contained in
the device's name wins (so "H100 PCIe" before "H100")."""
VOCAB = 256  # the built-in corpus is byte-level text: the parameter counts of gossiploco.model


def detect_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def parse_shape(text: str) -> tuple[int, int, ComputeConfig]:
    """``BxT`` with options ``:ckpt`` (activation checkpointing) and ``:mbN`` (micro-batches of N)."""
    dims, *options = text.split(":")
    batch, seq = (int(v) for v in dims.lower().split("x"))
    micro, ckpt = 0, False
    for option in options:
        if option == "ckpt":
            ckpt = True
        elif option.startswith("mb"):
            micro = int(option[2:])
        else:
            raise SystemExit(f"error: --shapes: unknown option {option!r} in {text!r} (ckpt, mbN)")
    return batch, seq, ComputeConfig(micro_batch_size=micro, checkpoint_activations=ckpt)


# -- 1. inner-step throughput --------------------------------------------------------------------


def step_throughput(size: str, batch: int, seq: int, device: torch.device, precision: str, compute: ComputeConfig,
                    fused: bool | None, args: argparse.Namespace) -> dict:
    """Median milliseconds per inner step of one configuration, on synthetic tokens."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=max(1 << 20, 4 * batch * seq), dtype=np.uint16)
    model = build_model(size, VOCAB, seq, seed=0, device=device)
    opt = InnerOptimizer(model, InnerOptConfig(warmup_steps=0), total_steps=1 << 30, fused=fused)
    trainer = LocalTrainer(model, opt, TokenStream(tokens, seq, batch, seed=0, worker=0), precision, compute)
    try:
        for _ in range(args.warmup):
            trainer.inner_step()
        trainer.synchronize()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        per_step = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.inner_step()
            trainer.synchronize()
            per_step.append((time.perf_counter() - start) / args.steps)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        return {"ms": 1000 * statistics.median(per_step), "peak_gb": peak / 1e9 if peak is not None else None}
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        del trainer, model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()


def throughput_rows(args: argparse.Namespace, device: torch.device, peak_tflops: float | None) -> list[dict]:
    rows = []
    for size in args.sizes:
        n = count_parameters(size, VOCAB)
        m = MODEL_SIZES[size]
        for shape in (args.shapes or DEFAULT_SHAPES[size]).split(","):
            batch, seq, tuned = parse_shape(shape)
            variants = {"eager": (ComputeConfig(compile="off"), False), "tuned": (tuned, None)}
            for variant, (compute, fused) in variants.items():
                got = step_throughput(size, batch, seq, device, args.precision, compute, fused, args)
                row = {"size": size, "params": n, "shape": shape, "variant": variant, **got}
                if "ms" in got:
                    tps = batch * seq / (got["ms"] / 1000)
                    row["tokens_per_s"] = tps
                    if peak_tflops:
                        row["mfu"] = 6 * n * tps / (peak_tflops * 1e12)
                        row["mfu_attn"] = (6 * n + 12 * m.n_layers * seq * m.dim) * tps / (peak_tflops * 1e12)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


# -- 2. the end of a round, outside the mixes ---------------------------------------------------------


def landed_end_of_round(trainer: LocalTrainer, z: dict, momentum: dict, cfg: OuterOptConfig) -> None:
    """The end of a round as it was before [compute] (the alternative): the parameters copied to the host,
    the pseudo-gradient and outer step tensor by tensor on the CPU, z copied back into the model."""
    y = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in trainer.model.named_parameters()}
    delta = {n: y[n] - z[n] for n in y}
    g = {n: -delta[n] for n in delta}
    new_z = {n: z[n] - cfg.lr * (g[n] + cfg.momentum * (momentum[n] * cfg.momentum + g[n])) for n in g}
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            p.copy_(new_z[n])
    trainer.synchronize()


def end_of_round_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Median seconds of the end of a round without its mixes (both identity here: no bytes to pack or
    send), for the peers' model: the pseudo-gradient, the outer step and loading z, as
    ``FactoredDiLoCo.end_round`` does them for each outer-state placement, beside ``landed_end_of_round``."""
    tokens = np.zeros(1 << 16, dtype=np.uint16)
    corpus = Corpus(tokens, tokens, VOCAB, "zeros")
    rows = []
    placements = ["device", "host"] if device.type == "cuda" else ["host"]
    for path in ["landed", *placements]:
        cfg = load_config("diloco", {"model.size": args.peer_size, "mix2.kind": "identity", "workers": 1, "inner_steps": 1,
                                     "data.seq_len": 8, "data.batch_size": 1, "compute.compile": "off",
                                     "compute.outer_state": "host" if path == "landed" else path})
        trainer = build_trainer(cfg, corpus, device, 0)
        algo = FactoredDiLoCo(trainer, cfg, MemoryHub(1, 60.0).exchange(0))
        seconds = []
        for r in range(args.repeats + 1):
            if path == "landed":
                start = time.perf_counter()
                landed_end_of_round(trainer, algo.z, algo.momentum, cfg.outer)
            else:
                algo.begin_round(r)  # Mix1 is identity: its thread returns at once
                start = time.perf_counter()
                algo.end_round(r)
            seconds.append(time.perf_counter() - start)
        algo.close()
        rows.append({"path": path, "state": str(algo.state_device) if path != "landed" else "cpu (tensor by tensor)",
                     "ms": 1000 * statistics.median(seconds[1:]), "params": count_parameters(args.peer_size, VOCAB)})
        print(json.dumps(rows[-1]), flush=True)
        del algo, trainer
    return rows


def host_vector_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """CUDA only: median seconds of a mix's host round trip for the peers' model (what ``FactoredDiLoCo`` does
    around Mix2, without the collective): pack the GPU state into a host vector, then the result back to the GPU,
    to the device's completion. ``in-process``: as ``Exchange.vector`` (the caching allocator's pinned memory);
    ``companion``: ``SharedVectors.take(device=...)`` (shared memory registered with CUDA); ``companion, landed``:
    as before that, pinned memory copied into a pageable shared vector (``SharedVectors.shared``), the result back
    from it."""
    from gossiploco.companion.vectors import SharedVectors
    from gossiploco.mixing.packing import pack, unpack
    from gossiploco.outer_state import to_device

    numel = count_parameters(args.peer_size, VOCAB)
    sizes = [numel // 8] * 7 + [numel - 7 * (numel // 8)]
    state = {f"p{i}": torch.randn(n, device=device) for i, n in enumerate(sizes)}
    names, vectors, rows = list(state), SharedVectors(), []
    variants = {"in-process": lambda: pack([state], names),  # as ``Exchange.vector`` for a GPU: pinned, cached
                "companion": lambda: pack([state], names, lambda n, gpu: vectors.take(n, device=gpu)),
                "companion, landed": lambda: vectors.shared(pack([state], names))}
    for name, host in variants.items():
        seconds = []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            flat = host()
            back = to_device(unpack(flat, [state], names)[0], device)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
            assert all(torch.equal(back[n], state[n]) for n in names), f"{name}: the round trip changed values"
            del flat, back
        rows.append({"variant": name, "s": statistics.median(seconds[1:]), "params": numel})
        print(json.dumps(rows[-1]), flush=True)
    assert vectors.unpinned == 0, "a shared vector could not be registered with CUDA (see the log)"
    vectors.release()
    return rows


# -- 3. four peers sharing the device ----------------------------------------------------------------


def peer_overrides(args: argparse.Namespace) -> dict:
    batch, seq, compute = parse_shape(args.peer_shape)
    return {"model.size": args.peer_size, "model.precision": args.precision, "data.batch_size": batch, "data.seq_len": seq,
            "inner_steps": args.inner_steps, "rounds": args.rounds, "monitor.enabled": False, "seed": 0,
            "compute.micro_batch_size": compute.micro_batch_size,
            "compute.checkpoint_activations": compute.checkpoint_activations, "timeouts.exchange_s": args.exchange_s,
            "inner.synthetic_step_s": args.synthetic_step_ms / 1000, "compute.companion": args.companion}


def run_peers(preset: str, args: argparse.Namespace, out: Path) -> dict:
    """4 peers of ``preset`` on ``args.device``; per peer, medians over rounds 1.. of its round_times."""
    overrides = peer_overrides(args)
    cli = ["--config", preset, "--device", args.device, "--quiet", *set_args(overrides)]
    with LocalPeers(args.peers, out / preset, cli, env={"OMP_NUM_THREADS": str(args.threads)}) as peers:
        peers.start()
        codes = peers.wait(args.timeout_s)
        failed = {r: c for r, c in codes.items() if c != 0}
        tails = {r: peers.log(r)[-3000:] for r in failed}
    if failed:  # the logs live in a temporary folder: show their ends before it goes
        for rank, tail in tails.items():
            print(f"--- peer {rank} (exit {failed[rank]}), the end of its log:\n{tail}", file=sys.stderr)
        raise SystemExit(f"error: {preset}: peers {failed} failed")
    per_peer = []
    for rank in range(args.peers):
        summary = json.loads((peers.peer_dir(rank) / "summary.json").read_text())
        rounds = [t for t in summary["round_times"] if t["round"] >= 1] or summary["round_times"]
        med = {k: statistics.median(t[k] for t in rounds) for k in ("s", "compute_s", "mix1_wait_s", "mix2_s", "other_s")}
        med["utilization"] = statistics.median(t["compute_s"] / t["s"] for t in rounds)
        med["other_fraction"] = statistics.median(t["other_s"] / t["s"] for t in rounds)
        # Mix1's own seconds (from its start on the background thread): above the compute seconds it ran on into
        # the blocking Mix2, whose time then counts both
        metrics = peers.peer_dir(rank) / "metrics.jsonl"
        mix1 = [json.loads(line).get("mix1_s") for line in metrics.read_text().splitlines() if line.strip()] \
            if metrics.exists() else []
        mix1 = [v for v in mix1[1:] or mix1 if v is not None]
        med["mix1_s"] = statistics.median(mix1) if mix1 else None
        per_peer.append(med)
    cfg = load_config(preset, overrides)
    return {"preset": preset, "cfg": cfg, "peers": per_peer, "command": cli,
            "step_s": statistics.median(p["compute_s"] for p in per_peer) / args.inner_steps}


def link_mbps(runs: list[dict], args: argparse.Namespace) -> tuple[float, str]:
    """The loopback link's rate from the diloco run's Mix2 (a global all-reduce of every parameter)."""
    diloco = next((r for r in runs if r["preset"] == "diloco"), None)
    if diloco is None:
        return args.link_mbps, f"--link-mbps {args.link_mbps:g}"
    params = sum(block_sizes(diloco["cfg"].model.size, VOCAB).values())
    mix2_s = statistics.median(p["mix2_s"] for p in diloco["peers"])
    bits = wire_factor("global", args.peers) * params * 4 * 8
    return bits / mix2_s / 1e6, f"diloco's median Mix2 ({mix2_s:.3f} s for {params / 1e6:.1f}M fp32 values)"


def predict(run: dict, mbps: float) -> float:
    cfg = run["cfg"]
    plan = comm_plan(cfg, VOCAB)
    sc = resolve_scenario(cfg, bandwidth_mbps=mbps, vocab_size=VOCAB, step_time_s=run["step_s"], workers=len(run["peers"]))
    return report(plan, sc, simulate(plan, sc))["compute_utilization"]


# -- report -----------------------------------------------------------------------------------------


def render(args: argparse.Namespace, device: torch.device, peak: float | None, rows: list[dict], ends: list[dict],
           hosts: list[dict], runs: list[dict], link: tuple[float, str] | None, wall_s: float) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    lines = ["# GPU benchmark (bench/gpu.py)", "",
             f"Command: `python bench/gpu.py {shlex.join(sys.argv[1:])}` ({wall_s:.0f} s)",
             f"Device: {name}; torch {torch.__version__}; precision {args.precision}; "
             f"peak {'%g TFLOPS (bf16 dense)' % peak if peak else 'unknown (give --peak-tflops for MFU)'}.", ""]
    if rows:
        lines += ["## Inner-step throughput", "",
                  f"Median of {args.repeats} x {args.steps} inner steps after {args.warmup} warm-up steps; synthetic tokens.",
                  "eager: no compile, default AdamW; tuned: compile on CUDA, fused AdamW on CUDA, the shape's options.", "",
                  "| size | params | batch x seq | variant | ms/step | tokens/s | MFU 6N | MFU 6N+attn | peak GB | tuned/eager |",
                  "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        eager = {(r["size"], r["shape"]): r for r in rows if r["variant"] == "eager"}
        for r in rows:
            if r.get("oom"):
                lines.append(f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['shape']} | {r['variant']} | out of memory | | | | | |")
                continue
            base = eager.get((r["size"], r["shape"]), {})
            speedup = f"{base['ms'] / r['ms']:.2f}x" if r["variant"] == "tuned" and "ms" in base else ""
            mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
            mfu_attn = f"{100 * r['mfu_attn']:.1f}%" if "mfu_attn" in r else "n/a"
            peak_gb = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "n/a"
            lines.append(f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['shape']} | {r['variant']} | {r['ms']:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {mfu} | {mfu_attn} | {peak_gb} | {speedup} |")
        lines.append("")
    if ends:
        landed = ends[0]["ms"]
        lines += ["## The end of a round, outside the mixes", "",
                  f"`{args.peer_size}` ({ends[0]['params'] / 1e6:.0f}M parameters): the pseudo-gradient, the outer step and "
                  f"loading z into the model, median of {args.repeats} rounds (mixes identity). landed: as before [compute] "
                  "(copies to the host, tensor by tensor on the CPU); the others: `FactoredDiLoCo.end_round` with the outer "
                  "state on the device or in host memory.", "",
                  "| path | outer state | ms | landed / this |", "|---|---|---:|---:|"]
        lines += [f"| {e['path']} | {e['state']} | {e['ms']:.1f} | {landed / e['ms']:.2f}x |" for e in ends]
        lines.append("")
    if hosts:
        base = hosts[0]["s"]
        lines += ["## A mix's host round trip", "",
                  f"`{args.peer_size}` ({hosts[0]['params'] / 1e6:.0f}M fp32 values) packed from the GPU into a host vector "
                  f"and back, no collective, median of {args.repeats}: in the training process's pinned memory, in the "
                  "companion's shared vectors registered with CUDA, and as the companion did before (pinned, copied into "
                  "pageable shared memory, back from there).", "",
                  "| host vector | s | / in-process |", "|---|---:|---:|"]
        lines += [f"| {h['variant']} | {h['s']:.3f} | {h['s'] / base:.2f}x |" for h in hosts]
        lines.append("")
    if runs:
        assert link is not None
        lines += [f"## {args.peers} peers sharing the device", "",
                  f"`{args.peer_size}`, {args.peer_shape} tokens per step, H = {args.inner_steps}, {args.rounds} rounds, "
                  + (f"inner steps replaced by {args.synthetic_step_ms:g} ms sleeps, " if args.synthetic_step_ms else "") +
                  "monitors off; per peer the median over rounds 1.. (round 0 compiles). Link: "
                  f"{link[0]:,.0f} Mbit/s, from {link[1]}. Predicted: the simulator for the measured step time and link.", "",
                  "| preset | peer | round s | step ms | utilization | predicted | Mix1 s | Mix1 wait s | Mix2 s | other s | other % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for run in runs:
            predicted = predict(run, link[0])
            for rank, p in enumerate(run["peers"]):
                lines.append(f"| {run['preset']} | {rank} | {p['s']:.2f} | {1000 * p['compute_s'] / args.inner_steps:.1f} | "
                             f"{100 * p['utilization']:.1f}% | {100 * predicted:.1f}% | "
                             f"{'n/a' if p.get('mix1_s') is None else '%.3f' % p['mix1_s']} | {p['mix1_wait_s']:.3f} | "
                             f"{p['mix2_s']:.3f} | {p['other_s']:.3f} | {100 * p['other_fraction']:.2f}% |")
        lines += ["", "Peer command (each of them, plus `--rank I --peers ... --swarm-key ... --out ...`): "
                  f"`gossiploco peer {shlex.join(runs[0]['command'])}` with `--config` set per preset.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--sizes", default=None, help="model sizes, comma-separated, or none (default: 125m,1.5b on CUDA, tiny,small on a CPU)")
    ap.add_argument("--shapes", default=None, help="BxT[:ckpt][:mbN], comma-separated, for every size (default: per size)")
    ap.add_argument("--precision", default=None, choices=("fp32", "bf16"), help="default: bf16 on CUDA, fp32 on a CPU")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-end-of-round", dest="end_of_round", action="store_false", help="skip timing the end of a round")
    ap.add_argument("--no-host-vectors", dest="host_vectors", action="store_false",
                    help="skip timing a mix's host round trip (CUDA only)")
    ap.add_argument("--presets", default="diloco,globalm1-localm2", help="comma-separated; empty: skip the peers")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--peer-size", default=None, help="default: 125m on CUDA, tiny on a CPU")
    ap.add_argument("--peer-shape", default=None, help="default: 16x256 on CUDA (the presets' batch), 4x64 on a CPU")
    ap.add_argument("--companion", default="off", choices=("off", "on"),
                    help="compute.companion of the peers: on runs each peer's exchange in its companion process "
                         "(measured on CPUs only so far; run both to compare)")
    ap.add_argument("--inner-steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each peer")
    ap.add_argument("--link-mbps", type=float, default=10000.0, help="the link, when no diloco run measures it")
    ap.add_argument("--exchange-s", type=float, default=120.0)
    ap.add_argument("--synthetic-step-ms", type=float, default=0.0,
                    help="peers sleep this long instead of computing each inner step (a CPU machine measuring the "
                         "mixes and the other time of a model too large to train on it)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.md"))
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    args.device = str(device)
    cuda = device.type == "cuda"
    args.sizes = [s for s in (args.sizes or ("125m,1.5b" if cuda else "tiny,small")).split(",") if s not in ("", "none")]
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.peer_size = args.peer_size or ("125m" if cuda else "tiny")
    args.peer_shape = args.peer_shape or ("16x256" if cuda else "4x64")
    peak = args.peak_tflops or detect_peak_tflops(device)
    start = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write(runs: list[dict]) -> str:
        """The report so far, written at once: a run stopped at its time limit keeps the parts it finished."""
        link = link_mbps(runs, args) if runs else None
        text = render(args, device, peak, rows, ends, hosts, runs, link, time.perf_counter() - start)
        Path(args.out).write_text(text)
        return text

    rows = throughput_rows(args, device, peak)
    ends = end_of_round_rows(args, device) if args.end_of_round else []
    hosts = host_vector_rows(args, device) if args.host_vectors and cuda else []
    runs: list[dict] = []
    text = write(runs)
    presets = [p for p in args.presets.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        for preset in presets:
            runs.append(run_peers(preset, args, Path(tmp)))
            text = write(runs)
    print(text)


if __name__ == "__main__":
    main()
