"""Benchmark: model FLOP utilisation (MFU) of drafter training, on random inputs.

Builds specgate's own `Eagle3Drafter` (specgate.drafter) for a target of the given shape
(default: Llama-3.1-8B, hidden H=4096, 32 heads, 8 KV heads, head_dim d=128,
intermediate I=14336, target vocab V=128256) with a draft vocabulary of Vd=32000, and
times training steps that run exactly the training code path of specgate.train:

    with autocast(bf16):  loss, stats = train.ttt_loss(drafter, embed, target_head, batch, K)
    loss.backward(); clip_grad_norm_(0.5); AdamW(betas 0.9/0.95).step(); scheduler.step(); zero_grad()

Precision `autocast` is what train.py does on a GPU (fp32 master weights, bf16 autocast);
`bf16` keeps weights, gradients and AdamW state in bf16 (no master copy).

Inputs are random: token ids, bf16 aux hidden states [B, T, 3H] and final hidden
states [B, T, H]; loss_mask and valid are all ones. The target head is random with the
rows outside the draft vocabulary scaled by 0.01, so the target's argmax falls inside
the draft vocabulary at (almost) every position and every position counts in the loss,
as with a well-chosen draft vocabulary. The rows that actually count are read back
from ttt_loss's per-step `count` and used for the lm_head FLOPs.

FLOPs are counted explicitly, multiply-add = 2 FLOPs, for N = B*T tokens and TTT steps
k = 0..K-1 (every step runs the layer on all N positions):

    fc        (k = 0 only)          2 * N * 3H * H
    q_proj                          2 * N * 2H * (heads * d)           per step
    k_proj, v_proj                  2 * 2 * N * 2H * (kv_heads * d)    per step
    o_proj                          2 * N * (heads * d) * H            per step
    MLP (gate, up, down)            3 * 2 * N * H * I                  per step
    lm_head (draft vocab)           2 * R_k * H * Vd                   per step, R_k = rows counted
    attention, step k               B * heads * d * 2 * 2 * (T(T+1)/2 + k*T)
                                    (q.k scores and p.v over the causal prefix of step 0
                                     plus the k own-chain keys of each query)
    model FLOPs = 3 * (sum of the above)        forward + backward (= 2x forward)

MFU = model FLOPs / step time / peak, with peak = 989 TFLOP/s (H100/H200 SXM dense bf16)
and, separately, the rate of an 8192^3 bf16 matmul measured in the same process.
Reported beside it, not in the model FLOPs:
  * attention as implemented: ttt_attention computes the full T x T score matrix and
    masks it, so the hardware does 2x the causal attention FLOPs;
  * the target-side work inside ttt_loss (no grad): the target argmax over the full
    vocabulary, 2*N*H*V, and the renormalised target distribution, 2*N*H*Vd.

Command (one GPU):  python -m specgate.bench_train_mfu --batch 1 2 --precision autocast bf16 --out r.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from specgate.drafter import Eagle3Drafter, drafter_config
from specgate.train import cosine_with_warmup, ttt_loss

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16, datasheet

LLAMA31_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, layers=32)


def target_config(hidden, heads, kv_heads, head_dim, intermediate, vocab, layers):
    """A Llama-3.1-shaped target config (only the drafter is built from it)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    return LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, num_hidden_layers=layers,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
                       rope_parameters=rope, bos_token_id=128000, eos_token_id=128001)  # fmt: skip


def model_flops(*, batch, seq, ttt, hidden, heads, kv_heads, head_dim, intermediate, draft_vocab, rows) -> dict:
    """FLOPs of one training step (see the module docstring); rows[k] = loss rows of step k."""
    n, h, qd, kvd = batch * seq, hidden, heads * head_dim, kv_heads * head_dim
    per_step_linear = 2 * n * (2 * h * qd + 2 * 2 * h * kvd + qd * h + 3 * h * intermediate)
    fwd = {
        "fc": 2 * n * 3 * h * h,
        "qkvo_mlp": ttt * per_step_linear,
        "lm_head": sum(2 * r * h * draft_vocab for r in rows),
        "attention_causal": sum(batch * heads * head_dim * 4 * (seq * (seq + 1) / 2 + k * seq) for k in range(ttt)),
    }
    attn_full = sum(batch * heads * head_dim * 4 * (seq * seq + k * seq) for k in range(ttt))
    total = 3 * sum(fwd.values())
    return {"forward": fwd, "model_flops": total,
            "hardware_flops_attention_as_implemented": total + 3 * (attn_full - fwd["attention_causal"])}  # fmt: skip


