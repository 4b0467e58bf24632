"""A trained model on disk: ``OUT/model.safetensors``, and loading a model from anything that holds one.

``save_model`` writes a run's final model (the workers' averaged parameters) as safetensors: raw
fp32 tensors under the model's own parameter names, with the run's config in the file's metadata
(``{"format": "gossiploco-model-1", "run_config": <json>}``), written atomically. Never a pickle:
nothing here calls ``torch.load``.

``load_model_source`` turns what a user points at into a ready model (``LoadedModel``):

* a run directory (``simulate`` / ``peer`` ``--out``): its ``model.safetensors``, else (a run still
  going, or stopped early) its newest intact checkpoint, averaged over the workers;
* a swarm directory (``swarm --out``): the first peer, by rank, whose directory has a model;
* a checkpoint's ``round-NNNNNN.json``, or a ``model.safetensors`` file;
* a folder written by ``gossiploco export`` (Hugging Face layout; ``gossiploco.hf_llama``).

The model is rebuilt from the run's config (``model.size``, ``data.seq_len``) and the embedding's
row count, and comes with the run's tokenizer (``tokenizer.run_tokenizer``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gossiploco.checkpoint import CheckpointError, checkpoint_files, load_model_params, run_checkpoints
from gossiploco.files import atomic_write
from gossiploco.errors import ConfigError, GossiplocoError
from gossiploco.hf_checkpoint import folder_args
from gossiploco.hf_llama import EXPORT_FORMAT, from_hf, is_hf_layout
from gossiploco.model import MODEL_SIZES, ModelArgs, Transformer
from gossiploco.tokenizer import (BPETokenizer, ByteTokenizer, data_tokenizer_spec, run_tokenizer, save_tokenizer_copy,
                                  tokenizer_digest)

log = logging.getLogger(__name__)
TensorDict = dict[str, torch.Tensor]

FORMAT = "gossiploco-model-1"
MODEL_FILE = "model.safetensors"
_PEER_DIR = re.compile(r"^peer-(\d+)$")


class ModelFileError(GossiplocoError):
    """Nothing loadable where a model was expected, or a model file that is damaged, of another format,
    or whose tensors do not fit its configuration."""


@dataclass
class LoadedModel:
    """A trained model ready for inference, with what it needs to be used."""

    model: Transformer
    """On the CPU, in eval mode, fp32, gradients off."""
    config: dict
    """The run's config (``RunConfig.to_dict()``) it was trained with."""
    tokenizer: ByteTokenizer | BPETokenizer
    description: str
    """Which file was loaded and why, for messages."""
    directory: Path
    """The directory the model file lies in (its tokenizer copy, its run's summary)."""
    summary: dict | None = None
    """The run's ``summary.json`` when it lies beside the model (``final_val_loss``...)."""

    @property
    def max_seq_len(self) -> int:
        return self.model.args.max_seq_len


# -- writing ---------------------------------------------------------------------------------------


def _tokenizer_sha256(run_config: dict, tokenizer) -> str | None:
    if tokenizer is not None:
        return tokenizer.sha256
    try:
        digest = tokenizer_digest(data_tokenizer_spec(run_config.get("data") or {}))
    except GossiplocoError:  # the file moved away mid-run and was never read in this process
        return None
    return digest.removeprefix("sha256:") if digest else None


