"""SpecForge's EAGLE-3 trainer model on the same shapes and FLOP count as specgate.bench_train_mfu.

Imports only SpecForge 0.2.0's training pieces (no SGLang, no wandb, no datasets) from an
unzipped wheel: specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3,
specforge.algorithms.eagle3.model.OnlineEagle3Model (TTT loop, compact teacher from hidden
states + target head) and specforge.optimizer.BF16Optimizer (fp32 masters, clip 0.5),
with SpecForge's default attention backend (flex_attention) and bf16 weights, as its
trainer builds them. SpecForge's pins (torch 2.11.0, transformers 5.8.1, sglang 0.5.14)
are not installed: the host's torch 2.11 and transformers run it.

FLOPs: specgate.bench_train_mfu.model_flops with lm_head rows = B*T at every TTT step
(SpecForge computes logits at every position and masks the loss).

usage: PYTHONPATH=/tmp/sf:src python gpu/bench_specforge_mfu.py [--batch 1 2] [--backend flex_attention] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specgate.bench_train_mfu import LLAMA31_8B, PEAK_BF16, model_flops


def draft_config(shape: dict, draft_vocab: int):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                      vocab_size=shape["vocab"], num_hidden_layers=1, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      hidden_act="silu", rope_parameters=rope, pad_token_id=0)  # fmt: skip
    cfg.draft_vocab_size = draft_vocab
    cfg.target_hidden_size = shape["hidden"]
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    return cfg


def run_one(shape, *, batch, seq, ttt, draft_vocab, backend, steps, warmup, device="cuda") -> dict:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    vocab, hidden = shape["vocab"], shape["hidden"]
    draft = LlamaForCausalLMEagle3(draft_config(shape, draft_vocab), attention_backend=backend)
    token_ids = torch.randperm(vocab)[:draft_vocab].sort().values
    with torch.no_grad():
        draft.t2d.zero_()
        draft.t2d[token_ids] = True
        draft.d2t.copy_(token_ids - torch.arange(draft_vocab))
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=ttt, attention_backend=backend).to(device=device, dtype=torch.bfloat16)
    opt = BF16Optimizer(model, lr=1e-4, max_grad_norm=0.5, total_steps=10_000)
    head = torch.randn(vocab, hidden, device=device) * 0.02
    outside = torch.ones(vocab, dtype=torch.bool, device=device)
    outside[token_ids.to(device)] = False
    head[outside] *= 0.01  # same teacher as specgate.bench_train_mfu: argmax inside the draft vocab
    head = head.to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1)

    def make():
        return {
            "input_ids": torch.randint(0, vocab, (batch, seq), device=device, generator=gen),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
            "loss_mask": torch.ones(batch, seq, 1, dtype=torch.long, device=device),
            "hidden_states": torch.randn(batch, seq, 3 * hidden, device=device, generator=gen).to(torch.bfloat16),
            "final": torch.randn(batch, seq, hidden, device=device, generator=gen).to(torch.bfloat16),
        }

    batches = [make() for _ in range(2)]
    times, losses = [], []
    for i in range(warmup + steps):
        b = batches[i % 2]
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        plosses, *_ = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], target=None,
                            loss_mask=b["loss_mask"], hidden_states=b["hidden_states"],
                            target_hidden_for_compact=b["final"], target_head_weight=head)  # fmt: skip
        loss = sum(0.8**k * pl for k, pl in enumerate(plosses))
        loss.backward()
        opt.step()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        dt = start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append(dt)
        print(f"  specforge step {i} {dt * 1e3:.1f} ms loss {losses[-1]:.4f}", flush=True)
    t_med = statistics.median(times)
    fl = model_flops(batch=batch, seq=seq, ttt=ttt, hidden=hidden, heads=shape["heads"], kv_heads=shape["kv_heads"],
                     head_dim=shape["head_dim"], intermediate=shape["intermediate"], draft_vocab=draft_vocab,
                     rows=[batch * seq] * ttt)  # fmt: skip
    out = {"trainer": "specforge-0.2.0 OnlineEagle3Model + BF16Optimizer", "backend": backend, "batch": batch, "seq": seq,
           "ttt": ttt, "steps_timed": len(times), "step_s_median": t_med, "step_s_min": min(times), "step_s_max": max(times),
           "tokens_per_s": batch * seq / t_med, "model_tflop_per_step": fl["model_flops"] / 1e12,
           "model_tflops_achieved": fl["model_flops"] / t_med / 1e12, "mfu_vs_989": fl["model_flops"] / t_med / PEAK_BF16,
           "loss_first_last": [losses[0], losses[-1]]}  # fmt: skip
    if cuda:
        out["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--backend", default="flex_attention")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shape", default="llama31_8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    a = p.parse_args()
    shape = LLAMA31_8B if a.shape == "llama31_8b" else json.loads(a.shape)
    import transformers

    res = {"command": "python gpu/bench_specforge_mfu.py " + " ".join(sys.argv[1:]), "torch": torch.__version__,
           "transformers": transformers.__version__, "machine": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}  # fmt: skip
    for b in a.batch:
        try:
            r = run_one(shape, batch=b, seq=a.seq, ttt=a.ttt, draft_vocab=a.draft_vocab, backend=a.backend, steps=a.steps,
                        warmup=a.warmup, device=a.device)  # fmt: skip
        except Exception as e:  # report, don't hide: the wheel runs outside its pins
            import traceback

            r = {"batch": b, "error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
        print(json.dumps(r), flush=True)
        res["runs"].append(r)
        if a.out:
            json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
