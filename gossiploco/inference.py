"""Using a trained model: ``generate`` text from a prompt, ``evaluate`` its loss on data.

Both take a ``model_file.LoadedModel`` and run on the CPU without gradients.

* ``generate`` continues a prompt token by token: greedy (``temperature = 0``) or sampled from the
  softmax of logits / temperature, optionally over the ``top_k`` likeliest tokens only, with its own
  seeded ``torch.Generator`` (the global RNG is never touched: a seed gives the same text every
  time). It stops at the document separator (end of text) or after ``max_new_tokens``; the context is
  the last ``max_seq_len`` tokens (the model never saw longer sequences).
* ``evaluate`` without data measures the run's own validation loss: the same held-out batches the
  run measured (``data.validation_batches`` with the run's config and seed), computed as the trainer
  does, so a finished run's ``model.safetensors`` gives its ``summary.json`` ``final_val_loss``. With
  data files: the mean loss over every token of those files (tokenized by the model's tokenizer,
  documents separated as in training), in consecutive non-overlapping windows of ``max_seq_len``
  tokens, run a few windows at a time so memory stays bounded.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gossiploco.errors import ConfigError, DataError
from gossiploco.model_file import LoadedModel

EVAL_BATCH = 8
"""Windows per forward pass when evaluating data files."""


# -- generation ------------------------------------------------------------------------------------


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise ConfigError("--max-new-tokens", f"must be >= 0, got {max_new_tokens}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ConfigError("--temperature", f"must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError("--top-k", f"must be >= 1, got {top_k}")


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """The next token from the last position's ``logits`` (vocab,): the likeliest when ``temperature`` is
    0, else a draw from softmax(logits / temperature) restricted to the ``top_k`` likeliest."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(loaded: LoadedModel, ids: list[int], max_new_tokens: int = 100, temperature: float = 1.0,
                 top_k: int | None = None, seed: int | None = None) -> list[int]:
    """The tokens generated after ``ids`` (the separator that ends the text not included). An empty
    ``ids`` starts from the separator: the beginning of a document."""
    _check_sampling(max_new_tokens, temperature, top_k)
    separator = loaded.tokenizer.separator_id
    tokens = [int(t) for t in ids] or [separator]
    vocab = loaded.model.args.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise DataError(f"prompt token ids must be in 0..{vocab - 1}")
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-loaded.max_seq_len:]], dtype=torch.long)  # (1, T <= max_seq_len)
        logits = loaded.model(context)[0, -1]  # (vocab,)
        token = next_token(logits, temperature, top_k, generator)
        if token == separator:
            break
        tokens.append(token)
        new.append(token)
    return new


def generate(loaded: LoadedModel, prompt: str, max_new_tokens: int = 100, temperature: float = 1.0,
             top_k: int | None = None, seed: int | None = None) -> str:
    """The text the model writes after ``prompt`` (the continuation only); see the module docstring."""
    ids = loaded.tokenizer.encode(prompt).tolist()
    return loaded.tokenizer.decode(generate_ids(loaded, ids, max_new_tokens, temperature, top_k, seed))


# -- evaluation ------------------------------------------------------------------------------------


def _result(loss: float, tokens: int, data: str, batches: int) -> dict:
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": tokens, "batches": batches, "data": data}


def run_config_here(loaded: LoadedModel):
    """The model's run config as a ``RunConfig``, made loadable on this machine: on the CPU, with the
    tokenizer the model was loaded with."""
    from gossiploco.config import config_from_dict

    raw = copy.deepcopy(loaded.config)
    raw["device"] = "cpu"
    tokenizer_path = getattr(loaded.tokenizer, "path", None)
    raw.setdefault("data", {})["tokenizer"] = str(tokenizer_path) if tokenizer_path is not None else ""
    return config_from_dict(raw)


