import pytest
import torch

from gossiploco.config import InnerOptConfig, OuterOptConfig
from gossiploco.model import build_model
from gossiploco.optim import InnerOptimizer, lr_factor, outer_step


def test_outer_step_equals_torch_sgd_nesterov_over_several_rounds():
    torch.manual_seed(0)
    cfg = OuterOptConfig()
    x = {"a": torch.randn(5, 3), "b": torch.randn(7)}
    v = {n: torch.zeros_like(t) for n, t in x.items()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in x.items()}
    sgd = torch.optim.SGD(ref.values(), lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        grads = {n: torch.randn_like(t) for n, t in x.items()}
        x, v = outer_step(x, grads, v, cfg)
        for n, p in ref.items():
            p.grad = grads[n].clone()
        sgd.step()
        for n in x:
            assert torch.allclose(x[n], ref[n].detach(), atol=1e-6)
            assert torch.allclose(v[n], sgd.state[ref[n]]["momentum_buffer"], atol=1e-6)


def test_outer_step_is_eq_38():
    # x' = x - lr((1 + mu) g + mu^2 v)
    cfg = OuterOptConfig(lr=0.5, momentum=0.8)
    x, g, v = torch.randn(10), torch.randn(10), torch.randn(10)
    new_x, new_v = outer_step({"p": x}, {"p": g}, {"p": v}, cfg)
    assert torch.allclose(new_x["p"], x - 0.5 * ((1 + 0.8) * g + 0.8**2 * v), atol=1e-6)
    assert torch.allclose(new_v["p"], 0.8 * v + g)


def test_schedule_warmup_then_linear_decay_to_zero():
    factors = [lr_factor(s, warmup_steps=10, total_steps=110) for s in range(110)]
    assert factors[0] == 0.1 and factors[9] == 1.0 and factors[10] == 1.0
    assert abs(factors[60] - 0.5) < 1e-12 and 0 < factors[109] <= 0.01
    assert lr_factor(110, 10, 110) == 0.0


def test_inner_optimizer_clips_decays_matrices_only_and_follows_schedule():
    model = build_model("tiny", 256, 8, seed=0)
    opt = InnerOptimizer(model, InnerOptConfig(lr=1e-2, warmup_steps=4, grad_clip=0.5), total_steps=20)
    groups = opt.opt.param_groups
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])
    assert groups[1]["weight_decay"] == 0.0
    tokens = torch.randint(0, 256, (2, 9))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    (loss * 100).backward()
    norm = opt.step()
    assert norm > 0.5  # reported pre-clip norm
    assert groups[0]["lr"] == 1e-2 * 0.25
    assert all(p.grad is None for p in model.parameters())


def test_adamw_moments_move_to_another_worker_exactly():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = InnerOptimizer(a, InnerOptConfig(), 100), InnerOptimizer(b, InnerOptConfig(), 100)
    assert torch.count_nonzero(opt_a.export_moments()) == 0  # before the first step
    for _ in range(3):
        a(torch.randn(8, 5)).pow(2).sum().backward()
        opt_a.step()
    opt_b.import_moments(opt_a.export_moments(), opt_a.step_index)
    b.load_state_dict(a.state_dict())
    assert torch.equal(opt_b.export_moments(), opt_a.export_moments()) and opt_b.step_index == 3
    x = torch.randn(8, 5)
    for model, opt in ((a, opt_a), (b, opt_b)):  # the next step is the same on both: the warm start is exact
        model(x).pow(2).sum().backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="expected"):
        opt_b.import_moments(torch.zeros(3), 0)
