import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from specgate.model.drafter import (
    FLEX_BLOCK,
    Bf16Copy,
    Eagle3Drafter,
    cached_attention,
    drafter_config,
    rms_norm,
    ttt_attention,
    ttt_attention_flex,
    ttt_attention_reference,
    ttt_block_mask,
    ttt_flex_keys,
    ttt_mask_mod,
)


def test_ttt_attention_hand_computed():
    # one head, head_dim 1, three positions, step 2: query t sees step-0 keys 0..t and the
    # step-1 and step-2 keys at position t only.
    q = torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1)
    k0, v0 = torch.tensor([0.0, 1.0, 2.0]).view(1, 1, 3, 1), torch.tensor([10.0, 20.0, 30.0]).view(1, 1, 3, 1)
    k1, v1 = torch.tensor([1.0, 0.0, -1.0]).view(1, 1, 3, 1), torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1)
    k2, v2 = torch.tensor([0.5, 0.5, 0.5]).view(1, 1, 3, 1), torch.tensor([-5.0, -6.0, -7.0]).view(1, 1, 3, 1)
    out = ttt_attention(q, [(k0, v0), (k1, v1), (k2, v2)]).flatten().tolist()

    def expected(t):
        qt = q.flatten()[t].item()
        keys = [(k0.flatten()[s].item(), v0.flatten()[s].item()) for s in range(t + 1)]
        keys += [(k1.flatten()[t].item(), v1.flatten()[t].item()), (k2.flatten()[t].item(), v2.flatten()[t].item())]
        weights = [math.exp(qt * k) for k, _ in keys]
        return sum(w * v for w, (_, v) in zip(weights, keys, strict=True)) / sum(weights)

    # position 0 by hand: scores q*k = [0, 1, 0.5] -> softmax weights over values [10, 1, -5]
    w = [math.exp(0), math.exp(1), math.exp(0.5)]
    assert math.isclose(out[0], (10 * w[0] + 1 * w[1] - 5 * w[2]) / sum(w), rel_tol=1e-5)
    for t in range(3):
        assert math.isclose(out[t], expected(t), rel_tol=1e-5)


def test_ttt_attention_step0_is_causal_attention_and_respects_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    torch.testing.assert_close(ttt_attention(q, [(k, v)]), cached_attention(q, k, v))


def test_ttt_step_equals_inference_chain(tiny_llama_dir):
    """Step k of training-time test computes what the k-th chained draft step computes at inference."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    cfg = drafter_config(target.config, 64, [1, 3, 4])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(target, torch.arange(0, 128, 2))
    emb = target.get_input_embeddings()
    t, anchor = 6, 3
    aux, ids = torch.randn(1, t, 3 * cfg.target_hidden_size), torch.randint(0, 100, (1, t + 3))
    pos = torch.arange(t)[None]
    with torch.no_grad():
        # training view: steps 0..2 over all anchors
        keys, h = [], aux
        for k in range(3):
            q, kk, vv, res = drafter.begin(h, emb(ids[:, 1 + k : 1 + k + t]), pos + k)
            keys.append((kk, vv))
            h = drafter.end(ttt_attention(q, keys), res)
        train_out = h[0, anchor]
        # inference view: extend over positions 0..anchor, then chain two steps
        q, k0, v0, res = drafter.begin(aux[:, : anchor + 1], emb(ids[:, 1 : anchor + 2]), pos[:, : anchor + 1])
        state = drafter.end(cached_attention(q, k0, v0), res)[:, -1:]
        kc, vc = k0, v0
        for step in (1, 2):
            p = torch.tensor([[anchor + step]])
            q, k1, v1, res = drafter.begin(state, emb(ids[:, anchor + 1 + step : anchor + 2 + step]), p)
            kc, vc = torch.cat([kc, k1], 2), torch.cat([vc, v1], 2)
            state = drafter.end(cached_attention(q, kc, vc), res)
    torch.testing.assert_close(state[0, 0], train_out, rtol=1e-4, atol=1e-5)


def _ttt_inputs(steps: int, t: int, *, heads=4, kv_heads=2, d=16, batch=2, dtype=torch.float32, device="cpu", seed=0):
    """Random q and `steps` (k, v) pairs with GQA (heads != kv_heads), as leaves that take gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, t, d, generator=gen, device=device, dtype=dtype).requires_grad_()
    keys = [tuple(torch.randn(batch, kv_heads, t, d, generator=gen, device=device, dtype=dtype).requires_grad_()
                  for _ in range(2)) for _ in range(steps)]  # fmt: skip
    return q, keys


def _grads(out: torch.Tensor, q: torch.Tensor, keys, upstream: torch.Tensor) -> list[torch.Tensor]:
    leaves = [q, *[x for kv in keys for x in kv]]
    return torch.autograd.grad(out, leaves, upstream)


