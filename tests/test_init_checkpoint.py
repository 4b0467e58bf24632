"""``--init PATH``: a run starts from a Hugging Face Llama-family checkpoint folder that transformers wrote.

The reference is transformers itself: ``LlamaForCausalLM`` / ``MistralForCausalLM`` built from a config with
grouped-query attention, Llama 3.1's rotary scaling and tied embeddings, saved in several safetensors shards.
Our model initialised from the folder must compute its logits; a short run from it must export a folder that
transformers loads back with our logits; other model types are refused by name; the run id follows the weights.

Tolerances. Both models compute the same function with fp32 operations in another order (the rotary pairs
permuted, the kv heads repeated, SDPA against eager attention), so they differ by rounding only. The reference
is our model in float64 (it computes in float64 throughout; transformers' does not: its RMSNorm casts to fp32),
which is the exact function to about 1e-15. Each fp32 forward differs from it by its rounding: two layers of
dot products of at most 96 terms, each rounding relatively by about sqrt(96) * eps32 = 1.2e-6, give about
1e-6 relative at logits of order 3 here (measured: 2e-6 for either model). The brief's 1e-5 is five times
that, and is asserted for transformers against the reference and against our fp32 model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import tiny_config
from gossiploco.checkpoint import shared_config
from gossiploco.errors import ConfigError
from gossiploco.export import export_hf
from gossiploco.hf_checkpoint import checkpoint_digest, folder_args, init_model, weight_files
from gossiploco.model import Transformer, rope_tables
from gossiploco.model_file import load_model_source
from gossiploco.runtime.peer import run_id_for
from test_export import randomize  # weights far from the init: norms 1 +- 0.2, matrices std 0.1
from gossiploco.tokenizer import BPETokenizer

transformers = pytest.importorskip("transformers")

SEQ_LEN = 32
FP32_TOLERANCE = 1e-5
VOCAB = 320
TEXT = "".join(f"def function_{i}(alpha, beta):\n    return alpha * {i} + beta  # héllo ✓\n\n" for i in range(300))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing in these tests may reach the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def llama_tokenizer_json() -> str:
    """A byte-level BPE with Llama 2's special tokens (<unk> 0, <s> 1, </s> 2: end of text is not id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT], trainer)
    return tokenizer.to_str()


_TOKENIZER: list[str] = []


def llama_config(**overrides):
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    return transformers.LlamaConfig(**{**fields, **overrides})


def save_checkpoint(folder, config, model_class, seed=0, shard_size=None):
    """A transformers model of ``config`` with random weights, saved (in shards when ``shard_size``) with a
    tokenizer.json in ``folder``; returns the model."""
    model = randomize(model_class(config), seed)
    model.save_pretrained(folder, max_shard_size=shard_size or "1GB")
    if not _TOKENIZER:
        _TOKENIZER.append(llama_tokenizer_json())
    (folder / "tokenizer.json").write_text(_TOKENIZER[0])
    return model


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """Llama 3.x-shaped: GQA 4/2, llama3 rope scaling, tied embeddings, three shards."""
    folder = tmp_path_factory.mktemp("llama")
    hf = save_checkpoint(folder, llama_config(), transformers.LlamaForCausalLM, shard_size="100KB")
    return folder, hf


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory):
    """Mistral-shaped: untied, default rope, a sliding window longer than the context, one file."""
    folder = tmp_path_factory.mktemp("mistral")
    config = transformers.MistralConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                                        num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-6, sliding_window=64,
                                        tie_word_embeddings=False)
    hf = save_checkpoint(folder, config, transformers.MistralForCausalLM, seed=1)
    return folder, hf


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def logits_diff(ours: Transformer, hf) -> float:
    with torch.no_grad():
        return float((ours(tokens()) - hf(tokens()).logits).abs().max())


def assert_same_logits(ours: Transformer, hf) -> None:
    """transformers' fp32 logits within FP32_TOLERANCE of our model's in float64 (the exact function) and fp32."""
    with torch.no_grad():
        exact = copy.deepcopy(ours).double()(tokens())
        theirs, mine = hf(tokens()).logits, ours(tokens())
    assert float((theirs - exact).abs().max()) < FP32_TOLERANCE
    assert float((theirs - mine).abs().max()) < FP32_TOLERANCE