@torch.no_grad()
def evaluate_validation(loaded: LoadedModel, batches: int | None = None) -> dict:
    """The loss on the run's own validation batches (the first ``batches`` of them; None: all), computed as
    ``LocalTrainer.evaluate`` does: the mean over batches of each batch's mean cross-entropy."""
    from gossiploco.data import load_corpus, validation_batches

    cfg = run_config_here(loaded)
    try:
        corpus = load_corpus(cfg.data)
    except DataError as exc:
        raise DataError(f"the run's validation data cannot be loaded here ({exc}); give data files to evaluate "
                        "on instead (--data)") from exc
    if corpus.vocab_size > loaded.model.args.vocab_size:
        raise DataError(f"{corpus.description}: {corpus.vocab_size} ids, the model has {loaded.model.args.vocab_size}")
    chosen = validation_batches(corpus, cfg.data, cfg.seed)[:batches]
    losses = [float(F.cross_entropy(loaded.model(x).flatten(0, 1), y.flatten())) for x, y in chosen]
    tokens = sum(y.numel() for _, y in chosen)
    description = (f"the run's validation split of {corpus.description}: {len(chosen)} batches of "
                   f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens (seed {cfg.seed})")
    return _result(sum(losses) / len(losses), tokens, description, len(chosen))


def _file_tokens(loaded: LoadedModel, paths: list[str]) -> tuple[np.ndarray, str]:
    from gossiploco.data import expand_paths

    files = expand_paths(paths)
    if all(p.suffix == ".bin" for p in files):
        dtype = np.dtype((loaded.config.get("data") or {}).get("bin_dtype", "uint16"))
        parts = []
        for path in files:
            if path.stat().st_size % dtype.itemsize:
                raise DataError(f"{path}: size {path.stat().st_size} is not a multiple of {dtype.itemsize} ({dtype})")
            parts.append(np.memmap(path, dtype=dtype, mode="r"))
        tokens = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return tokens, f"{len(files)} .bin file(s)"
    if any(p.suffix == ".bin" for p in files):
        raise DataError("--data: mix of .bin and text files; use one kind")
    documents = []
    for path in files:
        try:
            documents.append(path.read_bytes().replace(b"\x00", b""))
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc
    documents = [d for d in documents if d]
    if not documents:
        raise DataError(f"--data: every one of {len(files)} file(s) is empty")
    return loaded.tokenizer.encode_documents(documents), f"{len(files)} text file(s)"


@torch.no_grad()
def evaluate_files(loaded: LoadedModel, paths: list[str], batches: int | None = None) -> dict:
    """The mean loss over every token of the files ``paths`` name (globs allowed), predicted in consecutive
    non-overlapping windows of ``max_seq_len`` tokens (the last one shorter), ``EVAL_BATCH`` windows per
    forward pass; ``batches`` caps the passes (None: all the data)."""
    tokens, description = _file_tokens(loaded, paths)
    if len(tokens) < 2:
        raise DataError(f"{description}: {len(tokens)} token(s); at least 2 are needed to predict one")
    if int(np.max(tokens)) >= loaded.model.args.vocab_size:
        raise DataError(f"{description}: token {int(np.max(tokens))} >= the model's vocabulary "
                        f"{loaded.model.args.vocab_size}")
    T = loaded.max_seq_len
    starts = list(range(0, len(tokens) - 1, T))
    full = [s for s in starts if s + T + 1 <= len(tokens)]
    groups = [full[i:i + EVAL_BATCH] for i in range(0, len(full), EVAL_BATCH)]
    if len(full) < len(starts):
        groups.append([starts[-1]])  # the tail, shorter than a window
    groups = groups[:batches] if batches is not None else groups
    total, counted = 0.0, 0
    for group in groups:
        length = min(T, len(tokens) - 1 - group[0])
        rows = torch.from_numpy(np.stack([np.asarray(tokens[s:s + length + 1], dtype=np.int64) for s in group]))
        logits = loaded.model(rows[:, :-1])  # (B, length, vocab)
        total += float(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum"))
        counted += rows[:, 1:].numel()
    names = ", ".join(Path(p).name for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
    return _result(total / counted, counted, f"{description} ({names}), windows of {T} tokens", len(groups))


def evaluate(loaded: LoadedModel, data_paths: list[str] | None = None, batches: int | None = None) -> dict:
    """``{"loss", "ppl", "tokens", "batches", "data"}``: on the run's validation batches without
    ``data_paths``, else on every token of those files (see the module docstring)."""
    if batches is not None and batches < 1:
        raise ConfigError("--batches", f"must be >= 1, got {batches}")
    if data_paths:
        return evaluate_files(loaded, list(data_paths), batches)
    return evaluate_validation(loaded, batches)
