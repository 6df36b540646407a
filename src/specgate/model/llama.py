"""A Llama-family forward with per-request KV slots, readable top to bottom.

It runs the weights of a Hugging Face Llama model (no copy), so it matches the target
exactly in structure, but owns its KV cache: each request has a slot, the cache keeps
per-slot lengths, and one forward appends the same number of new tokens to each row of
a batch. It can also return the EAGLE-3 auxiliary hidden states of the new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.llama.modeling_llama import rotate_half

# Not cuDNN: its SDPA builds a graph on the host for each new key width, which changes every decode
# step. On an H200 that was 2.4 ms of CPU per call against 0.05 ms on the GPU: acceptance ran at
# 140 ms per step at batch 64, with 7 ms of GPU work; 34 ms without it (benchmarks/acceptance_step.py).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class KVCache:
    """K and V for `slots` requests of up to `max_len` tokens each, for every layer."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        # On a CPU, bf16 keys and values are held and attended in fp32: PyTorch's CPU attention
        # kernel is ~5x slower in bf16 than in fp32 (8.4 against 1.7 ms per layer for a 32-row
        # decode step of SmolLM2), and a bf16 decode step spent 81% of its time there.
        self.attend_dtype = torch.float32 if torch.device(device).type == "cpu" and dtype == torch.bfloat16 else dtype
        self.k = torch.zeros(shape, dtype=self.attend_dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.attend_dtype, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.max_len = max_len
        # Scattered slots (requests finish at different times) are gathered in one copy and attended in one
        # call. Row by row costs one call per row per layer: on an H200 acceptance ran at ~1 s per step at
        # batch 64, and on 2 CPU cores a plain step at batch 7 with one hole took 95 ms against 64 ms with
        # its slots in order (74 ms gathered), so a step's time hung on where finished requests had been.
        # On a GPU, repeat the KV heads for grouped-query attention: the memory-efficient SDPA kernel
        # takes a mask but not GQA, and without it SDPA falls back to the math path (41 against 34 ms
        # per acceptance step at batch 64 on an H200).
        self.expand_kv_heads = torch.device(device).type != "cpu"

    def attend(self, layer: int, slots: torch.Tensor, q, k, v) -> torch.Tensor:
        """Append k, v ([B, kv, n, d]) after each slot's current length and attend causally.

        Lengths are advanced by the caller (`advance`) once all layers have run.
        """
        n = q.shape[2]
        start = self.lengths[slots]
        end = start + n
        width = int(end.max())  # the one host sync per layer: attention spans keys 0..width
        if width > self.max_len:
            raise ValueError(f"KV slot overflow: {width} > max_len {self.max_len}")
        # one scatter for the whole batch: [B, n] (slot, position) pairs take k, v as [B, n, kv, d]
        pos = start[:, None] + torch.arange(n, device=start.device)[None, :]
        rows_idx = slots.to(self.k.device)[:, None].expand_as(pos)
        self.k[layer, rows_idx, :, pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer, rows_idx, :, pos] = v.transpose(1, 2).to(self.v.dtype)
        first, rows = int(slots[0]), len(slots)
        if rows > 1 and not bool((slots == torch.arange(first, first + rows, device=slots.device)).all()):
            return self._attend_rows(layer, slots.to(self.k.device), q, start, width)
        return self._attend_rows(layer, slice(first, first + rows), q, start, width)

    def _attend_rows(self, layer, rows, q, start, width: int) -> torch.Tensor:
        n = q.shape[2]
        keys, values = self.k[layer, rows, :, :width], self.v[layer, rows, :, :width]
        # query i of row r sits at position start[r] + i and sees keys 0..start[r] + i
        pos_q = start[:, None] + torch.arange(n, device=q.device)[None, :]
        mask = torch.arange(width, device=q.device)[None, None, :] <= pos_q[:, :, None]
        groups = q.shape[1] // keys.shape[1]
        if groups > 1 and self.expand_kv_heads:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        gqa = keys.shape[1] != q.shape[1]
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask[:, None], enable_gqa=gqa)
        return out.to(q.dtype)

    def advance(self, slots: torch.Tensor, n: int | torch.Tensor) -> None:
        self.lengths[slots] += n

    def truncate(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Forget everything past `lengths` (rejected draft tokens)."""
        self.lengths[slots] = lengths


class LlamaRunner:
    """The target's forward over its own HF weights, with KV slots and aux capture."""

    def __init__(self, hf_model, aux_layers: list[int] | None = None):
        self.model = hf_model.eval()
        self.body = hf_model.get_decoder()
        cfg = hf_model.config
        self.cfg = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.aux_layers = list(aux_layers or [])
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        return KVCache(self.cfg.num_hidden_layers, slots, self.cfg.num_key_value_heads, max_len, self.head_dim,
                       self.dtype, self.device)  # fmt: skip

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, slots: torch.Tensor, *, logits_for: str = "all"):
        """ids [B, n] appended to each slot. Returns (logits [B, n|1, V], aux [B, n, 3H] or None).

        logits_for="last" computes the head for the last position only (prefill).
        """
        b, n = ids.shape
        positions = cache.lengths[slots][:, None] + torch.arange(n, device=ids.device)[None, :]
        x = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        aux = {}
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, n, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(b, n, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(b, n, -1, self.head_dim).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            o = cache.attend(i, slots, q, k, v)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.aux_layers:  # EAGLE-3 layer id L = output of decoder layer L
                aux[i] = x
        cache.advance(slots, n)
        final = self.body.norm(x if logits_for == "all" else x[:, -1:])
        logits = self.model.get_output_embeddings()(final)
        aux_out = torch.cat([aux[L] for L in self.aux_layers], dim=-1) if aux else None
        return logits, aux_out
