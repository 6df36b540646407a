"""Model FLOP utilisation (MFU) of drafter training, with the FLOPs counted explicitly.

    python benchmarks/train_mfu.py --out train-mfu.md                 # Llama-3.1-8B shape, one GPU
    python benchmarks/train_mfu.py --specforge --out train-mfu.md     # SpecForge's trainer side by side

Builds specgate's `Eagle3Drafter` for a target of the given shape (default Llama-3.1-8B:
hidden H=4096, 32 heads, 8 KV heads, head_dim d=128, intermediate I=14336, vocab V=128256)
with a draft vocabulary of Vd=32000, and times training steps that run the training stage's
code path:

    with autocast(bf16): loss, stats = ttt_loss(drafter, embed, target_head, batch, K)
    loss.backward(); clip_grad_norm_(0.5); AdamW(betas 0.9/0.95).step(); scheduler.step(); zero_grad()

Code (`--code`): `specgate` is specgate.pipeline.train.ttt_loss as it is (flex_attention on a
GPU, one host sync per batch, the target head cast once); `dense` is a reference ttt_loss with the
same loss, stats and gradients, kept below so that one run measures both: dense TTT attention
(`ttt_attention_reference`: full [B, heads, T, T+k] scores per TTT step), a second teacher matmul for the
draft-vocabulary distribution, one host sync per step, the head re-cast per chunk.
Both call the same Eagle3Drafter (fused RMSNorm).

Precision (`--precision`): `autocast` is fp32 weights and
target head under bf16 autocast (the train stage's `precision: autocast`); `bf16-master` (the train
stage's `precision: bf16`, its GPU default) runs a bf16 copy of the drafter (specgate's
Bf16Copy) with fp32 master weights in a fused AdamW (one kernel) and a bf16 target head, the
setting of SpecForge's BF16Optimizer; `bf16` keeps weights, gradients and AdamW state in bf16 (no master copy).

Inputs are random: token ids, bf16 aux hidden states [B, T, 3H] and final hidden states
[B, T, H], every position valid and in the loss. The target head is random with the rows
outside the draft vocabulary scaled by 0.01, so the target's argmax falls inside the draft
vocabulary almost everywhere and every position counts in the loss, as with a well-chosen
draft vocabulary. The rows that count are read back from ttt_loss's per-step `count`.

FLOPs, multiply-add = 2, for N = B*T tokens and TTT steps k = 0..K-1 (every step runs the
layer on all N positions):

    fc        (k = 0 only)          2 * N * 3H * H
    q_proj                          2 * N * 2H * (heads * d)           per step
    k_proj, v_proj                  2 * 2 * N * 2H * (kv_heads * d)    per step
    o_proj                          2 * N * (heads * d) * H            per step
    MLP (gate, up, down)            3 * 2 * N * H * I                  per step
    lm_head (draft vocab)           2 * R_k * H * Vd                   per step, R_k = rows in the loss
    attention, step k               B * heads * d * 2 * 2 * (T(T+1)/2 + k*T)
                                    (q.k and p.v over the causal prefix plus the k own-chain keys)
    model FLOPs = 3 * (sum of the above)        forward + backward (= 2x forward)

MFU = model FLOPs / step time / peak. The peak is the datasheet's dense bf16 rate (989 TFLOP/s
on an H100 or H200 SXM; `--peak-tflops` for other GPUs) and, in its own column, the rate of an
8192^3 bf16 matmul measured in the same process. "Hardware TFLOP/s" adds what the hardware
does beyond the model FLOPs: `dense` computes the full T x T score matrix and masks it
(2x the causal attention), flex_attention (specgate, SpecForge) whole 128 x 128 blocks (the
causal ones plus one block per query block for each later step's keys); the target side
runs without gradients (the argmax over the full vocabulary, 2*N*H*V, and for `dense` and
SpecForge a second matmul for the draft-vocabulary distribution, 2*N*H*Vd).

SpecForge rows (`--specforge`) use SpecForge's own EAGLE-3 trainer (OnlineEagle3Model, its
draft Llama and BF16Optimizer with fp32 masters and clip 0.5, bf16 weights, flex_attention) on
the same shapes, the same teacher construction and the same FLOP count, except that its
lm_head runs on every position (R_k = N): it computes logits everywhere and masks the loss.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from common import emit, machine, markdown_table, parser, versions

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True),
}  # fmt: skip
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense, SXM
FLEX_BLOCK = 128  # flex_attention's sparsity block (specgate.model.drafter.FLEX_BLOCK)


# ---------------------------------------------------------------- the pure pieces


def model_flops(*, batch, seq, ttt, hidden, heads, kv_heads, head_dim, intermediate, draft_vocab, rows,
                attention="full") -> dict:  # fmt: skip
    """FLOPs of one training step as counted in the module docstring; rows[k] = loss rows of TTT step k.

    `attention` says what the hardware computes for the scores: "full" T x T (+ k) per step, or
    "flex" whole FLEX_BLOCK x FLEX_BLOCK blocks of the block-sparse TTT mask."""
    n, h, qd, kvd = batch * seq, hidden, heads * head_dim, kv_heads * head_dim
    per_step_linear = 2 * n * (2 * h * qd + 2 * 2 * h * kvd + qd * h + 3 * h * intermediate)
    forward = {
        "fc": 2 * n * 3 * h * h,
        "qkvo_mlp": ttt * per_step_linear,
        "lm_head": sum(2 * r * h * draft_vocab for r in rows),
        "attention_causal": sum(batch * heads * head_dim * 4 * (seq * (seq + 1) / 2 + k * seq) for k in range(ttt)),
    }
    if attention == "full":
        attention_hw = sum(batch * heads * head_dim * 4 * (seq * seq + k * seq) for k in range(ttt))
    else:  # causal blocks, and for each later step one block per query block
        nb = -(-seq // FLEX_BLOCK)
        blocks = sum(nb * (nb + 1) // 2 + k * nb for k in range(ttt))
        attention_hw = batch * heads * head_dim * 4 * blocks * FLEX_BLOCK**2
    total = 3 * sum(forward.values())
    return {"forward": forward, "model_flops": total,
            "hardware_flops": total + 3 * (attention_hw - forward["attention_causal"])}  # fmt: skip


def target_side_flops(*, batch, seq, hidden, vocab, draft_vocab, draft_matmul=True) -> float:
    """ttt_loss's no-grad teacher: argmax over the full vocabulary, softmax over the draft vocabulary
    (a second matmul unless the draft logits are columns picked from the full ones)."""
    n = batch * seq
    return 2 * n * hidden * vocab + (2 * n * hidden * draft_vocab if draft_matmul else 0)


COLUMNS = ["trainer", "precision", "batch × seq", "step ms, median (min–max)", "tokens/s", "model TFLOP/step",
           "model TFLOP/s", "MFU vs datasheet", "MFU vs measured matmul", "hardware TFLOP/s", "peak GiB"]  # fmt: skip


def tflop(x: float) -> str:
    """Three significant figures for small shapes, one decimal for real ones."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def table_row(r: dict, peak_tflops: float | None, matmul_tflops: float | None) -> list[str]:
    """One table row from a run's measurements (seconds, FLOPs); errors keep their row."""
    head = [r["trainer"], r["precision"], f"{r['batch']} × {r['seq']}"]
    if "error" in r:
        return head + [r["error"]] + ["–"] * (len(COLUMNS) - 4)
    t = statistics.median(r["step_s"])
    achieved = r["model_flops"] / t / 1e12
    return head + [
        f"{t * 1e3:.1f} ({min(r['step_s']) * 1e3:.1f}–{max(r['step_s']) * 1e3:.1f})",
        f"{r['batch'] * r['seq'] / t:.0f}",
        tflop(r["model_flops"] / 1e12),
        tflop(achieved),
        f"{achieved / peak_tflops:.3f}" if peak_tflops else "–",
        f"{achieved / matmul_tflops:.3f}" if matmul_tflops else "–",
        tflop(r["hardware_flops"] / t / 1e12),
        f"{r['peak_bytes'] / 2**30:.1f}" if r.get("peak_bytes") else "–",
    ]


