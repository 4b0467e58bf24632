"""Training from a prepared folder: memory-mapped loading, epochs of windows partitioned between peers (computed from
the streams), a stream resumed where it stopped, and the folder's digest in the run identity."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from gossiploco.checkpoint import shared_config
from gossiploco.config import DataConfig
from gossiploco.data import load_corpus, make_stream
from gossiploco.errors import DataError
from gossiploco.prepare import PrepareOptions, prepare
from gossiploco.prepared_corpus import ShardedTokens
from gossiploco.tokenizer import train_bpe
from gossiploco.window_stream import WindowStream, window_count
from tests.conftest import tiny_config

SEQ = 8


def sharded(lengths: list[int]) -> tuple[ShardedTokens, np.ndarray]:
    """Shards of distinct consecutive tokens (token = its position in the concatenation), and the concatenation."""
    whole = np.arange(sum(lengths), dtype=np.uint32)
    cuts = np.cumsum([0, *lengths])
    return ShardedTokens([whole[a:b] for a, b in zip(cuts[:-1], cuts[1:])]), whole


def test_sharded_tokens_slice_like_their_concatenation():
    tokens, whole = sharded([5, 1, 7, 3])
    assert len(tokens) == 16
    for a in range(17):
        for b in range(a, 17):
            assert tokens[a:b].tolist() == whole[a:b].tolist()


def epoch_windows(stream: WindowStream, batches: int) -> list[int]:
    return np.concatenate([stream.next_windows() for _ in range(batches)]).tolist()


def test_four_peers_read_every_window_once_an_epoch_and_never_the_same_one():
    lengths = [97, 250, 9, 161, 64]  # windows: 12, 31, 1, 20, 7 = 71
    tokens, whole = sharded(lengths)
    total = sum(window_count(n, SEQ) for n in lengths)
    assert total == 71
    streams = [WindowStream(tokens, SEQ, 1, seed=3, stream=k, slices=4) for k in range(4)]
    sizes = [len(range(k, total, 4)) for k in range(4)]  # 18, 18, 18, 17
    epochs = [epoch_windows(s, n) for s, n in zip(streams, sizes)]
    assert all(len(set(e)) == len(e) for e in epochs)  # no repeat within a peer's epoch
    flat = [w for e in epochs for w in e]
    assert sorted(flat) == list(range(total))  # together: every window exactly once, no two peers share one
    assert all(s.epoch == 1 and s.position == 0 for s in streams)
    second = [epoch_windows(s, n) for s, n in zip(streams, sizes)]
    assert sorted(w for e in second for w in e) == list(range(total)) and second != epochs  # a new order each epoch
    # The batches hold the windows' tokens: seq_len + 1 tokens from the window's start, never across a shard's end
    starts = np.concatenate([[0], np.cumsum(lengths)])
    stream = WindowStream(tokens, SEQ, 4, seed=3, stream=2, slices=4)
    windows = stream.next_windows()
    inputs, targets = stream.read(windows)
    per_shard = [window_count(n, SEQ) for n in lengths]
    first_window = np.concatenate([[0], np.cumsum(per_shard)])
    for row, w in enumerate(windows.tolist()):
        shard = int(np.searchsorted(first_window, w, side="right")) - 1
        begin = int(starts[shard]) + (w - int(first_window[shard])) * SEQ
        assert begin + SEQ + 1 <= starts[shard + 1]
        assert inputs[row].tolist() == whole[begin:begin + SEQ].tolist()
        assert targets[row].tolist() == whole[begin + 1:begin + SEQ + 1].tolist()
    assert inputs.dtype == torch.int64 and inputs.shape == (4, SEQ)


def test_a_resumed_stream_continues_where_it_stopped_even_across_an_epoch():
    tokens, _ = sharded([200, 133])
    stream = WindowStream(tokens, SEQ, 3, seed=1, stream=1, slices=2)
    reference = WindowStream(tokens, SEQ, 3, seed=1, stream=1, slices=2)
    ahead = [reference.next_windows().tolist() for _ in range(12)]  # 36 windows: past the 20-window slice's end
    for stop in (0, 5, 6, 7):
        stream = WindowStream(tokens, SEQ, 3, seed=1, stream=1, slices=2)
        for _ in range(stop):
            stream.next_windows()
        resumed = WindowStream(tokens, SEQ, 3, seed=1, stream=1, slices=2)
        resumed.load_state(json.loads(json.dumps(stream.state())))  # through a checkpoint's JSON
        assert [resumed.next_windows().tolist() for _ in range(12 - stop)] == ahead[stop:]
    with pytest.raises(DataError, match="does not fit this one"):
        WindowStream(tokens, SEQ, 3, seed=1, stream=0, slices=2).load_state(stream.state())
    with pytest.raises(DataError, match="not a prepared folder's window stream"):
        stream.load_state({"bit_generator": "PCG64"})
    with pytest.raises(DataError, match="fewer than the 100 peers' slices"):
        WindowStream(tokens, SEQ, 3, seed=1, stream=0, slices=100)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two prepared folders of the same text: one per tokenizer (vocabularies 300 and 310)."""
    root = tmp_path_factory.mktemp("prepared")
    text = "".join(f"def f{i}(x):\n    return x * {i} + sum(range({i}))\n\n" for i in range(150))
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": text[i:i + 500]}) + "\n" for i in range(0, len(text), 500)))
    folders = []
    for vocab in (300, 310):
        tokenizer = train_bpe([root / "corpus.jsonl"], vocab, root / f"tok{vocab}.json")
        folder = root / f"data{vocab}"
        prepare([str(root / "corpus.jsonl")], tokenizer.path, folder, PrepareOptions(val_fraction=0.1, shard_tokens=1000))
        folders.append(folder)
    return folders