def test_llama3_shaped_checkpoint_in_shards_gives_transformers_logits(llama_folder):
    folder, hf = llama_folder
    assert len(weight_files(folder)) >= 2 and (folder / "model.safetensors.index.json").is_file()
    ours = init_model(folder, SEQ_LEN).eval()
    args = ours.args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size) == (64, 2, 4, 2, 96, VOCAB)
    assert args.tie_embeddings and ours.lm_head.weight is ours.tok_embeddings.weight
    assert "lm_head.weight" not in dict(ours.named_parameters())
    assert args.rope_scaling is not None and args.rope_theta == 100.0 and args.norm_eps == 1e-5
    assert all(p.requires_grad for p in ours.parameters())
    assert_same_logits(ours, hf)


def test_the_llama3_scaling_matters_here(llama_folder):
    """Every branch of the scaling acts at this context (else the logits test proves little about it). With
    theta 100 and head size 16 the wavelengths are 2 pi * 100^(2i/16); L = 32 tokens: wavelength < L / 4 = 8
    (i = 0) kept, > L / 1 = 32 (i >= 3) divided by 8, between (i = 1, 2) interpolated."""
    args = folder_args(llama_folder[0], SEQ_LEN)
    head_dim = args.dim // args.n_heads
    plain_cos, _ = rope_tables(head_dim, SEQ_LEN, args.rope_theta)
    scaled_cos, _ = rope_tables(head_dim, SEQ_LEN, args.rope_theta, args.rope_scaling)
    positions = torch.arange(SEQ_LEN, dtype=torch.float32)
    freqs = 100.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.equal(plain_cos[:, 0], scaled_cos[:, 0])
    assert torch.allclose(scaled_cos[:, 3:], torch.cos(torch.outer(positions, freqs[3:] / 8)), atol=1e-6)
    smooth = (32 * freqs[1] / (2 * torch.pi) - 1) / (4 - 1)  # (L / wavelength - low) / (high - low)
    assert torch.allclose(scaled_cos[:, 1], torch.cos(positions * ((1 - smooth) * freqs[1] / 8 + smooth * freqs[1])),
                          atol=1e-6)
    assert (plain_cos[:, 1:] - scaled_cos[:, 1:]).abs().amax(0).min() > 0.01


