"""Prepare a corpus once, then start peers from it: ``gossiploco data prepare``'s tokens per second, and a peer's
start-up (loading the corpus and its first batch) from the prepared folder against today's text loading.

Steps (each in its own process, so every start-up is a fresh peer's):

1. ``gossiploco data prepare`` of every file of ``--corpus`` (``bench/make_corpus.py`` writes one) into
   ``WORK/prepared``: wall time, CPU time, documents, tokens, tokens/s and text MB/s;
2. a peer's start-up from the prepared folder, for each of ``--peers`` stream indices: ``load_corpus`` (the
   memory maps) + its window stream + its first batch, timed after the imports;
3. the same start-up with today's text loading (``data.paths`` = the corpus's text files, ``data.tokenizer`` =
   the same tokenizer: every file read and tokenized at the start), for each ``--text-mb`` (``data.max_corpus_mb``),
   with its peak memory; the time per MB gives an extrapolation to the prepared corpus's text;
4. optionally (``--swarm``) ``gossiploco swarm`` of ``--peers`` peers of the tiny model from the prepared folder
   for 2 rounds: the swarm's summary (tokens seen, validation loss) shows the whole path works.

    python -m bench.make_corpus --out /tmp/corpus/src --gb 1.0
    gossiploco tokenizer train --vocab-size 8192 --max-mb 40 --out /tmp/corpus/tokenizer.json
    nice -n 10 python -m bench.prepare --corpus /tmp/corpus/src --tokenizer /tmp/corpus/tokenizer.json \\
        --work /tmp/corpus --text-mb 25 100 --swarm --out bench/results/prepare.md
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.make_corpus import DEFAULT_ROOTS, text_files

STARTUP = r"""
import json, resource, sys, time
from gossiploco.config import DataConfig
from gossiploco.data import load_corpus, make_stream
start = time.perf_counter()
cfg = DataConfig(**json.loads(open(sys.argv[1]).read()))
corpus = load_corpus(cfg)
loaded = time.perf_counter()
stream = make_stream(corpus, cfg, seed=0, worker=int(sys.argv[2]), workers=int(sys.argv[3]))
inputs, _ = stream.next_batch()
done = time.perf_counter()
print(json.dumps({"load_s": loaded - start, "first_batch_s": done - loaded, "startup_s": done - start,
                  "train_tokens": len(corpus.train), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "batch": list(inputs.shape)}))
