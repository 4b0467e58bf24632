"""Where a network peer's exchange runs: on threads of the training process (``ZmqExchange``) or in a companion
process (``CompanionExchange``; ``compute.companion``), built here with the peer's settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gossiploco.companion.exchange import CompanionExchange
from gossiploco.config import RunConfig
from gossiploco.security.trust import Trust
from gossiploco.transport.deadlines import AdaptiveDeadlines
from gossiploco.transport.fault_injection import SendHook
from gossiploco.transport.zmq_exchange import ZmqExchange

MAILBOX_SLACK_BYTES = 64 << 20
"""Mailbox room beyond four models' worth of early chunks (monitors, small models)."""


def uses_companion(cfg: RunConfig) -> bool:
    """``compute.companion``: on; off; or auto, which is off for now on every device. The companion has been
    measured on CPUs only (``bench/results/overlap-fp32.md``); on CUDA the packed vectors are page-locked, so they
    are copied into shared memory at each call (not yet registered in place), which no GPU run has measured."""
    return cfg.compute.companion == "on"


def open_exchange(cfg: RunConfig, rank: int, known: Sequence[str] | Mapping[int, str], run_id: str, *,
                  model_bytes: int, companion: bool, bind: str | None, trust: Trust | None, fault: SendHook | None,
                  sealed_port: int) -> ZmqExchange | CompanionExchange:
    """The peer's exchange (its join round decided later, by ``peer_join``). Early chunks: a partner ahead of this
    peer may send its Mix2 of this round, its Mix1 of the next and a monitor average before this peer starts any
    (measured: one model's worth was not enough), and the partners may differ; the mailbox holds that, plus room
    for small exchanges. ``sealed_port``: -1 for none, else 0-65535 (0: any free port)."""
    t = cfg.timeouts
    chunk = int(cfg.transport.chunk_mb * (1 << 20)) // 4 * 4
    settings = dict(
        rank=rank, endpoints=known, run_id=run_id, timeout_s=t.exchange_s, grace_s=t.grace_s,
        deadlines=AdaptiveDeadlines(t.exchange_s, min_s=t.min_exchange_s, factor=t.adaptive_factor),
        max_message_bytes=int(cfg.transport.max_message_mb * (1 << 20)), chunk_bytes=chunk, bind=bind,
        join_round=None, heartbeat_s=t.heartbeat_s, trust=trust, mailbox_bytes=4 * model_bytes + MAILBOX_SLACK_BYTES,
        sender_mailbox_bytes=3 * model_bytes + 2 * chunk, fault=fault,
        sealed_port=None if sealed_port == -1 else sealed_port, links_idle_s=cfg.transport.links_idle_s,
        links_cap=cfg.transport.links_kept(cfg.groups.size))
    if companion:
        return CompanionExchange(niceness=cfg.compute.companion_niceness, **settings)
    return ZmqExchange(**settings)
