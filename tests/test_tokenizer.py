"""Tokenizers: the byte-level default, a byte-level BPE trained locally, and how a run names, keeps and checks
its tokenizer (the file's hash is part of the run's identity, its path is not)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from typer.testing import CliRunner

from conftest import tiny_config
from gossiploco import checkpoint as ckpt
from gossiploco.checkpoint import CheckpointError, Snapshot
from gossiploco.cli import app
from gossiploco.config import DataConfig
from gossiploco.data import load_corpus
from gossiploco.errors import ConfigError, DataError
from gossiploco.runtime.peer import run_id_for
from gossiploco.tokenizer import (BPETokenizer, ByteTokenizer, load_tokenizer, run_tokenizer, save_tokenizer_copy,
                                  train_bpe)

UNICODE = "Grüße aus Köln: naïve café, 東京 ✓ 😀\n\tdef f(x):  return x ** 2  # Āā <|endoftext|>"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def write_corpus(directory, files=12, lines=60):
    """Small text files of repeated words (so BPE has merges to learn) and a little unicode."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        rows = [f"{WORDS[(i + j) % len(WORDS)]} {WORDS[(3 * j) % len(WORDS)]} = {j}; café ✓" for j in range(lines)]
        path = directory / f"doc{i:02d}.txt"
        path.write_text("\n".join(rows) + "\n")
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tokenizer of 320 tokens trained on a small corpus (shared by the tests that only read it)."""
    root = tmp_path_factory.mktemp("tok")
    files = write_corpus(root / "corpus")
    return train_bpe(files, 320, root / "tok.json"), files


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A second tokenizer, trained on other text."""
    root = tmp_path_factory.mktemp("other")
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    return train_bpe([root / "a.txt"], 300, root / "other.json")


def test_bpe_round_trips_any_text_with_the_separator_at_id_0(trained):
    tokenizer, _ = trained
    assert tokenizer.separator_id == 0 and tokenizer.vocab_size == 320
    ids = tokenizer.encode(UNICODE)
    assert ids.dtype == np.uint16 and 0 not in ids  # a literal <|endoftext|> in text is text, not the separator
    assert tokenizer.decode(ids) == UNICODE
    assert tokenizer.decode(np.concatenate([ids, [0], ids])) == UNICODE + UNICODE  # the separator is skipped
    assert len(tokenizer.encode("alpha beta gamma")) < len("alpha beta gamma".encode())  # it learnt merges
    loaded = HFTokenizer.from_str(tokenizer.to_hf_json())
    assert loaded.token_to_id("<|endoftext|>") == 0
    assert loaded.encode("café alpha ✓").ids == tokenizer.encode("café alpha ✓").tolist()
    assert hashlib.sha256(tokenizer.to_hf_json().encode()).hexdigest() == tokenizer.sha256


@pytest.mark.parametrize("text", ["héllo ✓", "Ā ā (U+0100 is what ByteLevel writes for byte 0)", "a\x00b", "<|endoftext|>",
                                  "\r\n\t  \u2028😀", ""])
def test_the_byte_tokenizers_hugging_face_form_gives_every_byte_its_own_id(text):
    tokenizer = ByteTokenizer()
    loaded = HFTokenizer.from_str(tokenizer.to_hf_json())
    ids = loaded.encode(text).ids
    assert ids == list(text.encode()) == tokenizer.encode(text).tolist()
    assert loaded.decode(ids) == text.replace("\x00", "") == tokenizer.decode(ids)
    assert loaded.token_to_id("\x00") == 0 and loaded.get_vocab_size() == 256 and tokenizer.sha256 is None


