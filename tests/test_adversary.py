"""The attack bench's dishonest member (``gossiploco.adversary``) does what each attack's definition says."""

from __future__ import annotations

import pytest
import torch

from gossiploco.adversary import Adversary, adversary_from_env
from gossiploco.errors import ConfigError


def delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(40, generator=g), "b": torch.randn(3, 5, generator=g)}


def test_scale_sign_and_replay_follow_their_definitions():
    d0, d1 = delta(0), delta(1)
    scaled = Adversary.parse("scale:1000").pseudo_gradient(d0, 0)
    assert all(torch.equal(scaled[n], d0[n] * 1000) for n in d0)
    flipped = Adversary.parse("sign").pseudo_gradient(d0, 0)
    assert all(torch.equal(flipped[n], -d0[n]) for n in d0)
    replay = Adversary.parse("replay")
    replay.pseudo_gradient(d0, 0)
    again = replay.pseudo_gradient(d1, 1)  # round 1 sends round 0's update
    assert all(torch.equal(again[n], d0[n]) for n in d0)


def test_noise_has_the_asked_spread_and_the_weight_lie_only_touches_the_claim():
    d = {"w": torch.randn(100_000, generator=torch.Generator().manual_seed(2))}
    noise = Adversary.parse("noise:10", seed=3).pseudo_gradient(d, 0)["w"]
    # the sample std of 1e5 normal draws is within 1% of sigma (its relative standard error is 1/sqrt(2e5))
    assert float(noise.std()) == pytest.approx(10 * float(d["w"].std()), rel=0.01)
    liar = Adversary.parse("weight")
    assert liar.claimed_tokens(512) == 512_000 and liar.pseudo_gradient(d, 0) is d
    assert Adversary.parse("state_flood:5").state_requests_per_round() == 5


def test_a_little_is_enough_sends_mean_minus_z_sigma_of_the_honest_updates():
    honest = [delta(s) for s in range(5)]
    sent = Adversary.parse("alie:1.5").pseudo_gradient(delta(9), 0, honest)
    for n in honest[0]:
        stacked = torch.stack([h[n] for h in honest])
        expected = stacked.mean(0) - 1.5 * stacked.std(0, unbiased=False)
        assert torch.allclose(sent[n], expected, atol=1e-6)


def test_unknown_attacks_and_bad_strengths_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="unknown attack"):
        Adversary.parse("bogus")
    with pytest.raises(ConfigError, match="must be a number"):
        Adversary.parse("scale:lots")
    monkeypatch.setenv("GOSSIPLOCO_ATTACK", "sign:2")
    assert adversary_from_env() == Adversary("sign", 2.0)
    monkeypatch.delenv("GOSSIPLOCO_ATTACK")
    assert adversary_from_env() is None
