"""Using a trained model: loading it from whatever holds one, generating text, evaluating its loss (the run's own
validation loss reproduced exactly), and the ``generate`` / ``eval`` / ``export`` commands."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_config
from gossiploco import inference
from gossiploco.checkpoint import CheckpointError, Snapshot, run_checkpoints, write_checkpoint
from gossiploco.cli import app
from gossiploco.errors import ConfigError, DataError
from gossiploco.model import build_model
from gossiploco.model_file import ModelFileError, load_model_source, save_model
from gossiploco.tokenizer import ByteTokenizer, save_tokenizer_copy, train_bpe

SEQ_LEN = 64


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_params(seed: int = 1, scale: float = 0.1, vocab_size: int = 256) -> dict[str, torch.Tensor]:
    """Parameters of the tiny model, far from its init (so that greedy text is not all one token)."""
    model = build_model("tiny", vocab_size, SEQ_LEN, seed)
    generator = torch.Generator().manual_seed(seed)
    return {n: (1.0 + 0.2 * torch.randn(p.shape, generator=generator)) if n.endswith("norm.weight")
            else scale * torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}


def run_config(**overrides) -> dict:
    return tiny_config("diloco", **{"data.seq_len": SEQ_LEN, **overrides}).to_dict()


@pytest.fixture
def run_dir(tmp_path):
    """A run directory holding a tiny model."""
    save_model(tiny_params(), tmp_path / "run", run_config())
    return tmp_path / "run"


@pytest.fixture
def loaded(run_dir):
    return load_model_source(run_dir)


# -- generation ------------------------------------------------------------------------------------


def test_greedy_generation_is_deterministic(loaded):
    first = inference.generate(loaded, "def main(", max_new_tokens=40, temperature=0)
    assert first == inference.generate(loaded, "def main(", max_new_tokens=40, temperature=0, seed=7)
    assert len(inference.generate_ids(loaded, ByteTokenizer().encode("def main(").tolist(), 40, 0)) >= 1


def test_sampling_is_reproducible_with_a_seed_and_leaves_the_global_rng_alone(loaded):
    ids = ByteTokenizer().encode("import ").tolist()
    state = torch.get_rng_state()
    a = inference.generate_ids(loaded, ids, 40, temperature=1.0, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    assert a == inference.generate_ids(loaded, ids, 40, temperature=1.0, seed=3)
    assert a != inference.generate_ids(loaded, ids, 40, temperature=1.0, seed=4)
    assert inference.generate_ids(loaded, ids, 40, temperature=0.7, top_k=5, seed=3) == \
        inference.generate_ids(loaded, ids, 40, temperature=0.7, top_k=5, seed=3)


def test_top_k_1_is_greedy(loaded):
    ids = ByteTokenizer().encode("class ").tolist()
    greedy = inference.generate_ids(loaded, ids, 30, temperature=0)
    assert inference.generate_ids(loaded, ids, 30, temperature=1.5, top_k=1, seed=11) == greedy


def test_generation_stops_at_the_separator(tmp_path):
    params = tiny_params()
    params["lm_head.weight"] = torch.zeros_like(params["lm_head.weight"])  # every logit 0: argmax is id 0
    save_model(params, tmp_path / "run", run_config())
    loaded = load_model_source(tmp_path / "run")
    assert inference.generate(loaded, "x = ", max_new_tokens=20, temperature=0) == ""
    assert inference.generate_ids(loaded, [], 5, temperature=0) == []  # an empty prompt starts a document


def test_the_context_is_the_last_max_seq_len_tokens(loaded):
    long = [int(t) for t in torch.randint(1, 256, (SEQ_LEN + 30,), generator=torch.Generator().manual_seed(0))]
    assert inference.generate_ids(loaded, long, 10, temperature=0) == \
        inference.generate_ids(loaded, long[-SEQ_LEN:], 10, temperature=0)


@pytest.mark.parametrize("kwargs, field", [({"temperature": -1.0}, "--temperature"), ({"top_k": 0}, "--top-k"),
                                           ({"max_new_tokens": -1}, "--max-new-tokens")])
def test_bad_sampling_settings_are_refused(loaded, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        inference.generate(loaded, "x", **kwargs)


# -- evaluation ------------------------------------------------------------------------------------


def small_corpus(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(1500)))
    return text


def test_eval_reproduces_the_runs_final_validation_loss(tmp_path):
    from gossiploco.runtime.virtual import VirtualSwarm

    cfg = tiny_config("diloco", workers=2, rounds=1, inner_steps=2, **{"data.paths": [str(small_corpus(tmp_path))]})
    result = VirtualSwarm(cfg).run()
    save_model(result.final_params, tmp_path / "run", cfg.to_dict())
    measured = inference.evaluate(load_model_source(tmp_path / "run"))
    assert abs(measured["loss"] - result.summary["final_val_loss"]) < 1e-4
    assert measured["tokens"] == cfg.data.val_batches * cfg.data.batch_size * cfg.data.seq_len
    assert measured["ppl"] == pytest.approx(math.exp(measured["loss"]))
    assert inference.evaluate(load_model_source(tmp_path / "run"), batches=1)["tokens"] == \
        cfg.data.batch_size * cfg.data.seq_len


def test_eval_on_data_files_counts_every_token(tmp_path, loaded, monkeypatch):
    text = tmp_path / "held-out.txt"
    text.write_text("x = [i * i for i in range(10)]  # ü\n" * 9)  # 333 bytes: 5 full windows and a tail
    size = len(text.read_bytes())
    measured = inference.evaluate(loaded, [str(text)])
    assert measured["tokens"] == size  # every byte and the closing separator predicted once
    monkeypatch.setattr(inference, "EVAL_BATCH", 1)
    assert inference.evaluate(loaded, [str(text)])["loss"] == pytest.approx(measured["loss"], abs=1e-5)


def test_a_uniform_model_scores_log_vocab(tmp_path):
    params = tiny_params()
    params["lm_head.weight"] = torch.zeros_like(params["lm_head.weight"])
    save_model(params, tmp_path / "run", run_config())
    text = tmp_path / "a.txt"
    text.write_text("hello\n" * 50)
    assert inference.evaluate(load_model_source(tmp_path / "run"), [str(text)])["loss"] == \
        pytest.approx(math.log(256), abs=1e-6)


# -- loading ---------------------------------------------------------------------------------------


def write_checkpoint_of(run, params_by_worker: list[dict], round_index: int = 1, config: dict | None = None):
    tensors = {f"w{m}/z/{n}": v for m, params in enumerate(params_by_worker) for n, v in params.items()}
    snapshot = Snapshot(round_index, tensors, {"workers": [f"w{m}" for m in range(len(params_by_worker))]})
    return write_checkpoint(run_checkpoints(run), snapshot, config or run_config())


def test_a_run_without_a_final_model_loads_its_newest_checkpoint_averaged(tmp_path):
    a, b = tiny_params(1), tiny_params(2)
    write_checkpoint_of(tmp_path / "run", [tiny_params(3)], 1)
    meta = write_checkpoint_of(tmp_path / "run", [a, b], 2)
    loaded = load_model_source(tmp_path / "run")
    assert "round-000002" in loaded.description and "checkpoint" in loaded.description
    average = (a["norm.weight"].double() + b["norm.weight"].double()) / 2
    assert torch.allclose(loaded.model.norm.weight, average.float())
    assert torch.equal(load_model_source(meta).model.norm.weight, loaded.model.norm.weight)
    save_model(a, tmp_path / "run", run_config())  # the final model, once written, wins
    assert torch.equal(load_model_source(tmp_path / "run").model.norm.weight, a["norm.weight"])


def test_a_bpe_run_uses_its_own_copy_of_the_tokenizer_checked_by_hash(tmp_path):
    text = small_corpus(tmp_path)
    bpe = train_bpe([text], 300, tmp_path / "tok.json")
    config = run_config(**{"data.tokenizer": str(bpe.path)})
    write_checkpoint_of(tmp_path / "run", [tiny_params(vocab_size=bpe.vocab_size)], 1, config)
    save_tokenizer_copy(bpe, tmp_path / "run")
    (tmp_path / "tok.json").unlink()  # the original moved away: the run's copy is used
    loaded = load_model_source(tmp_path / "run")
    assert loaded.tokenizer.sha256 == bpe.sha256 and loaded.model.args.vocab_size == bpe.vocab_size
    assert isinstance(inference.generate(loaded, "def function_", 5, temperature=0), str)
    other = train_bpe([text], 290, tmp_path / "other.json")
    (tmp_path / "run" / "tokenizer.json").write_text(other.to_hf_json())
    with pytest.raises(DataError, match="another tokenizer"):
        load_model_source(tmp_path / "run")


def test_a_swarm_directory_loads_its_first_peer_with_a_model(tmp_path):
    swarm = tmp_path / "swarm"
    (swarm / "peer-0").mkdir(parents=True)  # a peer that never finished: nothing to load
    (swarm / "peer-0.log").write_text("started\n")
    save_model(tiny_params(10), swarm / "peer-10", run_config())
    save_model(tiny_params(2), swarm / "peer-2", run_config())
    loaded = load_model_source(swarm)
    assert "peer-2" in loaded.description and "swarm" in loaded.description
    assert torch.equal(loaded.model.norm.weight, tiny_params(2)["norm.weight"])


def test_the_model_file_itself_and_the_exported_folder_load(tmp_path, run_dir):
    pytest.importorskip("tokenizers")
    from gossiploco.export import export_hf

    by_file = load_model_source(run_dir / "model.safetensors")
    folder = export_hf(run_dir, tmp_path / "hf")
    for source in (folder, folder / "config.json", folder / "model.safetensors"):
        again = load_model_source(source)
        for name, p in by_file.model.named_parameters():
            assert torch.equal(again.model.get_parameter(name), p), (source, name)
    assert by_file.max_seq_len == SEQ_LEN and not by_file.model.training


def test_nothing_loadable_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "notes.txt").write_text("hi")
    with pytest.raises(ModelFileError, match="no model to load"):
        load_model_source(tmp_path / "garbage")
    with pytest.raises(ModelFileError, match="no such file"):
        load_model_source(tmp_path / "missing")
    with pytest.raises(ModelFileError, match="not a model file"):
        load_model_source(tmp_path / "garbage" / "notes.txt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelFileError, match="not a readable safetensors"):
        load_model_source(tmp_path / "bad.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match="not a gossiploco model"):
        load_model_source(tmp_path / "other.safetensors")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a gossiploco-checkpoint"):
        load_model_source(tmp_path / "bad.json")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.pt").write_bytes(b"pickle")
    with pytest.raises(ModelFileError, match="never loaded"):
        load_model_source(tmp_path / "old")


def test_tensors_that_do_not_fit_the_config_are_named(tmp_path):
    params = tiny_params()
    params["layers.1.mlp.w2.weight"] = params["layers.1.mlp.w2.weight"][:, :10]
    del params["norm.weight"]
    save_model(params, tmp_path / "run", run_config())
    with pytest.raises(ModelFileError, match=r"missing: norm.weight.*wrong shape: layers.1.mlp.w2.weight"):
        load_model_source(tmp_path / "run")
    save_model(tiny_params(), tmp_path / "small", run_config(**{"model.size": "small"}))
    with pytest.raises(ModelFileError, match="do not fit model.size 'small'"):
        load_model_source(tmp_path / "small")


# -- the commands ----------------------------------------------------------------------------------


def test_generate_prints_only_the_text(run_dir):
    result = CliRunner().invoke(app, ["generate", str(run_dir), "--prompt", "def main(", "--temperature", "0",
                                      "--max-new-tokens", "20"])
    assert result.exit_code == 0, result.output
    expected = inference.generate(load_model_source(run_dir), "def main(", 20, temperature=0)
    assert result.stdout == expected + "\n"
    assert "model.safetensors" in result.stderr


def test_eval_and_export_commands(tmp_path, run_dir):
    text = tmp_path / "a.txt"
    text.write_text("print('hello')\n" * 20)
    result = CliRunner().invoke(app, ["eval", str(run_dir), "--data", str(text)])
    assert result.exit_code == 0, result.output
    measured = inference.evaluate(load_model_source(run_dir), [str(text)])
    assert f"loss {measured['loss']:.4f}" in result.stdout and f"tokens {measured['tokens']}" in result.stdout
    assert "a.txt" in result.stdout and "model.safetensors" in result.stdout
    result = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "config.json").is_file()
    result = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 2 and "--overwrite" in result.stderr


def test_commands_fail_with_a_clear_message(tmp_path):
    result = CliRunner().invoke(app, ["generate", str(tmp_path), "--prompt", "x"])
    assert result.exit_code == 2 and "no model to load" in " ".join(result.stderr.split())
    assert result.stdout == ""
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such file" in result.stderr


@pytest.mark.slow
def test_eval_of_a_finished_simulate_run_matches_its_summary(tmp_path):
    run = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "gossiploco", "simulate", "--config", "diloco", "--workers", "2",
                            "--inner-steps", "2", "--rounds", "2", "--model", "tiny", "--device", "cpu", "--quiet",
                            "--set", "data.max_corpus_mb=2.0", "--set", "data.seq_len=32", "--out", str(run)],
                           capture_output=True, text=True, timeout=240)
    assert train.returncode == 0, train.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert abs(inference.evaluate(load_model_source(run))["loss"] - summary["final_val_loss"]) < 1e-4
    shown = subprocess.run([sys.executable, "-m", "gossiploco", "eval", str(run)], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0 and f"loss {summary['final_val_loss']:.4f}" in shown.stdout, shown.stderr
