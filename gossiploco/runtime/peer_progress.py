"""A network peer's training progress: what it carries from one metrics record to the next (the stats of the
rounds since, the training losses) and across its run (failure and catch-up counters, tokens processed), and
the outer state at the start of the round it is in, which it hands to peers catching up (``peer_join``).
Checkpoints save and restore it (``snapshot``/``restore``, ``peer_checkpoint``)."""

from __future__ import annotations

import torch

from gossiploco.runtime.common import mean_loss, merge_stats

TensorDict = dict[str, torch.Tensor]

COUNTS = ("mix1_failures", "mix2_failures", "grad_failures", "monitor_failures", "monitor_late", "monitor_waits", "monitor_dropped",
          "catchups", "round_clock_refused")
"""What a peer counts over its run (its summary reports them)."""


class TrainingProgress:
    """Used by the peer's main thread, except ``round_start``: the exchange's thread reads it (it is replaced
    whole, never changed in place, so a reader sees one round's state)."""

    def __init__(self) -> None:
        self._pending: dict = {}
        """Stats of the rounds since the last record, written with the next one (``merge_stats``)."""
        self._losses: list[torch.Tensor | float] = []
        """Training losses since the last record."""
        self._counts = dict.fromkeys(COUNTS, 0)
        self._tokens = 0
        self._round_start: tuple[int, TensorDict, TensorDict] | None = None

    # -- between records ---------------------------------------------------------------------------

    def merge(self, stats: dict) -> None:
        """Stats for the next record: ``*_failures`` add up, anything else is the latest value (``merge_stats``)."""
        merge_stats(self._pending, stats)

    def add_loss(self, loss: torch.Tensor | float) -> None:
        """One inner step's training loss (a tensor is read when the next record is made, not now)."""
        self._losses.append(loss)

    def take(self) -> dict:
        """What the next record carries: the mean training loss since the last one (if any step ran) and the
        merged stats; both start again empty."""
        taken: dict = {}
        if self._losses:
            taken["loss"] = mean_loss(self._losses)
        taken.update(self._pending)
        self._pending, self._losses = {}, []
        return taken

    # -- over the run ------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """``n`` more of counter ``name`` (one of ``COUNTS``)."""
        self._counts[name] += n

    @property
    def counts(self) -> dict[str, int]:
        """A copy of the counters."""
        return dict(self._counts)

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    @property
    def tokens(self) -> int:
        """Tokens this peer trained on over its run (a resumed run's included)."""
        return self._tokens

    # -- the round's start -------------------------------------------------------------------------

    def set_round_start(self, k: int, z: TensorDict, momentum: TensorDict) -> None:
        """Round ``k`` begins from outer state ``z``, ``momentum`` (dicts nobody changes in place afterwards:
        the outer step makes new ones)."""
        self._round_start = (k, z, momentum)

    @property
    def round_start(self) -> tuple[int, TensorDict, TensorDict] | None:
        """``(k, z, momentum)`` of the round this peer last started (None before its first): what it gives a
        peer catching up. Safe to read from any thread."""
        return self._round_start

    # -- checkpoints -------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The progress as plain values, for a checkpoint's metadata."""
        return {"pending": dict(self._pending), "losses": [float(v) for v in self._losses], "counts": dict(self._counts),
                "tokens": self._tokens}

    def restore(self, state: dict) -> None:
        """Continue from ``snapshot()``'s values (in a checkpoint's metadata, beside other keys)."""
        self._pending = dict(state["pending"])
        self._losses = list(state["losses"])
        self._counts.update(state["counts"])
        self._tokens = int(state["tokens"])
