"""A peer's walk through a prepared corpus's training windows: every window once an epoch, none shared.

The training split (``prepared_corpus.ShardedTokens``) is cut into *windows*: shard s of n_s tokens gives
the (n_s - 1) // T windows starting at 0, T, 2T, ... of T + 1 tokens (T = seq_len; inputs are the first
T, targets the last T), so the windows' targets are disjoint and a window never spans two shards. The
windows are numbered 0..N-1 in shard order.

Epoch e orders all N windows by a permutation drawn from (run seed, e) alone, the same on every peer.
The run's S = ``slices`` streams (S = the run's ``workers``) deal that order out like cards: stream k
reads the windows at positions k, k + S, k + 2S, ... of the permutation, a peer whose stream index
is i reading slice k = i mod S. Hence:

* within an epoch a stream reads no window twice, and the S slices together are every window once;
* two peers whose stream indices differ modulo S never read the same window of an epoch; with a
  static peer list the indices are the ranks 0..S-1, so the run's peers partition each epoch;
* with a directory the index is the peer's ``--rank`` if given, else its peer id: ids drawn at random
  land in the same slice with probability 1/S per pair (n peers: at most n(n-1)/(2S) colliding pairs
  expected), so give joining peers distinct ``--rank`` values 0..S-1 to keep the guarantee. A peer that
  leaves takes its slice's unread windows with it until a peer of the same slice (or it, resumed from
  its checkpoint) comes back.

A stream's position (epoch, windows read in it) is ``state()``; ``load_state`` continues there, so a
resumed peer neither repeats nor skips data. Nothing is read ahead: a batch reads its B windows from the
memory maps.
"""

from __future__ import annotations

import numpy as np
import torch

from gossiploco.errors import DataError
from gossiploco.prepared_corpus import ShardedTokens

__all__ = ["WindowStream", "window_count"]
_EPOCH_SALT = 0xE90C


def window_count(shard_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len in a shard of ``shard_tokens`` tokens."""
    return max(shard_tokens - 1, 0) // seq_len


class WindowStream:
    """Stream ``stream``'s batches of (inputs, targets) from ``tokens``'s windows (see the module docstring).
    ``DataError`` when the corpus has fewer windows than slices. Not thread-safe (one trainer reads it)."""

    kind = "windows"

    def __init__(self, tokens: ShardedTokens, seq_len: int, batch_size: int, seed: int, stream: int, slices: int):
        if slices < 1:
            raise DataError(f"window stream: {slices} slices; need at least 1")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.stream, self.slices = stream, slices
        self.slice = stream % slices
        counts = np.array([window_count(len(s), seq_len) for s in tokens.shards], dtype=np.int64)
        self.first_window = np.concatenate([[0], np.cumsum(counts)])
        """``first_window[s]``: the number of shard s's first window."""
        self.windows = int(self.first_window[-1])
        if self.windows < slices:
            raise DataError(f"prepared corpus: {self.windows} training windows of {seq_len + 1} tokens, fewer than the "
                            f"{slices} peers' slices; use a shorter data.seq_len or more data")
        self.epoch = 0
        self.position = 0
        """Windows of this epoch's slice already read."""
        self._order = self._slice_of(0)

    def _slice_of(self, epoch: int) -> np.ndarray:
        permutation = np.random.default_rng([self.seed, epoch, _EPOCH_SALT]).permutation(self.windows)
        return permutation[self.slice::self.slices].copy()

    def next_windows(self) -> np.ndarray:
        """The numbers of the next batch's ``batch_size`` windows (crossing into the next epoch when this one's
        slice runs out), advancing the position."""
        taken = []
        need = self.batch_size
        while need:
            chunk = self._order[self.position:self.position + need]
            taken.append(chunk)
            self.position += len(chunk)
            need -= len(chunk)
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._slice_of(self.epoch)
        return np.concatenate(taken)

    def read(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, targets) of ``windows``, each (B, T) int64."""
        shard_of = np.searchsorted(self.first_window, windows, side="right") - 1
        rows = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        for i, (window, shard) in enumerate(zip(windows.tolist(), shard_of.tolist())):
            start = (window - int(self.first_window[shard])) * self.seq_len
            rows[i] = self.tokens.shards[shard][start:start + self.seq_len + 1]
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(self.next_windows())

    def state(self) -> dict:
        """The position, as JSON (goes in a checkpoint)."""
        return {"kind": self.kind, "epoch": self.epoch, "position": self.position, "windows": self.windows,
                "slice": self.slice, "slices": self.slices}

    def load_state(self, state: dict) -> None:
        """Continue at ``state`` (from ``state()`` of the same stream over the same corpus); ``DataError`` if it is
        another stream's, or of another corpus or seq_len."""
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            raise DataError("the checkpoint's data stream is not a prepared folder's window stream (the run's data "
                            "changed?)")
        mine = {"windows": self.windows, "slice": self.slice, "slices": self.slices}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise DataError(f"the checkpoint's data stream {theirs} does not fit this one {mine}: another corpus, "
                            "seq_len, number of workers or stream index")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._slice_of(self.epoch)
        if not 0 <= self.position < len(self._order):
            raise DataError(f"the checkpoint's data stream position {self.position} is outside its slice "
                            f"({len(self._order)} windows)")
