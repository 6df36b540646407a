"""The reference engine's KV cache: a batch over scattered slots attends as each row would alone."""

import torch

from specgate.model.llama import KVCache


def _filled_cache(expand_kv_heads: bool = False) -> KVCache:
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(layers=1, slots=6, kv_heads=2, max_len=32, head_dim=8, dtype=torch.float32, device="cpu")
    cache.expand_kv_heads = expand_kv_heads  # on by default on a GPU
    for slot, length in enumerate([5, 9, 3, 12, 7, 1]):  # different history per slot
        q = torch.randn(1, 4, length, 8, generator=gen)
        k, v = torch.randn(1, 2, length, 8, generator=gen), torch.randn(1, 2, length, 8, generator=gen)
        cache.attend(0, torch.tensor([slot]), q, k, v)
        cache.advance(torch.tensor([slot]), length)
    return cache


def test_scattered_slots_attend_as_each_row_alone():
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([4, 1, 3])  # not contiguous: the path a batch takes once requests finish unevenly
    q = torch.randn(3, 4, 2, 8, generator=gen)
    k, v = torch.randn(3, 2, 2, 8, generator=gen), torch.randn(3, 2, 2, 8, generator=gen)
    cache, expanded = _filled_cache(), _filled_cache(expand_kv_heads=True)
    out = cache.attend(0, slots, q, k, v)
    torch.testing.assert_close(expanded.attend(0, slots, q, k, v), out)  # KV heads repeated by hand, as on a GPU
    torch.testing.assert_close(expanded.k, cache.k)
    # each row equals attention over its own keys only (causal within the 2 new tokens), not the batch's widest
    for i, (slot, length) in enumerate(zip([4, 1, 3], [7, 9, 12], strict=True)):
        keys, values = cache.k[0, slot, :, : length + 2], cache.v[0, slot, :, : length + 2]
        mask = torch.arange(length + 2)[None, :] <= (length + torch.arange(2))[:, None]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        ref = sdpa(q[i : i + 1], keys[None], values[None], attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out[i : i + 1], ref)
    assert cache.lengths.tolist() == [5, 9, 3, 12, 7, 1]  # attend appends; only advance moves the lengths
