"""How fast the exchange's codecs are, per value, against the landed ones, side by side in one run.

The landed codecs are ``gossiploco/mixing/compression.py`` as it was at ``--landed`` (a git revision, read with
``git show`` into a module of its own: nothing is copied into the repository). For each codec both versions
encode the same vector (``--values`` standard normal fp32 values; a fresh payload each time, as an exchange
makes one) and decode it into a vector already in use (the exchanges' path: ``decode(..., out=...)``),
alternating landed and current ``--repeats`` times with ``--threads`` torch threads; the figures are medians,
in nanoseconds per value. Both versions must send the same bytes (a codec's payload is a wire format), but for
top-k's choice among magnitudes tied at a chunk's k-th largest, which is not specified ("ties only"). The process
sets glibc's malloc thresholds as a peer's exchange does (``transport.process_limits.reuse_freed_memory``: a freed
payload's memory serves the next; ``--glibc-malloc-defaults`` leaves them, and each fresh payload faults its pages
in: ``int8``'s 16 MB payload then took 0.49 ns a value to encode here, 0.19 with the thresholds).

    python -m bench.codecs --repeats 15         # 1 and 2 threads, writes bench/results/codecs.md
    python -m bench.codecs --values 1000000 --repeats 3 --threads 1 --out /tmp/codecs.md
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gossiploco.mixing import compression
from gossiploco.transport.process_limits import reuse_freed_memory
from testbed.machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
LANDED = "ff961bc"
"""The last commit before the codecs were made to avoid passes over memory."""
CODECS = ("none", "bf16", "int8", "4bit", "e3m0", "topk")


def landed_module(revision: str):
    """``compression.py`` at ``revision``, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:gossiploco/mixing/compression.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "landed_compression.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("landed_compression", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(modules: dict, name: str, x: torch.Tensor, repeats: int) -> dict:
    """Median encode and decode seconds of each version of codec ``name``, and whether their payloads agree."""
    out = torch.empty_like(x)
    codecs = {label: module.build_codec(name) for label, module in modules.items()}
    payloads = {label: codec.encode(x) for label, codec in codecs.items()}  # warm up
    for label, codec in codecs.items():
        codec.decode(payloads[label], x.numel(), out=out)
    accumulators = {label: torch.zeros_like(x) for label in codecs}
    times = {label: {"encode": [], "decode": [], "add": []} for label in codecs}
    for _ in range(repeats):
        for label, codec in codecs.items():
            start = time.perf_counter()
            payload = codec.encode(x)
            times[label]["encode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            codec.decode(payload, x.numel(), out=out)
            times[label]["decode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            decode_add(codec, payload, x.numel(), accumulators[label], out)
            times[label]["add"].append(time.perf_counter() - start)
        start = time.perf_counter()
        accumulators["current"].add_(out)
        times.setdefault("plain add", {"add": []})["add"].append(time.perf_counter() - start)
    same = torch.equal(payloads["landed"], payloads["current"])
    if not same and name == "topk":
        same = "ties only" if differ_only_at_ties(codecs["current"], x, payloads["landed"], payloads["current"]) else False
    return {label: {way: statistics.median(v) for way, v in t.items()} for label, t in times.items()} | {"same": same}


def decode_add(codec, payload: torch.Tensor, numel: int, acc: torch.Tensor, out: torch.Tensor) -> None:
    """What an exchange does with a payload it sums: ``acc += decode(payload)``, in one pass where the codec has
    ``decode_add`` (the current ones), else decoded into ``out`` and added (the landed ones)."""
    if hasattr(codec, "decode_add"):
        codec.decode_add(payload, numel, acc)
    else:
        acc.add_(codec.decode(payload, numel, out=out))


def differ_only_at_ties(codec, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two top-k payloads of ``x`` differ only in which of several values equal to a chunk's k-th largest
    magnitude they keep (``codec_kernels.select_row``: which is not specified; 16M normal fp32 values have such ties)."""
    n, k = codec._shape(x.numel())
    chunks = torch.nn.functional.pad(x, (0, n * codec.chunk - x.numel())).view(n, codec.chunk)
    kth = chunks.abs().topk(k, dim=1).values[:, -1:]
    differ = (codec.decode(a, x.numel()) != codec.decode(b, x.numel()))
    differ = torch.nn.functional.pad(differ, (0, n * codec.chunk - x.numel())).view(n, codec.chunk)
    return bool((chunks.abs() == kth)[differ].all())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS))
    ap.add_argument("--landed", default=LANDED)
    ap.add_argument("--glibc-malloc-defaults", action="store_true",
                    help="leave glibc's malloc thresholds as they are (a peer's process sets them: "
                         "transport.process_limits.reuse_freed_memory; else a fresh payload's pages fault in each time)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "codecs.md")
    args = ap.parse_args(argv)
    reused = False if args.glibc_malloc_defaults else reuse_freed_memory()
    malloc = "a peer process's (freed payloads' memory reused)" if reused else "glibc's defaults"
    modules = {"landed": landed_module(args.landed), "current": compression}
    x = torch.randn(args.values, generator=torch.Generator().manual_seed(0))
    started = time.monotonic()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.codecs:
            r = measure(modules, name, x, args.repeats)
            ns = {label: {way: r[label][way] / args.values * 1e9 for way in ("encode", "decode", "add")}
                  for label in ("landed", "current")} | {"plain add": r["plain add"]["add"] / args.values * 1e9}
            rows.append((threads, name, ns, r["same"]))
            print(f"{threads} thread(s) {name}: encode {ns['landed']['encode']:.2f} -> {ns['current']['encode']:.2f} ns, "
                  f"decode {ns['landed']['decode']:.2f} -> {ns['current']['decode']:.2f} ns, "
                  f"decode + add {ns['landed']['add']:.2f} -> {ns['current']['add']:.2f} ns, same bytes {r['same']}",
                  flush=True)
    command = "python -m bench.codecs" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    lines = ["# Codec speed: current against landed", "", "Produced by `bench/codecs.py` (see its docstring).", "",
             "```", command, "```", "",
             f"Machine: {cpu_model()}, {torch.get_num_threads()} torch threads at most here, torch {torch.__version__}, "
             f"Python {platform.python_version()}. {args.values:,} standard normal fp32 values, median of "
             f"{args.repeats} alternating runs; landed: `{args.landed}`. Wall time {time.monotonic() - started:.0f} s. "
             f"glibc's malloc thresholds: {malloc}.",
             "", "| threads | codec | encode ns/value landed | current | speed-up | decode ns/value landed | current "
             "| speed-up | same bytes |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for threads, name, ns, same in rows:
        enc = ns["landed"]["encode"] / ns["current"]["encode"]
        dec = ns["landed"]["decode"] / ns["current"]["decode"]
        lines.append(f"| {threads} | {name} | {ns['landed']['encode']:.2f} | {ns['current']['encode']:.2f} | {enc:.1f}x | "
                     f"{ns['landed']['decode']:.2f} | {ns['current']['decode']:.2f} | {dec:.1f}x | {same} |")
    one_thread = {name: ns["landed"] for threads, name, ns, _ in rows if threads == 1}
    if one_thread and len(args.threads) > 1:
        copy = {threads: ns["current"]["decode"] for threads, name, ns, _ in rows if name == "none"}
        lines += ["", "Against the landed codecs on one thread (what the issue measured: about 3 ns a value each way): "
                  "the current codecs' speed-up with each number of threads. A decode writes the whole vector, which "
                  "`none`'s decode does and nothing else (a copy into it): the last column is each decode's time "
                  "over that copy's, with as many threads. `none` and `bf16` are torch's conversions, unchanged: "
                  "their differences are this machine's memory, whose speed varies by tens of percent from run to "
                  "run.", "", "| threads | codec | encode speed-up | decode speed-up | decode / a copy |",
                  "|---:|---|---:|---:|---:|"]
        for threads, name, ns, _ in rows:
            if name in one_thread:
                over_copy = f"{ns['current']['decode'] / copy[threads]:.2f}" if threads in copy else "-"
                lines.append(f"| {threads} | {name} | {one_thread[name]['encode'] / ns['current']['encode']:.1f}x | "
                             f"{one_thread[name]['decode'] / ns['current']['decode']:.1f}x | {over_copy} |")
    lines += ["", "Decode and add (`acc += decode(payload)`: what an owner's sum and a sparse group mean do with each "
              "payload they receive): the landed codecs decode into a vector and add it (two passes over memory); the "
              "current ones' `decode_add` decodes a piece (top-k: a chunk) into cache and adds it from there, one stream "
              "over the vector. `plain add` is `acc += y` of two fp32 vectors, the unfused add alone.", "",
              "| threads | codec | decode + add ns/value landed | current | speed-up | plain add | current / plain add |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for threads, name, ns, _ in rows:
        lines.append(f"| {threads} | {name} | {ns['landed']['add']:.2f} | {ns['current']['add']:.2f} | "
                     f"{ns['landed']['add'] / ns['current']['add']:.1f}x | {ns['plain add']:.2f} | "
                     f"{ns['current']['add'] / ns['plain add']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"results in {args.out}")
    return 0 if all(same for *_, same in rows) else 1  # "ties only" counts as the same


if __name__ == "__main__":
    sys.exit(main())
