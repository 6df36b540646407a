"""Widen a Llama-family model, and its EAGLE-3 drafter, without changing what either computes.

A model of hidden size D becomes one of hidden size D' >= D with more heads, a wider MLP and
more layers. Each kernel then does the work of the larger shape (so a step costs what that
shape costs), while the outputs stay the small model's:

- The residual stream is padded with zeros, x' = [x, 0]. RMSNorm over D' dims of [x, 0]
  equals sqrt(D'/D) * RMSNorm(x) once eps' = eps * D/D', so every norm weight is scaled
  by sqrt(D/D') and `rms_norm_eps` by D/D'.
- New query and KV heads, MLP channels and hidden dims get zero weights. Their output
  projections have zero columns, so they add nothing. head_dim is kept, and each original
  query head stays in the GQA group of its own KV head: query head i of group j (of g)
  becomes head j * g' + i % g, KV head j stays j.
- New layers have every projection zero: each adds 0 to the residual stream (an identity
  layer). They come after the original layers, so the EAGLE-3 capture layers keep their ids.
- Embeddings and the LM head are padded with zero columns; the vocabulary is unchanged
  (a padded vocabulary would get logit 0 and could win the argmax).

The drafter is widened the same way to the widened target's shape: its fc reads the three
zero-padded aux states and writes a zero-padded state, and its attention input is
[embed', hidden'], each half padded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Widening:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int

    @classmethod
    def of(cls, cfg: dict) -> Widening:
        """The shape of a Hugging Face Llama config (dict), in these terms."""
        return cls(cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"],
                   cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"])  # fmt: skip


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def check_widening(cfg: dict, to: Widening, key: str = "target.widen") -> None:
    """Raise ValueError naming the config key if `to` cannot hold the model of `cfg` exactly."""
    frm = Widening.of(cfg)
    for name, small in asdict(frm).items():
        if getattr(to, name) < small:
            raise ValueError(f"config key '{key}.{name}': {getattr(to, name)} is below the model's {small}")
    if to.num_heads % to.num_kv_heads:
        raise ValueError(f"config key '{key}.num_heads': {to.num_heads} is not a multiple of num_kv_heads {to.num_kv_heads}")
    if to.num_heads // to.num_kv_heads < frm.num_heads // frm.num_kv_heads:
        raise ValueError(f"config key '{key}': {to.num_heads // to.num_kv_heads} query heads per KV head cannot hold the "
                         f"model's groups of {frm.num_heads // frm.num_kv_heads}")  # fmt: skip
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"config key '{key}': models with attention or MLP biases are not supported")


def widened_config(cfg: dict, to: Widening) -> dict:
    """The widened model's config.json: new widths, the same head_dim, eps scaled by D/D'."""
    out = dict(cfg)
    out |= {"hidden_size": to.hidden_size, "num_hidden_layers": to.num_layers, "intermediate_size": to.intermediate_size,
            "num_attention_heads": to.num_heads, "num_key_value_heads": to.num_kv_heads, "head_dim": head_dim(cfg),
            "rms_norm_eps": cfg["rms_norm_eps"] * cfg["hidden_size"] / to.hidden_size}  # fmt: skip
    return out


def _head_rows(frm: Widening, to: Widening, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the widened q and k/v projections that the original heads' rows go to."""
    g, g_new = frm.num_heads // frm.num_kv_heads, to.num_heads // to.num_kv_heads
    q_heads = [(i // g) * g_new + i % g for i in range(frm.num_heads)]
    q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in q_heads])
    return q_rows, torch.arange(frm.num_kv_heads * d)


def _place(old: torch.Tensor, shape: tuple[int, ...], rows=None, cols=None) -> torch.Tensor:
    """A zero tensor of `shape` holding `old` at rows x cols (default: the leading block)."""
    new = torch.zeros(shape, dtype=old.dtype)
    rows = torch.arange(old.shape[0]) if rows is None else rows
    if old.dim() == 1:
        new[rows] = old
    else:
        cols = torch.arange(old.shape[1]) if cols is None else cols
        new[rows[:, None], cols[None, :]] = old
    return new