def test_training_refuses_a_bad_vocabulary_size_and_an_existing_file(tmp_path, trained):
    _, files = trained
    for bad in (10, 256, (1 << 20) + 1, True):
        with pytest.raises(ConfigError, match="--vocab-size"):
            train_bpe(files, bad, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
    existing = tmp_path / "existing.json"
    existing.write_text("keep me")
    with pytest.raises(ConfigError, match="exists"):
        train_bpe(files, 300, existing)
    assert existing.read_text() == "keep me"
    assert train_bpe(files, 300, existing, overwrite=True).vocab_size == 300
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text"):
        train_bpe([empty], 300, tmp_path / "none.json")


def test_loading_a_missing_or_unusable_file_says_what_is_wrong(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        BPETokenizer(tmp_path / "missing.json")
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\x00 not json")
    with pytest.raises(DataError, match="not a Hugging Face tokenizers JSON"):
        BPETokenizer(garbage)
    no_eot = tmp_path / "bytes.json"
    no_eot.write_text(ByteTokenizer().to_hf_json())  # a real tokenizer, but with no end-of-text token
    with pytest.raises(DataError, match=re.escape("has no end-of-text token")):
        BPETokenizer(no_eot)
    assert isinstance(load_tokenizer(""), ByteTokenizer) and isinstance(load_tokenizer("bytes"), ByteTokenizer)
    with pytest.raises(ConfigError, match="data.tokenizer: no such file"):
        DataConfig(tokenizer=str(tmp_path / "missing.json")).check("data")


def test_a_corpus_encoded_with_bpe_is_shorter_and_has_the_tokenizers_vocabulary(trained):
    tokenizer, files = trained
    paths = [str(f) for f in files]
    by_bytes = load_corpus(DataConfig(paths=paths, seq_len=16, val_fraction=0.2))
    by_bpe = load_corpus(DataConfig(paths=paths, seq_len=16, val_fraction=0.2, tokenizer=str(tokenizer.path)))
    assert by_bytes.train.dtype == np.uint8 and by_bytes.vocab_size == 256
    assert by_bpe.train.dtype == np.uint16 and by_bpe.vocab_size == tokenizer.vocab_size
    assert len(by_bpe.train) + len(by_bpe.val) < 0.6 * (len(by_bytes.train) + len(by_bytes.val))
    separators = lambda c: int((c.train == 0).sum() + (c.val == 0).sum())  # noqa: E731
    # one after each document (and one more where every document fell into one split, which the temporary
    # directory's name decides: the loader then cuts the joined documents in two)
    assert separators(by_bpe) == separators(by_bytes) in (len(files), len(files) + 1)
    assert int(by_bpe.train.max()) < tokenizer.vocab_size
    text = tokenizer.decode(by_bpe.train) + tokenizer.decode(by_bpe.val)
    assert sorted(text.splitlines()) == sorted(line for f in files for line in f.read_text().splitlines())
    with pytest.raises(ConfigError, match="already tokenized"):
        DataConfig(paths=["x.bin"], vocab_size=10, tokenizer=str(tokenizer.path)).check("data")


def test_the_run_id_follows_the_tokenizers_content_not_its_path(tmp_path, trained, other):
    tokenizer, _ = trained
    moved = tmp_path / "elsewhere" / "same.json"
    moved.parent.mkdir()
    shutil.copy(tokenizer.path, moved)
    here = tiny_config("diloco", **{"data.tokenizer": str(tokenizer.path)})
    there = tiny_config("diloco", **{"data.tokenizer": str(moved)})
    bytes_run = tiny_config("diloco")
    assert run_id_for(here) == run_id_for(there)
    assert run_id_for(here) != run_id_for(tiny_config("diloco", **{"data.tokenizer": str(other.path)}))
    assert run_id_for(here) != run_id_for(bytes_run)
    assert run_id_for(bytes_run) == run_id_for(tiny_config("diloco", **{"data.tokenizer": "bytes"}))
    # A byte-level run keeps the id it had before data.tokenizer existed (its checkpoints still resume).
    before = bytes_run.to_dict()
    del before["data"]["tokenizer"]
    del before["round"]  # nor did [round]: left out at its defaults (checkpoint.shared_config)
    del before["model"]["init"]  # nor model.init: left out when empty (no checkpoint to start from)
    for own in ckpt.NOT_IDENTITY:
        before.pop(own)
    assert run_id_for(bytes_run) == f"diloco-{hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:12]}"


def test_a_checkpoint_resumes_with_its_tokenizer_moved_and_refuses_another(tmp_path, trained, other):
    tokenizer, _ = trained
    original = tmp_path / "tok.json"
    shutil.copy(tokenizer.path, original)
    config = tiny_config("diloco", **{"data.tokenizer": str(original)}).to_dict()
    meta_path = ckpt.write_checkpoint(tmp_path / "checkpoints", Snapshot(1, {"w0/z/a": torch.ones(2)}, {"workers": ["w0"]}),
                                      config)
    checkpoint = ckpt.read_checkpoint(meta_path)
    assert checkpoint.meta["identity"]["data"]["tokenizer"] == f"sha256:{tokenizer.sha256}"
    moved = tmp_path / "moved.json"
    original.rename(moved)
    ckpt.check_compatible(checkpoint, tiny_config("diloco", **{"data.tokenizer": str(moved)}).to_dict())
    with pytest.raises(CheckpointError, match=rf"data\.tokenizer: checkpoint 'sha256:{tokenizer.sha256}', now 'sha256:"):
        ckpt.check_compatible(checkpoint, tiny_config("diloco", **{"data.tokenizer": str(other.path)}).to_dict())
    with pytest.raises(CheckpointError, match=r"data\.tokenizer: checkpoint 'sha256:\w+', now '\(absent\)'"):
        ckpt.check_compatible(checkpoint, tiny_config("diloco").to_dict())  # the byte-level tokenizer


def test_a_runs_copy_of_its_tokenizer_is_found_and_checked(tmp_path, trained, other):
    tokenizer, _ = trained
    run_dir = tmp_path / "run"
    assert save_tokenizer_copy(ByteTokenizer(), run_dir) is None and not run_dir.exists()
    copy = save_tokenizer_copy(tokenizer, run_dir)
    assert copy == run_dir / "tokenizer.json" and copy.read_bytes() == tokenizer.path.read_bytes()
    config = {"data": {"tokenizer": str(tmp_path / "gone.json")}}
    assert run_tokenizer(run_dir, config).sha256 == tokenizer.sha256  # the copy, although the configured file is gone
    assert run_tokenizer(run_dir, config, sha256=tokenizer.sha256).sha256 == tokenizer.sha256
    assert run_tokenizer(run_dir, {"data": {"tokenizer": f"sha256:{tokenizer.sha256}"}}).sha256 == tokenizer.sha256
    with pytest.raises(DataError, match="differs from the run's tokenizer"):
        run_tokenizer(run_dir, config, sha256=other.sha256)
    assert run_tokenizer(tmp_path / "no-copy", {"data": {"tokenizer": str(other.path)}}).sha256 == other.sha256
    with pytest.raises(DataError, match="put the tokenizer file there"):
        run_tokenizer(tmp_path / "no-copy", config)
    assert isinstance(run_tokenizer(tmp_path / "no-copy", {"data": {"tokenizer": ""}}), ByteTokenizer)


def test_the_tokenizer_train_command_writes_a_usable_file(tmp_path):
    files = write_corpus(tmp_path / "corpus", files=4)
    out = tmp_path / "cli.json"
    args = ["tokenizer", "train", "--data", str(tmp_path / "corpus" / "*.txt"), "--vocab-size", "300", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "300 tokens" in result.output and f"data.tokenizer={out}" in result.output and "tokens per byte" in result.output
    tokenizer = BPETokenizer(out)
    assert tokenizer.decode(tokenizer.encode(files[0].read_text())) == files[0].read_text()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "exists" in again.output
    bad = CliRunner().invoke(app, [*args[:-3], "100", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "--vocab-size" in bad.output


@pytest.mark.slow
def test_simulate_trains_with_a_bpe_tokenizer_and_keeps_it_in_the_run(tmp_path, trained):
    tokenizer, files = trained
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gossiploco", "simulate", "--config", "diloco", "--workers", "2", "--inner-steps", "3",
         "--rounds", "2", "--model", "tiny", "--device", "cpu", "--quiet", "--data", str(files[0].parent / "*.txt"),
         "--set", "data.seq_len=16", "--set", "data.batch_size=4", "--set", "data.val_batches=1",
         "--set", "data.heldout_batch_size=2", "--set", "data.val_fraction=0.2",
         "--set", f"data.tokenizer={tokenizer.path}", "--out", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer.json").read_bytes() == tokenizer.path.read_bytes()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_config"]["data"]["tokenizer"] == str(tokenizer.path)
    assert np.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] < np.log(tokenizer.vocab_size) + 1.0
    if (out / "model.safetensors").exists():
        from safetensors.torch import load_file

        params = load_file(out / "model.safetensors")
    else:
        params = torch.load(out / "model.pt", weights_only=True)
    assert params["tok_embeddings.weight"].shape[0] == tokenizer.vocab_size
    loaded = run_tokenizer(out, summary["run_config"])
    assert loaded.sha256 == tokenizer.sha256
