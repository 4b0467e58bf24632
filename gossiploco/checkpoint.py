"""Checkpoints on disk: what a run needs to continue exactly, written atomically off the training thread.

A checkpoint is taken at a round boundary (the start of round k, before Mix1 is launched) and is
two files in ``OUT/checkpoints/``:

* ``round-00000k.safetensors``: every tensor (safetensors: a header and raw bytes, never a pickle),
  keyed ``<worker>/<what>/<parameter>`` (``w0/z/layers.1.mlp.w1.weight``, ``w0/adam/exp_avg/...``);
* ``round-00000k.json``: the metadata: format, round, the run's config and its digest, the size and
  SHA-256 of the tensor file, and per worker the state that is not a tensor (the data stream's
  generator, the optimizer's step, the pending metrics...).

Each file is written to a temporary name in the same directory, flushed, fsynced and renamed, and
the directory is fsynced; the JSON goes last, so a checkpoint exists once its JSON does and a crash
mid-write leaves at most a stray temporary file. The ``keep`` newest checkpoints are kept, older ones
deleted only after a newer one is complete. Reading checks the JSON, the format, the tensor file's
size and hash: a damaged newest checkpoint is skipped with a warning naming the damage, and the one
before it is used.

``CheckpointWriter`` writes on its own thread: the training thread hands it a ``Snapshot`` (tensors
already copied off the live state) and goes on. If the disk is slower than the rounds, a newer
snapshot replaces one still waiting (never more than one waits); a failed write is logged with its
cause and counted, and the run goes on.
"""

from __future__ import annotations

import hashlib
import json
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gossiploco.config import RoundConfig
from gossiploco.errors import GossiplocoError
from gossiploco.files import atomic_write, atomic_write_bytes
from gossiploco.prepared_corpus import prepared_identity
from gossiploco.tokenizer import tokenizer_digest

log = logging.getLogger(__name__)
TensorDict = dict[str, torch.Tensor]

FORMAT = "gossiploco-checkpoint-1"
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^round-(\d{6,})\.json$")
NOT_IDENTITY = ("device", "compute", "checkpoint", "logging")
"""Config fields a resumed run may change: where and how it computes, how it checkpoints, where its metrics go."""
DEFAULT_ROUND = {k: v for k, v in dataclasses.asdict(RoundConfig()).items() if k != "clock"}
"""The ``[round]`` section of a run that does not set one (left out of the identity), less ``clock``: a round clock
at its default (``start``) is left out too, so runs from before the setting existed keep their identity."""


class CheckpointError(GossiplocoError):
    """A checkpoint cannot be used: damaged, of another format, or of another run's configuration."""


@dataclass
class Snapshot:
    """The state at the start of round ``round``, ready to be written."""

    round: int
    tensors: TensorDict
    meta: dict
    ready: Callable[[], None] | None = None
    """Waits until the tensors hold their values (copies from a GPU run asynchronously); None: they do."""


@dataclass
class Checkpoint:
    """A checkpoint read back and verified."""

    round: int
    tensors: TensorDict
    meta: dict
    path: Path


# -- configuration identity ------------------------------------------------------------------------


def shared_config(config: dict) -> dict:
    """The config (a ``RunConfig.to_dict()``) as every peer of a run, and every checkpoint it resumes, must
    agree on it: all but ``NOT_IDENTITY``, and the tokenizer named by its content, ``data.tokenizer =
    "sha256:<hex>"``, not by its path (peers keep the file where they like; a moved file is the same run).
    The byte-level tokenizer leaves ``data.tokenizer`` out, so byte-level runs keep the identity they had
    before the field existed (their checkpoints still resume). The one definition behind the run id
    (``runtime.peer.run_id_for``) and checkpoint compatibility; idempotent. ``ConfigError`` if the
    tokenizer file cannot be read. A prepared folder in ``data.paths`` is named by ``prepared_identity`` (its
    tokenizer's digest and shards), not by its path. Likewise a ``round`` section at its defaults (steps budget,
    equal weights) is left out: runs from before the section existed keep their identity. A checkpoint to start
    from (``model.init``) is named by its digest (``hf_checkpoint.checkpoint_digest``: its config and weights),
    so peers holding other weights are in another run; without one, ``model.init`` is left out."""
    shared = {k: v for k, v in config.items() if k not in NOT_IDENTITY}
    model = shared.get("model")
    if isinstance(model, dict) and "init" in model:
        model = dict(model)
        init = str(model.pop("init"))
        if init:
            from gossiploco.hf_checkpoint import checkpoint_digest

            model["init"] = checkpoint_digest(init)
            model.pop("size", None)  # the checkpoint's config gives the shape: model.size is not used
        shared["model"] = model
    rounds = shared.get("round")
    if isinstance(rounds, dict) and rounds.get("clock") == "start":
        shared["round"] = rounds = {k: v for k, v in rounds.items() if k != "clock"}
    if rounds == DEFAULT_ROUND:
        del shared["round"]
    data = shared.get("data")
    if isinstance(data, dict) and "tokenizer" in data:
        data = dict(data)
        digest = tokenizer_digest(str(data.pop("tokenizer")))
        if digest is not None:
            data["tokenizer"] = digest
        shared["data"] = data
    if isinstance(data, dict) and data.get("paths"):
        # A prepared folder by its data (tokenizer digest, shards), not its path: "prepared:sha256:<hex>"
        shared["data"] = {**data, "paths": [prepared_identity(str(p)) or p for p in data["paths"]]}
    return shared


