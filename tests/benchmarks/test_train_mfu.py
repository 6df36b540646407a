"""specgate's ttt_loss against the dense reference that benchmarks/train_mfu.py keeps for its
`dense` rows: the same loss, stats and gradients, so the benchmark compares like with like."""

from types import SimpleNamespace

import pytest
import torch
from test_benchmarks import load
from transformers import LlamaConfig

from specgate.model.drafter import Eagle3Drafter, drafter_config
from specgate.pipeline.train import soft_cross_entropy, ttt_loss

TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip


def _setup(device="cpu", t=40, seed=0):
    """A random drafter over a 120-token draft vocabulary, and a batch of two sequences, the second
    right-padded, with holes in the loss mask; the target's argmax falls outside the draft vocabulary
    at some positions, so every filter of the loss is exercised."""
    gen = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(**TARGET)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config(cfg, 120, [0, 1, 2]))
    token_ids = torch.randperm(300, generator=gen)[:120].sort().values
    head = torch.randn(300, 64, generator=gen)
    # init_from_target reads only the target's head and final norm
    target = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=head),
                             get_decoder=lambda: SimpleNamespace(norm=SimpleNamespace(weight=torch.ones(64))))  # fmt: skip
    drafter.init_from_target(target, token_ids)
    drafter, embed = drafter.to(device), torch.nn.Embedding(300, 64).to(device).requires_grad_(False)
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, t - 9 :] = False
    batch = {
        "input_ids": torch.randint(0, 300, (2, t), generator=gen) * valid,
        "loss_mask": (torch.rand(2, t, generator=gen) > 0.3) & valid,
        "valid": valid,
        "aux_hidden": torch.randn(2, t, 3 * 64, generator=gen).to(torch.bfloat16) * valid[..., None],
        "final_hidden": torch.randn(2, t, 64, generator=gen).to(torch.bfloat16) * valid[..., None],
    }
    return drafter, embed, head.to(device), {k: v.to(device) for k, v in batch.items()}


def _run(loss_fn, drafter, embed, head, batch, ttt):
    drafter.zero_grad(set_to_none=True)
    total, stats = loss_fn(drafter, embed, head, batch, ttt, 0.8)
    total.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return total.detach(), [{k: v.detach().clone() for k, v in s.items()} for s in stats], grads


@pytest.mark.parametrize(("t", "ttt"), [(40, 4), (5, 7)])  # (5, 7): fewer anchors than TTT steps
def test_ttt_loss_equals_the_dense_reference(t, ttt):
    dense = load("train_mfu").dense_ttt_loss
    drafter, embed, head, batch = _setup(t=t)
    new_total, new_stats, new_grads = _run(ttt_loss, drafter, embed, head, batch, ttt)
    ref_total, ref_stats, ref_grads = _run(dense, drafter, embed, head, batch, ttt)
    assert len(new_stats) == len(ref_stats) == min(ttt, t - 2)
    counts = [int(s["count"]) for s in ref_stats]
    assert 0 < min(counts) and max(counts) < 2 * t  # the masks removed rows, and rows are left
    if t >= 40:  # enough rows that the random draft's argmax hits the target's a few times
        assert sum(int(s["correct"]) for s in ref_stats) > 0
    for new, ref in zip(new_stats, ref_stats, strict=True):
        assert int(new["count"]) == int(ref["count"]) and int(new["correct"]) == int(ref["correct"])
        torch.testing.assert_close(new["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_total, ref_total, rtol=1e-5, atol=1e-6)
    assert new_grads.keys() == ref_grads.keys() and "midlayer.self_attn.q_proj.weight" in new_grads
    for name in ref_grads:
        torch.testing.assert_close(new_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_ttt_loss_with_no_anchors():
    drafter, embed, head, batch = _setup(t=2)
    total, stats = ttt_loss(drafter, embed, head, batch, 3)
    assert stats == [] and total == 0.0


def test_soft_cross_entropy_is_the_cross_entropy_against_p():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=gen).to(torch.bfloat16).requires_grad_()
    target_p = torch.softmax(torch.randn(8, 11, generator=gen), -1)
    targets = torch.tensor([7, 0, 3, 3, 5])
    got = soft_cross_entropy(logits, target_p, targets)
    want = -(target_p[targets] * torch.log_softmax(logits.float(), -1)).sum(-1)
    assert got.dtype == torch.float32  # bf16 logits, fp32 arithmetic
    torch.testing.assert_close(got, want)
    upstream = torch.rand(5, generator=gen)
    torch.testing.assert_close(*(torch.autograd.grad(x, logits, upstream)[0] for x in (got, want)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled GPU path needs a GPU")
@pytest.mark.parametrize("autocast", [False, True])
def test_ttt_loss_on_a_gpu_equals_the_dense_reference(autocast):
    """flex_attention and the compiled soft cross-entropy against the pre-change code on the same GPU."""
    dense = load("train_mfu").dense_ttt_loss
    drafter, embed, head, batch = _setup(device="cuda", t=300)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        new_total, new_stats, new_grads = _run(ttt_loss, drafter, embed, head, batch, 7)
        ref_total, ref_stats, ref_grads = _run(dense, drafter, embed, head, batch, 7)
    tol = 2e-2 if autocast else 1e-3  # bf16 operands: flash-style accumulation order differs from the scores matrix
    for new, ref in zip(new_stats, ref_stats, strict=True):
        assert int(new["count"]) == int(ref["count"])
        assert abs(int(new["correct"]) - int(ref["correct"])) <= max(1, int(ref["count"]) // 50)
    assert abs(float(new_total) - float(ref_total)) <= tol * abs(float(ref_total))
    for name in ref_grads:
        rel = (new_grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()
        assert rel < tol * 3, (name, float(rel))


def test_flex_hardware_flops_on_given_numbers():
    m = load("train_mfu")
    # T = 256: 2 query blocks of 128. Step 0 computes the 3 causal blocks, step 1 those and 2 more (one per
    # query block for step 1's keys): 8 blocks of 128 x 128, each 4 * d FLOPs per score for one head of d = 2
    args = dict(batch=1, seq=256, ttt=2, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=3, draft_vocab=5, rows=[1, 1])
    full, flex = m.model_flops(**args), m.model_flops(**args, attention="flex")
    assert flex["model_flops"] == full["model_flops"]  # what counts as useful work does not change
    causal = 2 * 4 * (256 * 257 / 2) + 2 * 4 * (256 * 257 / 2 + 256)
    assert flex["forward"]["attention_causal"] == causal
    assert flex["hardware_flops"] == flex["model_flops"] + 3 * (2 * 4 * 8 * 128 * 128 - causal)
    assert m.target_side_flops(batch=1, seq=3, hidden=4, vocab=10, draft_vocab=5, draft_matmul=False) == 2 * 3 * 4 * 10
