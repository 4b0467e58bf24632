"""The fault schedule of one simulated run, drawn from its seed.

Kinds: ``crash`` (for good), ``restart`` (crash, then a new process with the same id that
downloads the state), ``pause`` (SIGSTOP until ``end``, then SIGCONT), and link faults on one
peer's links or one pair: ``delay``, ``loss``, ``dup``, ``reorder``, ``slow`` (a narrow link),
``partition`` (two-way, heals at ``end``) and ``oneway`` (one direction only); and ``newcomer``
(``draw_newcomers``): a brand-new peer ``peer`` (an id past the swarm's) starts at ``start`` and joins
(``simulation.newcomers``). A crash can hit
any peer at any instant, the agreement leader (the lowest id) included, and mid-agreement or
mid-chunk alike, because its time is continuous and independent of the protocol's progress.

In about a third of the seeds the swarm also has a reachability pattern (``draw_reachability``):
some peers behind NAT, 1 or 2 relays, often data and time limits on relayed connections, and
often ``relay_crash`` (a relay down for good) or ``relay_restart`` (down until ``end``), where
``peer`` is the relay's id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from gossiploco.simulation.network import LinkFault

KINDS = ("crash", "restart", "pause", "delay", "loss", "dup", "reorder", "slow", "partition", "oneway")
RELAY_KINDS = ("relay_crash", "relay_restart")
NAT_SHARE = 1 / 3
"""The share of seeds whose swarm has peers behind NAT and relays."""


@dataclass(frozen=True)
class Fault:
    kind: str
    start: float
    end: float
    peer: int = 0
    peers: tuple[int, ...] = ()
    amount: float = 0.0

    def link(self) -> LinkFault:
        return LinkFault(self.kind, self.start, self.end, self.peers, self.amount)

    def __str__(self) -> str:
        if self.kind in RELAY_KINDS:
            who = f"relay r{self.peer}"
        else:
            who = (f"peer {self.peer}" if self.kind in ("crash", "restart", "pause", "newcomer")
                   else f"link {self.peers or 'all'}")
        extra = f" amount={self.amount:g}" if self.amount else ""
        return f"{self.kind} {who} t={self.start:.3f}..{self.end:.3f}{extra}"


def draw_faults(rng: random.Random, settings) -> list[Fault]:
    """1 to 3 faults within the run's expected span; at most ``peers - 1`` peers crash for good."""
    span = settings.rounds * (settings.inner_s + 0.3)
    faults: list[Fault] = []
    crashed = 0
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(KINDS)
        if kind == "crash" and crashed >= settings.peers - 1:
            kind = "pause"
        start = rng.uniform(0.0, span)
        end = start + rng.uniform(0.2, 3.0)
        peer = 0 if rng.random() < 0.4 else rng.randrange(settings.peers)  # the leader, often
        a, b = rng.sample(range(settings.peers), 2)
        if kind in ("crash", "restart", "pause"):
            crashed += kind == "crash"
            faults.append(Fault(kind, start, end, peer=peer))
        elif kind == "delay":
            faults.append(Fault(kind, start, end, peers=(peer,) if rng.random() < 0.5 else (), amount=rng.uniform(0.01, 0.5)))
        elif kind in ("loss", "dup", "reorder"):
            faults.append(Fault(kind, start, end, peers=(a, b), amount=rng.uniform(0.05, 0.5)))
        elif kind == "slow":
            faults.append(Fault(kind, start, end, peers=(a, b), amount=rng.uniform(1e3, 1e5)))
        else:
            faults.append(Fault(kind, start, end, peers=(a, b)))
    return faults


def draw_reachability(rng: random.Random, settings):
    """``settings`` with a reachability pattern in about a third of the seeds (else as they are), and
    the relay faults: 1 to all peers behind NAT, 1 or 2 relays, each limit in half of them (small
    enough to reset connections within the run), and in two thirds a relay that goes down mid-run,
    for good in half of those."""
    if rng.random() >= NAT_SHARE:
        return settings, []
    span = settings.rounds * (settings.inner_s + 0.3)
    behind_nat = tuple(sorted(rng.sample(range(settings.peers), rng.randint(1, settings.peers))))
    relays = rng.randint(1, 2)
    data_limit = rng.randint(2_000, 20_000) if rng.random() < 0.5 else None
    time_limit_s = rng.uniform(1.0, span) if rng.random() < 0.5 else None
    settings = replace(settings, behind_nat=behind_nat, relays=relays, relay_bandwidth_bps=rng.uniform(1e5, 1e8),
                       relay_data_limit=data_limit, relay_time_limit_s=time_limit_s)
    if rng.random() >= 2 / 3:
        return settings, []
    start = rng.uniform(0.0, span)
    kind = rng.choice(RELAY_KINDS)
    return settings, [Fault(kind, start, start + rng.uniform(0.2, 3.0), peer=rng.randrange(relays))]


def draw_churn(rng: random.Random, settings) -> list[Fault]:
    """Each peer crashes in each round with probability ``settings.churn`` (at a uniform time within the round's
    expected span) and restarts ``churn_down_s`` later, as a volunteer's machine does: the scaling runs' failures."""
    if settings.churn <= 0:
        return []
    round_s = settings.inner_s * (1 + settings.inner_spread / 2) + 0.3
    faults = []
    for r in range(settings.rounds):
        for peer in range(settings.peers):
            if rng.random() < settings.churn:
                start = (r + rng.random()) * round_s
                faults.append(Fault("restart", start, start + settings.churn_down_s, peer=peer))
    return faults


NEWCOMER_SHARE = 1 / 4
"""The share of chaos seeds in which brand-new peers join."""


def draw_newcomers(rng: random.Random, settings) -> list[Fault]:
    """In ``NEWCOMER_SHARE`` of the seeds 1 or 2 brand-new peers (ids ``settings.peers``, ``settings.peers + 1``)
    start within the first half of the run's expected span: the swarm is still running when they catch up."""
    if rng.random() >= NEWCOMER_SHARE:
        return []
    span = settings.rounds * (settings.inner_s + 0.3)
    return _newcomers(settings, [rng.uniform(0.0, span / 2) for _ in range(rng.randint(1, 2))])


def draw_arrivals(rng: random.Random, settings, share: float) -> list[Fault]:
    """Brand-new peers arriving through the run: in each round, each of ``settings.peers`` slots brings one with
    probability ``share`` (so ``share x M`` a round on average), at a uniform time within the round's expected span;
    ids from ``settings.peers`` on. The scaling runs' joins (``simulate_scale``'s ``newcomers``)."""
    if share <= 0:
        return []
    round_s = settings.inner_s * (1 + settings.inner_spread / 2) + 0.3
    return _newcomers(settings, [(r + rng.random()) * round_s for r in range(settings.rounds - 1)  # none in the last
                                 for _ in range(settings.peers) if rng.random() < share])


def _newcomers(settings, starts: list[float]) -> list[Fault]:
    """Newcomers starting at ``starts``, in time order, with ids from ``settings.peers`` on."""
    return [Fault("newcomer", start, start, peer=settings.peers + i) for i, start in enumerate(sorted(starts))]