def config_digest(config: dict) -> str:
    return hashlib.sha256(json.dumps(shared_config(config), sort_keys=True).encode()).hexdigest()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): value}


def config_differences(saved: dict, current: dict) -> list[str]:
    """``field: checkpoint X, now Y`` for every identity field that differs (``saved``: best its shared form,
    whose tokenizer is a digest, since the file may have moved since)."""
    a, b = _flatten(shared_config(saved)), _flatten(shared_config(current))
    return [f"{k}: checkpoint {a.get(k, '(absent)')!r}, now {b.get(k, '(absent)')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k, "(absent)") != b.get(k, "(absent)")]


def check_compatible(checkpoint: Checkpoint, config: dict) -> None:
    """Raise ``CheckpointError`` naming every field where ``config`` differs from the checkpoint's run."""
    if checkpoint.meta.get("config_sha256") == config_digest(config):
        return
    diffs = config_differences(checkpoint.meta.get("identity") or checkpoint.meta.get("config", {}), config)
    raise CheckpointError(
        f"{checkpoint.path} belongs to a run with another configuration; it differs in "
        + "; ".join(diffs or ["(the digest only)"])
        + ". Resume with the same --config, options and --set values, or start a new run with another --out")


# -- writing ---------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_paths(directory: Path, round_index: int) -> tuple[Path, Path]:
    stem = f"round-{round_index:06d}"
    return directory / f"{stem}.safetensors", directory / f"{stem}.json"


def write_checkpoint(directory: Path, snapshot: Snapshot, config: dict) -> Path:
    """Write ``snapshot`` as a checkpoint of the run configured by ``config``; returns the JSON's path.
    The config is stored as given and in its shared form (``identity``), which names the tokenizer by
    its digest: a resume is checked against that after the tokenizer file moved."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if snapshot.ready is not None:
        snapshot.ready()
    tensor_path, meta_path = checkpoint_paths(directory, snapshot.round)
    tensors = {k: v.detach().contiguous() for k, v in snapshot.tensors.items()}
    atomic_write(tensor_path, lambda tmp: save_file(tensors, str(tmp)))
    identity = shared_config(config)
    meta = {"format": FORMAT, "round": snapshot.round, "config": config, "identity": identity,
            "config_sha256": config_digest(identity),
            "tensors": {"file": tensor_path.name, "bytes": tensor_path.stat().st_size, "sha256": _sha256(tensor_path)},
            "written_at": time.time(), **snapshot.meta}
    atomic_write_bytes(meta_path, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
    return meta_path


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (and stray temporary files); returns what went."""
    gone = []
    for meta_path in checkpoint_files(directory)[keep:]:
        tensor_path = meta_path.with_suffix(".safetensors")
        meta_path.unlink(missing_ok=True)  # the JSON first: a half-deleted checkpoint is never found
        tensor_path.unlink(missing_ok=True)
        gone.append(meta_path)
    for tmp in directory.glob(".round-*.tmp"):
        tmp.unlink(missing_ok=True)
    return gone


class CheckpointWriter:
    """Writes snapshots on a background thread; see the module docstring."""

    def __init__(self, directory: Path, config: dict, keep: int):
        self.directory = Path(directory)
        self.config = config
        self.keep = keep
        self.written: list[int] = []
        self.failures = 0
        self.replaced = 0
        """Snapshots dropped because a newer one arrived before the disk took them."""
        self.write_s = 0.0
        self.last_write_s = 0.0
        self.last_submitted = -1
        """The round of the newest snapshot handed in."""
        self._queued: Snapshot | None = None
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue ``snapshot`` (returns at once)."""
        with self._cond:
            if self._closed:
                raise CheckpointError("checkpoint writer is closed")
            if self._queued is not None:
                self.replaced += 1
                log.warning("checkpoint of round %d not written: the disk is slower than the rounds (round %d "
                            "replaces it)", self._queued.round, snapshot.round)
            self._queued = snapshot
            self.last_submitted = snapshot.round
            self._cond.notify_all()

    @property
    def writing(self) -> bool:
        """Whether a snapshot is being written now."""
        with self._cond:
            return self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued snapshot is written (or failed); False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queued is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Write what is queued, then stop the thread. Returns whether everything was written in time."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=0 if not done else timeout_s)
        return done

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._queued is None:
                    return
                snapshot, self._queued, self._busy = self._queued, None, True
            start = time.perf_counter()
            try:
                write_checkpoint(self.directory, snapshot, self.config)
                prune(self.directory, self.keep)
                self.written.append(snapshot.round)
            except Exception as exc:  # noqa: BLE001 - a failed write (disk full, permissions) is loud, not fatal
                self.failures += 1
                log.error("checkpoint of round %d could not be written to %s: %s: %s", snapshot.round, self.directory,
                          type(exc).__name__, exc)
            finally:
                seconds = time.perf_counter() - start
                with self._cond:
                    self.write_s += seconds
                    self.last_write_s = seconds
                    self._busy = False
                    self._cond.notify_all()

    def stats(self) -> dict:
        return {"checkpoints_written": len(self.written), "checkpoint_failures": self.failures,
                "checkpoints_replaced": self.replaced, "checkpoint_write_s": self.write_s}


# -- reading ---------------------------------------------------------------------------------------


def checkpoint_files(directory: Path) -> list[Path]:
    """The checkpoints' JSON files in ``directory``, newest round first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def read_checkpoint(meta_path: Path) -> Checkpoint:
    """Read and verify one checkpoint; ``CheckpointError`` says what is damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta_path = Path(meta_path)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: unreadable metadata ({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{meta_path}: not a {FORMAT} checkpoint (format {found!r})")
    info = meta.get("tensors")
    if not isinstance(info, dict) or not isinstance(info.get("file"), str) or "/" in info["file"]:
        raise CheckpointError(f"{meta_path}: metadata names no tensor file")
    tensor_path = meta_path.parent / info["file"]
    if not tensor_path.is_file():
        raise CheckpointError(f"{meta_path}: its tensor file {tensor_path.name} is missing")
    size = tensor_path.stat().st_size
    if size != info.get("bytes"):
        raise CheckpointError(f"{tensor_path}: {size} bytes, the checkpoint says {info.get('bytes')} (truncated or replaced)")
    digest = _sha256(tensor_path)
    if digest != info.get("sha256"):
        raise CheckpointError(f"{tensor_path}: SHA-256 {digest[:12]}... does not match the checkpoint's "
                              f"{str(info.get('sha256'))[:12]}... (the file is damaged)")
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{tensor_path}: unreadable tensors ({exc})") from exc
    return Checkpoint(round=int(meta["round"]), tensors=tensors, meta=meta, path=meta_path)


def latest_checkpoint(directory: Path) -> Checkpoint | None:
    """The newest intact checkpoint in ``directory`` (damaged newer ones skipped with a warning); None if
    there is none at all; ``CheckpointError`` if there are some and every one is damaged."""
    files = checkpoint_files(Path(directory))
    damaged = []
    for meta_path in files:
        try:
            checkpoint = read_checkpoint(meta_path)
        except CheckpointError as exc:
            damaged.append(str(exc))
            log.warning("skipping a damaged checkpoint: %s", exc)
            continue
        if damaged:
            log.warning("resuming from %s, an older checkpoint (%d newer one(s) damaged)", meta_path.name, len(damaged))
        return checkpoint
    if damaged:
        raise CheckpointError("every checkpoint in " + str(directory) + " is damaged: " + "; ".join(damaged))
    return None


def run_checkpoints(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def load_model_params(path: Path) -> tuple[TensorDict, dict]:
    """The model a checkpoint holds (the workers' outer parameters z averaged: Algorithm 1, line 15, at the
    checkpoint's round) and its run's config. ``path``: a run directory or a checkpoint's JSON file."""
    path = Path(path)
    if path.suffix == ".json":
        checkpoint = read_checkpoint(path)
    else:
        found = latest_checkpoint(run_checkpoints(path))
        if found is None:
            raise CheckpointError(f"{path}: no checkpoint (expected {run_checkpoints(path)}/round-NNNNNN.json)")
        checkpoint = found
    workers = checkpoint.meta.get("workers") or []
    sums: TensorDict = {}
    for worker in workers:
        kind = "z" if any(k.startswith(f"{worker}/z/") for k in checkpoint.tensors) else "params"
        prefix = f"{worker}/{kind}/"
        for key, value in checkpoint.tensors.items():
            if key.startswith(prefix):
                name = key[len(prefix):]
                sums[name] = value.double() if name not in sums else sums[name] + value.double()
    if not sums:
        raise CheckpointError(f"{checkpoint.path}: holds no model parameters")
    return {n: (v / len(workers)).float() for n, v in sums.items()}, checkpoint.meta["config"]
