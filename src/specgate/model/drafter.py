"""The EAGLE-3 drafter, matching SGLang's `LlamaForCausalLMEagle3` forward.

    h        = fc(cat(low, mid, high))               # step 0: target features -> H
             | previous step's pre-norm output        # later steps feed the draft's own state
    x        = cat(input_layernorm(embed(token)), hidden_norm(h))          # width 2H
    r        = h + o_proj(attention(q/k/v_proj(x)))    # RoPE as in the target
    out      = r + mlp(post_attention_layernorm(r))    # pre-norm output, fed to the next step
    logits   = lm_head(norm(out))                      # over the draft vocabulary

Token embeddings are the target's (frozen, passed in, never saved). A draft id i maps to
target id i + d2t[i]. Attention is left to the caller, which knows which keys a query may
see: training-time test (`ttt_attention`) or a KV cache at inference (`cached_attention`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)


def drafter_config(target_config, draft_vocab_size: int, aux_layers: list[int]) -> LlamaConfig:
    """A one-layer Llama config with the target's widths and RoPE, in the layout SGLang loads."""
    t = target_config.to_dict()
    keep = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_scaling",
            "rope_theta", "bos_token_id", "eos_token_id", "pad_token_id", "vocab_size"]  # fmt: skip
    cfg = LlamaConfig(**{k: t[k] for k in keep if t.get(k) is not None})
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.num_hidden_layers = 1
    cfg.tie_word_embeddings = False
    cfg.draft_vocab_size = draft_vocab_size
    cfg.target_hidden_size = target_config.hidden_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}
    return cfg


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, 2H] -> q [B, heads, T, d], k and v [B, kv_heads, T, d], RoPE applied."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def init_from_target(self, target, token_ids: torch.Tensor, std: float = 0.02) -> None:
        """Random layer weights; lm_head = the target's head rows of the draft tokens; norm = target's."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[token_ids])
            self.norm.weight.copy_(target.get_decoder().norm.weight)
        self.d2t.copy_(token_ids - torch.arange(len(token_ids)))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    # -- the forward, in the pieces that training and inference share --------------

    def begin(self, h: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        """Inputs of one step -> (q, k, v, residual). h: [B,T,H] (or [B,T,3H_target] at step 0)."""
        if h.shape[-1] != self.config.hidden_size:
            h = self.fc(h)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], dim=-1)
        cos, sin = self.rotary(x, positions)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        return q, k, v, h

    def end(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B, heads, T, d] -> the step's pre-norm output [B, T, H]."""
        layer = self.midlayer
        b, _, t, _ = attn.shape
        r = residual + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def ttt_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Training-time-test attention for step k = len(keys) - 1.

    keys[0] are the step-0 keys/values (all positions, seen causally); keys[j] for j >= 1
    are step j's, and a query at position t sees only position t of each. That is what a
    query at draft step k sees at inference: the prefix's KV plus its own chain.
    """
    k0, v0 = keys[0]
    rep = q.shape[1] // k0.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    extra_v = []
    for kj, vj in keys[1:]:
        kj, vj = kj.repeat_interleave(rep, 1), vj.repeat_interleave(rep, 1)
        scores.append((q * kj).sum(-1, keepdim=True) * scale)
        extra_v.append(vj)
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :t] @ v0
    for j, vj in enumerate(extra_v):
        out = out + probs[..., t + j : t + j + 1] * vj
    return out


def cached_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
    """Attention of the last q.shape[2] positions over a KV cache that already holds them."""
    n, total = q.shape[2], k_all.shape[2]
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
