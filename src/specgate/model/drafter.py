"""The EAGLE-3 drafter, matching SGLang's `LlamaForCausalLMEagle3` forward.

    h        = fc(cat(low, mid, high))               # step 0: target features -> H
             | previous step's pre-norm output        # later steps feed the draft's own state
    x        = cat(input_layernorm(embed(token)), hidden_norm(h))          # width 2H
    r        = h + o_proj(attention(q/k/v_proj(x)))    # RoPE as in the target
    out      = r + mlp(post_attention_layernorm(r))    # pre-norm output, fed to the next step
    logits   = lm_head(norm(out))                      # over the draft vocabulary

Token embeddings are the target's (frozen, passed in, never saved). A draft id i maps to
target id i + d2t[i]. Attention is left to the caller, which knows which keys a query may
see: training-time test (`ttt_attention`: flex_attention on a GPU, the written-out
`ttt_attention_reference` on a CPU) or a KV cache at inference (`cached_attention`).
`Bf16Copy` runs a drafter in bf16 while its original keeps the fp32 master weights.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
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


def rms_norm(norm: LlamaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """What `norm(x)` computes, through F.rms_norm: one fused kernel each way on a GPU instead of
    LlamaRMSNorm's chain of elementwise passes in fp32 (x upcast, squared, mean, rsqrt, scaled,
    cast back, times the weight, and as many in the backward), at every call of every TTT step.

    In fp32 the two agree to rounding; in bf16 F.rms_norm rounds once where LlamaRMSNorm rounds the
    normalised x before the weight multiplies it. Mixed dtypes (fp32 weight, bf16 x) keep
    LlamaRMSNorm, whose result is then fp32."""
    if x.dtype != norm.weight.dtype:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


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

    def init_from_target(self, target, token_ids: torch.Tensor, std: float = 0.02, copy_head: bool = False) -> None:
        """Every linear weight ~ N(0, std), norms 1, as SpecForge's drafters start.

        copy_head: lm_head = the target's head rows of the draft tokens and norm = the target's final
        norm. The copied head turns the random first outputs into confident wrong logits (loss ~21
        at step 0 on SmolLM2 against ln(draft vocab) ~9 from a random head), so it is not the default."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
        if copy_head:
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
        x = torch.cat([rms_norm(layer.input_layernorm, embeds), rms_norm(layer.hidden_norm, h)], dim=-1)
        cos, sin = self.rotary(x, positions)
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        return q, k, v, h

    def end(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B, heads, T, d] -> the step's pre-norm output [B, T, H]."""
        layer = self.midlayer
        b, _, t, _ = attn.shape
        r = residual + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        return r + layer.mlp(rms_norm(layer.post_attention_layernorm, r))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm(self.norm, out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class Bf16Copy:
    """A bf16 copy of a drafter for the forward and backward; the original keeps fp32 master weights.

    Per training step:
        loss = ttt_loss(copy.model, ...); loss.backward()
        copy.grads_to_master()            # the bf16 gradients, as fp32, on the master's parameters
        clip + optimizer.step() over the master's parameters
        copy.weights_from_master()        # the updated weights, rounded to bf16, into the copy

    Updates accumulate in fp32 (a bf16 weight cannot take a step smaller than 2^-8 of itself), while
    every matmul reads bf16 weights without autocast re-casting fp32 ones. Only parameters change
    dtype: buffers stay as they are (RoPE's inv_freq in bf16 would shift position 2048 by radians).
    The master is what a checkpoint saves, so a resume that calls weights_from_master() is exact.
    """

    def __init__(self, master: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.master = master
        self.model = copy.deepcopy(master)
        for p in self.model.parameters():
            p.data = p.data.to(dtype)
        self.master_params = [p for p in master.parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def grads_to_master(self) -> None:
        for master, p in zip(self.master_params, self.params, strict=True):
            if p.grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.copy_(p.grad)
            p.grad = None

    @torch.no_grad()
    def weights_from_master(self) -> None:
        for master, p in zip(self.master_params, self.params, strict=True):
            p.copy_(master)


def ttt_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Training-time-test attention for step k = len(keys) - 1 (see `ttt_attention_reference`).

    On a GPU through flex_attention, which never builds the score matrix. On a CPU the reference:
    flex_attention has no backward there (torch 2.11-2.13), and its CPU forward materialises
    the scores anyway.
    """
    if q.device.type == "cuda":
        return ttt_attention_flex(q, keys)
    return ttt_attention_reference(q, keys)


def ttt_attention_reference(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Training-time-test attention for step k = len(keys) - 1, written out: the definition.

    keys[0] are the step-0 keys/values (all positions, seen causally); keys[j] for j >= 1
    are step j's, and a query at position t sees only position t of each. That is what a
    query at draft step k sees at inference: the prefix's KV plus its own chain.

    Materialises the full [B, heads, T, T + k] score matrix: the CPU path and the reference that
    the fast path is tested against.
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


# flex_attention's sparsity granule: each TTT step's keys start on a block boundary, so a query
# block sees one key block of each later step (the one holding its own positions) instead of two.
FLEX_BLOCK = 128


def ttt_mask_mod(block_len: torch.Tensor):
    """Which keys a query sees when the steps' keys are laid out as [K0 | K1 | ... | Kk], each
    padded to block_len positions: step-0 keys up to its own position (kv <= q; every key of a
    later step lies beyond q), and its own position in every later step's block. block_len is
    a tensor so that a compiled kernel takes a new sequence length as data, not as a recompile."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx % block_len == q_idx)

    return mask_mod


def ttt_flex_keys(keys: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype):
    """keys -> (K, V, block_len): the steps' keys and values along the sequence axis, each step
    padded to a multiple of FLEX_BLOCK positions (the padding is masked out)."""
    t = keys[0][0].shape[2]
    block_len = -(-t // FLEX_BLOCK) * FLEX_BLOCK

    def laid_out(xs):
        return torch.cat([F.pad(x.to(dtype), (0, 0, 0, block_len - t)) for x in xs], dim=2)

    return laid_out([k for k, _ in keys]), laid_out([v for _, v in keys]), block_len


@functools.lru_cache(maxsize=64)
def ttt_block_mask(t: int, steps: int, device: torch.device):
    """The BlockMask of ttt_mask_mod for T queries and `steps` key groups; it depends on
    nothing else (right padding needs no mask: a real query never reaches a padded key)."""
    block_len = -(-t // FLEX_BLOCK) * FLEX_BLOCK
    mask_mod = ttt_mask_mod(torch.tensor(block_len, device=device))
    return create_block_mask(mask_mod, None, None, t, steps * block_len, device=device)


@functools.cache
def _compiled_flex_attention():
    # compiled once per process: eager flex_attention materialises the scores, the compiled
    # kernel does not. The default dynamic=None recompiles once to a dynamic kernel when the
    # key length changes (every TTT step) instead of compiling one kernel per step.
    return torch.compile(flex_attention)


def ttt_attention_flex(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """ttt_attention_reference through flex_attention: one fused kernel over the laid-out keys
    with a block-sparse mask. Compiled on a GPU; eager elsewhere (forward only on a CPU).

    Under autocast q and k leave RoPE in fp32 (fp32 cos/sin) while v leaves its linear layer in
    the compute dtype; flex_attention needs one dtype, so all three take v's."""
    dtype = keys[0][1].dtype
    k_all, v_all, _ = ttt_flex_keys(keys, dtype)
    block_mask = ttt_block_mask(q.shape[2], len(keys), q.device)
    attend = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    return attend(q.to(dtype), k_all, v_all, block_mask=block_mask, enable_gqa=True)


def cached_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
    """Attention of the last q.shape[2] positions over a KV cache that already holds them."""
    n, total = q.shape[2], k_all.shape[2]
    mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
