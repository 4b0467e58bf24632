"""When a failed Mix1 is run a second time, among the survivors of its group.

A global Mix1 is a ring all-reduce (or the compressed two-phase mean) over the group the agreement formed, and it
cannot finish without every member: one that crashes or leaves mid-exchange fails it for the whole group, whose
survivors keep their own values for the round (identity). In a swarm of hundreds with 1% of peers failing a round,
that was the commonest Mix1 failure (``bench/results/scale.md``, "Why exchanges fail"). The survivors can run it
again: the key ``keys.again_key(key)`` keeps the first attempt's buckets, so the group re-forms from those of
its members that are still there and ask, under a leader drawn anew (the first may be the member that failed).
A group whose leader never decided (``MixResult.leaderless``: dead behind an idle link, frozen) is run again too:
its members all failed alike and meet again without it. Members that completed the first attempt, and a silent
leader, are left out of the second by the agreement (``protocol.declines``).

Mix1 runs beside the inner steps and is waited for at the round's end, so a second attempt is worth starting only
while the round has time left for it: ``RunAgain`` allows it until ``again_by``, the round's expected end (its
start plus the last round's length) less two grace windows (the agreement: a follower waits at most about two)
and the time the last successful Mix1 took. Before a first whole round there is no length to go by: no second
attempt. Once only: a second failure is the round's identity, as before.

Written once for the runtime (``factored.FactoredDiLoCo``, on ``time.monotonic``) and the simulator
(``simulation.swarm``, on its clock): every time is passed in.
"""

from __future__ import annotations


class RunAgain:
    """One worker's policy for running Mix1 again (module docstring). ``enabled``: ``mix1.again`` and a global
    Mix1; ``grace_s``: the agreement's grace window."""

    def __init__(self, enabled: bool, grace_s: float):
        self.enabled = enabled
        self.grace_s = grace_s
        self._began: float | None = None
        self._round_s: float | None = None
        """The last whole round's length (start to start); None before one."""
        self._ok_s = 0.0
        """What the last successful Mix1 exchange took."""
        self.tried = 0
        """Exchanges run again."""
        self.succeeded = 0
        """Of those, the ones that succeeded."""

    def round_began(self, now: float) -> float | None:
        """A round starts at ``now``: returns its ``again_by`` (None: no second attempt this round)."""
        if self._began is not None:
            self._round_s = now - self._began
        self._began = now
        if not self.enabled or self._round_s is None:
            return None
        return now + self._round_s - 2 * self.grace_s - self._ok_s

    def wanted(self, again_by: float | None, now: float) -> bool:
        """Whether an exchange that failed at ``now`` is run again (its round's ``again_by``)."""
        return again_by is not None and now <= again_by

    def ended(self, ok: bool, seconds: float, again: bool) -> None:
        """An exchange ended (``again``: the second attempt) after ``seconds``, ``ok`` or not."""
        if again:
            self.tried += 1
            self.succeeded += ok
        if ok:
            self._ok_s = seconds