def target_side_flops(*, batch, seq, hidden, vocab, draft_vocab) -> float:
    n = batch * seq
    return 2 * n * hidden * vocab + 2 * n * hidden * draft_vocab


def matmul_rate(n: int = 8192, iters: int = 50, repeats: int = 7, device="cuda") -> dict:
    """Median TFLOP/s of an n^3 bf16 matmul (random inputs, three rotating input pairs)."""
    pairs = [(torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16))
             for _ in range(3)]  # fmt: skip
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for i in range(10):
        torch.mm(*pairs[i % 3], out=out)
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            torch.mm(*pairs[i % 3], out=out)
        end.record()
        torch.cuda.synchronize()
        rates.append(2 * n**3 * iters / (start.elapsed_time(end) / 1e3))
    del pairs, out
    torch.cuda.empty_cache()
    return {"n": n, "tflops_median": statistics.median(rates) / 1e12, "tflops_all": [round(r / 1e12, 1) for r in rates]}


def build(shape: dict, draft_vocab: int, precision: str, device, seed: int = 0):
    """Drafter (specgate's class, initialised by its own init_from_target), frozen embedding, target head."""
    torch.manual_seed(seed)
    cfg = drafter_config(target_config(**shape), draft_vocab, [1, shape["layers"] // 2 - 1, shape["layers"] - 4])
    vocab, hidden = shape["vocab"], shape["hidden"]
    token_ids = torch.randperm(vocab)[:draft_vocab].sort().values  # CPU, as in train.py's init_from_target call
    head = torch.randn(vocab, hidden, device=device) * 0.02
    outside = torch.ones(vocab, dtype=torch.bool, device=device)
    outside[token_ids] = False
    head[outside] *= 0.01  # the target's argmax lands in the draft vocabulary (see docstring)
    norm_w = torch.ones(hidden, device=device)
    shim = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=head),
                           get_decoder=lambda: SimpleNamespace(norm=SimpleNamespace(weight=norm_w)))  # fmt: skip
    with torch.device(device):
        drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(shim, token_ids)
    embed = torch.nn.Embedding(vocab, hidden, device=device).requires_grad_(False)
    if precision == "bf16":
        drafter, embed, head = drafter.to(torch.bfloat16), embed.to(torch.bfloat16), head.to(torch.bfloat16)
    return cfg, drafter, embed, head


def random_batch(b: int, t: int, hidden: int, vocab: int, device, gen: torch.Generator) -> dict:
    kw = dict(device=device, generator=gen)
    return {
        "input_ids": torch.randint(0, vocab, (b, t), **kw),
        "loss_mask": torch.ones(b, t, dtype=torch.bool, device=device),
        "valid": torch.ones(b, t, dtype=torch.bool, device=device),
        "aux_hidden": torch.randn(b, t, 3 * hidden, **kw).to(torch.bfloat16),
        "final_hidden": torch.randn(b, t, hidden, **kw).to(torch.bfloat16),
    }


