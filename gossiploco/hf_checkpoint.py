"""A Hugging Face Llama-family checkpoint folder as a run's starting point (``model.init``, ``--init PATH``).

The folder is what ``save_pretrained`` writes and the Hub serves::

    config.json                         the architecture (``hidden_size``, ``num_key_value_heads``, ...)
    model.safetensors                   the weights in one file, or
    model.safetensors.index.json        a ``weight_map`` naming the shards model-0000i-of-0000n.safetensors
    tokenizer.json                      the tokenizer (``tokenizers`` JSON), used for text data

Accepted: ``model_type`` "llama" (Llama 2 and 3.x, SmolLM, TinyLlama) and "mistral" (whose sliding
window is refused when it is shorter than the run's context, where it would change the attention).
Everything else is refused by name, and so is any setting our model does not compute (attention or
MLP biases, an activation other than SiLU, a head size other than dim / heads, a rotary type other than
the default and "llama3"): ``ConfigError`` on ``model.init`` naming the field and its value.

Weights are read with ``safetensors`` (never ``torch.load``), renamed and re-laid-out by
``hf_llama.from_hf`` (the inverse of what ``gossiploco export`` writes), and converted to fp32. The
folder's digest (``checkpoint_digest``) names the weights in the run's identity, so every peer starts
from the same ones and a peer holding other weights lands in another run.
"""

from __future__ import annotations

import functools

import hashlib
import json
import logging
from pathlib import Path

import torch

from gossiploco.errors import ConfigError
from gossiploco.hf_llama import from_hf
from gossiploco.model import Llama3RopeScaling, ModelArgs, Transformer

log = logging.getLogger(__name__)
TensorDict = dict[str, torch.Tensor]

FIELD = "model.init"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
MODEL_TYPES = ("llama", "mistral")
"""The ``model_type`` values whose models ``gossiploco.model.Transformer`` computes exactly."""
ROPE_TYPES = ("default", "llama3")
IGNORED_TENSORS = (".rotary_emb.inv_freq",)
"""Tensors older checkpoints hold that are not weights (recomputed from the config): skipped, counted in the log."""


def _fail(message: str) -> ConfigError:
    return ConfigError(FIELD, message)


