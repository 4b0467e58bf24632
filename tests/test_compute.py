"""How a peer computes (``[compute]``): none of it may change the math. Micro-batches, recomputed
activations, fused-kernel attention, the multi-tensor outer step and the outer state's placement are
checked against the plain formulas written out here (and against the paper's DiLoCo reference of
test_algorithm); inner steps must not wait for the device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gossiploco.config import ComputeConfig, InnerOptConfig, OuterOptConfig
from gossiploco.errors import ConfigError
from gossiploco.model import Attention, ModelArgs, RMSNorm, apply_rope, build_model, flash_attention_runs, rope_tables
from gossiploco.optim import InnerOptimizer, outer_step, outer_step_on_delta
from gossiploco.outer_state import SideStream, state_device, to_device
from gossiploco.runtime.common import build_trainer, mean_loss
from gossiploco.runtime.peer import run_id_for
from gossiploco.runtime.virtual import VirtualSwarm
from gossiploco.trainer import LocalTrainer
from test_algorithm import reference_diloco


def trainer_for(corpus, compute: ComputeConfig, batch: int = 4, seq: int = 16, fused: bool | None = None) -> LocalTrainer:
    from gossiploco.data import TokenStream

    model = build_model("tiny", corpus.vocab_size, seq, seed=0)
    stream = TokenStream(corpus.train, seq, batch, seed=0, worker=0)
    return LocalTrainer(model, InnerOptimizer(model, InnerOptConfig(), 10, fused=fused), stream, "fp32", compute)


def gradients(trainer: LocalTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


FP32_UNIT_ROUNDOFF = 2.0 ** -24
"""u: the relative error of one fp32 rounding."""


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): how far n fp32 roundings in a row can move a result, relatively (Higham,
    Accuracy and Stability of Numerical Algorithms, lemma 3.1)."""
    return n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)


