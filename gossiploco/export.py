"""``export_hf``: a trained model as a Hugging Face folder that ``transformers`` loads with no extra code.

The folder holds::

    config.json               LlamaConfig fields (gossiploco.hf_llama.hf_config)
    generation_config.json    end of text / padding ids
    model.safetensors         Llama-named fp32 tensors (wq, wk rows in Llama's rotary layout), metadata
                              {"format": "pt"} plus the run's config, so gossiploco loads it back too
    tokenizer.json            the run's tokenizer as Hugging Face ``tokenizers`` JSON
    tokenizer_config.json     PreTrainedTokenizerFast, its end-of-text and padding tokens
    special_tokens_map.json
    README.md                 a model card: the run, its config, its validation loss, how to load it

so that ``LlamaForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` work
offline. Writing the export needs neither ``transformers`` nor a network. The folder is written
under a temporary name beside ``out_dir`` and renamed into place: it appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from gossiploco.files import fsync_dir
from gossiploco.errors import ConfigError, GossiplocoError
from gossiploco.hf_llama import EXPORT_FORMAT, hf_config, to_hf
from gossiploco.model_file import MODEL_FILE, LoadedModel, load_model_source
from gossiploco.runtime.run_dir import holds_run
from gossiploco.tokenizer import TOKENIZER_FILE


class ExportError(GossiplocoError):
    """The export cannot be written where asked."""


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("--out", f"{out_dir} is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise ConfigError("--out", f"{out_dir} exists and is not empty; give another folder, or --overwrite to "
                                       "replace it")
        if holds_run(out_dir) and not (out_dir / "config.json").is_file():
            raise ConfigError("--out", f"{out_dir} holds a training run; an export never replaces one, even with "
                                       "--overwrite")


def _special_token(tokenizer_json: str, token_id: int) -> str:
    from tokenizers import Tokenizer as HFTokenizer

    token = HFTokenizer.from_str(tokenizer_json).id_to_token(token_id)
    if token is None:
        raise ExportError(f"the tokenizer has no token with id {token_id} (its end of text)")
    return token


def _tokenizer_line(tokenizer) -> str:
    if tokenizer.sha256 is None:
        return "byte-level (a UTF-8 byte is its id, 0 ends a text)"
    return f"byte-level BPE, {tokenizer.vocab_size} ids (sha256 {tokenizer.sha256[:12]}...)"


def _model_card(loaded: LoadedModel, n_params: int, folder: str) -> str:
    config, summary = loaded.config, loaded.summary or {}
    val, ppl = summary.get("final_val_loss"), summary.get("final_val_ppl")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [gossiploco, llama]", "---", "",
        f"# {config.get('name', 'gossiploco')} ({config['model']['size']}, {n_params / 1e6:.2f}M parameters)", "",
        "A Llama-style language model trained with gossiploco (decentralized training: Factored Gossip DiLoCo), "
        "exported to the Hugging Face Llama layout.", "",
        f"- source: `{loaded.description}`",
        f"- training: mode {config.get('mode')}, {summary.get('workers', config.get('workers'))} workers x "
        f"{config.get('rounds')} rounds x {config.get('inner_steps')} inner steps, seed {config.get('seed')}",
        f"- context: {config['data']['seq_len']} tokens; tokenizer: {_tokenizer_line(loaded.tokenizer)}",
        f"- final validation loss: {val:.4f}" + (f" (perplexity {ppl:.2f})" if ppl is not None else "") if val is not None
        else "- final validation loss: not recorded beside this model",
        "",
        "## Use", "", "```python", "from transformers import AutoTokenizer, LlamaForCausalLM", "",
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")',
        f'model = LlamaForCausalLM.from_pretrained("{folder}")',
        'ids = tokenizer("def main(", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=50, do_sample=False)[0]))", "```", "",
        f"Or with gossiploco: `gossiploco generate {folder} --prompt \"def main(\"`, `gossiploco eval {folder}`.", "",
        "## Run config", "", "```json", json.dumps(config, indent=1, sort_keys=True), "```", "",
    ]
    return "\n".join(lines)


def export_files(loaded: LoadedModel, folder: str = "PATH") -> dict[str, bytes | dict[str, torch.Tensor]]:
    """The export folder's files: name -> bytes, and ``model.safetensors`` -> its tensors. ``folder``: how
    the model card names the folder in its examples."""
    model, tokenizer = loaded.model, loaded.tokenizer
    special = tokenizer.separator_id
    tokenizer_json = tokenizer.to_hf_json()
    token = _special_token(tokenizer_json, special)
    config = hf_config(model.args, special)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": token, "pad_token": token, "bos_token": None,
        "unk_token": None, "model_max_length": model.args.max_seq_len, "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }
    generation = {"bos_token_id": special, "eos_token_id": special, "pad_token_id": special}
    params = {n: p.detach() for n, p in model.named_parameters()}

    def text(value) -> bytes:
        return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")

    return {
        "config.json": text(config),
        "generation_config.json": text(generation),
        MODEL_FILE: to_hf(params, model.args),
        TOKENIZER_FILE: tokenizer_json.encode("utf-8"),
        "tokenizer_config.json": text(tokenizer_config),
        "special_tokens_map.json": text({"eos_token": token, "pad_token": token}),
        "README.md": _model_card(loaded, sum(p.numel() for p in params.values()), folder).encode("utf-8"),
    }


def _write_folder(folder: Path, files: dict, loaded: LoadedModel) -> None:
    from safetensors.torch import save_file

    for name, content in files.items():
        path = folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            metadata = {"format": "pt", "gossiploco": EXPORT_FORMAT,
                        "run_config": json.dumps(loaded.config, sort_keys=True)}
            if loaded.tokenizer.sha256:
                metadata["tokenizer_sha256"] = loaded.tokenizer.sha256
            save_file(content, str(path), metadata=metadata)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    fsync_dir(folder)


def export_hf(source_path: Path | str, out_dir: Path | str, overwrite: bool = False) -> Path:
    """Export the model ``source_path`` names (anything ``load_model_source`` takes) to the Hugging Face
    folder ``out_dir``; returns it. ``ConfigError`` for an ``out_dir`` that exists and is not empty
    (unless ``overwrite``; a training run is never replaced), ``ModelFileError`` for a source with no
    loadable model."""
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    loaded = load_model_source(source_path)
    files = export_files(loaded, out_dir.name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    old = None
    try:
        _write_folder(staging, files, loaded)
        _check_target(out_dir, overwrite)  # again: something may have appeared while writing
        if out_dir.is_dir() and any(out_dir.iterdir()):
            old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
            os.replace(out_dir, old)
        os.replace(staging, out_dir)  # over an empty folder or none
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.replace(old, out_dir)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out_dir
