import math

import torch

from specgate.model.drafter import (
    Eagle3Drafter,
    cached_attention,
    drafter_config,
    ttt_attention,
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
        return sum(w * v for w, (_, v) in zip(weights, keys)) / sum(weights)

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