def run_one(shape: dict, *, batch: int, seq: int, ttt: int, draft_vocab: int, precision: str, steps: int, warmup: int,
            device="cuda") -> dict:  # fmt: skip
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg, drafter, embed, head = build(shape, draft_vocab, precision, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0, betas=(0.9, 0.95))
    scheduler = cosine_with_warmup(optimizer, 1, steps + warmup)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "autocast")
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [random_batch(batch, seq, shape["hidden"], shape["vocab"], device, gen) for _ in range(2)]

    def step(b):
        with autocast:
            loss, stats = ttt_loss(drafter, embed, head, b, ttt, 0.8)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss, stats

    times, rows_seen, losses = [], None, []
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss, stats = step(batches[i % len(batches)])
        if cuda:
            end.record()
            torch.cuda.synchronize()
        dt = start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t0
        rows = [int(s["count"]) for s in stats]
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append(dt)
            rows_seen = rows if rows_seen is None else [max(a, c) for a, c in zip(rows_seen, rows, strict=True)]
    t_med = statistics.median(times)
    dims = dict(hidden=shape["hidden"], heads=shape["heads"], kv_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                intermediate=shape["intermediate"], draft_vocab=draft_vocab)  # fmt: skip
    fl = model_flops(batch=batch, seq=seq, ttt=ttt, rows=rows_seen, **dims)
    extra = target_side_flops(batch=batch, seq=seq, hidden=shape["hidden"], vocab=shape["vocab"], draft_vocab=draft_vocab)
    out = {
        "batch": batch, "seq": seq, "ttt": ttt, "precision": precision, "steps_timed": len(times), "warmup": warmup,
        "step_s_median": t_med, "step_s_min": min(times), "step_s_max": max(times),
        "tokens_per_s": batch * seq / t_med, "rows_per_ttt_step": rows_seen,
        "drafter_params_M": round(sum(p.numel() for p in params) / 1e6, 1),
        "model_tflop_per_step": fl["model_flops"] / 1e12, "forward_tflop_parts": {k: v / 1e12 for k, v in fl["forward"].items()},
        "model_tflops_achieved": fl["model_flops"] / t_med / 1e12,
        "mfu_vs_989": fl["model_flops"] / t_med / PEAK_BF16,
        "hw_tflops_incl_full_attention_and_target_side": (fl["hardware_flops_attention_as_implemented"] + extra) / t_med / 1e12,
        "target_side_tflop_per_step": extra / 1e12,
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "finite": all(math.isfinite(x) for x in losses),
    }  # fmt: skip
    if cuda:
        out["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--precision", nargs="+", default=["autocast", "bf16"], choices=["autocast", "bf16"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shape", default="llama31_8b",
                   help="llama31_8b, or JSON with hidden/heads/kv_heads/head_dim/intermediate/vocab/layers")  # fmt: skip
    p.add_argument("--no-matmul", action="store_true", help="skip the 8192^3 matmul reference")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write all results as JSON here")
    args = p.parse_args(argv)
    shape = LLAMA31_8B if args.shape == "llama31_8b" else json.loads(args.shape)
    cuda = torch.device(args.device).type == "cuda"
    result = {
        "command": "python -m specgate.bench_train_mfu " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(), "shape": shape, "draft_vocab": args.draft_vocab,
        "peak_bf16_tflops_datasheet": PEAK_BF16 / 1e12, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }  # fmt: skip
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    if cuda and not args.no_matmul:
        result["matmul_8192"] = matmul_rate()
        print("matmul 8192^3 bf16:", json.dumps(result["matmul_8192"]), flush=True)
    runs = []
    for precision in args.precision:
        for b in args.batch:
            try:
                r = run_one(shape, batch=b, seq=args.seq, ttt=args.ttt, draft_vocab=args.draft_vocab, precision=precision,
                            steps=args.steps, warmup=args.warmup, device=args.device)  # fmt: skip
            except torch.OutOfMemoryError as e:
                r = {"batch": b, "precision": precision, "error": f"OOM: {str(e)[:300]}"}
            if "matmul_8192" in result and "model_tflops_achieved" in r:
                r["mfu_vs_measured_matmul"] = r["model_tflops_achieved"] / result["matmul_8192"]["tflops_median"]
            runs.append(r)
            print(json.dumps(r), flush=True)
    result["runs"] = runs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\n| precision | batch | step ms | tok/s | model TFLOP/step | TFLOP/s | MFU (989) | MFU (matmul) | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['precision']} | {r['batch']} | {r['error'][:60]} |")
            continue
        print(f"| {r['precision']} | {r['batch']} | {r['step_s_median'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
              f"{r['model_tflop_per_step']:.2f} | {r['model_tflops_achieved']:.1f} | {r['mfu_vs_989']:.3f} | "
              f"{r.get('mfu_vs_measured_matmul', float('nan')):.3f} | {r.get('peak_mem_GiB', '-')} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
