"""A dishonest member's state-request flood, for the attack bench (``GOSSIPLOCO_ATTACK=state_flood:N``).

Started by ``NetworkPeer.set_adversary`` when its ``Adversary`` asks for state requests
(``Adversary.state_requests_per_round``): a daemon thread that, each time this peer's round changes, asks
every other member ``N`` times for its state (``ZmqExchange.fetch_state``: a 173-byte request answered by
the whole state). What it gets is counted (``served``, ``refused``, ``failed``) and logged when the exchange
closes; the honest peers' answer is bounded by ``protocol.state_limit``.
"""

from __future__ import annotations

import logging
import threading

from gossiploco.errors import ExchangeClosed, ExchangeError

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often the thread looks at this peer's round."""


class StateFlood:
    """Asks every member ``per_round`` times per round for its state over ``exchange`` (module docstring)."""

    def __init__(self, exchange, rank: int, per_round: int):
        self.exchange, self.rank, self.per_round = exchange, rank, per_round
        self.served = self.refused = self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"state-flood-{rank}", daemon=True)

    def start(self) -> StateFlood:
        log.warning("rank %s: flooding every member with %d state requests per round (attack bench)",
                    self.rank, self.per_round)
        self._thread.start()
        return self

    def _run(self) -> None:
        seen = -1
        stop = threading.Event()
        try:
            while not self.exchange.is_closed():
                round_index = self.exchange.current_round
                if round_index > seen and round_index >= 1:
                    seen = round_index
                    for member in [m for m in self.exchange.members() if m != self.rank]:
                        for _ in range(self.per_round):
                            self._ask(member)
                stop.wait(POLL_S)
        except ExchangeClosed:
            pass
        log.warning("rank %s: state flood over: %d states served, %d requests refused, %d failed otherwise",
                    self.rank, self.served, self.refused, self.failed)

    def _ask(self, member: int) -> None:
        try:
            self.exchange.fetch_state(member)
            self.served += 1
        except ExchangeClosed:
            raise
        except ExchangeError as exc:
            if "refused the request" in str(exc):
                self.refused += 1
            else:
                self.failed += 1
