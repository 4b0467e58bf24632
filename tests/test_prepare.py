"""``gossiploco data prepare``: every source format read, the shards checked against an independent tokenization,
resume after an interruption equal to an uninterrupted run, refusals, and errors naming file and row."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import gossiploco.prepare as prepare_module
from gossiploco.corpus_sources import find_sources
from gossiploco.errors import ConfigError, DataError
from gossiploco.prepare import PrepareOptions, PreparedTokenizer, is_val, prepare
from gossiploco.prepared_corpus import read_manifest
from gossiploco.tokenizer import train_bpe

WORDS = "the of gossip peer round mix shard token window epoch ünïcode 世界 def class return </s> <|endoftext|>".split()


def documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "text.txt").write_text("\n".join(documents(200, 0)))
    return train_bpe([folder / "text.txt"], 300, folder / "tokenizer.json").path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One file of each kind; returns (folder, {file name: its documents in row order})."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = {"a.parquet": documents(30, 1), "b.jsonl": documents(12, 2), "c.jsonl.gz": documents(12, 3),
            "d.jsonl.zst": documents(12, 4), "e.txt": documents(1, 5)}
    pq.write_table(pa.table({"id": list(range(30)), "text": docs["a.parquet"]}), folder / "a.parquet", row_group_size=7)
    lines = {name: "".join(json.dumps({"text": d, "n": 1}) + "\n" for d in docs[name]).encode()
             for name in ("b.jsonl", "c.jsonl.gz", "d.jsonl.zst")}
    (folder / "b.jsonl").write_bytes(lines["b.jsonl"])
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(lines["c.jsonl.gz"]))
    (folder / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines["d.jsonl.zst"]))
    (folder / "e.txt").write_text(docs["e.txt"][0])
    return folder, docs


def read_split(out, manifest, split) -> np.ndarray:
    parts = [np.fromfile(out / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"] if s["split"] == split]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=manifest["dtype"])


def test_every_source_format_reads_every_row_and_starts_at_any_row(corpus):
    folder, docs = corpus
    sources = find_sources([str(folder)])
    assert [(s.path.name, s.kind) for s in sources] == [("a.parquet", "parquet"), ("b.jsonl", "jsonl"),
                                                        ("c.jsonl.gz", "jsonl"), ("d.jsonl.zst", "jsonl"), ("e.txt", "text")]
    for source in sources:
        expected = docs[source.path.name]
        assert [d.text for d in source.read("text")] == expected
        start = len(expected) // 2 + 1 if len(expected) > 1 else 1  # parquet: inside a row group (7 rows each)
        assert [(d.row, d.text) for d in source.read("text", start)] == list(enumerate(expected))[start:]


@pytest.mark.slow  # importing datasets (pandas, ...) alone takes about a second
def test_a_datasets_folder_is_read_and_its_missing_library_named(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    docs = documents(9, 6)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    (source,) = find_sources([str(tmp_path / "saved")])
    assert source.kind == "datasets" and [d.text for d in source.read("text", 4)] == docs[4:]
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match=r"saved: a datasets folder needs .*pip install 'gossiploco\[datasets\]'"):
        list(source.read("text"))


def test_the_shards_hold_an_independent_tokenization_of_every_document_and_the_manifest_counts_them(
        corpus, tokenizer_file, tmp_path):
    folder, docs = corpus
    out = tmp_path / "out"
    manifest = prepare([str(folder)], tokenizer_file, out, PrepareOptions(val_fraction=0.25, shard_tokens=800))
    reference = Tokenizer.from_file(str(tokenizer_file))  # independent: plain encode, one document at a time
    reference.encode_special_tokens = True
    eot = reference.token_to_id("<|endoftext|>")
    expected = {"train": [], "val": []}
    for name, texts in docs.items():
        for row, text in enumerate(texts):
            split = "val" if is_val(name, row, 0.25) else "train"
            expected[split] += reference.encode(text, add_special_tokens=False).ids + [eot]
    assert manifest["complete"] and manifest["dtype"] == "uint16" and manifest["tokenizer"]["eot_id"] == eot == 0
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    for split in ("train", "val"):
        tokens = read_split(out, manifest, split)
        assert tokens.tolist() == expected[split], split
        assert manifest["splits"][split]["tokens"] == len(tokens)
        assert manifest["splits"][split]["documents"] == int(np.sum(tokens == eot))
    assert 10 < manifest["splits"]["val"]["documents"] < 30  # a quarter of 67 documents, by document
    assert manifest["splits"]["train"]["shards"] > 2  # shards of about 800 tokens
    for shard in manifest["shards"]:
        assert (out / shard["file"]).stat().st_size == 2 * shard["tokens"]
    for source in manifest["sources"]:
        data = open(source["path"], "rb").read()
        assert source["bytes"] == len(data) and source["sha256"] == hashlib.sha256(data).hexdigest()
    assert (out / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()


def test_an_interrupted_preparation_continued_equals_an_uninterrupted_one(corpus, tokenizer_file, tmp_path, monkeypatch):
    folder, _ = corpus
    options = PrepareOptions(val_fraction=0.2, shard_tokens=700)
    monkeypatch.setattr(prepare_module, "BATCH_DOCUMENTS", 5)  # several batches, shards closed between them
    whole = prepare([str(folder)], tokenizer_file, tmp_path / "whole", options)

    def interrupt_at(call: int):
        calls = [0]

        def progress(*_):
            calls[0] += 1
            if calls[0] == call:
                raise KeyboardInterrupt
        return progress

    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):  # after the first batch, before the first shard
        prepare([str(folder)], tokenizer_file, out, options, progress=interrupt_at(1))
    assert read_manifest(out, complete=False)["shards"] == []
    with pytest.raises(KeyboardInterrupt):  # continued, then interrupted after some shards
        prepare([str(folder)], tokenizer_file, out, options, progress=interrupt_at(5))
    cut = read_manifest(out, complete=False)
    assert not cut["complete"] and 0 < len(cut["shards"]) < len(whole["shards"])
    with pytest.raises(DataError, match="did not finish"):
        read_manifest(out)
    # A crash after a shard's rename but before the manifest's: a shard file the manifest does not list, and a temporary
    (out / f"train-{len(cut['shards']) + 5:05d}.bin").write_bytes(b"\0" * 64)
    (out / ".train-00099.bin.x.tmp").write_bytes(b"\0" * 8)
    continued = prepare([str(folder)], tokenizer_file, out, options)
    assert continued == whole
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())
    for shard in whole["shards"]:
        assert (out / shard["file"]).read_bytes() == (tmp_path / "whole" / shard["file"]).read_bytes()


def test_a_finished_other_or_unrelated_folder_is_not_overwritten_unless_asked(corpus, tokenizer_file, tmp_path):
    folder, _ = corpus
    source = [str(folder / "b.jsonl")]
    out = tmp_path / "out"
    first = prepare(source, tokenizer_file, out, PrepareOptions(val_fraction=0.2))
    with pytest.raises(ConfigError, match="holds a finished preparation"):
        prepare(source, tokenizer_file, out, PrepareOptions(val_fraction=0.2))
    assert prepare(source, tokenizer_file, out, PrepareOptions(val_fraction=0.2), overwrite=True) == first
    manifest = read_manifest(out)
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"other settings \(val_fraction differ\)"):
        prepare(source, tokenizer_file, out, PrepareOptions(val_fraction=0.3))
    unrelated = tmp_path / "mine"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty and holds no prepared data"):
        prepare(source, tokenizer_file, unrelated, PrepareOptions())
    prepare(source, tokenizer_file, unrelated, PrepareOptions(val_fraction=0.2), overwrite=True)
    assert (unrelated / "notes.txt").read_text() == "keep me"  # --overwrite deletes prepared files only


def write_bad(tmp_path, kind):
    if kind == "missing column":
        pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "bad.parquet")
        return tmp_path / "bad.parquet", r"bad\.parquet: row 0: no column 'text' \(columns: content\)"
    if kind == "non-text parquet value":
        pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "bad.parquet", row_group_size=1)
        return tmp_path / "bad.parquet", r"bad\.parquet: row 0: the text column holds a int"
    if kind == "non-text json value":
        (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": ["a list"]}\n')
        return tmp_path / "bad.jsonl", r"bad\.jsonl: row 2: the text column holds a list"
    if kind == "bad json":
        (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": oops}\n'))
        return tmp_path / "bad.jsonl.gz", r"bad\.jsonl\.gz: line 2 \(row 1\): not JSON"
    if kind == "missing key":
        (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
        return tmp_path / "bad.jsonl", r"bad\.jsonl: line 2 \(row 1\): no key 'text'"
    if kind == "corrupt zstd":
        (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage" * 10)
        return tmp_path / "bad.jsonl.zst", r"bad\.jsonl\.zst: line 1 \(row 0\): cannot read it"
    if kind == "unreadable parquet":
        (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
        return tmp_path / "bad.parquet", r"bad\.parquet: cannot read it as Parquet"
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    return tmp_path / "bad.txt", r"bad\.txt: row 0: not UTF-8 text \(byte 3\)"


@pytest.mark.parametrize("kind", ["missing column", "non-text parquet value", "non-text json value", "bad json",
                                  "missing key", "corrupt zstd", "unreadable parquet", "latin-1 text file"])
def test_bad_input_is_a_data_error_naming_the_file_and_row(tmp_path, tokenizer_file, kind):
    path, message = write_bad(tmp_path, kind)
    with pytest.raises(DataError, match=message):
        prepare([str(path)], tokenizer_file, tmp_path / "out", PrepareOptions())


def test_null_and_empty_documents_are_skipped_and_counted(tmp_path, tokenizer_file):
    pq.write_table(pa.table({"text": ["one", None, "", "two"]}), tmp_path / "n.parquet")
    manifest = prepare([str(tmp_path / "n.parquet")], tokenizer_file, tmp_path / "out", PrepareOptions(val_fraction=0.0))
    assert manifest["skipped"] == {"empty": 2} and manifest["splits"]["train"]["documents"] == 2


def save_tokenizer(path, specials, template=None) -> str:
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, tokenizer.token_to_id(t)) for t in specials])
    tokenizer.save(str(path))
    return str(path)


def test_the_end_of_text_id_is_the_one_the_tokenizer_names_or_the_flag_names(tmp_path):
    assert PreparedTokenizer(save_tokenizer(tmp_path / "l2.json", ["<s>", "</s>"])).eot_id == 4  # Llama 2, Mistral
    assert PreparedTokenizer(save_tokenizer(tmp_path / "l3.json", ["<|begin_of_text|>", "<|end_of_text|>"])).eot_token \
        == "<|end_of_text|>"  # Llama 3
    templated = PreparedTokenizer(save_tokenizer(tmp_path / "t.json", ["[CLS]", "[END]"], "[CLS] $A [END]"))
    assert (templated.eot_token, templated.eot_id) == ("[END]", 4)  # from the post-processor's template
    bare = save_tokenizer(tmp_path / "bare.json", ["[PAD]"])
    with pytest.raises(DataError, match=r"bare\.json: names no end-of-text token .* name it with --eot-token"):
        PreparedTokenizer(bare)
    assert PreparedTokenizer(bare, eot_token="[PAD]").eot_id == 3
    with pytest.raises(DataError, match="--eot-token 'nope' is not one of its tokens"):
        PreparedTokenizer(bare, eot_token="nope")


def test_a_vocabulary_over_65536_ids_is_written_as_uint32_and_loads(tmp_path):
    from gossiploco.config import DataConfig
    from gossiploco.data import load_corpus

    vocab = {**{f"w{i}": i for i in range(40)}, "w65536": 65536, "w69999": 69999, "</s>": 70_000}  # sparse ids
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "big.json"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"w69999 w{i} w65536"}) + "\n" for i in range(40)))
    manifest = prepare([str(tmp_path / "d.jsonl")], tmp_path / "big.json", tmp_path / "out", PrepareOptions(val_fraction=0.3))
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"] == {
        "sha256": hashlib.sha256((tmp_path / "big.json").read_bytes()).hexdigest(), "vocab_size": 70_001,
        "eot_id": 70_000, "eot_token": "</s>"}
    corpus = load_corpus(DataConfig(paths=[str(tmp_path / "out")], seq_len=4))
    first = corpus.train[0:4].tolist()
    assert corpus.vocab_size == 70_001 and first[0::2] == [69999, 65536] and first[3] == 70_000 and first[1] < 40


def test_the_command_line_prepares_reports_and_refuses_with_the_cause(corpus, tokenizer_file, tmp_path):
    from typer.testing import CliRunner

    from gossiploco.cli import app

    folder, _ = corpus
    args = ["data", "prepare", str(folder / "b.jsonl"), str(folder / "a.parquet"), "--tokenizer", str(tokenizer_file),
            "--out", str(tmp_path / "out"), "--val-fraction", "0.2", "--shard-tokens", "500"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "prepared 2 source(s)" in done.output and "gossiploco simulate --data" in done.output
    assert read_manifest(tmp_path / "out")["val_fraction"] == 0.2
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "holds a finished preparation" in again.output
