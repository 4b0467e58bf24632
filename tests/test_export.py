"""``gossiploco export``: the exported folder is a Hugging Face Llama model that ``transformers`` loads offline
with no extra code, and computes what our model computes (logits, greedy generation, tokenization)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import tiny_config
from gossiploco.errors import ConfigError
from gossiploco.export import export_files, export_hf
from gossiploco.hf_llama import from_hf, to_hf
from gossiploco.model import ModelArgs, Transformer, build_model
from gossiploco.model_file import LoadedModel, load_model_source, save_model
from gossiploco.tokenizer import ByteTokenizer, train_bpe

transformers = pytest.importorskip("transformers")

SEQ_LEN = 64
LOGITS_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing in these tests may reach the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def randomize(model: Transformer, seed: int) -> Transformer:
    """Weights far from the init: norms around 1 (not all ones), matrices of std 0.1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.eval()


def saved_model(tmp_path, size="tiny", seed=1, vocab_size=256, tokenizer=None, **overrides):
    """A run directory holding a model of ``size`` with random weights, and that model."""
    cfg = tiny_config("diloco", **{"model.size": size, "data.seq_len": SEQ_LEN, **overrides})
    model = randomize(build_model(size, vocab_size, SEQ_LEN, seed), seed)
    run = tmp_path / f"run-{size}-{seed}"
    save_model(dict(model.named_parameters()), run, cfg.to_dict(), tokenizer)
    return run, model