def reference_model_and_batch(corpus, seq: int, batch: int, *, size: str = "tiny", seed: int = 0,
                              dtype: torch.dtype = torch.float32, at: dict[str, torch.Tensor] | None = None,
                              step: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model in ``dtype`` at the parameters ``at`` (default: the seed's initial model) and worker 0's batch
    number ``step`` (0: its first)."""
    from gossiploco.data import TokenStream

    model = build_model(size, corpus.vocab_size, seq, seed=seed).to(dtype)
    if at is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(at[n])
    stream = TokenStream(corpus.train, seq, batch, seed=seed, worker=0)
    for _ in range(step):
        stream.next_batch()
    inputs, targets = stream.next_batch()
    return model, inputs, targets


def micro_batch_gradients(corpus, seq: int, batch: int, micro: int, *, dtype: torch.dtype = torch.float32,
                          **where) -> tuple[float, list[dict[str, torch.Tensor]], torch.Tensor]:
    """The batch's mean loss, the gradient of each ``micro``-sequence micro-batch's share of it (its mean
    cross-entropy times micro / batch; ``micro = 0``: one part, the whole batch) and each token's cross-entropy,
    in ``dtype``, for the model and batch of ``reference_model_and_batch(**where)``."""
    model, inputs, targets = reference_model_and_batch(corpus, seq, batch, dtype=dtype, **where)
    loss, parts, tokens = 0.0, [], []
    for x, y in zip(inputs.split(micro or batch), targets.split(micro or batch)):
        model.zero_grad(set_to_none=True)
        logits = model(x).flatten(0, 1)
        part = F.cross_entropy(logits, y.flatten()) * (x.shape[0] / batch)
        part.backward()
        loss += float(part.detach())
        parts.append({n: p.grad.clone() for n, p in model.named_parameters()})
        tokens.append(F.cross_entropy(logits.detach(), y.flatten(), reduction="none"))
    return loss, parts, torch.cat(tokens)


def summed_term_sizes(corpus, seq: int, batch: int, **where) -> dict[str, torch.Tensor]:
    """Each parameter's gradient is a sum over the batch's tokens t of one term each: delta_t a_t^T for a linear
    layer (its output's gradient and its input), delta_t * xhat_t for an RMSNorm's weight (xhat_t: the normalised
    input), delta_t added to the row of token t's id for the embedding. This is, elementwise, the sum of those
    terms' absolute values (the same formulas on |delta| and |a|), in float64, for
    ``reference_model_and_batch(**where)``."""
    model, inputs, targets = reference_model_and_batch(corpus, seq, batch, dtype=torch.float64, **where)
    names = {module: name for name, module in model.named_modules()}
    seen = []

    def keep(module, args, out):
        out.retain_grad()
        seen.append((module, args[0], out))

    summed = (nn.Linear, nn.Embedding, RMSNorm)
    hooks = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, summed)]
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    for hook in hooks:
        hook.remove()
    sizes = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for module, a, out in seen:
        delta = out.grad.abs().flatten(0, -2)  # (tokens, out features)
        if isinstance(module, nn.Linear):
            term = delta.T @ a.abs().flatten(0, -2)
        elif isinstance(module, RMSNorm):
            term = (delta * (out.detach() / module.weight.detach()).abs().flatten(0, -2)).sum(0)
        else:
            term = torch.zeros_like(module.weight).index_add_(0, a.flatten(), delta)
        sizes[names[module] + ".weight"] += term
    assert {names[module] + ".weight" for module, _, _ in seen} == set(sizes), "a parameter of another kind"
    return sizes


def eq22_gradient_bounds(corpus, micro: int, seq: int = 16, batch: int = 4,
                         **where) -> dict[str, tuple[torch.Tensor, float]]:
    """For each tensor, eq. 22's gradient (in float64) and how far from it fp32 rounding may put a gradient
    computed in ``micro``-sequence micro-batches, in any order and by any kernels, in the L2 norm, for the
    model and batch of ``reference_model_and_batch(**where)``.

    An fp32 gradient is the exact gradient g (computed here in float64) plus two kinds of rounding error. The
    terms: each token's term of the gradient's sum (see ``summed_term_sizes``) is computed through the whole
    network, with errors that no formula here bounds; they are measured, as the whole-batch fp32 gradient's
    error ||g32 - g||, with a factor 2 for another computation's rounding being of the same size, not the same
    value. The sum: the N = batch * seq terms are added in an order that micro-batching (k = batch / micro
    parts, then k - 1 additions), the CPU's vector width, its thread count and a compiled kernel's loop all
    choose; in any order, N - 1 fp32 additions are off by at most gamma_{N-1} sum_t |term_t| (about (N - 1) u,
    u = 2^-24; Higham, Accuracy and Stability of Numerical Algorithms, section 4.2). So, per tensor,

        ||got - g|| <= 2 ||g32 - g|| + gamma_{N-1} || sum_t |term_t| ||

    The second term is what another summation order may cost, and it is needed: torch.compile's gradient of the
    final RMSNorm's weight is 2.8 times as far from eq. 22's as the eager fp32 one (measured on an AMD EPYC), so
    twice the eager error alone is no bound for it. Both terms are this machine's numbers for this model and
    batch, not an assumed size, so the bound holds whatever the CPU; here it is 1e-5 to 4e-5 of each tensor's
    norm (the terms' absolute values sum to 2 to 4.5 times the gradient), and errors are a few percent of it.
    A micro-batching that weighted, dropped or repeated one of k <= 4 micro-batches is off by a quarter or more
    of the gradient, a loss scaled by 1 + 1e-3 by a thousandth of it."""
    _, parts, _ = micro_batch_gradients(corpus, seq, batch, micro, dtype=torch.float64, **where)
    _, fp32, _ = micro_batch_gradients(corpus, seq, batch, 0, **where)
    sizes = summed_term_sizes(corpus, seq, batch, **where)
    bounds = {}
    for n, size in sizes.items():
        exact = sum(part[n] for part in parts)
        rounding = float((fp32[0][n].double() - exact).norm())
        bounds[n] = exact, 2 * rounding + gamma(batch * seq - 1) * float(size.norm())
    return bounds


def eq22_loss_bound(corpus, micro: int, seq: int = 16, batch: int = 4, **where) -> tuple[float, float]:
    """The batch's mean loss (in float64), and how far from it fp32 rounding may put the loss computed in
    ``micro``-sequence micro-batches, derived like the gradient's bound, for ``reference_model_and_batch(**where)``.

    The loss is L = (1/N) sum_i c_i over the N = batch * seq tokens' cross-entropies c_i >= 0. Computed in fp32,
    each c_i is off by e_i (the forward pass's rounding, measured here as in ``eq22_gradient_bounds``: the fp32
    token losses against float64, with the factor 2 for another computation's rounding of the same size), and
    (1/N) sum_i |e_i| <= ||e|| / sqrt(N). Then the sums: each of the k = batch / micro parts is a mean of
    n = N / k terms (n - 1 additions and one division), scaled by its share 1 / k (one more rounding) and added
    to the others by k - 1 additions. Each rounding is off by at most u times its result, and every result,
    carried to the loss's scale, is at most L (the c_i are not negative), so the n - 1 + 1 + 1 + k - 1 = N / k + k
    roundings add at most gamma_{N/k+k} L. So

        |got - L| <= 2 ||e32|| / sqrt(N) + gamma_{N/k+k} L

    under 10^-5 of L for the tests' batches (N = 64 or 128), where a wrongly weighted or dropped micro-batch is
    off by a whole part (1 / k of L)."""
    loss, _, exact_tokens = micro_batch_gradients(corpus, seq, batch, 0, dtype=torch.float64, **where)
    _, _, fp32_tokens = micro_batch_gradients(corpus, seq, batch, 0, **where)
    tokens, parts = exact_tokens.numel(), batch // (micro or batch)
    rounding = float((fp32_tokens.double() - exact_tokens).norm()) / math.sqrt(tokens)
    return loss, 2 * rounding + gamma(tokens // parts + parts) * loss


def assert_is_eq22_gradient(got: dict[str, torch.Tensor], corpus, micro: int, seq: int = 16, batch: int = 4,
                            **where) -> dict[str, float]:
    """``got`` (a trainer's gradient after one ``forward_backward``, in ``micro``-sequence micro-batches, of the
    model and batch of ``reference_model_and_batch(**where)``: by default the initial model and worker 0's first
    batch) is eq. 22's gradient, to fp32 rounding: within ``eq22_gradient_bounds``' derived bound, tensor by
    tensor. Returns each tensor's bound."""
    bounds = eq22_gradient_bounds(corpus, micro, seq, batch, **where)
    for n, (exact, bound) in bounds.items():
        error = float((got[n].double() - exact).norm())
        assert error <= bound, (f"{n}: the gradient is {error:.3g} from eq. 22's (norm {float(exact.norm()):.3g}); "
                                f"fp32 rounding allows {bound:.3g}")
    return {n: bound for n, (_, bound) in bounds.items()}


@pytest.mark.parametrize("micro, recompute", [(1, False), (2, False), (2, True), (0, True)])
def test_micro_batches_and_recomputed_activations_give_the_whole_batch_gradient(corpus, micro, recompute):
    want_loss, loss_bound = eq22_loss_bound(corpus, micro)
    trainer = trainer_for(corpus, ComputeConfig(micro_batch_size=micro, checkpoint_activations=recompute))
    loss = trainer.forward_backward()
    assert torch.is_tensor(loss) and abs(float(loss) - want_loss) <= loss_bound
    assert_is_eq22_gradient(gradients(trainer), corpus, micro)


@pytest.mark.parametrize("in_kernel", [False, True])
def test_grouped_query_attention_equals_repeated_heads_either_way(monkeypatch, in_kernel):
    """softmax(Q K^T / sqrt(d) + causal mask) V, each kv head serving n_heads / n_kv_heads query heads:
    with the kv heads repeated (CPU, fp32, older GPUs) and read in place by the kernel (enable_gqa: the
    flash kernel on a GPU; here PyTorch's reference path of the same call)."""
    assert not flash_attention_runs(torch.device("cpu"), 8)
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
    attn = Attention(args)
    if in_kernel:  # what a GPU with flash attention does, for half-precision CUDA inputs: pretend these are
        attn.kv_heads_in_kernel = True
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        monkeypatch.setattr("gossiploco.model.HALF_DTYPES", (torch.float32,))
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw["enable_gqa"]) or sdpa(*a, **kw))
    x = torch.randn(2, 7, 32)
    cos, sin = (t[:7] for t in rope_tables(8, 16, 500000.0))
    q = apply_rope(attn.wq(x).view(2, 7, 4, 8), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, 7, 2, 8), cos, sin).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 7, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(attn(x, cos, sin), want, rtol=1e-5, atol=1e-6)
    assert calls == [in_kernel]


def test_an_inner_step_never_reads_a_value_back_from_the_device(corpus, monkeypatch):
    """Reading a tensor's value on the host (item, float, bool, tolist) waits for a GPU: inner steps do
    none of it; the losses are read together when a record is written. The optimizer is the fused AdamW
    a GPU gets (PyTorch's other AdamW reads its step counter, a CPU tensor there, which costs nothing)."""
    trainer = trainer_for(corpus, ComputeConfig(micro_batch_size=2), fused=True)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("an inner step read a value back from the device")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, forbidden)
        losses = [trainer.inner_step() for _ in range(3)]
    assert trainer.inner_opt.step_index == 3
    assert mean_loss(losses) == pytest.approx(sum(float(v) for v in losses) / 3)
    assert mean_loss([1.0, torch.tensor(3.0)]) == 2.0


def reference_outer_step(x, g, v, cfg):
    """Eqs. 36-37, tensor by tensor: v' = mu v + g; z = x - lr (g + mu v')."""
    new_v = {n: v[n] * cfg.momentum + g[n] for n in g}
    update = {n: g[n] + cfg.momentum * new_v[n] if cfg.nesterov else new_v[n] for n in g}
    return {n: x[n] - cfg.lr * update[n] for n in g}, new_v


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_multi_tensor_outer_steps_are_eqs_36_37_to_the_last_bit(nesterov):
    gen = torch.Generator().manual_seed(1)
    shapes = {"a": (5, 3), "b": (7,), "c": (2, 2, 2)}
    x, g, v = ({n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(3))
    cfg = OuterOptConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    want_x, want_v = reference_outer_step(x, g, v, cfg)
    inputs = [{n: t.clone() for n, t in d.items()} for d in (x, g, v)]
    for got_x, got_v in (outer_step(x, g, v, cfg), outer_step_on_delta(x, {n: -t for n, t in g.items()}, v, cfg)):
        assert all(torch.equal(got_x[n], want_x[n]) and torch.equal(got_v[n], want_v[n]) for n in shapes)
    assert all(torch.equal(d[n], e[n]) for d, e in zip((x, g, v), inputs) for n in shapes)  # inputs untouched


def test_diloco_with_micro_batches_recomputation_and_host_state_is_still_the_papers_diloco(make_config, corpus):
    cfg = make_config("diloco", workers=3, inner_steps=3, rounds=3,
                      **{"compute.micro_batch_size": 2, "compute.checkpoint_activations": True, "compute.outer_state": "host"})
    # The gradient (eq. 22), tightly: AdamW is nearly blind to a gradient's scale (and clipping rescales it), so
    # a wrongly weighted micro-batch sum shows here, not in the trained parameters.
    trainer = build_trainer(cfg, corpus, torch.device("cpu"), 0)
    trainer.forward_backward()
    assert_is_eq22_gradient(gradients(trainer), corpus, 2, cfg.data.seq_len, cfg.data.batch_size,
                            size=cfg.model.size, seed=cfg.seed)
    # The trained parameters, against the paper's DiLoCo whose reference sums the same micro-batches in the
    # same order. Comparing with the whole-batch reference instead would be fragile: the two gradients differ by
    # fp32 summation error (~u times the summed terms), and for a coordinate whose gradient is all cancellation
    # and whose second moment is tiny, AdamW's m / sqrt(v) turns that into a different update of up to the
    # learning rate (1.6e-5 on one element of 4,096 on an AVX-512 CPU). With the same grouping the gradients are
    # the same fp32 sums, and what is left is test_algorithm's plain comparison: AdamW and the outer step
    # written by PyTorch and by gossiploco, a few ulps apart (1e-7 here), under the same 1e-6.
    result = VirtualSwarm(cfg, corpus=corpus).run()
    expected = reference_diloco(cfg, corpus, micro_batch_size=cfg.compute.micro_batch_size)
    for n, v in expected.items():
        torch.testing.assert_close(result.final_params[n], v, rtol=1e-5, atol=1e-6)


def test_compute_settings_are_each_peers_own_and_checked(make_config):
    plain = make_config("globalm1-localm2")
    tuned = make_config("globalm1-localm2", **{"compute.compile": "off", "compute.micro_batch_size": 2,
                                               "compute.checkpoint_activations": True, "compute.outer_state": "device"})
    assert run_id_for(plain) == run_id_for(tuned)  # peers that compute differently still train together
    assert run_id_for(plain) != run_id_for(make_config("globalm1-localm2", **{"data.batch_size": 2}))
    with pytest.raises(ConfigError, match="compute.micro_batch_size: must divide data.batch_size = 4"):
        make_config("diloco", **{"compute.micro_batch_size": 3})
    with pytest.raises(ConfigError, match="compute.compile"):
        make_config("diloco", **{"compute.compile": "yes"})
    with pytest.raises(ConfigError, match="compute.outer_state"):
        make_config("diloco", **{"compute.outer_state": "gpu"})


def test_the_outer_state_stays_in_host_memory_without_a_gpu_and_copies_are_plain():
    cpu = torch.device("cpu")
    assert state_device("auto", cpu, 1 << 30) == cpu and state_device("device", cpu, 1) == cpu
    side = SideStream(cpu)
    assert side.mark() is None and side.done() is None
    with side.enter(None):
        values = {"a": torch.ones(3), "b": torch.ones(2, dtype=torch.float64)}
    moved = to_device(values, cpu)
    assert moved["a"] is values["a"] and moved["b"].dtype == torch.float32  # kept where already right
    side.join(None, list(moved.values()))


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"compute.micro_batch_size": 2, "compute.checkpoint_activations": True}])
def test_a_compiled_model_trains_like_the_eager_one(make_config, corpus, options):
    """torch.compile (inductor, here on the CPU) changes how the step runs, not what it computes, also with
    micro-batches and activations recomputed inside the compiled graph: at every inner step, from the same
    parameters, the compiled trainer's loss and gradient are eq. 22's, and the eager trainer's, to fp32 rounding.

    Step by step at the same parameters, not the parameters after a few steps: fused kernels round differently,
    and AdamW turns a last-bit difference in a gradient that is all cancellation into an update differing by up
    to the learning rate, so trajectories drift apart by an amount no fp32 bound covers. The optimizer step is
    the same code in both trainers (only the model is compiled), so the same gradient gives the same step."""
    cfg = make_config("diloco", workers=2, inner_steps=2, rounds=1)
    eager = build_trainer(cfg, corpus, torch.device("cpu"), 0)
    compiled_cfg = make_config("diloco", workers=2, inner_steps=2, rounds=1, **{"compute.compile": "on", **options})
    compiled = build_trainer(compiled_cfg, corpus, torch.device("cpu"), 0)
    assert compiled.compiled and not eager.compiled
    micro = compiled_cfg.compute.micro_batch_size
    shape = dict(seq=cfg.data.seq_len, batch=cfg.data.batch_size, size=cfg.model.size, seed=cfg.seed)
    for step in range(3):
        compiled.load_params(eager.params())
        compiled.inner_opt.import_moments(eager.inner_opt.export_moments(), eager.inner_opt.step_index)
        at = eager.params_cpu()
        eager_loss, compiled_loss = float(eager.forward_backward()), float(compiled.forward_backward())
        for got, parts in ((eager_loss, 0), (compiled_loss, micro)):
            want, bound = eq22_loss_bound(corpus, parts, **shape, at=at, step=step)
            assert abs(got - want) <= bound, f"step {step}: loss {got!r}, eq. 22's {want!r}, fp32 allows {bound:.3g}"
        want, got = gradients(eager), gradients(compiled)
        eager_bounds = assert_is_eq22_gradient(want, corpus, 0, **shape, at=at, step=step)
        compiled_bounds = assert_is_eq22_gradient(got, corpus, micro, **shape, at=at, step=step)
        for n in want:  # each within its bound of the exact gradient, so within their sum of each other
            error = float((got[n] - want[n]).double().norm())
            assert error <= eager_bounds[n] + compiled_bounds[n], f"step {step}, {n}: {error:.3g} from the eager one"
        eager.inner_opt.step()
        compiled.inner_opt.step()
    assert compiled.inner_opt.step_index == eager.inner_opt.step_index == 3


