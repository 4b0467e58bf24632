import numpy as np
import pytest
import torch

from gossiploco.config import DataConfig
from gossiploco.builtin_corpus import stdlib_files
from gossiploco.data import DOC_SEPARATOR, ByteTokenizer, TokenStream, heldout_batch, load_corpus
from gossiploco.errors import DataError


def test_stdlib_corpus_is_deterministic_and_split_by_document():
    files = stdlib_files()
    assert len(files) > 100 and files == stdlib_files()
    cfg = DataConfig(max_corpus_mb=2.0)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert a.vocab_size == 256 and a.description == "stdlib sources"
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert 0.01 < len(a.val) / (len(a.train) + len(a.val)) < 0.15
    # No document is split: every validation document is absent from the training text.
    val_docs = [d for d in bytes(a.val).split(bytes([DOC_SEPARATOR])) if len(d) > 200]
    train_text = bytes(a.train)
    assert val_docs and all(doc not in train_text for doc in val_docs[:20])


def test_worker_streams_differ_by_worker_and_repeat_by_seed():
    corpus = load_corpus(DataConfig(max_corpus_mb=1.0))
    s0, s0again, s1 = (TokenStream(corpus.train, 16, 4, seed=7, worker=w) for w in (0, 0, 1))
    x0, y0 = s0.next_batch()
    assert x0.shape == (4, 16) and x0.dtype == torch.int64
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(x0, s0again.next_batch()[0])
    assert not torch.equal(x0, s1.next_batch()[0])
    other_seed = TokenStream(corpus.train, 16, 4, seed=8, worker=0)
    assert not torch.equal(x0, other_seed.next_batch()[0])


def test_heldout_batch_is_fixed_and_from_validation():
    cfg = DataConfig(max_corpus_mb=1.0, seq_len=16, heldout_batch_size=3)
    corpus = load_corpus(cfg)
    batch = heldout_batch(corpus, cfg, seed=0)
    assert batch.shape == (3, 16) and torch.equal(batch, heldout_batch(corpus, cfg, seed=0))
    val = bytes(corpus.val)
    assert all(bytes(row.tolist()) in val for row in batch)


def test_text_files_and_globs(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    corpus = load_corpus(DataConfig(paths=[str(tmp_path / "*.txt")], seq_len=16, val_fraction=0.2))
    assert corpus.description == "30 text file(s)"
    assert b"document 3 " in bytes(corpus.train) + bytes(corpus.val)
    single = tmp_path / "one.txt"
    single.write_text("just one document " * 40)
    one = load_corpus(DataConfig(paths=[str(single)], seq_len=16))
    assert len(one.train) > len(one.val) > 0
    assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_pretokenized_bin_files_are_memory_mapped(tmp_path, dtype):
    tokens = (np.arange(5000) % 1000).astype(dtype)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    corpus = load_corpus(DataConfig(paths=[str(path)], bin_dtype=dtype, vocab_size=1000, seq_len=16))
    assert isinstance(corpus.train, np.memmap) and corpus.vocab_size == 1000
    assert len(corpus.train) + len(corpus.val) == 5000
    x, _ = TokenStream(corpus.train, 16, 2, 0, 0).next_batch()
    assert int(x.max()) < 1000


def test_bad_data_gives_clear_errors(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        load_corpus(DataConfig(paths=[str(tmp_path / "missing.txt")]))
    with pytest.raises(DataError, match="matches no file"):
        load_corpus(DataConfig(paths=[str(tmp_path / "*.nothing")]))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="every file is empty"):
        load_corpus(DataConfig(paths=[str(empty)]))
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match="need at least"):
        load_corpus(DataConfig(paths=[str(short)], seq_len=64))
    binf = tmp_path / "t.bin"
    np.arange(100, dtype=np.uint16).tofile(binf)
    with pytest.raises(DataError, match="vocab_size: required"):
        load_corpus(DataConfig(paths=[str(binf)]))
    with pytest.raises(DataError, match=">= data.vocab_size"):
        load_corpus(DataConfig(paths=[str(binf)], vocab_size=50, seq_len=8))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="not a multiple"):
        load_corpus(DataConfig(paths=[str(odd)], vocab_size=10))