def hf_model(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def max_logits_diff(model: Transformer, hf, vocab_size: int, seed: int = 0) -> float:
    tokens = torch.randint(0, vocab_size, (3, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return float((model(tokens) - hf(tokens).logits).abs().max())


@pytest.mark.parametrize("size", ["tiny", "small"])  # grouped-query attention: 4 / 2 and 6 / 2 heads
def test_transformers_computes_the_same_logits(tmp_path, size):
    run, model = saved_model(tmp_path, size)
    folder = export_hf(run, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == model.args.n_kv_heads
    assert max_logits_diff(model, hf_model(folder), 256) < LOGITS_TOLERANCE


def test_multi_head_attention_and_the_rotary_reordering(tmp_path):
    """n_kv_heads == n_heads (no size has it), and the reordering undone exactly on the way back."""
    args = ModelArgs(dim=48, n_layers=2, n_heads=3, n_kv_heads=3, ffn_dim=96, vocab_size=256, max_seq_len=SEQ_LEN)
    model = randomize(Transformer(args), 5)
    params = {n: p.detach() for n, p in model.named_parameters()}
    assert all(torch.equal(params[n], v) for n, v in from_hf(to_hf(params, args), args).items())
    cfg = tiny_config("diloco", **{"data.seq_len": SEQ_LEN})
    loaded = LoadedModel(model=model, config=cfg.to_dict(), tokenizer=ByteTokenizer(), description="test",
                         directory=tmp_path)
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, content in export_files(loaded).items():
        if isinstance(content, bytes):
            (folder / name).write_bytes(content)
        else:
            from safetensors.torch import save_file

            save_file(content, str(folder / name), metadata={"format": "pt"})
    assert max_logits_diff(model, hf_model(folder), 256) < LOGITS_TOLERANCE


def test_the_export_loads_back_into_gossiploco(tmp_path):
    run, model = saved_model(tmp_path)
    folder = export_hf(run, tmp_path / "hf")
    loaded = load_model_source(folder)
    assert "exported" in loaded.description
    for name, p in model.named_parameters():
        assert torch.equal(loaded.model.get_parameter(name), p), name


def test_auto_tokenizer_encodes_and_decodes_bytes_as_gossiploco_does(tmp_path):
    run, _ = saved_model(tmp_path)
    folder = export_hf(run, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = ByteTokenizer()
    for text in ["héllo ✓", "def f(x):\n\treturn x  # ü 😀", " leading  spaces "]:
        ids = tokenizer(text).input_ids
        assert ids == ours.encode(text).tolist()
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 0


def test_a_bpe_tokenizer_is_exported_with_the_model(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def function_{i}(alpha, beta):\n    return alpha * {i} + beta\n\n" for i in range(400)))
    bpe = train_bpe([text], 300, tmp_path / "tok.json")
    run, model = saved_model(tmp_path, vocab_size=bpe.vocab_size, tokenizer=bpe, **{"data.tokenizer": str(bpe.path)})
    (tmp_path / "tok.json").unlink()  # the run keeps its own copy
    folder = export_hf(run, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    sample = "def function_7(alpha, beta): héllo ✓"
    assert tokenizer(sample).input_ids == bpe.encode(sample).tolist()
    assert tokenizer.decode(tokenizer(sample).input_ids) == sample
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert max_logits_diff(model, hf_model(folder), bpe.vocab_size) < LOGITS_TOLERANCE
    assert load_model_source(folder).tokenizer.sha256 == bpe.sha256


def test_greedy_generation_matches_transformers(tmp_path):
    from gossiploco.inference import generate_ids

    run, _ = saved_model(tmp_path)
    folder = export_hf(run, tmp_path / "hf")
    loaded = load_model_source(run)
    prompt = ByteTokenizer().encode("def main(").tolist()
    ours = generate_ids(loaded, prompt, max_new_tokens=30, temperature=0)  # within the context: no clamping
    with torch.no_grad():
        theirs = hf_model(folder).generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    theirs = theirs[0, len(prompt):].tolist()
    assert ours == theirs[:len(ours)] and len(ours) >= 1
    if len(ours) < 30:  # our generation stopped at the separator: so did theirs
        assert theirs[len(ours)] == 0


def test_the_folder_has_the_files_transformers_expects(tmp_path):
    run, _ = saved_model(tmp_path)
    folder = export_hf(run, tmp_path / "hf")
    names = {p.name for p in folder.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "README.md"}
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        assert "model.layers.1.mlp.gate_proj.weight" in set(f.keys())
    card = (folder / "README.md").read_text()
    assert "LlamaForCausalLM.from_pretrained" in card and '"seq_len": 64' in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_an_existing_folder_is_not_overwritten_unless_asked(tmp_path):
    run, _ = saved_model(tmp_path)
    other, other_model = saved_model(tmp_path, seed=2)
    folder = export_hf(run, tmp_path / "hf")
    before = (folder / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(other, folder)
    assert (folder / "model.safetensors").read_bytes() == before
    export_hf(other, folder, overwrite=True)
    assert max_logits_diff(other_model, hf_model(folder), 256) < LOGITS_TOLERANCE
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the replaced folder is gone
    with pytest.raises(ConfigError, match="training run"):
        export_hf(other, run, overwrite=True)  # never replaces a run, even when asked
    (tmp_path / "empty").mkdir()
    assert export_hf(run, tmp_path / "empty").joinpath("config.json").is_file()


@pytest.mark.slow
def test_export_of_a_real_simulate_run(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(3000)))
    run = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "gossiploco", "simulate", "--config", "diloco", "--workers", "2",
                            "--inner-steps", "2", "--rounds", "2", "--model", "tiny", "--device", "cpu", "--quiet",
                            "--data", str(text), "--out", str(run)], capture_output=True, text=True, timeout=240)
    assert train.returncode == 0, train.stderr
    assert (run / "model.safetensors").is_file() and not (run / "model.pt").exists()
    export = subprocess.run([sys.executable, "-m", "gossiploco", "export", str(run), "--out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    loaded = load_model_source(run)
    assert max_logits_diff(loaded.model, hf_model(tmp_path / "hf"), 256) < LOGITS_TOLERANCE
    summary = json.loads((run / "summary.json").read_text())
    assert f"{summary['final_val_loss']:.4f}" in (tmp_path / "hf" / "README.md").read_text()