# T = 200 is no multiple of FLEX_BLOCK: each step's keys are padded, and a query block spans two key blocks
@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_flex_path_forward_equals_reference_on_cpu(steps):
    q, keys = _ttt_inputs(steps, 200, seed=steps)
    # flex_attention refuses CPU inputs that take gradients (it has no CPU backward): they are checked below
    q, keys = q.detach(), [(k.detach(), v.detach()) for k, v in keys]
    torch.testing.assert_close(ttt_attention_flex(q, keys), ttt_attention_reference(q, keys), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_flex_layout_and_mask_give_the_reference_values_and_gradients(steps):
    """The laid-out keys under ttt_mask_mod, attended densely with autograd, are the reference function."""
    q, keys = _ttt_inputs(steps, 200, seed=10 + steps)
    k_all, v_all, block_len = ttt_flex_keys(keys, q.dtype)
    assert block_len == 256 and k_all.shape[2] == steps * 256
    mask = create_mask(ttt_mask_mod(torch.tensor(block_len)), None, None, 200, k_all.shape[2], device="cpu")
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
    ref = ttt_attention_reference(q, keys)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(ref)
    for got, want in zip(_grads(out, q, keys, upstream), _grads(ref, q, keys, upstream), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_block_mask_holds_every_needed_block_and_one_per_later_step():
    t, steps = 300, 4  # 3 query blocks; each step's keys padded to 384
    block_mask = ttt_block_mask(t, steps, torch.device("cpu"))
    dense = create_mask(ttt_mask_mod(torch.tensor(384)), None, None, t, steps * 384, device="cpu")[0, 0]
    dense = torch.nn.functional.pad(dense, (0, 0, 0, 3 * FLEX_BLOCK - t))
    needed = dense.view(3, FLEX_BLOCK, steps * 3, FLEX_BLOCK).any(-1).any(1)
    listed = block_mask.to_dense()[0, 0].bool()
    assert torch.equal(listed, needed)
    # query block i: step-0 key blocks 0..i, then block i of each later step
    assert listed.sum(1).tolist() == [1 + (steps - 1), 2 + (steps - 1), 3 + (steps - 1)]


def test_ttt_attention_takes_the_reference_on_a_cpu():
    q, keys = _ttt_inputs(3, 40)
    assert torch.equal(ttt_attention(q, keys), ttt_attention_reference(q, keys))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex_attention kernel needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_path_on_a_gpu_equals_reference(dtype):
    """ttt_attention on a GPU (compiled flex_attention): values and gradients against the reference in fp64."""
    for steps in (1, 2, 7):
        q, keys = _ttt_inputs(steps, 700, heads=8, kv_heads=2, d=64, dtype=dtype, device="cuda", seed=steps)
        out = ttt_attention(q, keys)
        q64 = q.detach().double().requires_grad_()
        keys64 = [tuple(x.detach().double().requires_grad_() for x in kv) for kv in keys]
        ref = ttt_attention_reference(q64, keys64)
        upstream = torch.randn_like(ref)
        got = [out.double(), *[g.double() for g in _grads(out, q, keys, upstream.to(dtype))]]
        want = [ref, *_grads(ref, q64, keys64, upstream)]
        for g, w in zip(got, want, strict=True):
            rel = (g - w).norm() / w.norm()
            assert rel < (1e-2 if dtype == torch.bfloat16 else 1e-3), (steps, float(rel))


def test_bf16_copy_keeps_fp32_masters_and_buffers():
    cfg = drafter_config(
        type("C", (), {"to_dict": lambda self: dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                                     num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5,
                                                     max_position_embeddings=256, rope_theta=10000.0),
                       "hidden_size": 32})(), 50, [0, 1, 2])  # fmt: skip
    torch.manual_seed(0)
    master = Eagle3Drafter(cfg)
    copy = Bf16Copy(master)
    assert all(p.dtype == torch.bfloat16 for p in copy.params) and all(p.dtype == torch.float32 for p in copy.master_params)
    assert copy.model.rotary.inv_freq.dtype == torch.float32  # RoPE's frequencies are not rounded to bf16
    for p in copy.params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in copy.params]
    copy.grads_to_master()
    for m, g in zip(copy.master_params, grads, strict=True):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g.float())
    assert all(p.grad is None for p in copy.params)
    with torch.no_grad():
        for m in copy.master_params:
            m.add_(1e-4)  # far below bf16's resolution at these weights: the master keeps it, the copy rounds
    copy.weights_from_master()
    for m, p in zip(copy.master_params, copy.params, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_rms_norm_computes_what_the_llama_norm_computes():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = (torch.randn(3, 5, 64) * 3).requires_grad_()
    got, want = rms_norm(norm, x), norm(x)
    torch.testing.assert_close(got, want)
    upstream = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, [x, norm.weight], upstream),
                               torch.autograd.grad(want, [x, norm.weight], upstream))  # fmt: skip
    # bf16: one rounding instead of two
    norm16 = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    norm16.weight.data = norm.weight.data.to(torch.bfloat16)
    x16 = x.detach().to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(norm16, x16).float(), norm16(x16).float(), rtol=2e-2, atol=2e-2)
    assert rms_norm(norm, x16).dtype == torch.float32  # mixed dtypes: LlamaRMSNorm's own promotion
