"""Brand-new peers in the seeded simulator (``simulation.newcomers``, ``Fault`` kind ``newcomer``): an id nobody has
in its view joins a running swarm. Its connections are refused until each member has read its record; it then joins
through the runtime's own program (``protocol.lifecycle.join``), catches up, and takes part in its exchanges within
2 rounds of the swarm (``recovery.not_mixing``), over a full mesh and over links on demand, every property of the
simulator holding."""

from __future__ import annotations

import random
import re

import pytest

from gossiploco.simulation.faults import Fault, draw_newcomers
from gossiploco.simulation.runs import simulate
from gossiploco.simulation.swarm import Settings, SimSwarm

CARRIERS = {"full mesh": 0.0, "links on demand": 1.5}


def _first_link_and_read(log: list[str], newcomer: int) -> tuple[dict[int, float], dict[int, float]]:
    """When each peer's first connection with ``newcomer`` came up, and when it read ``newcomer``'s record."""
    linked: dict[int, float] = {}
    found: dict[int, float] = {}
    for line in log:
        at, _, text = line.strip().partition(" ")
        path = re.match(r"PATH (\d+)-(\d+) ", text)
        if path:
            a, b = int(path[1]), int(path[2])
            if newcomer in (a, b):
                linked.setdefault(b if a == newcomer else a, float(at))
        read = re.match(rf"(\d+) found {newcomer}'s record", text)
        if read:
            found[int(read[1])] = float(at)
    return linked, found


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_newcomer_is_refused_until_its_record_is_read_then_joins_and_mixes_within_two_rounds(carrier):
    settings = Settings(peers=6, rounds=6, links_idle_s=CARRIERS[carrier])
    swarm = SimSwarm(3, settings, log=True)
    result = swarm.run([Fault("newcomer", 1.3, 1.3, peer=6)])

    assert result.violations == []
    assert result.finished[6] == settings.rounds  # it joined, caught up and ran to the end with the others
    assert all(result.finished[p] == settings.rounds for p in range(6))
    swarm_round = swarm.recovery.returned[6][1]
    assert swarm.recovery.first_round(6) is not None and swarm.recovery.first_round(6) <= swarm_round + 2
    linked, found = _first_link_and_read(result.log, 6)
    assert set(found) == set(range(6))  # every member read its record (within discovery_s of its start)
    assert all(1.3 <= at <= 1.3 + settings.discovery_s for at in found.values())
    assert linked, "the newcomer never connected to anyone"
    for peer, at in linked.items():  # no handshake of the newcomer's was accepted before that member knew its key
        assert at >= found[peer], f"peer {peer} connected with the newcomer at {at} before reading its record"


@pytest.mark.parametrize("carrier", CARRIERS)
def test_members_slow_to_read_a_newcomers_record_delay_it_but_never_lose_it(carrier):
    """Reads due up to 5 s after its start, past the handshake's deadline (``heartbeat_s``, 1.5 s): over links on demand
    its first dials fail and count as lost links; it dials again and joins once read."""
    settings = Settings(peers=5, rounds=8, links_idle_s=CARRIERS[carrier], discovery_s=5.0)
    swarm = SimSwarm(8, settings, log=True)
    result = swarm.run([Fault("newcomer", 0.9, 0.9, peer=5)])

    assert result.violations == []
    assert result.finished[5] == settings.rounds
    linked, found = _first_link_and_read(result.log, 5)
    assert linked and all(at >= found[peer] for peer, at in linked.items())


def test_two_newcomers_find_each_other_and_the_swarm_and_both_finish():
    settings = Settings(peers=4, rounds=7, links_idle_s=2.0)
    swarm = SimSwarm(21, settings, log=True)
    result = swarm.run([Fault("newcomer", 0.7, 0.7, peer=4), Fault("newcomer", 1.9, 1.9, peer=5)])

    assert result.violations == []
    assert result.finished[4] == result.finished[5] == settings.rounds
    assert any(re.search(r"PATH (4-5|5-4) ", line) for line in result.log)  # the later one found the earlier


def test_a_quarter_of_the_chaos_seeds_bring_newcomers_with_ids_past_the_swarms():
    drawn = [draw_newcomers(random.Random(f"newcomers-{seed}"), Settings(peers=5)) for seed in range(400)]
    share = sum(bool(faults) for faults in drawn) / len(drawn)
    assert 0.18 < share < 0.32  # 1/4 drawn: 400 draws put the share within 0.04 of it 95% of the time
    for faults in drawn:
        assert [f.peer for f in faults] == list(range(5, 5 + len(faults)))
        assert all(f.kind == "newcomer" and f.start == f.end for f in faults)


def test_chaos_seeds_with_newcomers_hold_every_property():
    seeds = [s for s in range(200) if draw_newcomers(random.Random(f"newcomers-{s}"), Settings())][:12]
    for seed in seeds:
        result = simulate(seed)
        newcomers = [f.peer for f in result.faults if f.kind == "newcomer"]
        assert newcomers, seed
        assert result.violations == [], (seed, [str(v) for v in result.violations])
        for peer in newcomers:
            assert peer in result.finished, (seed, peer)  # it joined (a late one may find the swarm done: gave up)


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_newcomer_arriving_mid_round_takes_part_from_the_next_round_with_its_state(carrier):
    """Found with brand-new peers: one arriving during round 0 took part in round 0 (nobody was ahead of it), so it
    trained that round half a round late: its Mix2 missed the others' (they went on without it, or, where it led a
    bucket by the draw, waited for it), and it fell behind and caught up only at round 2. Now the others' answers say
    how long ago they began their round (``Hello.began_ms_ago``), and past ``late_join_s`` it waits for the boundary
    and downloads round 1's state (``lifecycle.joined_late``)."""
    settings = Settings(peers=6, rounds=5, links_idle_s=CARRIERS[carrier])
    swarm = SimSwarm(4, settings, log=True)
    result = swarm.run([Fault("newcomer", 0.1, 0.1, peer=6)])

    assert result.violations == []
    assert any(re.search(r" 6 caught up from \d+ at round 1$", line) for line in result.log)
    assert not [line for line in result.log if re.search(r" \d+ mix\d/0 failed", line)], "round 0: nothing failed"
    assert not [line for line in result.log if re.search(r" [0-5] mix\d/\d+ failed", line)], "no member's failed"
    assert result.finished[6] == settings.rounds