def save_model(params: TensorDict, out_dir: Path, run_config: dict, tokenizer=None) -> Path:
    """Write ``params`` as ``out_dir/model.safetensors`` (all or nothing) with ``run_config`` in its
    metadata; with a BPE ``tokenizer``, also its copy ``out_dir/tokenizer.json``. Returns the file's path."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        save_tokenizer_copy(tokenizer, out_dir)
    tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in params.items()}
    metadata = {"format": FORMAT, "run_config": json.dumps(run_config, sort_keys=True)}
    sha256 = _tokenizer_sha256(run_config, tokenizer)
    if sha256:
        metadata["tokenizer_sha256"] = sha256
    path = out_dir / MODEL_FILE
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return path


# -- building the model ----------------------------------------------------------------------------


def model_args(config: dict, vocab_size: int) -> ModelArgs:
    """The architecture of a run's model: ``MODEL_SIZES[model.size]``, ``vocab_size`` ids, a context of
    ``data.seq_len`` tokens; for a run started from a checkpoint (``model.init``), that checkpoint's
    ``config.json`` (which must still be there)."""
    try:
        size, seq_len = config["model"]["size"], int(config["data"]["seq_len"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"the run config names no model.size and data.seq_len ({exc!r})") from exc
    init = str(config["model"].get("init") or "")
    if init:
        try:
            return folder_args(init, seq_len)
        except ConfigError as exc:
            raise ModelFileError(f"the run started from the checkpoint {init}, whose config.json gives the "
                                 f"model's shape: {exc}") from exc
    if size not in MODEL_SIZES:
        raise ModelFileError(f"model.size {size!r} is not a size this version knows ({', '.join(MODEL_SIZES)})")
    return ModelArgs(**{**MODEL_SIZES[size].__dict__, "vocab_size": vocab_size, "max_seq_len": max(seq_len, 1)})


def build_loaded_model(params: TensorDict, config: dict, where: str) -> Transformer:
    """The model of ``config`` holding ``params`` (our names), in eval mode on the CPU. ``ModelFileError``
    lists missing, unexpected and mis-shaped tensors."""
    embedding = params.get("tok_embeddings.weight")
    if embedding is None or embedding.dim() != 2:
        raise ModelFileError(f"{where}: no token embedding (tok_embeddings.weight); not a model of this project")
    args = model_args(config, int(embedding.shape[0]))
    with torch.device("meta"):  # shapes only: the weights come from params, nothing is initialised twice
        model = Transformer(args)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    wrong = [f"{n} {tuple(params[n].shape)} (expected {expected[n]})" for n in sorted(set(expected) & set(params))
             if tuple(params[n].shape) != expected[n]]
    problems = [f"{label}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    if problems:
        init = config["model"].get("init")
        shape = f"the checkpoint model.init = {init}" if init else f"model.size {config['model']['size']!r}"
        raise ModelFileError(f"{where}: the tensors do not fit {shape} (vocab {args.vocab_size}): " + "; ".join(problems))
    model.load_state_dict({n: params[n].to(torch.float32) for n in expected}, strict=not args.tie_embeddings,
                          assign=True)  # a tied model's state dict also names lm_head.weight, tied again below
    model.tie_embeddings()
    model.reset_rope()
    model.requires_grad_(False)
    return model.eval()


# -- reading ---------------------------------------------------------------------------------------


def read_model_file(path: Path) -> tuple[TensorDict, dict, dict]:
    """(parameters under our names, run config, metadata) of a ``model.safetensors``: ours, or one an export
    wrote in the Hugging Face layout. ``ModelFileError`` when it is unreadable or not a gossiploco model."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors file ({exc})") from exc
    if metadata.get("format") != FORMAT and metadata.get("gossiploco") != EXPORT_FORMAT:
        hint = " (a checkpoint's tensors: give its .json file)" if path.name.startswith("round-") else ""
        raise ModelFileError(f"{path}: not a gossiploco model (metadata format {metadata.get('format')!r}){hint}")
    try:
        config = json.loads(metadata["run_config"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: its metadata holds no run config") from exc
    if is_hf_layout(tensors):
        if (config.get("model") or {}).get("init") and (path.parent / "config.json").is_file():
            # an export of a run started from a checkpoint is a checkpoint folder itself: its config.json gives the
            # shape, so it loads after the checkpoint it started from is gone
            config = {**config, "model": {**config["model"], "init": str(path.parent)}}
        args = model_args(config, int(tensors["model.embed_tokens.weight"].shape[0]))
        try:
            tensors = from_hf(tensors, args)
        except KeyError as exc:
            raise ModelFileError(f"{path}: tensor {exc.args[0]!r} is not part of a Llama model of this project") from exc
    return tensors, config, metadata


def _read_summary(directory: Path) -> dict | None:
    try:
        summary = json.loads((directory / "summary.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def _loaded(params: TensorDict, config: dict, directory: Path, description: str, where: str,
            tokenizer_sha256: str | None = None) -> LoadedModel:
    model = build_loaded_model(params, config, where)
    tokenizer = run_tokenizer(directory, config, tokenizer_sha256)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ModelFileError(f"{where}: its tokenizer has {tokenizer.vocab_size} ids, the model only "
                             f"{model.args.vocab_size}: not the tokenizer it was trained with")
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, description=description, directory=directory,
                       summary=_read_summary(directory))


def _load_file(path: Path, description: str) -> LoadedModel:
    params, config, metadata = read_model_file(path)
    return _loaded(params, config, path.parent, description, str(path), metadata.get("tokenizer_sha256"))


def _load_checkpoint(meta_path: Path, description: str) -> LoadedModel:
    params, config = load_model_params(meta_path)
    run_dir = meta_path.parent.parent if meta_path.parent.name == "checkpoints" else meta_path.parent
    identity = json.loads(meta_path.read_text()).get("identity") or {}  # read and verified just now
    tokenizer_sha256 = (identity.get("data") or {}).get("tokenizer")  # "sha256:<hex>", absent for bytes
    return _loaded(params, config, run_dir, description, str(meta_path), tokenizer_sha256)


def _has_model(directory: Path) -> bool:
    return (directory / MODEL_FILE).is_file() or bool(checkpoint_files(run_checkpoints(directory)))


def _peer_dirs(directory: Path) -> list[Path]:
    """A swarm directory's peer directories, by rank."""
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _PEER_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _load_run_dir(directory: Path) -> LoadedModel:
    if (directory / MODEL_FILE).is_file():
        kind = "exported model" if (directory / "config.json").is_file() else "final model"
        return _load_file(directory / MODEL_FILE, f"{directory / MODEL_FILE} ({kind})")
    damaged = []
    for meta_path in checkpoint_files(run_checkpoints(directory)):
        try:
            return _load_checkpoint(meta_path, f"{meta_path} (the newest checkpoint: {directory} has no {MODEL_FILE}, "
                                               "the run is still going or stopped early)")
        except CheckpointError as exc:
            damaged.append(str(exc))
            log.warning("skipping a damaged checkpoint: %s", exc)
    if damaged:
        raise ModelFileError(f"{directory}: no {MODEL_FILE} and every checkpoint is damaged: " + "; ".join(damaged))
    raise ModelFileError(f"{directory}: no model here")  # callers check _has_model first


def load_model_source(path: Path | str) -> LoadedModel:
    """The model ``path`` names (see the module docstring). ``ModelFileError`` (or the ``CheckpointError``
    or ``DataError`` of a damaged checkpoint or a missing tokenizer) says what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix == ".safetensors":
            return _load_file(path, str(path))
        if path.name == "config.json" and (path.parent / MODEL_FILE).is_file():
            return _load_file(path.parent / MODEL_FILE, f"{path.parent / MODEL_FILE} (exported model)")
        if path.suffix == ".json":
            return _load_checkpoint(path, f"{path} (checkpoint)")
        raise ModelFileError(f"{path}: not a model file (expected {MODEL_FILE}, a checkpoint's round-NNNNNN.json, or "
                             "a directory holding one)")
    if _has_model(path):
        return _load_run_dir(path)
    for peer_dir in _peer_dirs(path):
        if _has_model(peer_dir):
            loaded = _load_run_dir(peer_dir)
            loaded.description = f"{loaded.description}, the first peer of the swarm {path} with a model"
            return loaded
    old = " (model.pt, an older version's pickle, is never loaded: it could run code)" if (path / "model.pt").exists() else ""
    raise ModelFileError(f"{path}: no model to load{old}; expected a run directory ({MODEL_FILE} or "
                         "checkpoints/round-NNNNNN.json), a swarm directory (peer-N/), or a folder from `gossiploco export`")
