"""The simulator's seeded runs: ``simulate(seed)``, the chaos seeds (each seed draws the swarm's size, grouping,
pairing, clock, carrier, faults and reachability), and ``simulate_scale``, a scaling run on a real run's clock
ratios (``bench/scale_sim.py``)."""

from __future__ import annotations

import random

from gossiploco.simulation.faults import draw_arrivals, draw_churn, draw_faults, draw_newcomers, draw_reachability
from gossiploco.simulation.swarm import Settings, SimResult, SimSwarm


def simulate(seed: int, peers: int | None = None, rounds: int = 5, log: bool = False, mix2: str | None = None,
             max_peers: int = 8) -> SimResult:
    """One seeded run: the peer count (2 to 8 unless given; with ``max_peers`` above 8, an eighth of the seeds draw
    9 to ``max_peers``), the group size (2, 3, 4 or 16: small buckets split even small swarms), gossip's pairing
    (half ready, half bucket), rounds on the shared clock (a quarter, with a random overshoot), links on demand (a
    third, ``Settings.links_idle_s``), a failed Mix1 run again (three quarters, ``Settings.mix1_again``), the
    faults, brand-new peers joining (a quarter, ``draw_newcomers``), the reachability pattern and all timings follow
    from ``seed``; Mix2's exchange too, unless ``mix2`` names it (the draws stay the same)."""
    rng = random.Random(f"schedule-{seed}")
    settings = Settings(peers=peers or rng.randint(2, 8), rounds=rounds, mix2=rng.choice(["gossip", "gossip", "global"]))
    scale = random.Random(f"scale-{seed}")  # its own stream: the schedule's draws stay what they were
    if peers is None and max_peers > 8 and scale.random() < 0.125:
        settings.peers = scale.randint(9, max_peers)
    settings.group_size = scale.choice([2, 3, 4, 16, 16, 16])
    settings.pairing = random.Random(f"pairing-{seed}").choice(["ready", "bucket"])  # its own stream, as above
    clock = random.Random(f"clock-{seed}")  # a quarter: time-budget rounds on the shared clock (``round_clock``)
    if clock.random() < 0.25:
        settings.round_period, settings.round_jitter = settings.inner_s * clock.uniform(1.5, 3), clock.uniform(0, 0.3)
    links = random.Random(f"links-{seed}")  # a third: links on demand, closed idle after 0.3 to 3 rounds
    if links.random() < 1 / 3:
        settings.links_idle_s = settings.inner_s * links.uniform(0.3, 3.0)
        settings.links_cap = links.choice([0, 0, 1, 2, 3])  # small caps: links closed to make room in small swarms
    settings.mix1_again = random.Random(f"again-{seed}").random() < 0.75  # a quarter: a failed Mix1 is not run again
    if mix2 is not None:
        settings.mix2 = mix2
    faults = draw_faults(rng, settings)
    settings, relay_faults = draw_reachability(rng, settings)
    newcomers = draw_newcomers(random.Random(f"newcomers-{seed}"), settings)  # its own stream, as above
    return SimSwarm(seed, settings, log=log).run(faults + relay_faults + newcomers)


SCALE_TIMES = {"inner_s": 20.0, "grace_s": 2.0, "exchange_s": 30.0, "min_exchange_s": 5.0, "hello_s": 2.0,
               "heartbeat_s": 5.0, "churn_down_s": 10.0, "discovery_s": 2.0}
"""A scaling run's clock, in the ratios of a real run's (``[timeouts]``: grace 10 s, exchanges of minutes at most,
rounds of minutes): 20 s of inner steps, a 2 s grace window. The chaos seeds' 1 s rounds would make a 60 ms ring
step a large share of a round, which no real run has."""


def simulate_scale(seed: int, peers: int, *, rounds: int = 5, group_size: int = 16, churn: float = 0.01,
                   links: str = "consumer", inner_spread: float = 0.05, mix2: str = "gossip", newcomers: float = 0.0,
                   log: bool = False, **overrides) -> SimResult:
    """A scaling run (``bench/scale_sim.py``): ``peers`` peers on consumer links, compute times within
    ``inner_spread`` of each other (time-budget rounds end together up to such a jitter), each peer crashing in a
    round with probability ``churn`` and coming back ``churn_down_s`` later, and ``newcomers x peers`` brand-new
    peers arriving a round on average (``draw_arrivals``); no other fault. ``log``: keep the run's notes."""
    settings = Settings(peers=peers, rounds=rounds, group_size=group_size, churn=churn, links=links,
                        inner_spread=inner_spread, mix2=mix2, **{**SCALE_TIMES, **overrides})
    faults = draw_churn(random.Random(f"churn-{seed}"), settings)
    faults += draw_arrivals(random.Random(f"arrivals-{seed}"), settings, newcomers)
    return SimSwarm(seed, settings, log=log).run(faults)