def read_hf_config(folder: Path | str) -> dict:
    """The folder's ``config.json``; ``ConfigError`` when the folder or the file is missing or unreadable."""
    folder = Path(folder)
    if not folder.is_dir():
        raise _fail(f"{folder} is not a folder (expected a Hugging Face checkpoint: config.json and safetensors)")
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _fail(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(f"{path} is not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise _fail(f"{path} holds no JSON object")
    return config


def _rope(config: dict, where: Path) -> tuple[float, Llama3RopeScaling | None]:
    """(rope theta, llama3 scaling or None) from transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling``."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000.0)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _fail(f"{where}: rope type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _fail(f"{where}: partial_rotary_factor {params['partial_rotary_factor']} is not supported (only 1)")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    try:
        scaling = Llama3RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                    high_freq_factor=float(params["high_freq_factor"]),
                                    original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise _fail(f"{where}: llama3 rope scaling without a usable {exc}") from exc
    if not scaling.high_freq_factor > scaling.low_freq_factor > 0 or scaling.factor <= 0:
        raise _fail(f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor > 0 and factor > 0, "
                    f"got {scaling}")
    return theta, scaling


def checkpoint_args(config: dict, seq_len: int, where: Path | str = CONFIG_FILE) -> ModelArgs:
    """Our ``ModelArgs`` for a checkpoint's ``config.json`` (a dict) and a context of ``seq_len`` tokens;
    ``ConfigError`` naming the model type or the field our model does not compute."""
    where = Path(where)
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        architectures = ", ".join(config.get("architectures") or []) or "none named"
        raise _fail(f"{where}: model_type {model_type!r} ({architectures}) is not supported; --init takes the "
                    f"Llama family: model_type {' or '.join(repr(t) for t in MODEL_TYPES)} (Llama 2/3.x, SmolLM, "
                    "TinyLlama, Mistral)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise _fail(f"{where}: {key} is true; our model has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise _fail(f"{where}: hidden_act {config['hidden_act']!r} is not supported (only silu: SwiGLU)")
    window = config.get("sliding_window") if model_type == "mistral" else None
    if window is not None and int(window) < seq_len:
        raise _fail(f"{where}: Mistral's sliding window of {window} tokens is shorter than data.seq_len = {seq_len}, "
                    "and our attention has no window: use data.seq_len <= the window")
    theta, scaling = _rope(config, where)
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        args = ModelArgs(dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
                         n_kv_heads=int(config.get("num_key_value_heads") or heads),
                         ffn_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                         max_seq_len=max(int(seq_len), 1), rope_theta=theta,
                         norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                         rope_scaling=scaling)
    except KeyError as exc:
        raise _fail(f"{where}: no {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise _fail(f"{where}: a shape field is not a number ({exc})") from exc
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != dim:
        raise _fail(f"{where}: head_dim {head_dim} times {heads} heads is not hidden_size {dim}; our model needs "
                    "head_dim = hidden_size / num_attention_heads")
    if dim % heads or heads % args.n_kv_heads:
        raise _fail(f"{where}: hidden_size {dim}, {heads} heads and {args.n_kv_heads} kv heads do not divide")
    return args


def folder_args(folder: Path | str, seq_len: int) -> ModelArgs:
    """``checkpoint_args`` of the folder's ``config.json``."""
    return checkpoint_args(read_hf_config(folder), seq_len, Path(folder) / CONFIG_FILE)


def weight_files(folder: Path | str) -> list[Path]:
    """The folder's safetensors files: the shards its index names (sorted), else ``model.safetensors``.
    ``ConfigError`` when there are none, or the index names a missing shard."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise _fail(f"{index}: not a safetensors index with a weight_map ({exc!r})") from exc
        outside = [name for name in names if not isinstance(name, str) or Path(name).name != name]
        if outside:
            raise _fail(f"{index}: shard names must be file names in the folder, got {outside[:4]}")
        missing = [name for name in names if not (folder / name).is_file()]
        if missing or not names:
            raise _fail(f"{index}: shards missing: {', '.join(missing) or 'none named'}")
        return [folder / name for name in names]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    found = ", ".join(sorted(p.name for p in folder.iterdir())[:8])
    raise _fail(f"{folder}: no {WEIGHTS_FILE} and no {INDEX_FILE} (found: {found or 'nothing'}); only safetensors "
                "weights are read (never pickled .bin files)")


_DIGESTS: dict[tuple, str] = {}
"""Digests already computed in this process, keyed by the files' (path, inode, size, mtime)."""


def checkpoint_digest(folder: Path | str) -> str:
    """``sha256:<hex>`` of the folder's ``config.json`` and weight files (each file's name, size and bytes, in
    order): what a run's identity holds for ``model.init``. A spec already in that form is returned as is.
    Computed once per process while the files are unchanged. ``ConfigError`` if a file cannot be read."""
    if str(folder).startswith("sha256:"):
        return str(folder)
    folder = Path(folder)
    files = [folder / CONFIG_FILE] + weight_files(folder)
    try:
        key = tuple((str(f), s.st_ino, s.st_size, s.st_mtime_ns) for f in files for s in [f.stat()])
        if key not in _DIGESTS:
            digest = hashlib.sha256()
            for f in files:
                digest.update(f"{f.name}\0{f.stat().st_size}\0".encode())
                with open(f, "rb") as stream:
                    while chunk := stream.read(1 << 22):
                        digest.update(chunk)
            _DIGESTS[key] = "sha256:" + digest.hexdigest()
        return _DIGESTS[key]
    except OSError as exc:
        raise _fail(f"cannot read the checkpoint {folder}: {exc.strerror or exc}") from exc


def read_hf_tensors(folder: Path | str) -> TensorDict:
    """Every tensor of the folder's weight files under its Hugging Face name, as stored (any dtype)."""
    from safetensors import SafetensorError, safe_open

    tensors: TensorDict = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in tensors:
                        raise _fail(f"{path}: tensor {name!r} is also in another shard")
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise _fail(f"{path}: not a readable safetensors file ({exc})") from exc
    return tensors


def checkpoint_params(folder: Path | str, args: ModelArgs) -> TensorDict:
    """The folder's weights under our names and rotary layout, fp32, checked against ``args``: every
    parameter present with its shape, nothing left over (``ConfigError`` lists what does not fit). A
    tied model's stored ``lm_head.weight`` (some tools write it) must equal the embedding and is dropped."""
    tensors = read_hf_tensors(folder)
    skipped = [n for n in tensors if n.endswith(IGNORED_TENSORS)]
    for name in skipped:
        del tensors[name]
    if skipped:
        log.info("%s: skipped %d rotary tables (recomputed from config.json)", folder, len(skipped))
    if args.tie_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        embedding = tensors.get("model.embed_tokens.weight")
        if embedding is None or not torch.equal(head, embedding):
            raise _fail(f"{folder}: tie_word_embeddings is true but lm_head.weight differs from the embedding")
        log.info("%s: dropped lm_head.weight, equal to the tied embedding", folder)
    try:
        params = from_hf(tensors, args)
    except KeyError as exc:
        raise _fail(f"{folder}: tensor {exc.args[0]!r} is not part of a Llama model") from exc
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in Transformer(args).named_parameters()}
    missing = sorted(set(expected) - set(params))
    unexpected = sorted(set(params) - set(expected))
    wrong = [f"{n} {tuple(params[n].shape)} (config.json says {expected[n]})"
             for n in sorted(set(expected) & set(params)) if tuple(params[n].shape) != expected[n]]
    problems = [f"{label}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    if problems:
        raise _fail(f"{folder}: the weights do not fit its config.json: " + "; ".join(problems))
    return {n: params[n].to(torch.float32) for n in expected}


def init_model(folder: Path | str, seq_len: int, device: torch.device | str = "cpu") -> Transformer:
    """The folder's model for a context of ``seq_len`` tokens, with its weights, in fp32 on ``device``
    (training mode, gradients on, as ``model.build_model`` returns one)."""
    args = folder_args(folder, seq_len)
    params = checkpoint_params(folder, args)
    with torch.device("meta"):  # shapes only: the weights come from the folder, nothing is initialised twice
        model = Transformer(args)
    model.load_state_dict(params, strict=False, assign=True)
    model.tie_embeddings()
    model.reset_rope()
    return model.to(device)


def tokenizer_path(folder: Path | str) -> Path:
    """The folder's ``tokenizer.json`` (it need not exist: the caller's loader says so)."""
    return Path(folder) / TOKENIZER_FILE


def check_data_tokenizer(folder: Path | str, data_tokenizer: Path | str | None) -> None:
    """Refuse data tokenized otherwise than the checkpoint's own ``tokenizer.json`` (when the folder has one and
    the data names a tokenizer file: ``data.tokenizer``, or a prepared folder's copy): the two must give every
    token the same id (their vocabularies, special tokens included, are compared, not their bytes), else the
    checkpoint's embeddings would be read for other tokens. ``ConfigError`` naming both files."""
    own = tokenizer_path(folder)
    if data_tokenizer is None or not own.is_file():
        return
    if not _same_ids(str(Path(data_tokenizer).resolve()), str(own.resolve())):
        raise _fail(f"the data was tokenized with {data_tokenizer}, whose vocabulary differs from the checkpoint's "
                    f"{own}: prepare it with `gossiploco data prepare ... --tokenizer {own}`")


@functools.lru_cache(maxsize=8)
def _same_ids(theirs: str, mine: str) -> bool:
    """Whether two tokenizer files give every token the same id; once per pair of files in a process (every worker
    of ``simulate`` builds its model from the checkpoint). ``ConfigError`` when one cannot be read."""
    from tokenizers import Tokenizer

    try:
        a, b = Tokenizer.from_file(theirs), Tokenizer.from_file(mine)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
        raise _fail(f"cannot compare the data's tokenizer {theirs} with the checkpoint's {mine}: {exc}") from exc
    return a.get_vocab(with_added_tokens=True) == b.get_vocab(with_added_tokens=True)