"""


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$", shlex.join(command), file=sys.stderr, flush=True)
    return subprocess.run(command, check=True, **kwargs)


def startup(data: dict, worker: int, workers: int, work: Path) -> dict:
    """A fresh process's start-up with ``DataConfig(**data)`` (passed in a file: the text files' list is long)."""
    config = work / "startup-data.json"
    config.write_text(json.dumps(data))
    done = run([sys.executable, "-c", STARTUP, str(config), str(worker), str(workers)], capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="A folder of bench/make_corpus.py.")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="Where the prepared folder and runs go.")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--text-mb", type=float, nargs="*", default=[25.0, 100.0])
    parser.add_argument("--swarm", action="store_true")
    parser.add_argument("--skip-prepare", action="store_true", help="Reuse WORK/prepared (measured before).")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    info = json.loads((args.corpus / "corpus.json").read_text())
    prepared = args.work / "prepared"
    lines = ["# Prepare once, start peers in milliseconds", "", f"Command: `{shlex.join(['python', '-m', 'bench.prepare', *sys.argv[1:]])}`", "",
             f"Corpus (`bench/make_corpus.py`): {info['text_bytes'] / 1e9:.3f} GB of text in {info['documents']:,} documents "
             f"({len(info['files'])} files: Parquet, JSON Lines plain and zstd; {info['file_bytes'] / 1e6:.0f} MB on disk), "
             f"made of {info['unique_text_bytes'] / 1e6:.0f} MB of unique text (the machine's sources and docs) written in "
             f"{info['passes']} passes. Tokenizer: `{args.tokenizer.name}`, byte-level BPE trained locally.", ""]
    if not args.skip_prepare:
        sources = [str(args.corpus / f) for f in info["files"]]
        command = [sys.executable, "-m", "gossiploco", "data", "prepare", *sources, "--tokenizer", str(args.tokenizer),
                   "--out", str(prepared), "--overwrite"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        run(command)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        manifest = json.loads((prepared / "manifest.json").read_text())
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        documents = sum(s["documents"] for s in manifest["splits"].values())
        lines += ["## `gossiploco data prepare`", "",
                  f"`{shlex.join(['gossiploco', *command[3:]])}`", "",
                  "| documents | tokens | train / val tokens | shards | wall s | CPU s | tokens/s | text MB/s |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {documents:,} | {tokens:,} | {manifest['splits']['train']['tokens']:,} / "
                  f"{manifest['splits']['val']['tokens']:,} | {len(manifest['shards'])} | {wall:.1f} | {cpu:.1f} | "
                  f"{tokens / wall:,.0f} | {info['text_bytes'] / 1e6 / wall:.2f} |", ""]
    manifest = json.loads((prepared / "manifest.json").read_text())
    data = {"paths": [str(prepared)], "seq_len": args.seq_len, "batch_size": 8}
    peers = [startup(data, k, args.peers, args.work) for k in range(args.peers)]
    lines += [f"## Peer start-up from the prepared folder ({args.peers} peers, seq_len {args.seq_len})", "",
              "`load_corpus` (memory maps) + the peer's window stream (its slice of the epoch's permutation) + its first "
              "batch, in a fresh process each, timed after the imports.", "",
              "| peer | load s | stream + first batch s | start-up s | peak RSS MB |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {p['load_s']:.3f} | {p['first_batch_s']:.3f} | {p['startup_s']:.3f} | {p['max_rss_mb']:.0f} |"
              for k, p in enumerate(peers)]
    median_prepared = statistics.median(p["startup_s"] for p in peers)
    lines += ["", f"Median start-up {median_prepared:.3f} s for {manifest['splits']['train']['tokens']:,} training tokens.", ""]
    files = text_files([r for r in DEFAULT_ROOTS if Path(r).is_dir()])
    lines += ["## Today's text loading of the same text", "",
              f"`data.paths` = the {len(files):,} text files the corpus was made of, `data.tokenizer` = the same tokenizer, "
              "`data.max_corpus_mb` = MB read; every start reads and tokenizes them.", "",
              "| MB of text | start-up s | s per MB | peak RSS MB |", "|---:|---:|---:|---:|"]
    measured = []
    for mb in args.text_mb:
        text = startup({"paths": [str(f) for f in files], "tokenizer": str(args.tokenizer), "max_corpus_mb": mb,
                        "seq_len": args.seq_len, "batch_size": 8}, 0, args.peers, args.work)
        measured.append((mb, text["startup_s"]))
        lines.append(f"| {mb:g} | {text['startup_s']:.1f} | {text['startup_s'] / mb:.3f} | {text['max_rss_mb']:.0f} |")
    total_mb = info["text_bytes"] / 2**20
    (mb_a, s_a), (mb_b, s_b) = measured[0], measured[-1]
    slope = (s_b - s_a) / (mb_b - mb_a) if mb_b > mb_a else s_b / mb_b  # the fixed cost (listing files, loading) apart
    estimate = s_b + slope * (total_mb - mb_b)
    lines += ["", f"Extrapolated to the prepared corpus's {total_mb:,.0f} MB of text (a line through the first and last "
              f"measurements: {slope:.3f} s per MB beyond {mb_b:g} MB): about {estimate:,.0f} s per peer start, against "
              f"{median_prepared:.3f} s from the prepared folder.", ""]
    if args.swarm:
        out = args.work / "swarm"
        command = [sys.executable, "-m", "gossiploco", "swarm", "--peers", str(args.peers), "--model", "tiny", "--rounds", "2",
                   "--inner-steps", "5", "--data", str(prepared), "--out", str(out), "--set", "data.seq_len=128"]
        start = time.perf_counter()
        run(command, capture_output=True, text=True)
        summary = json.loads((out / "summary.json").read_text())
        lines += ["## A swarm from the prepared folder", "", f"`{shlex.join(['gossiploco', *command[3:]])}`", "",
                  f"{summary['finished']} of {summary['peers']} peers finished in {time.perf_counter() - start:.0f} s; "
                  f"tokens seen by the swarm {summary.get('swarm_tokens'):,}; final validation loss "
                  f"{summary['final_val_loss']:.3f}.", ""]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
