"""``CompanionExchange``: the trainer's handle on a peer's exchange that runs in a companion process.

It takes ``ZmqExchange``'s arguments, starts the companion (``host.main``, spawned: a fresh interpreter that
imports the transport, not the trainer's model) and answers what the runtime asks of an exchange by calling the
companion (``channel``): the collectives (their tensors cross in shared memory: ``all_reduce_mean(inplace=True)``
reduces in the caller's own buffer, which the call moves into shared memory), membership, paths, the lifecycle
programs and the counters. The trainer's threads only wait on the pipe meanwhile, so a Mix1 in flight costs the
training thread no turn of the interpreter.

Lifetimes are tied both ways. The companion exits when the trainer's end of its pipe closes, which the kernel
does when the trainer dies, however it dies (``host``). When the companion dies (killed, crashed), every call in
progress and every later one raises ``CompanionDied`` (an ``ExchangeBroken``: the peer stops with it, the cause
and the companion's exit code in the message), and the loss is logged at once. A call that gets no answer within
its bound (the exchange's own deadlines plus a margin) raises it too: a frozen companion is as good as dead.
Start-up failures (a port taken) are raised by the constructor as ``ZmqExchange`` raises them.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.multiprocessing

from gossiploco.companion import host
from gossiploco.companion.channel import Channel
from gossiploco.companion.vectors import SharedVectors
from gossiploco.errors import CompanionDied
from gossiploco.mixing.exchange import Exchange
from gossiploco.protocol import lifecycle
from gossiploco.reach.paths import PathControl
from gossiploco.transport.zmq_service import StateProvider

log = logging.getLogger(__name__)

STARTUP_S = 120.0
"""How long the companion may take to start (a fresh interpreter importing torch and binding its sockets)."""
QUICK_S = 60.0
"""Bound on a call that does no exchange (counters, membership, paths)."""
CLOSE_S = 10.0
"""How long ``close`` waits for the companion to exit before killing it."""


def _counter(name: str) -> property:
    """A read-only property: the companion's exchange's counter ``name`` (as it ended, once closed)."""
    return property(lambda self: self._get(name), doc=f"The companion's exchange's ``{name}``.")


class RemoteDeadlines:
    """The companion's ``AdaptiveDeadlines`` as the checkpoint sees them: ``state()`` and ``load_state``."""

    def __init__(self, channel: Channel):
        self._channel = channel

    def state(self) -> dict:
        return self._channel.call("deadlines_state", timeout_s=QUICK_S)

    def load_state(self, state: dict) -> None:
        self._channel.call("load_deadlines", state, timeout_s=QUICK_S)