def _norm(w: torch.Tensor, frm: Widening, to: Widening) -> torch.Tensor:
    """An RMSNorm weight over the padded stream: scaled by sqrt(D/D'), then padded (with ones: the
    padded dims are always 0, so their weight is free; ones keep the tensor an ordinary norm)."""
    scaled = (w.float() * math.sqrt(frm.hidden_size / to.hidden_size)).to(w.dtype)
    return torch.cat([scaled, torch.ones(to.hidden_size - frm.hidden_size, dtype=w.dtype)])


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def widen_target_tensors(state: dict[str, torch.Tensor], cfg: dict, to: Widening) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the widened model, layer by layer, so a large result never sits in memory whole."""
    frm, d = Widening.of(cfg), head_dim(cfg)
    D, q_rows, kv_rows = to.hidden_size, *_head_rows(frm, to, d)
    hidden = torch.arange(frm.hidden_size)
    for name in state:
        m = _LAYER.match(name)
        if not (m or name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")):
            raise ValueError(f"cannot widen tensor {name!r}: not part of a plain Llama model")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state and not (name == "lm_head.weight" and cfg.get("tie_word_embeddings")):
            w = state[name]
            yield name, _place(w, (w.shape[0], D), cols=hidden)
    for layer in range(to.num_layers):
        p = f"model.layers.{layer}."

        def get(suffix: str, shape: tuple[int, ...], rows=None, cols=None, layer=layer, p=p):
            if layer >= frm.num_layers:  # an identity layer: every projection zero
                return torch.zeros(shape, dtype=state["model.norm.weight"].dtype)
            return _place(state[p + suffix], shape, rows, cols)

        yield p + "self_attn.q_proj.weight", get("self_attn.q_proj.weight", (to.num_heads * d, D), q_rows)
        yield p + "self_attn.k_proj.weight", get("self_attn.k_proj.weight", (to.num_kv_heads * d, D), kv_rows)
        yield p + "self_attn.v_proj.weight", get("self_attn.v_proj.weight", (to.num_kv_heads * d, D), kv_rows)
        yield p + "self_attn.o_proj.weight", get("self_attn.o_proj.weight", (D, to.num_heads * d), None, q_rows)
        yield p + "mlp.gate_proj.weight", get("mlp.gate_proj.weight", (to.intermediate_size, D))
        yield p + "mlp.up_proj.weight", get("mlp.up_proj.weight", (to.intermediate_size, D))
        yield p + "mlp.down_proj.weight", get("mlp.down_proj.weight", (D, to.intermediate_size))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            base = state[p + norm] if layer < frm.num_layers else torch.ones_like(state["model.norm.weight"])
            yield p + norm, _norm(base, frm, to)
    yield "model.norm.weight", _norm(state["model.norm.weight"], frm, to)


def widen_drafter_tensors(state: dict[str, torch.Tensor], cfg: dict, to: Widening) -> dict[str, torch.Tensor]:
    """An EAGLE-3 drafter (SGLang's LlamaForCausalLMEagle3 names) widened to `to`, the widened target's shape.

    The drafter has the target's widths (`check_draft` requires it), so `to` is the target's widening.
    """
    frm, d = Widening.of(cfg), head_dim(cfg)
    D, q_rows, kv_rows = to.hidden_size, *_head_rows(frm, to, d)
    h, n_aux = frm.hidden_size, state["fc.weight"].shape[1] // cfg["target_hidden_size"]
    if cfg["target_hidden_size"] != h:
        raise ValueError(f"drafter hidden_size {h} differs from its target's {cfg['target_hidden_size']}")
    # the attention input is [embed (D) | hidden (D)]: each half keeps its leading h dims
    both = torch.cat([torch.arange(h), D + torch.arange(h)])
    aux = torch.cat([k * D + torch.arange(h) for k in range(n_aux)])
    out = {
        "fc.weight": _place(state["fc.weight"], (D, n_aux * D), cols=aux),
        "midlayer.self_attn.q_proj.weight": _place(state["midlayer.self_attn.q_proj.weight"], (to.num_heads * d, 2 * D), q_rows, both),
        "midlayer.self_attn.k_proj.weight": _place(state["midlayer.self_attn.k_proj.weight"], (to.num_kv_heads * d, 2 * D), kv_rows, both),
        "midlayer.self_attn.v_proj.weight": _place(state["midlayer.self_attn.v_proj.weight"], (to.num_kv_heads * d, 2 * D), kv_rows, both),
        "midlayer.self_attn.o_proj.weight": _place(state["midlayer.self_attn.o_proj.weight"], (D, to.num_heads * d), None, q_rows),
        "midlayer.mlp.gate_proj.weight": _place(state["midlayer.mlp.gate_proj.weight"], (to.intermediate_size, D)),
        "midlayer.mlp.up_proj.weight": _place(state["midlayer.mlp.up_proj.weight"], (to.intermediate_size, D)),
        "midlayer.mlp.down_proj.weight": _place(state["midlayer.mlp.down_proj.weight"], (D, to.intermediate_size)),
        "lm_head.weight": _place(state["lm_head.weight"], (state["lm_head.weight"].shape[0], D)),
        "d2t": state["d2t"],
        "t2d": state["t2d"],
    }  # fmt: skip
    for norm in ("norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight"):  # fmt: skip
        out[norm] = _norm(state[norm], frm, to)
    unknown = set(state) - set(out)
    if unknown:
        raise ValueError(f"cannot widen drafter tensors {sorted(unknown)}")
    return out


def widened_drafter_config(cfg: dict, to: Widening) -> dict:
    out = widened_config(cfg, to)
    out["num_hidden_layers"] = 1
    out["target_hidden_size"] = to.hidden_size
    return out