@pytest.mark.parametrize("setting", ["auto", "on"])
def test_a_compiler_failure_is_logged_and_training_goes_on_eager_unless_compile_is_on(corpus, setting, caplog):
    """A GPU without Triton support, or a machine without a C++ compiler, makes torch.compile fail at the
    first step: "auto" says why and trains uncompiled; "on" makes it the error it asked for."""

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    trainer = trainer_for(corpus, ComputeConfig(compile=setting if setting == "auto" else "off"))
    trainer._compile = setting  # a compiled trainer whose compiler fails (real torch.compile, a failing backend)
    trainer._train_forward, trainer.compiled = torch.compile(trainer.model, backend=broken_backend), True
    if setting == "on":
        with pytest.raises(Exception, match="no compiler here"):
            trainer.inner_step()
        return
    trainer.forward_backward()
    assert not trainer.compiled and "torch.compile failed" in caplog.text and "no compiler here" in caplog.text
    assert_is_eq22_gradient(gradients(trainer), corpus, 0)  # eq. 22, to this machine's fp32 rounding


@pytest.mark.slow
def test_compiling_ahead_changes_nothing_but_when_the_compiler_runs(make_config, corpus):
    """A peer compiles before joining (``warm_up``): the run that follows is the one it would have been."""
    cfg = make_config("diloco", workers=2, inner_steps=2, rounds=1, **{"compute.compile": "on", "compute.micro_batch_size": 2})
    # One thread: compiled CPU kernels split their reductions among threads in an order that varies from run to
    # run (two cold runs differ by ~1e-7), and AdamW can turn such a difference in a gradient that is all
    # cancellation into one of up to the learning rate, so no tolerance would hold on every CPU. With one thread
    # the same code on the same inputs gives the same bits: "the same run" is then checked as it is meant.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cold, warm = (build_trainer(cfg, corpus, torch.device("cpu"), 0) for _ in range(2))
        assert warm.warm_up() > 0 and all(p.grad is None for p in warm.model.parameters())
        assert warm.inner_opt.step_index == 0 and build_trainer(make_config("diloco"), corpus, torch.device("cpu"), 0).warm_up() == 0.0
        for _ in range(2):
            assert torch.equal(cold.inner_step(), warm.inner_step())
        for n, p in warm.params().items():
            assert torch.equal(p, cold.params()[n]), n
    finally:
        torch.set_num_threads(threads)