def test_a_transformers_4_config_gives_the_same_shape(tmp_path, llama_folder):
    """transformers 4.x wrote the rotary settings as rope_theta + rope_scaling (no rope_parameters)."""
    config = json.loads((llama_folder[0] / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert folder_args(tmp_path, SEQ_LEN) == folder_args(llama_folder[0], SEQ_LEN)


def test_mistral_checkpoint_gives_transformers_logits(mistral_folder):
    folder, hf = mistral_folder
    ours = init_model(folder, SEQ_LEN).eval()
    assert not ours.args.tie_embeddings and ours.args.n_heads == 6 and ours.args.rope_scaling is None
    assert_same_logits(ours, hf)


def test_the_checkpoint_tokenizer_separates_documents_with_its_end_of_text(llama_folder):
    tokenizer = BPETokenizer(llama_folder[0] / "tokenizer.json")
    assert tokenizer.separator_id == 2 and tokenizer.vocab_size <= VOCAB
    assert tokenizer.decode(tokenizer.encode("def function_7(alpha): ✓")) == "def function_7(alpha): ✓"


def test_unsupported_models_and_settings_are_refused_by_name(tmp_path, llama_folder):
    config = json.loads((llama_folder[0] / "config.json").read_text())
    cases = [({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2' (GPT2LMHeadModel)"),
             ({"model_type": "qwen2"}, "model_type 'qwen2'"),
             ({"attention_bias": True}, "attention_bias is true"),
             ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
             ({"head_dim": 32}, "head_dim 32"),
             ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type 'yarn'"),
             ({"model_type": "mistral", "sliding_window": 16}, "sliding window of 16 tokens")]
    for i, (change, message) in enumerate(cases):
        folder = tmp_path / f"case-{i}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match="model.init: .*" + message.replace("(", r"\(").replace(")", r"\)")):
            folder_args(folder, SEQ_LEN)
    with pytest.raises(ConfigError, match="model.init: .*model_type 'gpt2'"):
        tiny_config("diloco", **{"model.init": str(tmp_path / "case-0"), "data.seq_len": SEQ_LEN})
    (tmp_path / "case-2" / "config.json").write_text(json.dumps(config))  # a good config, but no weights
    with pytest.raises(ConfigError, match="no model.safetensors .*never pickled"):
        weight_files(tmp_path / "case-2")


def test_a_tied_checkpoint_has_no_lm_head_block(llama_folder):
    """Its LM head is the embedding: a preset mixing "lm_head" on its own is refused, naming the blocks there are."""
    init = {"model.init": str(llama_folder[0]), "data.seq_len": SEQ_LEN}
    assert tiny_config("globalm1", **init).model.architecture(SEQ_LEN).tie_embeddings
    with pytest.raises(ConfigError, match="mix2.blocks: no block matches 'lm_head'; blocks are embed, .*, norm$"):
        tiny_config("globalm1-localm2-subset", **init)


def test_the_run_id_names_the_checkpoint_by_its_weights(tmp_path, llama_folder):
    """Same weights elsewhere: same run id; one changed weight: another run id; no --init: the id of before."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = llama_folder[0]
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    overrides = {"data.seq_len": SEQ_LEN}
    base = tiny_config("diloco", **overrides)
    original = tiny_config("diloco", **overrides, **{"model.init": str(folder)})
    moved = tiny_config("diloco", **overrides, **{"model.init": str(copy)})
    assert original.data.tokenizer == str(folder / "tokenizer.json")  # the checkpoint's tokenizer for text data
    assert run_id_for(original) == run_id_for(moved) != run_id_for(base)
    assert shared_config(original.to_dict())["model"]["init"] == checkpoint_digest(folder)
    assert "init" not in shared_config(base.to_dict())["model"]
    other_size = tiny_config("diloco", **overrides, **{"model.init": str(folder), "model.size": "small"})
    assert run_id_for(other_size) == run_id_for(original)  # model.size is not used with a checkpoint
    shard = weight_files(copy)[-1]
    tensors = load_file(str(shard))
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    changed = tiny_config("diloco", **overrides, **{"model.init": str(copy)})
    assert run_id_for(changed) != run_id_for(original)


@pytest.mark.slow
def test_train_from_the_checkpoint_export_and_reload_in_transformers(tmp_path, llama_folder):
    """``simulate --init``: two workers train two rounds from the checkpoint, on text tokenized by its tokenizer;
    the model moved; the export is a tied Llama 3 folder that transformers loads with our logits, and that
    gossiploco loads after the checkpoint it started from is gone."""
    import shutil

    from typer.testing import CliRunner

    from gossiploco.cli import app

    folder = tmp_path / "checkpoint"
    shutil.copytree(llama_folder[0], folder)
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    run = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "simulate", "--config", "diloco", "--workers", "2", "--inner-steps", "2", "--rounds", "2", "--device", "cpu",
        "--quiet", "--data", str(text), "--init", str(folder), "--out", str(run), "--set", f"data.seq_len={SEQ_LEN}",
        "--set", "data.batch_size=2", "--set", "data.val_batches=1", "--set", "data.heldout_batch_size=2",
        "--set", "inner.warmup_steps=1", "--set", "inner.lr=1e-3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    loaded = load_model_source(run)
    start = init_model(folder, SEQ_LEN)
    assert loaded.model.args == start.args and loaded.tokenizer.separator_id == 2
    moved = max(float((p - start.state_dict()[n]).abs().max()) for n, p in loaded.model.state_dict().items())
    assert moved > 1e-4  # it trained
    hf_dir = export_hf(run, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_parameters"]["rope_type"] == "llama3"
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    assert logits_diff(loaded.model, hf) < FP32_TOLERANCE
    shutil.rmtree(folder)
    again = load_model_source(hf_dir)
    assert again.model.args == loaded.model.args and logits_diff(again.model, hf) < FP32_TOLERANCE


def test_data_tokenized_otherwise_than_the_checkpoint_is_refused(tmp_path, llama_folder):
    """A prepared folder (or data.tokenizer) whose tokenizer gives other ids than the checkpoint's would read the
    checkpoint's embeddings for other tokens: refused, naming the fix; the checkpoint's own tokenizer (or a copy
    of it elsewhere, or one serialised differently with the same ids) is accepted."""
    from tokenizers import Tokenizer

    from gossiploco.errors import ConfigError
    from gossiploco.hf_checkpoint import check_data_tokenizer
    from gossiploco.runtime.common import initial_model

    folder = llama_folder[0]
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    same = tmp_path / "same.json"
    same.write_text(own.to_str(pretty=True))  # other bytes, the same ids
    check_data_tokenizer(folder, same)
    check_data_tokenizer(folder, None)  # byte-level text or .bin: nothing to compare (the vocabulary check remains)
    other = tmp_path / "other.json"
    own.add_special_tokens(["<|other|>"])
    other.write_text(own.to_str())
    with pytest.raises(ConfigError, match="differs from the checkpoint's .*data prepare"):
        check_data_tokenizer(folder, other)
    cfg = tiny_config("diloco", **{"data.seq_len": SEQ_LEN, "model.init": str(folder), "data.tokenizer": str(other)})
    with pytest.raises(ConfigError, match="differs from the checkpoint's"):
        initial_model(cfg, VOCAB, torch.device("cpu"))
