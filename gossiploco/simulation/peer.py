"""A virtual peer: the real protocol (``PeerNode`` and its calls) run by cooperative tasks in virtual time.

Tasks are generators that yield what they wait for: ``("wait", t)`` (until the node changes or
time ``t``), ``("sleep", t)`` (until time ``t``: inner steps) or ``("join", task)`` (until that task
ends: Mix2 waiting for Mix1). ``run_call`` is the event-driven twin of ``protocol.call.run_call``:
the same ``start``/``poll``/``feed``/``fail`` steps, resumed whenever the node changes; ``drive`` is the
twin of ``protocol.lifecycle.drive``: the runtime's own join and catch-up programs, run unchanged.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from gossiploco.errors import ExchangeError, ExchangeTimeout, PeerFailed
from gossiploco.mixing.again import RunAgain
from gossiploco.protocol import lifecycle
from gossiploco.protocol.call import Call
from gossiploco.protocol.collectives import state_chunks
from gossiploco.protocol.messages import Data, Send, ServeState
from gossiploco.protocol.node import PeerNode

if TYPE_CHECKING:
    from gossiploco.simulation.swarm import SimSwarm


class Task:
    """One cooperative task of a peer; see the module docstring."""

    def __init__(self, peer: SimPeer, gen: Generator, name: str):
        self.peer, self.gen, self.name = peer, gen, name
        self.done, self.result, self.error = False, None, None
        self.waiting = False  # resumes on node changes
        self.token = 0
        self.joiners: list[Task] = []
        self.armed_at: float | None = None
        """When this task's pending wait timer fires (None: none pending): a task woken by an event and waiting again
        until the same time reuses it rather than queueing one more (at 1,000 peers the stale timers were most of
        the event queue)."""

    def resume(self, value: Any = None) -> None:
        self.waiting = False
        self.token += 1
        try:
            what = self.gen.send(value)
        except StopIteration as stop:
            self._finish(stop.value, None)
            return
        except ExchangeError as exc:  # noqa: PERF203 - a task that ends in an error hands it to its joiner
            self._finish(None, exc)
            return
        kind, arg = what
        net, token = self.peer.swarm.net, self.token
        if kind == "wait":
            self.waiting = True
            if self.armed_at != arg:
                self.armed_at = arg
                net.at(arg, lambda: self._wait_over(arg))
        elif kind == "sleep":
            net.at(arg, lambda: self._timer(token))
        elif kind == "join":
            if arg.done:
                net.at(net.now, lambda: self._timer(token))
            else:
                arg.joiners.append(self)
        else:
            raise ValueError(f"unknown wait {kind!r}")

    def _wait_over(self, at: float) -> None:
        """The wait timer armed for ``at`` fired: it ends the task's current wait if that wait is still until ``at``."""
        if self.armed_at != at:
            return  # a later wait re-armed for another time: that timer ends it
        self.armed_at = None
        if self.waiting:
            self._timer(self.token)

    def _timer(self, token: int) -> None:
        if token == self.token and not self.done and self.peer.running:
            if self.peer.frozen:
                self.peer.held.append(lambda: self._timer(token))
            else:
                self.resume()

    def _finish(self, result, error) -> None:
        self.done, self.result, self.error = True, result, error
        for joiner in self.joiners:
            token = joiner.token
            self.peer.swarm.net.at(self.peer.swarm.net.now, lambda j=joiner, t=token: j._timer(t))


