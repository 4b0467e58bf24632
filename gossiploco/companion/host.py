"""The companion process: it runs one peer's ``ZmqExchange`` and answers its trainer's calls (``channel``).

``main`` is the process's body (started by ``CompanionExchange`` with the spawn method: a fresh interpreter, no
copy of the trainer's model). It builds the exchange from the trainer's arguments, says ``("ready", facts)`` or
``("failed", exception)`` on the pipe, then serves calls until the trainer's end of the pipe closes: when the
trainer closes it after ``leave``/``close``, or when the trainer process dies, however it dies (its end is closed
by the kernel). Either way the companion closes its exchange (its peers see the connection drop, as they would
see the trainer's) and exits: it never outlives its trainer. It ignores SIGINT and SIGTERM: a Ctrl+C or a stop sent
to the process group is the trainer's to handle (it leaves the swarm gracefully through this exchange, then closes
it); a trainer that cannot close it kills it (``CompanionExchange.close``).

Only the names in ``CALLS`` can be called (the exchange's public interface the runtime uses), ``COUNTERS`` read
(properties) and ``current_round`` set; ``shut`` leaves or closes the exchange and returns its final counters. ``serve_state`` takes no argument here: the state provider is the
trainer's, and a state request is answered by calling ``provide_state`` on the trainer's side of the channel.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing.connection import Connection

from gossiploco.companion.channel import Channel
from gossiploco.companion.vectors import Registry
from gossiploco.transport.zmq_exchange import ZmqExchange

log = logging.getLogger(__name__)

CALLS = frozenset({
    "members", "group", "all_reduce_mean", "swap", "swap_mean", "all_to_all", "fetch_state", "add_peer",
    "forget_peer", "set_grouping", "set_behind_nat", "dial_reverse", "reverse_offers", "connected", "wait_connected",
    "check_reachable", "protocol_state", "security_counts", "sealed_counts", "join_swarm", "catch_up_if_behind",
    "is_closed", "deadlines_state", "load_deadlines", "link_ahead", "completed"})
"""Methods of ``ZmqExchange`` the trainer calls (``CompanionExchange``)."""
IN_PLACE = {"all_reduce_mean": 1, "swap_mean": 2}
"""The collectives that may leave their result in the vector they were given, and where that vector is among their
arguments: when they did, in the trainer's shared vector, nothing is sent back."""
COUNTERS = ("current_round", "round_ends", "bytes_sent", "wire_bytes_sent", "dropped_messages",
            "unencodable_messages", "bytes_received", "malformed_messages", "isolated_mixes", "joined_round")
"""The properties the trainer reads (``("get", name)``), and still reads after the exchange closed (``shut``
returns them)."""


def lower_priority(niceness: int) -> None:
    """Add ``niceness`` to every thread of this process (Linux schedules threads: a thread made before this, by an
    import, keeps its own); the threads made afterwards inherit their maker's."""
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + niceness, 19)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only, which the exchange's threads inherit it from
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def main(conn: Connection, kwargs: dict, log_level: int, niceness: int = 0) -> None:
    """The companion's body: build the exchange (``ZmqExchange(**kwargs)``), serve its trainer, exit with it.
    ``niceness``: added to the scheduling niceness of every thread of this process before the exchange starts its own
    (``lower_priority``), so that where training and communication share cores, a core goes to training first
    (``compute.companion_niceness``)."""
    # Ctrl+C reaches the whole process group, this process too: the trainer handles it (it leaves gracefully and
    # closes this exchange), so the companion must not die of it first; likewise a SIGTERM to the group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [companion]: %(message)s")
    if niceness:
        lower_priority(niceness)
    try:
        exchange = ZmqExchange(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - the trainer raises it, with its own traceback
        conn.send(("failed", exc))
        return
    conn.send(("ready", {"pid": os.getpid(), "bound": exchange.bound, "endpoints": dict(exchange.endpoints)}))
    gone = threading.Event()
    vectors = Registry()
    channel: Channel | None = None

    def provide_state():
        return channel.call("provide_state")

    def handle(name: str, args: tuple, kwargs: dict):
        if name == "get" and len(args) == 1 and args[0] in COUNTERS:
            return getattr(exchange, args[0])
        if name == "set_round":
            exchange.current_round = int(args[0])
            return None
        if name == "set_round_ends":
            exchange.round_ends = None if args[0] is None else (int(args[0][0]), float(args[0][1]))
            return None
        if name == "shut":  # leave or close, then the counters as they end (the trainer's summary reads them later)
            how, linger_s = args
            if how not in ("leave", "close"):
                raise AttributeError(f"the companion's exchange does not shut by {how!r}")
            getattr(exchange, how)(linger_s=linger_s)
            return {**{counter: getattr(exchange, counter) for counter in COUNTERS},
                    "security_counts": exchange.security_counts(), "sealed_counts": exchange.sealed_counts()}
        if name == "serve_state":
            exchange.serve_state(provide_state)
            return None
        if name not in CALLS:
            raise AttributeError(f"the companion's exchange does not serve {name!r}")
        args = tuple({k: vectors.resolve(v) for k, v in a.items()} if isinstance(a, dict) else vectors.resolve(a)
                     for a in args)  # the trainer's shared vectors, named or sent once (``vectors``)
        result = getattr(exchange, name)(*args, **kwargs)
        given = args[IN_PLACE[name]] if name in IN_PLACE else None
        if given is not None and result.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
            return None  # reduced in the trainer's own (shared) vector: nothing to send back
        return result

    channel = Channel(conn, handle, f"companion-{kwargs.get('rank')}", on_lost=lambda why: gone.set())
    gone.wait()
    log.debug("rank %s: %s; closing the exchange", kwargs.get("rank"), channel.why)
    exchange.close()
    channel.close()
