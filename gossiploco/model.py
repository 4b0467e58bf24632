"""A Llama-3-style decoder in one file: RMSNorm, rotary embeddings, SwiGLU MLP, separate
token embedding and LM head. Plain single-device code: nothing here knows about mixing,
peers or networks.

Parameter names are stable and are what ``gossiploco.blocks`` groups into blocks:
``tok_embeddings.weight``, ``layers.{i}.attention_norm.weight``, ``layers.{i}.attention.w{q,k,v,o}.weight``,
``layers.{i}.mlp_norm.weight``, ``layers.{i}.mlp.w{1,2,3}.weight``, ``norm.weight``, ``lm_head.weight``.
With tied embeddings (``ModelArgs.tie_embeddings``, as SmolLM and Llama 3.2 1B have) the LM head is the token
embedding itself: one parameter, ``tok_embeddings.weight``, and no ``lm_head.weight`` among the parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's long-context rotary scaling (``rope_type: "llama3"``): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_position_embeddings / high_freq_factor`` kept, those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 256
    max_seq_len: int = 1024
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """The LM head is the token embedding (one shared matrix)."""
    rope_scaling: Llama3RopeScaling | None = None
    """None: plain rotary frequencies theta^(-2i/d)."""


MODEL_SIZES: dict[str, ModelArgs] = {
    # ~0.1M parameters: unit tests, well under a second per step on a CPU.
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192),
    # ~1.5M parameters: CPU benchmarks.
    "small": ModelArgs(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512),
    # ~125M parameters: a GPU user's first real run.
    "125m": ModelArgs(dim=768, n_layers=17, n_heads=12, n_kv_heads=4, ffn_dim=2560),
    # ~1.5B parameters: the paper's model size.
    "1.5b": ModelArgs(dim=2048, n_layers=30, n_heads=16, n_kv_heads=8, ffn_dim=6144),
}


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or as it is if wider: half-precision activations are normalised and rotated in fp32, and a
    float64 model (the tests' reference for the fp32 one) computes in float64 throughout."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim); normalise in fp32 for stability, return in x's dtype
        xf = at_least_fp32(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def llama3_scaled(freqs: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling (Meta's ``apply_scaling``): with wavelength w = 2 pi / f and
    L = original_max_position_embeddings, f stays for w < L / high_freq_factor, becomes f / factor for
    w > L / low_freq_factor, and between them (1 - s) f / factor + s f with
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / scaling.low_freq_factor, old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, freqs)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, seq_len: int, theta: float,
                scaling: Llama3RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        freqs = llama3_scaled(freqs, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, n_heads, head_dim); pairs (x[2i], x[2i+1]) rotate by angle t * freq_i
    xf = at_least_fp32(x).unflatten(-1, (-1, 2))  # (B, T, H, head_dim/2, 2)
    x_even, x_odd = xf[..., 0], xf[..., 1]
    cos = cos[None, :, None, :]  # (1, T, 1, head_dim/2)
    sin = sin[None, :, None, :]
    out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


HALF_DTYPES = (torch.float16, torch.bfloat16)


def flash_attention_runs(device: torch.device, head_dim: int) -> bool:
    """Whether PyTorch's flash-attention kernel can run on ``device`` (for half-precision inputs): CUDA
    with compute capability 8.0 or newer, head size at most 256, flash attention enabled. Only that
    kernel (of PyTorch's fused ones) takes grouped-query attention in place (``enable_gqa``). Decided
    once, outside any compiled code (``Transformer.use_flash_gqa``)."""
    return (device.type == "cuda" and head_dim <= 256 and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(device) >= (8, 0))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.kv_heads_in_kernel = False
        """Half-precision inputs on CUDA go to the flash kernel with the kv heads read in place (see
        ``flash_attention_runs``); otherwise the kv heads are repeated for the kernel SDPA picks."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads. Where the flash
        # kernel can run, it reads the kv heads in place (enable_gqa); elsewhere enable_gqa would force
        # PyTorch's unfused math path, so the kv heads are repeated and SDPA picks its best kernel.
        repeat = self.n_heads // self.n_kv_heads
        in_kernel = repeat > 1 and self.kv_heads_in_kernel and q.is_cuda and q.dtype in HALF_DTYPES
        if repeat > 1 and not in_kernel:
            k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        # (B, n_heads, T, head_dim) in and out
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=in_kernel)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.dim % args.n_heads or args.n_heads % args.n_kv_heads:
            raise ValueError(f"dim {args.dim}, n_heads {args.n_heads}, n_kv_heads {args.n_kv_heads} do not divide")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_embeddings()
        self.reset_rope()
        self.checkpoint_activations = False
        """Training only: recompute each layer's activations in the backward pass instead of storing them."""

    def tie_embeddings(self) -> None:
        """With ``args.tie_embeddings``, make the LM head's weight the token embedding's (again, after
        parameters were replaced, e.g. by ``load_state_dict(assign=True)``); a no-op otherwise."""
        if self.args.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    def reset_rope(self) -> None:
        """(Re)compute the rotary tables (non-persistent buffers) on the CPU: after building on the meta device."""
        args = self.args
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta, args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def use_flash_gqa(self) -> None:
        """Let every attention layer pass its kv heads to the flash kernel in place, where it runs on the
        model's device (call after moving the model; a no-op elsewhere)."""
        device = self.tok_embeddings.weight.device
        for layer in self.layers:
            layer.attention.kv_heads_in_kernel = flash_attention_runs(device, layer.attention.head_dim)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic init from ``generator``: N(0, 0.02), output projections scaled by depth."""
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (B, T) int64 -> logits (B, T, vocab)
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.args.max_seq_len}")
        x = self.tok_embeddings(tokens)  # (B, T, dim)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        recompute = self.checkpoint_activations and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False) if recompute else layer(x, cos, sin)
        return at_least_fp32(self.lm_head(self.norm(x)))


def build_model(size: str, vocab_size: int, seq_len: int, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """The model of the named size with deterministic weights for ``seed`` (identical on every peer)."""
    base = MODEL_SIZES[size]
    args = ModelArgs(**{**base.__dict__, "vocab_size": vocab_size, "max_seq_len": max(seq_len, 1)})
    model = Transformer(args)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(device)


def meta_model(size: str, vocab_size: int = 256) -> Transformer:
    """The model of a named size on the meta device: parameter names and shapes, nothing allocated."""
    base = MODEL_SIZES[size]
    with torch.device("meta"):
        return Transformer(ModelArgs(**{**base.__dict__, "vocab_size": vocab_size, "max_seq_len": 8}))


def count_parameters(size: str, vocab_size: int = 256) -> int:
    """Parameter count of a named size, computed on the meta device (nothing allocated)."""
    return sum(p.numel() for p in meta_model(size, vocab_size).parameters())