# ---------------------------------------------------------------- the machine


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 50, repeats: int = 7) -> float:
    """Median TFLOP/s of an n^3 bf16 matmul (three rotating input pairs, so no cache reuse)."""
    pairs = [(torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16))
             for _ in range(3)]  # fmt: skip
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for i in range(10):
        torch.mm(*pairs[i % 3], out=out)
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            torch.mm(*pairs[i % 3], out=out)
        end.record()
        torch.cuda.synchronize(device)
        rates.append(2 * n**3 * iters / (start.elapsed_time(end) / 1e3))
    del pairs, out
    torch.cuda.empty_cache()
    return statistics.median(rates) / 1e12


class StepTimer:
    """Seconds of one step: CUDA events on a GPU (no host-side skew), the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def dims(cfg) -> dict:
    return dict(hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                intermediate=cfg.intermediate_size)  # fmt: skip


def teacher_head(vocab: int, hidden: int, token_ids: torch.Tensor, device) -> torch.Tensor:
    """A random target head whose argmax lands inside the draft vocabulary (see the docstring)."""
    head = torch.randn(vocab, hidden, device=device) * 0.02
    outside = torch.ones(vocab, dtype=torch.bool, device=device)
    outside[token_ids.to(device)] = False
    head[outside] *= 0.01
    return head


# ---------------------------------------------------------------- the dense reference


def dense_ttt_loss(drafter, embed, target_head, batch, ttt_length, decay=0.8):
    from specgate.model.drafter import ttt_attention_reference
    from specgate.pipeline.train import shift_left

    ids, valid = batch["input_ids"], batch["valid"]
    b, t = ids.shape
    token_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=ids.device))
    with torch.no_grad():
        final = batch["final_hidden"].to(target_head.dtype)
        full_argmax = torch.cat([(c @ target_head.T).argmax(-1) for c in final.split(128, dim=1)], dim=1)
        in_vocab = drafter.t2d[full_argmax] & valid
        lookup = torch.full((drafter.t2d.numel(),), -1, dtype=torch.long, device=ids.device)
        lookup[token_ids] = torch.arange(len(token_ids), device=ids.device)
        target_draft_id = lookup[full_argmax]
        target_p = torch.softmax((final @ target_head[token_ids].T).float(), dim=-1)
    positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
    h = batch["aux_hidden"].to(drafter.fc.weight.dtype)
    keys, total, stats = [], 0.0, []
    for k in range(ttt_length):
        q, key, value, residual = drafter.begin(h, embed(shift_left(ids, 1 + k)).to(h.dtype), positions + k)
        keys.append((key, value))
        out = drafter.end(ttt_attention_reference(q, keys), residual)  # the dense attention it used
        h = out
        m = t - 2 - k
        if m <= 0:
            break
        mask = batch["loss_mask"][:, 2 + k : 2 + k + m] & in_vocab[:, 1 + k : 1 + k + m]
        logits = drafter.logits(out[:, :m][mask]).float()
        p = target_p[:, 1 + k : 1 + k + m][mask]
        ce = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
        count = mask.sum()
        loss_k = ce.sum() / count.clamp(min=1)
        hit = logits.argmax(-1) == target_draft_id[:, 1 + k : 1 + k + m][mask]
        total = total + decay**k * loss_k
        stats.append({"loss": loss_k.detach(), "correct": hit.sum(), "count": count})
    return total, stats


# ---------------------------------------------------------------- specgate's trainer


def run_specgate(cfg, *, code, batch, seq, ttt, draft_vocab, precision, steps, warmup, device) -> dict:
    from specgate.model.drafter import Bf16Copy, Eagle3Drafter, drafter_config
    from specgate.pipeline.capture import default_layers
    from specgate.pipeline.train import cosine_with_warmup, ttt_loss

    loss_fn = ttt_loss if code == "specgate" else dense_ttt_loss
    torch.manual_seed(0)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    layers = [min(max(layer, 0), cfg.num_hidden_layers - 1) for layer in default_layers(cfg.num_hidden_layers)]
    token_ids = torch.randperm(vocab)[:draft_vocab].sort().values
    head = teacher_head(vocab, hidden, token_ids, device)
    norm = torch.ones(hidden, device=device)
    # init_from_target reads only the target's head and final norm: a stand-in saves building the target
    target = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=head),
                             get_decoder=lambda: SimpleNamespace(norm=SimpleNamespace(weight=norm)))  # fmt: skip
    with torch.device(device):
        drafter = Eagle3Drafter(drafter_config(cfg, draft_vocab, layers))
    drafter.init_from_target(target, token_ids)
    embed = torch.nn.Embedding(vocab, hidden, device=device).requires_grad_(False)
    copy = None
    if precision == "autocast":
        model = drafter
    else:  # the drafter's parameters in bf16, its buffers (RoPE's frequencies) as they are
        copy = Bf16Copy(drafter)
        model, embed, head = copy.model, embed.to(torch.bfloat16), head.to(torch.bfloat16)
        if precision == "bf16":  # no master: AdamW updates the bf16 weights themselves
            drafter, copy = copy.model, None
    params = [p for p in drafter.parameters() if p.requires_grad]  # what AdamW updates: the master if any
    # the training stage's AdamW (foreach: ~7 passes over every fp32 master tensor); bf16-master
    # takes the single-kernel fused one, part of the recipe this benchmark proposes for training
    fused = precision == "bf16-master" and device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0, betas=(0.9, 0.95), fused=fused or None)
    scheduler = cosine_with_warmup(optimizer, 1, steps + warmup)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast")
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [{
        "input_ids": torch.randint(0, vocab, (batch, seq), device=device, generator=gen),
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool, device=device),
        "valid": torch.ones(batch, seq, dtype=torch.bool, device=device),
        "aux_hidden": torch.randn(batch, seq, 3 * hidden, device=device, generator=gen).to(torch.bfloat16),
        "final_hidden": torch.randn(batch, seq, hidden, device=device, generator=gen).to(torch.bfloat16),
    } for _ in range(2)]  # fmt: skip

    times, rows, losses = [], [0] * ttt, []
    for i in range(warmup + steps):
        with StepTimer(device) as timer:
            with autocast:
                loss, stats = loss_fn(model, embed, head, batches[i % 2], ttt, 0.8)
            loss.backward()
            if copy is not None:
                copy.grads_to_master()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step()
            if copy is not None:
                copy.weights_from_master()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if i >= warmup:
            times.append(timer.seconds)
            rows = [max(a, int(s["count"])) for a, s in zip(rows, stats, strict=True)]
        print(f"  specgate {code} {precision} batch {batch} step {i}: {timer.seconds * 1e3:.1f} ms, loss {losses[-1]:.4f}",
              file=sys.stderr)  # fmt: skip
    if not all(math.isfinite(x) for x in losses):
        return {"error": f"non-finite loss {losses}"}
    new = code == "specgate"
    flops = model_flops(batch=batch, seq=seq, ttt=ttt, draft_vocab=draft_vocab, rows=rows,
                        attention="flex" if new and device.type == "cuda" else "full", **dims(cfg))  # fmt: skip
    extra = target_side_flops(batch=batch, seq=seq, hidden=hidden, vocab=vocab, draft_vocab=draft_vocab, draft_matmul=not new)
    return {"step_s": times, "model_flops": flops["model_flops"], "hardware_flops": flops["hardware_flops"] + extra}


# ---------------------------------------------------------------- SpecForge's trainer


def run_specforge(cfg, *, batch, seq, ttt, draft_vocab, backend, steps, warmup, device) -> dict:
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from transformers import LlamaConfig

    torch.manual_seed(0)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    draft_cfg = LlamaConfig(hidden_size=hidden, intermediate_size=cfg.intermediate_size, vocab_size=vocab,
                            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                            head_dim=dims(cfg)["head_dim"],
                            num_hidden_layers=1, max_position_embeddings=cfg.max_position_embeddings,
                            rms_norm_eps=cfg.rms_norm_eps, hidden_act=cfg.hidden_act, rope_parameters=cfg.rope_parameters,
                            pad_token_id=0)  # fmt: skip
    draft_cfg.draft_vocab_size, draft_cfg.target_hidden_size = draft_vocab, hidden
    draft_cfg.architectures = ["LlamaForCausalLMEagle3"]
    draft = LlamaForCausalLMEagle3(draft_cfg, attention_backend=backend)
    token_ids = torch.randperm(vocab)[:draft_vocab].sort().values
    with torch.no_grad():
        draft.t2d.zero_()
        draft.t2d[token_ids] = True
        draft.d2t.copy_(token_ids - torch.arange(draft_vocab))
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=ttt, attention_backend=backend).to(device=device, dtype=torch.bfloat16)
    optimizer = BF16Optimizer(model, lr=1e-4, max_grad_norm=0.5, total_steps=10_000)
    head = teacher_head(vocab, hidden, token_ids, device).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [{
        "input_ids": torch.randint(0, vocab, (batch, seq), device=device, generator=gen),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device),
        "loss_mask": torch.ones(batch, seq, 1, dtype=torch.long, device=device),
        "hidden_states": torch.randn(batch, seq, 3 * hidden, device=device, generator=gen).to(torch.bfloat16),
        "target_hidden_for_compact": torch.randn(batch, seq, hidden, device=device, generator=gen).to(torch.bfloat16),
    } for _ in range(2)]  # fmt: skip

    times = []
    for i in range(warmup + steps):
        with StepTimer(device) as timer:
            step_losses, *_ = model(target=None, target_head_weight=head, **batches[i % 2])
            loss = sum(0.8**k * x for k, x in enumerate(step_losses))
            loss.backward()
            optimizer.step()
        if i >= warmup:
            times.append(timer.seconds)
        print(f"  specforge batch {batch} step {i}: {timer.seconds * 1e3:.1f} ms, loss {float(loss):.4f}", file=sys.stderr)
    flops = model_flops(batch=batch, seq=seq, ttt=ttt, draft_vocab=draft_vocab, rows=[batch * seq] * ttt,
                        attention="flex" if backend == "flex_attention" else "full", **dims(cfg))  # fmt: skip
    extra = target_side_flops(batch=batch, seq=seq, hidden=hidden, vocab=vocab, draft_vocab=draft_vocab)
    return {"step_s": times, "model_flops": flops["model_flops"], "hardware_flops": flops["hardware_flops"] + extra}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--shape", default="llama-3.1-8b", help=" | ".join(SHAPES) + " | LlamaConfig kwargs as JSON")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2], help="sequences per step (default: 1 2)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--ttt", type=int, default=7, help="training-time-test steps K (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary size Vd (default: %(default)s)")
    p.add_argument("--code", nargs="+", default=["dense", "specgate"], choices=["dense", "specgate"],
                   help="specgate's ttt_loss as it is, and/or as it was (default: both)")  # fmt: skip
    p.add_argument("--precision", nargs="+", default=["autocast", "bf16-master"], choices=["autocast", "bf16-master", "bf16"],
                   help="specgate's precisions (default: %(default)s)")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (the min–max is the noise)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: datasheet for H100/H200)")
    p.add_argument("--no-matmul", action="store_true", help="skip the measured 8192^3 matmul reference")
    p.add_argument("--specforge", action="store_true", help="add SpecForge's trainer side by side (needs `specforge`)")
    p.add_argument("--specforge-backend", default="flex_attention", help="SpecForge attention backend (default: %(default)s)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--out", help="write the Markdown table here too")
    args = p.parse_args(argv)

    if args.specforge and importlib.util.find_spec("specforge") is None:
        sys.exit("error: --specforge needs the `specforge` package importable (pip install --no-deps specforge, "
                 "or its unpacked wheel on PYTHONPATH)")  # fmt: skip
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU (torch " + torch.__version__ + ")")
    from transformers import LlamaConfig

    from specgate.runtime import keep_freed_memory

    keep_freed_memory()  # as training does: freed activations stay in the heap instead of page-faulting back
    cfg = LlamaConfig(**(SHAPES[args.shape] if args.shape in SHAPES else json.loads(args.shape)))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops or next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
        matmul = None if args.no_matmul else matmul_tflops(device)
    else:  # a CPU has no bf16 datasheet peak worth dividing by; the matmul reference is GPU-only
        peak, matmul = args.peak_tflops, None

    runs = [(code, precision, b) for code in args.code for precision in args.precision for b in args.batch]
    runs += [("SpecForge", "bf16 + fp32 master", b) for b in args.batch] if args.specforge else []
    rows = []
    for code, precision, b in runs:
        trainer = {"specgate": "specgate", "dense": "dense reference"}.get(code, code)
        common = dict(batch=b, seq=args.seq, ttt=args.ttt, draft_vocab=args.draft_vocab, steps=args.steps,
                      warmup=args.warmup, device=device)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            if code in ("specgate", "dense"):
                r = run_specgate(cfg, code=code, precision=precision, **common)
            else:
                r = run_specforge(cfg, backend=args.specforge_backend, **common)
        except torch.OutOfMemoryError:
            r = {"error": "out of memory"}
        except Exception as e:  # SpecForge runs outside its own pins: report its failure in its row
            if code != "SpecForge":
                raise
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        if device.type == "cuda" and "error" not in r:
            r["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        rows.append(table_row({**r, "trainer": trainer, "precision": precision, "batch": b, "seq": args.seq}, peak, matmul))

    shape = args.shape if args.shape in SHAPES else json.dumps(json.loads(args.shape))
    d = dims(cfg)
    text = "\n".join([
        "# Drafter training MFU",
        "",
        f"`python {shlex.join(sys.argv if argv is None else ['benchmarks/train_mfu.py', *argv])}` · {machine(device)} · "
        f"{versions()} · {args.steps} timed steps per row after {args.warmup} warm-up steps",
        "",
        f"Target shape {shape} (H {d['hidden']}, {d['heads']}/{d['kv_heads']} heads of {d['head_dim']}, I {d['intermediate']}, "
        f"V {cfg.vocab_size}); draft vocabulary {args.draft_vocab}, {args.ttt} TTT steps. Datasheet peak: "
        + (f"{peak:.0f} TFLOP/s" if peak else "none") + "; measured 8192³ bf16 matmul: "
        + (f"{matmul:.0f} TFLOP/s" if matmul else "not measured") + ". FLOP count: `--help`.",
        "",
        markdown_table(COLUMNS, rows),
        "",
    ])  # fmt: skip
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