class SimPeer:
    """One incarnation of a virtual peer (a restart makes a new one with the same id)."""

    def __init__(self, swarm: SimSwarm, pid: int, incarnation: int, join_round: int | None,
                 records: dict[int, int] | None = None):
        """``records``: each other peer's join round as the run's directory says (``PeerRecord.joined``): the peer
        knows nobody else and finds them there, as a restarted runtime peer does (``SimSwarm.records``); None: it knows
        every id from the start, each a member from round 0 (a static list)."""
        self.swarm, self.pid, self.incarnation = swarm, pid, incarnation
        s = swarm.settings
        self.node = PeerNode(pid, swarm.ids if records is None else [], grace_s=s.grace_s, chunk_elems=s.chunk_elems,
                             mailbox_bytes=s.mailbox_bytes, join_round=join_round,
                             links_on_demand=bool(s.links_idle_s))
        self.reads_records = records is not None
        for other, joined in sorted((records or {}).items()):
            self.node.add_peer(other, joined)
        self.node.behind_nat = set(s.behind_nat)  # as peers' records tell the runtime's node
        self.node.group_seed, self.node.group_size = swarm.seed, s.group_size  # as ZmqExchange.set_grouping does
        self.node.paired = frozenset({"mix2"} if s.mix2 == "gossip" and s.pairing == "ready" else ())
        self.node.declines.labels = frozenset({"mix1"} if s.mix1_again else ())
        self.running, self.frozen = True, False
        self.thawed_at = -1.0
        """When this peer last resumed after a freeze (its own waits overran while it was stopped)."""
        self.held: list = []  # what arrived or fired while frozen
        self.tasks: list[Task] = []
        self.snapshot: tuple[int, Any] | None = None
        self.mix1_again = RunAgain(s.mix1_again, s.grace_s)

    @property
    def now(self) -> float:
        return self.swarm.net.now

    def spawn(self, gen: Generator, name: str) -> Task:
        task = Task(self, gen, name)
        self.tasks.append(task)
        self.swarm.net.at(self.now, lambda: task.resume() if self.running and not task.done else None)
        return task

    # -- events from the network ----------------------------------------------------------------

    def event(self, handle) -> None:
        """Run ``handle(node) -> actions`` now (or on resume if frozen), then wake the waiting tasks."""
        if not self.running:
            return
        if self.frozen:
            self.held.append(lambda: self.event(handle))
            return
        self.act(handle(self.node))
        for task in list(self.tasks):
            if task.waiting and not task.done:
                task.resume()

    def act(self, actions) -> None:
        for action in actions:
            if isinstance(action, ServeState):
                for chunk in state_chunks(action.nonce, self.snapshot, self.node.chunk_elems):
                    self.swarm.transmit(self.pid, Send(action.peer, chunk))
            else:
                self.swarm.transmit(self.pid, action)

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False
        self.thawed_at = self.now
        held, self.held = self.held, []
        for fn in held:
            fn()

    def crash(self) -> None:
        self.running = False
        self.tasks.clear()

    # -- running the protocol's programs ---------------------------------------------------------

    def drive(self, program: lifecycle.Program) -> Generator[tuple, Any, Any]:
        """The event-driven twin of ``protocol.lifecycle.drive``: the same lifecycle programs, in virtual time."""
        value: Any = None
        error: ExchangeError | None = None
        while True:
            done, effect = lifecycle.advance(program, value, error)
            if done:
                return effect
            error = None
            if isinstance(effect, lifecycle.Run):
                try:
                    value = yield from self.run_call(effect.call)
                except ExchangeError as exc:
                    error = exc
                continue
            if isinstance(effect, lifecycle.Act):
                self.act(effect.actions)
            elif isinstance(effect, lifecycle.Wait):
                yield ("wait", effect.until)
            elif isinstance(effect, lifecycle.Sleep):
                yield ("sleep", effect.until)
            value = self.now


    def run_call(self, call: Call) -> Generator[tuple, Any, Any]:
        """The event-driven twin of ``protocol.call.run_call``."""
        node = self.node
        self.act(call.start(node))
        began = self.now
        while True:
            step = call.poll(node, self.now)
            if step.wait_until is not None:
                self.act(step.sends)
                yield ("wait", step.wait_until)
                continue
            if step.error is not None:
                self.act(step.sends)
                self.swarm.checker.call_ended(self, call, began, self.now, ok=False)
                raise step.error
            if step.done:
                self.act(step.sends)
                outcome = call.outcome()
                self.swarm.checker.call_ended(self, call, began, self.now, ok=True)
                return outcome
            try:
                self.act(call.feed(step.mail))
            except (PeerFailed, ExchangeTimeout) as exc:
                self.act(call.fail(node, exc))
                self.swarm.checker.call_ended(self, call, began, self.now, ok=False)
                raise


def payload_bytes(send: Send) -> int:
    message = send.message
    return 64 + (message.data.numel() * message.data.element_size() if isinstance(message, Data) else 0)
