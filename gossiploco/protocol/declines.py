"""A peer that completed an exchange takes no part in it run again (``keys.again_key``), and says so.

A global Mix1 whose ring lost a member mid-exchange runs again among its group's survivors
(``mixing.again``), under ``mix1/r/again``, whose leader is drawn anew. A member that completed the first
attempt (every chunk it needed came before the crash) holds the group's mean already and runs no second
attempt. Silent, it would cost the others a grace window: the second attempt's leader would wait for its
``Ready``, and where it is the leader drawn, its followers would wait for a decision that never comes (the
"no decision" failures of a second attempt: ``bench/results/scale.md``). So it declines the key run again, with
an ``Abort`` of it:

* to each peer that sends it a ``Ready`` of that key (that asks it to lead), at once;
* to each member of the first attempt's group that tells it it abandoned the first attempt after this peer
  completed it (a member whose ring broke tells every member: ``DataCall.fail``), once: those are the peers
  that will run it again, its next leader among them.

The peers told leave it out of the second attempt: its leader stops waiting for it (``agreement.Lead``, as for
any member that abandoned a key), the lead order skips it (``leader_of``), and a follower whose leader declines
follows the next leader of that order instead (``agreement.Follow``), taking the lead itself where it is
next. Each follower of a bucket hears the same declines from the same peers, so they move on to the same next
leader; one that has not heard them yet when a ``Ready`` reaches it keeps the ``Ready`` (``holds``) instead of
answering "not leading", and counts it if it comes to lead.

A first attempt whose leader never decided (dead behind an idle link, frozen or late: ``errors.NoDecision``) is run
again too (its bucket's followers all failed alike, and meet again under the next leader): each follower counts the
silent leader as declining the run again (``leader_silent``), without a message, so it is neither waited for nor
followed the second time.

Only the labels in ``labels`` are declined (``ZmqExchange.set_grouping``'s ``run_again``; Mix1's when
``[mix1] again``): no other exchange runs again. What is kept is bounded (``Records``), and a peer's declines cost
at most one message per member of its group, only in rounds where a member of its group abandoned the exchange
after this peer completed it. (Telling the whole group at the first abandonment instead cost every completer a
group's worth of messages whenever a restarted member abandoned an exchange its predecessor had finished: 1.1
control messages more per peer and round at 64 simulated peers, 1% churn.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gossiploco.protocol import groups, keys
from gossiploco.protocol.messages import Abort, Send
from gossiploco.protocol.records import Records

if TYPE_CHECKING:
    from gossiploco.protocol.node import PeerNode


def is_again(key: str) -> bool:
    """Whether ``key`` is an exchange run again."""
    return keys.first_key(key) != key


class Declines:
    """The exchanges this peer completed whose run again it declines; see the module docstring."""

    def __init__(self) -> None:
        self.labels: frozenset[str] = frozenset()
        """Labels of the exchanges that may run again (``"mix1"``): only their keys are declined."""
        self.completed: Records[str, frozenset[int]] = Records()
        """key -> the group of a first attempt this peer completed."""
        self._told: Records[tuple[str, int], bool] = Records()
        """(key run again, peer) of the declines this peer sent on an abandonment (``on_abort``): each once."""
        self.sent = 0
        """Declines sent (each an ``Abort``): read by tests."""

    def complete(self, key: str, group) -> None:
        """This peer completed exchange ``key`` over ``group`` (its result is in hand)."""
        if group and self._runs_again(key):
            self.completed.put(key, frozenset(group))

    def _runs_again(self, key: str) -> bool:
        """Whether ``key`` is a first attempt of an exchange that may run again (its label is in ``labels``)."""
        return not is_again(key) and key.partition("/")[0] in self.labels

    def on_ready(self, sender: int, key: str) -> list[Send] | None:
        """A ``Ready`` for ``key``: the decline to answer it with, or None when this peer does not decline ``key``."""
        if not is_again(key) or keys.first_key(key) not in self.completed:
            return None
        self.sent += 1
        return [Send(sender, Abort(key))]

    def leader_silent(self, node: PeerNode, key: str, leader: int) -> None:
        """``leader`` never decided ``key`` (this follower's wait ran out: ``errors.NoDecision``). Dead, frozen or
        late, it will not take part in ``key`` run again: counted as declining it here (every follower of its bucket
        timed out on it alike), so that run's leader does not wait for it and the lead order skips it."""
        if self._runs_again(key):
            again = keys.again_key(key)
            node.aborted.put(again, node.aborted.get(again, set()) | {leader})

    def on_abort(self, key: str, sender: int) -> list[Send]:
        """``sender`` abandoned ``key`` (or a later phase of it): if this peer completed that exchange and ``sender``
        was of its group, ``sender`` may run it again; decline that to it, once."""
        for first in keys.phases(key):
            group = self.completed.get(first)
            again = keys.again_key(first)
            if group is None or sender not in group:
                continue
            if (again, sender) in self._told:
                return []
            self._told.put((again, sender), True)
            self.sent += 1
            return [Send(sender, Abort(again))]
        return []


def leader_of(node: PeerNode, key: str, candidates: list[int]) -> int:
    """The leader of ``candidates`` for ``key`` (``groups.leader_of``), skipping, for a key run again, the members
    that declined it or abandoned it (``node.aborted``): none of them will lead it."""
    if is_again(key):
        gone = node.aborted.get(key, set())
        candidates = [p for p in candidates if p not in gone]  # never this peer: it hears no abort of its own
    return groups.leader_of(node.group_seed, key, candidates)


def holds(key: str, sender: int, candidates: list[int]) -> bool:
    """Whether a ``Ready`` of ``key`` from ``sender``, addressed to this peer while the lead order by its view names
    another, is kept rather than answered "not leading": for a key run again from a member of this peer's bucket
    (the leaders before this peer may have declined to ``sender`` already, not yet to this peer)."""
    return is_again(key) and sender in candidates
