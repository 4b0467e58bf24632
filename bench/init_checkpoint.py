"""``--init`` at a real model's size: a SmolLM-135M-shaped checkpoint (Llama, 30 layers, dim 576, 9 heads / 3 kv
heads, ffn 1536, vocabulary 49152, tied embeddings, bf16 weights in shards as the Hub serves them) made here with
transformers' random init, then: the checkpoint's digest (first and cached), ``hf_checkpoint.init_model`` against
``LlamaForCausalLM.from_pretrained`` (wall seconds, median of ``--repeats``), and the largest logits difference
between the two in fp32. Nothing is downloaded.

    python bench/init_checkpoint.py --repeats 3 --out bench/results/init_checkpoint.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gossiploco.hf_checkpoint import checkpoint_digest, init_model, weight_files

SEQ_LEN = 128


def smollm_shaped(folder: Path, seed: int) -> None:
    import transformers

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100MB")


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import transformers

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "smollm-shaped"
        build_s, _ = timed(lambda: smollm_shaped(folder, 0))
        files = weight_files(folder)
        size_mb = sum(f.stat().st_size for f in files) / 2**20
        digest_s, digest = timed(lambda: checkpoint_digest(folder))
        cached_s, _ = timed(lambda: checkpoint_digest(folder))
        ours_s, theirs_s = [], []
        for _ in range(args.repeats):
            seconds, ours = timed(lambda: init_model(folder, SEQ_LEN).eval())
            ours_s.append(seconds)
            seconds, hf = timed(lambda: transformers.LlamaForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager").eval())
            theirs_s.append(seconds)
        tokens = torch.randint(0, 49152, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            mine, theirs = ours(tokens), hf(tokens).logits
        diff = float((mine - theirs).abs().max())
        scale = float(theirs.abs().max())
    params = sum(p.numel() for p in ours.parameters())
    lines = [
        "# `--init` at SmolLM-135M's shape", "",
        f"Regenerate: `python {' '.join(['bench/init_checkpoint.py', *sys.argv[1:]])}` (1 torch thread, this machine: "
        "2 cores shared with other work).", "",
        f"Checkpoint: Llama, 30 layers, dim 576, 9/3 heads, ffn 1536, vocab 49152, tied embeddings, {params / 1e6:.1f}M "
        f"parameters, bf16, {len(files)} shards, {size_mb:.0f} MB (built here with transformers' init in {build_s:.1f} s).", "",
        "| measurement | value |", "|---|---:|",
        f"| digest (SHA-256 of config.json + shards), first | {digest_s:.2f} s ({size_mb / digest_s:.0f} MB/s) |",
        f"| digest, again in the same process (cached) | {cached_s * 1e3:.2f} ms |",
        f"| `init_model` (read, rename, permute, to fp32), median of {args.repeats} | {statistics.median(ours_s):.2f} s |",
        f"| `LlamaForCausalLM.from_pretrained(dtype=float32)`, median of {args.repeats} | {statistics.median(theirs_s):.2f} s |",
        f"| ratio init_model / from_pretrained | {statistics.median(ours_s) / statistics.median(theirs_s):.2f} |",
        f"| max abs logits difference, fp32, 2 x {SEQ_LEN} tokens | {diff:.2e} (max abs logit {scale:.2f}) |", "",
        f"Digest: `{digest}`. Times per repeat: init_model {[round(s, 2) for s in ours_s]}, "
        f"from_pretrained {[round(s, 2) for s in theirs_s]}.", "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
