"""Mixing operators Mix(v) = sum_n w_mn v_n (paper eq. 7), written against ``Exchange``.

* ``IdentityMix``: W = I, no communication.
* ``GlobalMix``: W = (1/M) 1 1^T, an all-reduce average over the group.
* ``GossipMix``: one round of pairwise random matching; each pair averages, an unmatched peer
  keeps its value. Every peer computes the same matching from (seed, round, operator, members).

Each operator mixes only the parameters of its selected blocks; the others pass through
unchanged (identity). With a ``codec`` (``gossiploco.mixing.compression``) the global and gossip
operators exchange compressed payloads (``gossiploco.mixing.compressed``) and, with error feedback,
keep per parameter the residual their last successful mix lost, to send with the next one. With a
``weight`` (the tokens a worker processed, ``gossiploco.mixing.weighted``) the global and gossip
operators take weighted means instead, compressed or not; without one, the plain means. A
failed exchange never raises: the operator falls back to identity and reports the cause in
``MixResult`` (house rule: weaker mixing, never a stalled run).
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from gossiploco.errors import ExchangeClosed, ExchangeError, NoDecision, PeerFailed
from gossiploco.mixing.compressed import group_mean, pair_mean
from gossiploco.mixing.compression import Codec, Float32Codec
from gossiploco.mixing.exchange import Exchange
from gossiploco.mixing.mix_result import NON_FINITE, MixResult, TensorDict
from gossiploco.mixing.packing import pack, unpack
from gossiploco.mixing.robust_mean import Robust, robust_group_mean
from gossiploco.mixing.weighted import group_scale, pair_scale, push_sum_swap, weighted_all_reduce
from gossiploco.protocol.keys import again_key
from gossiploco.tensor_checks import all_finite

log = logging.getLogger(__name__)


INITIAL_REFERENCE = 1
"""The tag of x_0, the reference every worker of a fresh swarm starts with (``reference_tag`` gives 1 only
for a crc32 of 0: one chance in 2^32)."""


def reference_tag(round_index: int, members: Sequence[int]) -> int:
    """The nonzero tag of the reference made by the mix of ``round_index`` over ``members`` (in order)."""
    return 1 + zlib.crc32(f"{round_index}:{','.join(map(str, members))}".encode())


def pair_matching(seed: int, round_index: int, salt: str, members: Sequence[int]) -> dict[int, int | None]:
    """A uniformly random perfect matching of ``members``; with an odd count one peer is unmatched.

    Deterministic in (seed, round, salt, set of members), so every peer computes the same one.
    """
    ordered = sorted(members)
    rng = np.random.default_rng([seed, round_index, zlib.crc32(salt.encode())])
    perm = [ordered[i] for i in rng.permutation(len(ordered))]
    partners: dict[int, int | None] = {}
    for a, b in zip(perm[0::2], perm[1::2]):
        partners[a], partners[b] = b, a
    if len(perm) % 2:
        partners[perm[-1]] = None
    return partners


class Mixer(ABC):
    """A mixing operator over the parameters ``names`` (the selected blocks).

    ``mix`` is called by every peer of the group with the same ``round_index``; it blocks while
    the exchange runs and is thread-safe as long as concurrent calls use different operators.
    """

    kind: str

    def __init__(self, label: str, names: Sequence[str], seed: int, codec: Codec | None = None,
                 error_feedback: bool = False, feedback_decay: float = 1.0, key_suffix: str = ""):
        self.label = label  # "mix1" or "mix2": keys exchanges and salts matchings
        self.key_suffix = key_suffix
        """Appended to the exchange key (``"/f2"``: fragment 2 of Mix1), so fragments are separate exchanges."""
        self.names = list(names)
        self.seed = seed
        self.codec = None if codec is None or isinstance(codec, Float32Codec) else codec
        """None: exchange fp32 values (the uncompressed collectives)."""
        self.error_feedback = error_feedback and self.codec is not None
        self.feedback_decay = feedback_decay
        """The residual is added times this (SparseLoCo's accumulator decay; 1: nothing is forgotten)."""
        self.residual: TensorDict = {}
        """Error feedback, per parameter: what the last successful compressed mix of it lost (CPU fp32)."""
        self.robust: Robust | None = None
        """Robust mixing (``make_robust``; open runs), or None: plain means."""
        self.previous: torch.Tensor | None = None
        """Robust Mix1: its last result, where the screen measures the members' moves from."""
        self._again = self._grouped = self._leaderless = False
        """The call running is the exchange run again (``mix(again=True)``); its group was agreed, or its leader
        never decided (``_group``)."""

    def _anchor(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Where a robust mix measures moves from: Mix1's last result (None for Mix2, or before a first result)."""
        return self.previous if self.previous is not None and self.previous.numel() == flat.numel() else None

    def _remember(self, mixed: torch.Tensor) -> None:
        """Keep a robust Mix1's result as the next mix's anchor."""
        if self.label == "mix1":
            self.previous = mixed.clone()

    def make_robust(self, robust: Robust) -> None:
        """Mix robustly from now on (``gossiploco.mixing.robust``): the group's or the pair's values screened and
        clipped, and the members ``robust.ledger`` excluded left out."""
        self.robust = robust

    def mix(self, dicts: Sequence[TensorDict], round_index: int, exchange: Exchange,
            weight: float | None = None, again: bool = False, last_try: bool = True) -> MixResult:
        """Mix the selected entries of ``dicts`` (e.g. [z] or [z, momentum]) in one exchange. With ``weight``
        (> 0; every member must give one): the weighted mean (``gossiploco.mixing.weighted``). ``again``: this
        round's exchange run a second time after it failed, among those of its group that run it again
        (``keys.again_key``: the first's buckets, a leader of its own). ``last_try`` False: the caller may run a
        failed one again, and its warning says what comes next."""
        self._again, self._grouped, self._leaderless = again, False, False
        try:
            then = "; identity this round" if last_try else ""
            return self._mix(list(dicts), round_index, exchange, weight, again, then)
        finally:
            self._again = False

    def _mix(self, dicts: list[TensorDict], round_index: int, exchange: Exchange, weight: float | None,
             again: bool, then: str) -> MixResult:
        flat = pack(dicts, self.names, exchange.vector)
        nbytes = flat.numel() * 4 if self.codec is None else self.codec.encoded_bytes(flat.numel())
        start = time.perf_counter()
        residual = None
        new_weight = weight
        try:
            if self.robust is not None:
                mixed, partner, residual, nbytes, new_weight = self._combine_robust(flat, dicts, round_index, exchange,
                                                                                    weight)
            elif self.codec is not None:
                mixed, partner, residual, nbytes, new_weight = self._combine_compressed(flat, dicts, round_index,
                                                                                        exchange, weight)
            elif weight is not None:
                mixed, partner, nbytes, new_weight = self._combine_weighted(flat, weight, round_index, exchange)
            else:
                mixed, partner, nbytes = self._combine(flat, round_index, exchange)
        except ExchangeClosed:
            raise
        except ExchangeError as exc:
            log.warning("%s round %d: exchange failed (%s)%s", self.label, round_index, exc, then)
            self._failed()
            return MixResult(dicts, ok=False, cause=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - start,
                             bytes=nbytes, weight=weight, again=again, grouped=self._grouped,
                             leaderless=self._leaderless)
        if self._grouped and not again:  # its group's result is in hand: it takes no part in the exchange run again
            exchange.completed(self.key(round_index))
        if mixed is not flat and not all_finite(mixed):
            cause = NON_FINITE
            log.warning("%s round %d: %s%s", self.label, round_index, cause, then)
            self._failed()
            return MixResult(dicts, ok=False, cause=cause, partner=partner, seconds=time.perf_counter() - start, bytes=nbytes,
                             weight=weight, again=again, grouped=self._grouped)
        if mixed is flat:  # identity, an unmatched gossip peer, or a group of one: nothing exchanged
            return MixResult(dicts, ok=True, seconds=time.perf_counter() - start, weight=weight, again=again)
        if self.error_feedback and residual is not None:
            self.residual.update(unpack(residual, dicts, self.names)[0])
        values = unpack(mixed, dicts, self.names)
        return MixResult(values, ok=True, partner=partner, seconds=time.perf_counter() - start, bytes=nbytes,
                         weight=new_weight, again=again)

    def _prepare_compressed(self, flat: torch.Tensor, dicts: list[TensorDict], scale: float) -> None:
        """What a compressed mix sends, in ``flat``: ``scale x`` (a weighted mean's scale, 1.0 unweighted), plus the
        error-feedback residual at the scale it was lost at (``gossiploco.mixing.weighted``)."""
        if scale != 1.0:
            flat.mul_(scale)
        if self.error_feedback:
            self._add_residual(flat, dicts)

    def _add_residual(self, flat: torch.Tensor, dicts: list[TensorDict]) -> None:
        """``flat += decay * e``: the residual of each selected parameter (none yet: zero) onto the packed vector."""
        if len(dicts) != 1:
            raise ValueError(f"{self.label}: error feedback mixes one dict (a pseudo-gradient), got {len(dicts)}")
        offset = 0
        for n in self.names:
            size = dicts[0][n].numel()
            if n in self.residual:
                flat[offset:offset + size].add_(self.residual[n].reshape(-1), alpha=self.feedback_decay)
            offset += size

    @abstractmethod
    def _combine(self, flat: torch.Tensor, round_index: int, exchange: Exchange) -> tuple[torch.Tensor, int | None, int]:
        """Mixed version of ``flat`` (``flat`` itself for identity), the gossip partner if any, and the bytes sent."""

    def _combine_weighted(self, flat: torch.Tensor, weight: float, round_index: int,
                          exchange: Exchange) -> tuple[torch.Tensor, int | None, int, float]:
        """``_combine`` of the weighted mean: also this peer's weight after the mix. Default: identity."""
        return flat, None, 0, weight

    def key(self, round_index: int) -> str:
        """This mix's exchange key in round ``round_index`` (``"mix1/12"``, ``"mix1/12/f2"``; run again:
        ``"mix1/12/again"``)."""
        key = f"{self.label}/{round_index}{self.key_suffix}"
        return again_key(key) if self._again else key

    def _group(self, exchange: Exchange, key: str, round_index: int) -> list[int]:
        """``exchange.group``, noting that the group was agreed (``MixResult.grouped``) or that its leader never
        decided (``leaderless``)."""
        try:
            members = exchange.group(key, round_index)
        except NoDecision:
            self._leaderless = True
            raise
        self._grouped = True
        return members

    def _failed(self) -> None:
        """The exchange failed (or gave non-finite values): forget what depended on it succeeding."""

    def start_reference(self, dicts: Sequence[TensorDict]) -> None:
        """The state every worker starts from (x_0, zero momentum): a compressed mean's first reference."""

    def forget_reference(self) -> None:
        """This worker's state came from elsewhere (a download): its next compressed mean sends fp32."""

    def _combine_compressed(self, flat: torch.Tensor, dicts: list[TensorDict], round_index: int, exchange: Exchange,
                            weight: float | None) -> tuple[torch.Tensor, int | None, torch.Tensor | None, int, float | None]:
        """``_combine`` with ``self.codec`` (weighted with ``weight``): also the residual, the bytes sent and this
        peer's weight after the mix. Adds the residual to ``flat`` itself (``_prepare_compressed``)."""
        raise NotImplementedError(f"{self.kind} mixing sends nothing to compress")

    def _combine_robust(self, flat: torch.Tensor, dicts: list[TensorDict], round_index: int, exchange: Exchange,
                        weight: float | None) -> tuple[torch.Tensor, int | None, torch.Tensor | None, int, float | None]:
        """``_combine_compressed``'s contract, robustly (``self.robust``). Default: identity."""
        return flat, None, None, 0, weight


class IdentityMix(Mixer):
    kind = "identity"

    def __init__(self, label: str, names: Sequence[str] = (), seed: int = 0, codec: Codec | None = None,
                 error_feedback: bool = False, feedback_decay: float = 1.0, key_suffix: str = ""):
        super().__init__(label, [], seed)  # mixes nothing, so packs nothing

    def _combine(self, flat, round_index, exchange):
        return flat, None, 0

    def _combine_compressed(self, flat, dicts, round_index, exchange, weight):
        return flat, None, None, 0, weight


class GlobalMix(Mixer):
    """The group's mean. With a codec and no error feedback (Mix1: parameters, which must not be rounded)
    it compresses the difference from a **reference** every member holds: the previous compressed mean.

    The reference is the result of the last successful mix, identical in every member that had it; it
    is named by a tag (a digest of that mix's round and members) the exchange checks, so a member with
    another one (a newcomer, a peer that caught up, one whose last mix failed while the others' did not)
    fails the exchange at its first chunk. Every member whose mix failed drops its reference and sends
    its next one uncompressed (fp32, tag 0) through the same two-phase exchange; the others fail that one
    too and drop theirs, so at most two mixes after a disagreement every member sends fp32, gets the
    exact mean, and holds it as the new common reference: a change of membership costs one failed Mix1
    and one fp32 Mix1, never a deadline. The first reference is x_0, where every worker starts
    (``start_reference``); a worker that downloads its state has none (``forget_reference``). In a swarm split
    into groups (``protocol.groups``) the groups change every round, so a reference is only used by a group of
    exactly the members that made it (x_0 by any group): otherwise every member sends fp32, as every one of them
    sees the group differ from its reference's, and nothing fails. A worker alone in its group drops its reference
    (its next group-mates have moved on from it)."""

    kind = "global"

    def __init__(self, label: str, names: Sequence[str], seed: int, codec: Codec | None = None,
                 error_feedback: bool = False, feedback_decay: float = 1.0, key_suffix: str = ""):
        super().__init__(label, names, seed, codec, error_feedback, feedback_decay, key_suffix)
        self.referenced = self.codec is not None and not self.error_feedback
        self.reference: torch.Tensor | None = None
        """The last successful mean (packed), or None: the next mix sends fp32."""
        self.reference_tag = 0
        self.reference_members: list[int] | None = None
        """The members whose mean ``reference`` is (sorted); None: x_0, every worker's."""

    def _failed(self) -> None:
        self.reference, self.reference_tag, self.reference_members = None, 0, None

    def start_reference(self, dicts: Sequence[TensorDict]) -> None:
        if self.referenced:
            self.reference, self.reference_tag = pack(list(dicts), self.names), INITIAL_REFERENCE
            self.reference_members = None

    def _reference_for(self, flat: torch.Tensor, members: Sequence[int]) -> torch.Tensor | None:
        """The reference this mix compresses against, or None (send fp32): one of the right size, made by exactly
        these members (or x_0)."""
        ref = self.reference
        if ref is None or ref.numel() != flat.numel():
            return None
        if self.reference_members is not None and self.reference_members != sorted(members):
            return None
        return ref

    def _keep_reference(self, mean: torch.Tensor, round_index: int, members: Sequence[int],
                        into: torch.Tensor | None = None) -> None:
        self.reference = mean.clone() if into is None else into.copy_(mean)
        self.reference_tag, self.reference_members = reference_tag(round_index, members), sorted(members)

    def forget_reference(self) -> None:
        self._failed()

    def reference_state(self) -> tuple[torch.Tensor, int, list[int] | None] | None:
        """What a checkpoint keeps of the reference: (the packed mean, its tag, the members that made it or None
        for x_0), or None when the next mix sends fp32."""
        if self.reference is None:
            return None
        return self.reference, self.reference_tag, self.reference_members

    def restore_reference(self, reference: torch.Tensor, tag: int, members: Sequence[int] | None) -> None:
        """Hold ``reference_state``'s reference again (a resumed worker): used by a group of exactly ``members``
        (any group for x_0, ``members`` None)."""
        self.reference, self.reference_tag = reference, tag
        self.reference_members = sorted(members) if members is not None else None

    def _combine(self, flat, round_index, exchange):
        key = self.key(round_index)
        members = self._group(exchange, key, round_index)
        if len(members) <= 1:
            return flat, None, 0
        # ``flat`` is this call's own packed copy: the exchange may reduce in it (no second buffer).
        sent = 2 * (len(members) - 1) * flat.numel() * 4 // len(members)  # a ring's share of the payload
        return exchange.all_reduce_mean(key, flat, members, inplace=True), None, sent

    def _combine_weighted(self, flat, weight, round_index, exchange):
        key = self.key(round_index)
        members = self._group(exchange, key, round_index)
        if len(members) <= 1:
            return flat, None, 0, weight
        mean, mean_weight = weighted_all_reduce(key, flat, weight, members, exchange)
        return mean, None, 2 * (len(members) - 1) * (flat.numel() + 1) * 4 // len(members), mean_weight

    def _alone(self) -> None:
        """This worker's group is itself: it mixes nothing, and holds no reference its next group shares (its
        group-mates there moved on from x_0 or from the group that made its reference): fp32 next time."""
        if self.referenced:
            self._failed()

    def _combine_compressed(self, flat, dicts, round_index, exchange, weight):
        key = self.key(round_index)
        members = self._group(exchange, key, round_index)
        if len(members) <= 1:
            self._alone()
            return flat, None, None, 0, weight
        scale, new_weight, sent = 1.0, None, 0
        if weight is not None:
            (scale, new_weight), sent = group_scale(key, weight, members, exchange), 4 * (len(members) - 1)
        self._prepare_compressed(flat, dicts, scale)
        # ``flat`` is this call's own packed copy: the mean is written into it
        if not self.referenced:
            mean, residual, payload = group_mean(key, flat, members, exchange, self.codec, feedback=self.error_feedback,
                                                 inplace=True)
            return mean, None, residual, sent + payload, new_weight
        ref, tag = self._reference_for(flat, members), self.reference_tag
        self._failed()  # until this mix succeeds (``tag`` was read before: the exchange checks every member's)
        if ref is None:
            mean, _, payload = group_mean(key, flat, members, exchange, Float32Codec(), tag=0, inplace=True)
            ref = torch.empty_like(mean)
        else:  # weighted: s (z - ref) = s z - s ref, and the members' s average to 1, so the mean is wmean(z) - ref
            mean, _, payload = group_mean(key, flat.sub_(ref, alpha=scale), members, exchange, self.codec,
                                          tag=tag, inplace=True)
            mean.add_(ref)
        self._keep_reference(mean, round_index, members, into=ref)
        return mean, None, None, sent + payload, new_weight

    def _combine_robust(self, flat, dicts, round_index, exchange, weight):
        key = self.key(round_index)
        members = self._group(exchange, key, round_index)  # an excluded member still takes part, with weight 0
        if len(members) <= 1:
            self._alone()
            return flat, None, None, 0, weight
        codec = self.codec or Float32Codec()
        if self.error_feedback:
            self._prepare_compressed(flat, dicts, 1.0)
        ref = self._reference_for(flat, members) if self.referenced else None
        tag = self.reference_tag if ref is not None else 0
        if self.referenced:
            self._failed()  # until this mix succeeds
            if ref is None:
                codec = Float32Codec()
        anchor = self._anchor(flat)
        sent_v = flat if ref is None else flat - ref
        if ref is not None and anchor is not None:
            anchor = anchor - ref
        mean, new_weight, sent = robust_group_mean(key, sent_v, members, exchange, codec, self.robust.settings,
                                                   self.robust.ledger, round_index, weight=weight, tag=tag, anchor=anchor)
        if ref is not None:
            mean.add_(ref)
        residual = None
        if self.error_feedback:  # what encoding lost of what this member sent (not the owners' re-encoding)
            residual = flat - codec.roundtrip(flat)[1]
        if self.referenced:
            self._keep_reference(mean, round_index, members)
        self._remember(mean)
        return mean, None, residual, sent, new_weight


class GossipMix(Mixer):
    kind = "gossip"

    def __init__(self, label: str, names: Sequence[str], seed: int, codec: Codec | None = None,
                 error_feedback: bool = False, feedback_decay: float = 1.0, key_suffix: str = ""):
        super().__init__(label, names, seed, codec, error_feedback, feedback_decay, key_suffix)
        self.distances: deque[float] = deque(maxlen=16)
        """Robust gossip: the distances of this peer's last accepted partners (ClippedGossip's radius follows them)."""

    def _combine(self, flat, round_index, exchange):
        key = self.key(round_index)
        group = self._group(exchange, key, round_index)
        partner = pair_matching(self.seed, round_index, self.label, group).get(exchange.rank)
        if partner is None:
            return flat, None, 0
        # (a + b) / 2, computed identically on both sides (IEEE addition commutes), so the pair's sum is kept.
        # ``flat`` is this call's own packed copy: the exchange may average in it as the partner's chunks
        # arrive (a fresh receive buffer's pages cost more than the copy into them: ``bench/results/gossip-swap.md``).
        return exchange.swap_mean(key, partner, flat, inplace=True), partner, flat.numel() * 4

    def _combine_weighted(self, flat, weight, round_index, exchange):
        key = self.key(round_index)
        group = self._group(exchange, key, round_index)
        partner = pair_matching(self.seed, round_index, self.label, group).get(exchange.rank)
        if partner is None:
            return flat, None, 0, weight
        mean, pair_weight = push_sum_swap(key, partner, flat, weight, exchange)
        return mean, partner, (flat.numel() + 1) * 4, pair_weight

    def _combine_compressed(self, flat, dicts, round_index, exchange, weight):
        key = self.key(round_index)
        group = self._group(exchange, key, round_index)
        partner = pair_matching(self.seed, round_index, self.label, group).get(exchange.rank)
        if partner is None:
            return flat, None, None, 0, weight
        scale, new_weight, sent = 1.0, None, 0
        if weight is not None:
            (scale, new_weight), sent = pair_scale(key, weight, partner, exchange), 4
        self._prepare_compressed(flat, dicts, scale)
        mean, residual, payload = pair_mean(key, flat, partner, exchange, self.codec, self.error_feedback)
        return mean, partner, residual, sent + payload, new_weight

    def _combine_robust(self, flat, dicts, round_index, exchange, weight):
        """ClippedGossip (He, Karimireddy and Jaggi 2022): ``x + clip(x_partner - x, tau) / 2``, with ``tau`` following
        the honest spread: ``radius_factor`` times the median of this peer's last accepted partners' distances (until
        it has three: times its own move this round, from its last Mix1 result for parameters, from zero for a
        pseudo-gradient). A partner that sent non-finite values or whose move points against this peer's own (cosine
        below ``min_cosine``) fails the screen and is not mixed; one farther than ``outlier_factor`` such medians
        away fails it and is clipped. An excluded partner is swapped with (it is waiting) but not mixed. The token
        weight is left as it is (robust gossip takes the plain pair mean before clipping)."""
        key = self.key(round_index)
        group = self._group(exchange, key, round_index)
        partner = pair_matching(self.seed, round_index, self.label, group).get(exchange.rank)
        if partner is None:
            return flat, None, None, 0, weight
        codec = self.codec or Float32Codec()
        if self.error_feedback:
            self._prepare_compressed(flat, dicts, 1.0)
        payload, mine = codec.roundtrip(flat)
        got = exchange.swap(key, partner, payload)
        residual = flat - mine if self.error_feedback else None
        ledger, settings = self.robust.ledger, self.robust.settings
        if ledger.is_excluded(partner):
            return flat, partner, None, payload.numel(), weight
        try:
            theirs = codec.decode(got, flat.numel())
        except PeerFailed as exc:
            ledger.strike(round_index, partner, f"sent an unreadable payload ({exc})")
            return flat, partner, None, payload.numel(), weight
        diff = theirs.sub_(mine)
        distance = float(diff.norm())
        if distance != distance or distance == float("inf"):
            ledger.strike(round_index, partner, "non-finite values")
            return flat, partner, None, payload.numel(), weight
        typical = sorted(self.distances)[len(self.distances) // 2] if len(self.distances) >= 3 else None
        anchor = self._anchor(flat)
        own = mine if anchor is None else mine - anchor
        theirs_move = own + diff  # the partner's move from the same anchor
        cosine = float(own @ theirs_move) / max(float(own.norm()) * float(theirs_move.norm()), 1e-30)
        if cosine < settings.min_cosine:
            ledger.strike(round_index, partner, f"points against this peer's own update (cosine {cosine:.2f})")
            return flat, partner, None, payload.numel(), weight
        tau = settings.radius_factor * (typical if typical is not None else float(own.norm()))
        if typical is not None and distance > settings.outlier_factor * typical:
            ledger.strike(round_index, partner, f"{distance / typical:.1f}x the typical partner distance")
        else:
            self.distances.append(distance)
        scale = 1.0 if distance <= tau or tau == 0.0 else tau / distance
        mixed = mine + diff.mul_(scale / 2)
        self._remember(mixed)
        return mixed, partner, residual, payload.numel(), weight


MIXERS: dict[str, type[Mixer]] = {"identity": IdentityMix, "global": GlobalMix, "gossip": GossipMix}


def build_mixer(kind: str, label: str, names: Sequence[str], seed: int, codec: Codec | None = None,
                error_feedback: bool = False, feedback_decay: float = 1.0, key_suffix: str = "") -> Mixer:
    return MIXERS[kind](label, names, seed, codec, error_feedback, feedback_decay, key_suffix)