def test_a_prepared_folder_loads_memory_mapped_with_its_vocabulary(prepared):
    folder = prepared[0]
    cfg = DataConfig(paths=[str(folder)], seq_len=16, batch_size=2)
    corpus = load_corpus(cfg)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert corpus.prepared and corpus.vocab_size == manifest["tokenizer"]["vocab_size"] == 300
    assert len(corpus.train) == manifest["splits"]["train"]["tokens"] and len(corpus.train.shards) > 2
    assert all(isinstance(s, np.memmap) for s in corpus.train.shards + corpus.val.shards)
    stream = make_stream(corpus, cfg, seed=0, worker=1, workers=4)
    assert isinstance(stream, WindowStream) and stream.slice == 1
    inputs, _ = stream.next_batch()
    assert inputs.shape == (2, 16) and int(inputs.max()) < corpus.vocab_size
    with pytest.raises(DataError, match="data.vocab_size says 999"):
        load_corpus(DataConfig(paths=[str(folder)], vocab_size=999))
    with pytest.raises(DataError, match="another file"):
        load_corpus(DataConfig(paths=[str(folder)], tokenizer=str(folder.parent / "tok310.json")))


def test_the_run_identity_names_the_prepared_data_not_its_path(prepared, tmp_path):
    a, b = prepared

    def identity(folder) -> dict:
        return shared_config(tiny_config("diloco", **{"data.paths": [str(folder)]}).to_dict())["data"]["paths"]

    moved = tmp_path / "elsewhere"
    shutil.copytree(a, moved)
    assert identity(a)[0].startswith("prepared:sha256:")
    assert identity(a) == identity(moved) != identity(b)  # same data anywhere; another tokenizer is another run
    assert shared_config({"data": {"paths": identity(a)}})["data"]["paths"] == identity(a)  # idempotent
    shutil.rmtree(moved)
    assert identity(moved) == identity(a)  # a folder deleted mid-run keeps its identity


@pytest.mark.slow
def test_a_swarm_trains_from_a_prepared_folder_and_a_resumed_run_repeats_no_data(prepared, tmp_path):
    """4 workers of the virtual swarm from a prepared folder, interrupted mid-run and resumed from the checkpoint:
    bit for bit the uninterrupted run (the streams continued at their positions), and the tokens it saw reported."""
    from gossiploco.metrics import MetricsSink
    from gossiploco.runtime.virtual import VirtualSwarm
    from tests.test_checkpoint import assert_same_run, interrupted_then_resumed

    cfg = tiny_config("globalm1-localm2", rounds=4, **{"data.paths": [str(prepared[0])], "data.seq_len": 16})
    reference = VirtualSwarm(cfg).run(MetricsSink(tmp_path / "reference"))
    assert reference.summary["swarm_tokens"] == 4 * cfg.rounds * cfg.inner_steps * cfg.data.batch_size * cfg.data.seq_len
    result, checkpoint = interrupted_then_resumed(cfg, tmp_path / "cut", 14)  # mid-round 2
    assert checkpoint is not None and 0 < checkpoint.round < 4
    state = checkpoint.meta["worker_state"]["w3"]["stream"]
    assert state["kind"] == "windows" and state["slice"] == 3 and state["position"] > 0
    assert_same_run(result, tmp_path / "cut", reference, tmp_path / "reference")


def test_a_model_trained_on_a_prepared_folder_comes_with_the_folders_tokenizer(prepared, tmp_path):
    """The run keeps the folder's tokenizer (OUT/tokenizer.json) and its model file names it: loading the model gives
    that tokenizer, also once the prepared folder is gone (not the byte-level one a run without data.tokenizer has)."""
    from gossiploco.model import build_model
    from gossiploco.model_file import read_model_file, save_model
    from gossiploco.prepared_corpus import copy_tokenizer
    from gossiploco.tokenizer import run_tokenizer

    folder = tmp_path / "data"
    shutil.copytree(prepared[0], folder)
    cfg = tiny_config("diloco", **{"data.paths": [str(folder)], "data.seq_len": 16})
    sha256 = json.loads((folder / "manifest.json").read_text())["tokenizer"]["sha256"]
    run = tmp_path / "run"
    copy_tokenizer(folder, run)
    path = save_model(dict(build_model("tiny", 300, 16, 0).named_parameters()), run, cfg.to_dict())
    _, config, metadata = read_model_file(path)  # what loading the model (export, inference) reads its tokenizer from
    assert metadata["tokenizer_sha256"] == sha256
    assert run_tokenizer(run, config, metadata["tokenizer_sha256"]).sha256 == sha256
    assert run_tokenizer(run, config).sha256 == sha256  # from the folder's manifest
    shutil.rmtree(folder)
    tokenizer = run_tokenizer(run, config, metadata["tokenizer_sha256"])  # the folder gone: the model file's digest
    assert tokenizer.sha256 == sha256 and tokenizer.vocab_size == 300