class CompanionExchange(Exchange, PathControl):
    """A ``ZmqExchange`` in a companion process; see the module docstring. Same arguments as ``ZmqExchange``
    (by name). Every public method is thread-safe."""

    def __init__(self, niceness: int = 0, **kwargs):
        """``niceness``: the companion's scheduling niceness above its trainer's (``host.main``)."""
        self.rank: int = kwargs["rank"]
        self.timeout_s: float = kwargs["timeout_s"]
        self._grace_s: float = kwargs.get("grace_s", 10.0)
        self._provider: StateProvider | None = None
        self._vectors = SharedVectors()
        self._final: dict | None = None
        """The counters as the exchange closed (``close``/``leave``): what a summary reads afterwards."""
        ctx = torch.multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        self._process = ctx.Process(target=host.main, name=f"companion-{self.rank}", daemon=True,
                                    args=(theirs, kwargs, logging.getLogger().getEffectiveLevel(), niceness))
        self._process.start()
        theirs.close()  # the companion holds the only other end: its death closes the pipe
        try:
            if not mine.poll(STARTUP_S):
                raise CompanionDied(f"rank {self.rank}: the companion process did not start within {STARTUP_S:g} s")
            kind, value = mine.recv()
        except (EOFError, OSError):
            self._process.join(CLOSE_S)
            raise CompanionDied(f"rank {self.rank}: the companion process exited while starting "
                                f"(exit code {self._process.exitcode})") from None
        except CompanionDied:
            self._process.kill()
            raise
        if kind == "failed":
            self._process.join(CLOSE_S)
            raise value
        self.pid: int = value["pid"]
        self.endpoints: dict[int, str] = value["endpoints"]
        """Each known peer's address, as at start (this peer's own is what others reach it at)."""
        self._bound: str = value["bound"]
        self._channel = Channel(mine, self._handle, f"trainer-{self.rank}", on_lost=self._lost)
        self.deadlines = RemoteDeadlines(self._channel)
        # A trainer that exits without closing this exchange closes the pipe first: multiprocessing's own exit
        # handler (registered before, so run after this one) waits for the companion, which ends at the pipe's end.
        atexit.register(self._channel.close, "the trainer exited")

    # -- calls ---------------------------------------------------------------------------------------

    def _collective_s(self) -> float:
        """Bound on a collective's answer: its agreement (two grace windows and a control send) and the longest
        exchange deadline, twice, plus a minute: only a companion that stopped answering exceeds it."""
        return 2 * (2 * self._grace_s + 1.0 + self.timeout_s) + 60.0

    def _call(self, name: str, *args, timeout_s: float | None = QUICK_S, **kwargs):
        return self._channel.call(name, *args, timeout_s=timeout_s, **kwargs)

    def _get(self, name: str):
        if self._final is not None:  # closed: the counters as they ended
            return self._final[name]
        return self._channel.call("get", name, timeout_s=QUICK_S)

    def _handle(self, name: str, args: tuple, kwargs: dict):
        """The companion's calls: only the state a catching-up peer downloads from this one."""
        if name != "provide_state":
            raise AttributeError(f"the trainer does not serve {name!r}")
        return self._provider() if self._provider is not None else None

    def _lost(self, why: str) -> None:
        self._process.join(1.0)
        log.error("rank %d: the companion process (pid %d) is gone (exit code %s): %s; this peer stops", self.rank,
                  self.pid, self._process.exitcode, why)

    @property
    def alive(self) -> bool:
        """Whether the companion process runs and its channel is up."""
        return self._channel.why is None and self._process.is_alive()

    # -- the Exchange interface -----------------------------------------------------------------------

    def members(self, round_index: int | None = None) -> list[int]:
        return self._call("members", round_index)

    def group(self, key: str, round_index: int) -> list[int]:
        return self._call("group", key, round_index, timeout_s=self._collective_s())

    def link_ahead(self, key: str, round_index: int) -> None:
        self._call("link_ahead", key, round_index)

    def completed(self, key: str) -> None:
        self._call("completed", key)

    def all_reduce_mean(self, key: str, flat: torch.Tensor, members: Sequence[int], *,
                        inplace: bool = False) -> torch.Tensor:
        sent = self._vectors.shared(flat.detach())  # ``flat`` itself when it is a vector from ``vector``
        result = self._call("all_reduce_mean", key, self._vectors.wire(sent), list(members), inplace=inplace,
                            timeout_s=self._collective_s())
        # None: reduced in place, in the shared vector sent. Then a view of it, as ``ZmqExchange`` returns (a new
        # tensor object: a mixer takes ``flat`` itself back as "nothing was exchanged")
        return sent.view(flat.shape) if result is None else result

    def vector(self, numel: int, device: torch.device | None = None) -> torch.Tensor:
        """An fp32 vector in shared memory, reused once nothing holds it (``vectors``): given to the companion it
        is neither copied nor sent again (a ``Ref`` names it). Page-locked too for a GPU ``device``."""
        return self._vectors.take(numel, device=device)

    def swap(self, key: str, partner: int, flat: torch.Tensor) -> torch.Tensor:
        sent = self._vectors.wire(self._vectors.shared(flat.detach()))
        return self._call("swap", key, partner, sent, timeout_s=self._collective_s())

    def swap_mean(self, key: str, partner: int, flat: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        sent = self._vectors.shared(flat.detach())
        result = self._call("swap_mean", key, partner, self._vectors.wire(sent), inplace=inplace,
                            timeout_s=self._collective_s())
        return sent.view(flat.shape) if result is None else result  # None: averaged in the shared vector sent

    def all_to_all(self, key: str, parts: Mapping[int, torch.Tensor], members: Sequence[int],
                   sizes: Mapping[int, int], tag: int = 0) -> dict[int, torch.Tensor]:
        shared: dict[int, torch.Tensor] = {}  # one copy of a tensor given for several members (an all-gather)
        for t in parts.values():
            if id(t) not in shared:
                shared[id(t)] = self._vectors.shared(t.detach())
        wire = {p: self._vectors.wire(shared[id(t)]) for p, t in parts.items()}
        return self._call("all_to_all", key, wire, list(members), dict(sizes), tag, timeout_s=self._collective_s())

    def fetch_state(self, peer: int) -> tuple[int, torch.Tensor]:
        return self._call("fetch_state", peer, timeout_s=self._collective_s())

    def serve_state(self, provider: StateProvider) -> None:
        """Answer other peers' state downloads with ``provider()``, called here when the companion asks."""
        self._provider = provider
        self._call("serve_state")

    def close(self, linger_s: float = 0.0) -> None:
        """Close the companion's exchange, then the companion (killed if it does not exit within ``CLOSE_S``)."""
        self._shut("close", linger_s)

    def leave(self, linger_s: float = 0.5) -> None:
        """Leave gracefully (``ZmqExchange.leave``), then end the companion."""
        self._shut("leave", linger_s)

    def _shut(self, how: str, linger_s: float) -> None:
        if self._channel.why is None:
            try:
                self._final = self._call("shut", how, linger_s, timeout_s=QUICK_S + linger_s)
            except CompanionDied:
                pass
        self._channel.close("the trainer closed the exchange")
        atexit.unregister(self._channel.close)
        self._vectors.release()
        self._process.join(CLOSE_S)
        if self._process.is_alive():
            log.error("rank %d: the companion process (pid %d) did not exit within %g s; killing it", self.rank,
                      self.pid, CLOSE_S)
            self._process.kill()
            self._process.join(CLOSE_S)

    # -- the lifecycle (``ZmqExchange.join_swarm`` and ``catch_up_if_behind``) --------------------------

    def _lifecycle_s(self, life: lifecycle.Settings) -> float:
        return life.connect_s + 2 * life.hello_s + life.boundary_s + 2 * life.state_s + self._collective_s()

    def join_swarm(self, life: lifecycle.Settings, start_round: int, quorum: int,
                   quorum_until: float | None) -> lifecycle.Position:
        extra = 0.0 if quorum_until is None else max(0.0, quorum_until - time.monotonic())
        return self._call("join_swarm", life, start_round, quorum, quorum_until,
                          timeout_s=self._lifecycle_s(life) + extra)

    def catch_up_if_behind(self, life: lifecycle.Settings, r: int) -> lifecycle.Position:
        return self._call("catch_up_if_behind", life, r, timeout_s=self._lifecycle_s(life))

    def is_closed(self) -> bool:
        return self._channel.why is not None or self._call("is_closed")

    # -- discovery and paths (``PathControl``) -----------------------------------------------------------

    def add_peer(self, peer: int, endpoint: str, key: bytes | None = None, *, listen: bool = False,
                 relayed: bool = False, joined: int | None = None) -> bool:
        return self._call("add_peer", peer, endpoint, key, listen=listen, relayed=relayed, joined=joined)

    def forget_peer(self, peer: int) -> bool:
        return self._call("forget_peer", peer)

    def connected(self) -> list[int]:
        return self._call("connected")

    def set_behind_nat(self, peers: set[int], order_rings: bool = True) -> None:
        self._call("set_behind_nat", set(peers), order_rings)

    def reverse_offers(self) -> tuple[tuple[int, int, int], ...]:
        return self._call("reverse_offers")

    def dial_reverse(self, peer: int, endpoints: Sequence[str]) -> bool:
        return self._call("dial_reverse", peer, list(endpoints))

    def set_grouping(self, seed: int, size: int, paired: Collection[str] = (), run_again: Collection[str] = ()) -> None:
        self._call("set_grouping", seed, size, sorted(paired), sorted(run_again))

    def wait_connected(self, timeout_s: float) -> bool:
        return self._call("wait_connected", timeout_s, timeout_s=QUICK_S + timeout_s)

    def check_reachable(self, timeout_s: float) -> bool:
        return self._call("check_reachable", timeout_s, timeout_s=QUICK_S + timeout_s)

    @property
    def bound(self) -> str:
        return self._bound

    # -- counters --------------------------------------------------------------------------------------

    @property
    def current_round(self) -> int:
        return self._get("current_round")

    @current_round.setter
    def current_round(self, value: int) -> None:
        self._call("set_round", int(value))

    @property
    def round_ends(self) -> tuple[int, float] | None:
        return self._get("round_ends")

    @round_ends.setter
    def round_ends(self, value: tuple[int, float] | None) -> None:  # time.monotonic() is the machine's: both processes'
        self._call("set_round_ends", None if value is None else (int(value[0]), float(value[1])))

    bytes_sent = _counter("bytes_sent")
    wire_bytes_sent = _counter("wire_bytes_sent")
    bytes_received = _counter("bytes_received")
    dropped_messages = _counter("dropped_messages")
    unencodable_messages = _counter("unencodable_messages")
    malformed_messages = _counter("malformed_messages")
    isolated_mixes = _counter("isolated_mixes")
    joined_round = _counter("joined_round")

    def security_counts(self) -> dict[str, dict[str, int]]:
        return self._final["security_counts"] if self._final is not None else self._call("security_counts")

    def sealed_counts(self) -> dict[str, object]:
        return self._final["sealed_counts"] if self._final is not None else self._call("sealed_counts")

    def protocol_state(self) -> dict[str, int]:
        return self._call("protocol_state")
