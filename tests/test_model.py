import time

import pytest
import torch

from gossiploco.blocks import block_names, block_of, group_by_block, select_blocks, select_parameters
from gossiploco.errors import ConfigError
from gossiploco.model import MODEL_SIZES, RMSNorm, apply_rope, build_model, count_parameters, rope_tables


def test_forward_shapes_and_determinism():
    a = build_model("tiny", 256, 32, seed=3)
    b = build_model("tiny", 256, 32, seed=3)
    c = build_model("tiny", 256, 32, seed=4)
    tokens = torch.randint(0, 256, (2, 32))
    assert a(tokens).shape == (2, 32, 256)
    assert torch.equal(a(tokens), b(tokens))
    assert not torch.equal(a(tokens), c(tokens))


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model("tiny", 256, 16, seed=0)
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    assert torch.allclose(model(tokens)[0, :10], model(changed)[0, :10], atol=1e-6)
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_rmsnorm_and_rope_math():
    norm = RMSNorm(8, eps=0.0)
    x = torch.randn(3, 8)
    assert torch.allclose(norm(x), x / x.pow(2).mean(-1, keepdim=True).sqrt(), atol=1e-6)
    # Rotary embedding is a rotation: norms are kept, and q.k depends only on the relative offset.
    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 1, 8).expand(1, 16, 1, 8)
    k = torch.randn(1, 1, 1, 8).expand(1, 16, 1, 8)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    dots = (rq[0, :, 0] @ rk[0, :, 0].T)
    assert torch.allclose(dots[3, 1], dots[7, 5], atol=1e-5)


def test_named_sizes_have_the_advertised_parameter_counts():
    assert count_parameters("tiny") < 500_000
    assert 1e6 < count_parameters("small") < 5e6
    assert abs(count_parameters("125m") / 125e6 - 1) < 0.05
    assert abs(count_parameters("1.5b") / 1.5e9 - 1) < 0.05


def test_tiny_step_is_well_under_a_second_on_cpu():
    model = build_model("tiny", 256, 128, seed=0)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (8, 129))
    start = time.perf_counter()
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert (time.perf_counter() - start) / 3 < 5.0  # about 0.02 s alone; generous for a loaded CI machine


def test_every_parameter_is_in_exactly_one_block_in_model_order():
    model = build_model("tiny", 256, 16, seed=0)
    names = [n for n, _ in model.named_parameters()]
    groups = group_by_block(names)
    assert list(groups) == ["embed", "layers.0.attention", "layers.0.mlp", "layers.1.attention", "layers.1.mlp", "norm", "lm_head"]
    assert list(groups) == block_names(MODEL_SIZES["tiny"].n_layers)
    assert sorted(n for ns in groups.values() for n in ns) == sorted(names)
    assert groups["layers.0.attention"] == [
        "layers.0.attention_norm.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
    ]
    assert block_of("lm_head.weight") == "lm_head" and block_of("tok_embeddings.weight") == "embed"


def test_block_selection_patterns():
    blocks = block_names(4)
    assert select_blocks(blocks, ["layers.1"]) == ["layers.1.attention", "layers.1.mlp"]
    assert select_blocks(blocks, ["layers.*.attention"]) == [f"layers.{i}.attention" for i in range(4)]
    assert select_blocks(blocks, ["*"]) == blocks
    assert select_blocks(blocks, ["lm_head", "embed"]) == ["embed", "lm_head"]  # model order
    with pytest.raises(ConfigError, match="no block matches 'layers.1.mlpx'"):
        select_blocks(blocks, ["layers.1.mlpx"])
    # "layers.1" must not select layers.10+ (prefix match stops at a dot)
    assert select_blocks(block_names(12), ["layers.1"]) == ["layers.1.attention", "layers.1.mlp"]
    names = [n for n, _ in build_model("tiny", 256, 16, seed=0).named_parameters()]
    assert select_parameters(names, ["lm_head", "norm"]) == ["norm.weight", "lm_head.weight"]
