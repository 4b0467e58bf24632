"""The Hugging Face Llama layout of our model: tensor names, the rotary layout, ``config.json``.

``transformers.LlamaForCausalLM`` computes exactly what ``gossiploco.model.Transformer`` computes
(RMSNorm, SwiGLU, grouped-query attention, tied or untied LM head, Llama 3.1's rotary scaling, no biases) with
three differences of form:

* names: ``layers.{i}.attention.wq.weight`` is ``model.layers.{i}.self_attn.q_proj.weight`` and so
  on (``NAMES``; the MLP's w1, w2, w3 are gate_proj, down_proj, up_proj);
* the rotary layout: ours rotates the pairs (x[2i], x[2i+1]) of each head, Llama's ``rotate_half``
  the pairs (x[i], x[i + d/2]), both by the angle t * theta^(-2i/d). Reordering the output rows of
  wq and wk within each head to [0, 2, 4, ..., d-2, 1, 3, ..., d-1] moves our pair i to Llama's pair
  i, in q and k alike, so every attention score q.k is unchanged (``to_hf`` does it, ``from_hf``
  undoes it);
* the configuration: ``hf_config`` writes the ``LlamaConfig`` fields from our ``ModelArgs``.

Plain tensor code: nothing here imports ``transformers``.
"""

from __future__ import annotations

import re

import torch

from gossiploco.model import ModelArgs

TensorDict = dict[str, torch.Tensor]

NAMES: list[tuple[str, str]] = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.mlp.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]
"""(our name, Hugging Face name); ``{i}`` is the layer index."""
HF_MARKER = "model.embed_tokens.weight"
"""A tensor only the Hugging Face layout has: how a file's layout is recognised."""
EXPORT_FORMAT = "gossiploco-hf-llama-1"
"""The ``gossiploco`` metadata entry of an exported ``model.safetensors`` (whose ``format`` is transformers' "pt")."""


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), theirs) for ours, theirs in NAMES]
_FROM_HF = [(_pattern(theirs), ours) for ours, theirs in NAMES]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    return None


def rotary_row_order(head_dim: int) -> torch.Tensor:
    """Within one head: Llama's row j is our row ``order[j]`` (even rows first, then odd rows)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _reorder_heads(weight: torch.Tensor, heads: int, order: torch.Tensor) -> torch.Tensor:
    # weight: (heads * head_dim, dim); reorder the rows of each head's (head_dim, dim) slice
    head_dim = weight.shape[0] // heads
    return weight.view(heads, head_dim, -1)[:, order].reshape(weight.shape).contiguous()


def _heads(name: str, args: ModelArgs) -> int | None:
    """How many heads the rows of ``name`` (our name) hold, if rotary applies to its output."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def to_hf(params: TensorDict, args: ModelArgs) -> TensorDict:
    """Our parameters under Hugging Face Llama names, wq and wk rows in Llama's rotary layout.
    ``KeyError`` names a parameter that has no Llama counterpart."""
    return _convert(params, args, _TO_HF, rotary_row_order(args.dim // args.n_heads), ours_first=True)


def from_hf(tensors: TensorDict, args: ModelArgs) -> TensorDict:
    """The inverse of ``to_hf``: Llama-named tensors back to our names and rotary layout. ``KeyError``
    names a tensor that is not one of ours."""
    return _convert(tensors, args, _FROM_HF, torch.argsort(rotary_row_order(args.dim // args.n_heads)), ours_first=False)


def _convert(tensors: TensorDict, args: ModelArgs, table: list[tuple[re.Pattern, str]], order: torch.Tensor,
             ours_first: bool) -> TensorDict:
    """Rename every tensor by ``table`` and reorder the rotary rows of wq and wk by ``order``."""
    out = {}
    for name, value in tensors.items():
        target = _rename(name, table)
        if target is None:
            raise KeyError(name)
        heads = _heads(name if ours_first else target, args)
        out[target] = _reorder_heads(value, heads, order) if heads else value.contiguous()
    return out


def is_hf_layout(names) -> bool:
    return HF_MARKER in set(names)


def _rope_parameters(args: ModelArgs) -> dict:
    """transformers 5's ``rope_parameters``: the base, and Llama 3.1's scaling when the model has it."""
    scaling = args.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    return {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def hf_config(args: ModelArgs, special_id: int) -> dict:
    """``config.json`` of ``LlamaForCausalLM`` for ``args``. ``special_id``: the document separator, which
    is end of text, padding and (when generating from nothing) beginning of text. The rotary settings are
    written both as transformers 5 reads them (``rope_parameters``) and as 4.x does (``rope_theta``,
    ``rope_scaling``); a tied model (``args.tie_embeddings``) has no ``lm_head.weight`` tensor."""
    rope = _rope_parameters(args)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if args.rope_scaling is not None else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": special_id,
        "eos_token_id": special_id,
        "pad_token_id": special_id,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
