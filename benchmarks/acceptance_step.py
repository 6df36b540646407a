"""Milliseconds per batched speculative step of the offline acceptance decoder.

    python benchmarks/acceptance_step.py --out acceptance-step.md               # SmolLM2 shape, batch 64
    python benchmarks/acceptance_step.py --batch 16 --profile --out step.md     # plus torch.profiler tables

The acceptance stage decodes its evaluation prompts in batches with `SpecDecoder.spec_step`:
k draft steps, one target verify of k + 1 tokens per row, and one batched draft extend over the
accepted tokens. This times that step on a random-init target of a given shape (SmolLM2-135M by
default) and a random drafter built from it; the cost of a step does not depend on the weights,
so the stage's per-step time on a real target of that shape is the same. Prompt lengths are
staggered, as real prompts are, and every row ignores EOS so the batch stays full.

Rows of the table:
  contiguous slots   every row of the batch, slots 0..B-1
  scattered slots    every other row, the case once requests finish unevenly
  target verify only the target forward of k + 1 tokens per row alone (its KV is cut back after),
                     to show how much of a step is the verify

Each row is timed `--repeats` times over `--steps` steps; the table gives the median and the
min–max (the noise). `--profile` appends torch.profiler's table of one scattered step by op.
Weights are bf16 on a GPU and fp32 on a CPU, as each serves them.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time

import torch
from common import SHAPES, emit, machine, markdown_table, parser, shape_fields, shape_name, sync, versions

WARMUP_STEPS = 3


# ---------------------------------------------------------------- the pure pieces


def ms_cell(ms: list[float]) -> str:
    """Median and range of per-repeat milliseconds."""
    return f"{statistics.median(ms):.1f} ({min(ms):.1f}–{max(ms):.1f})"


def token_budget(*, prompt_len: int, k: int, steps: int, repeats: int) -> tuple[int, int]:
    """(max_new_tokens, max_len) such that no row finishes and no cache overflows during the run:
    every spec step emits at most k + 1 tokens per row, and a verify writes k + 1 positions past the end."""
    spec_steps = 2 * WARMUP_STEPS + 2 * repeats * steps + 1  # warm-up, contiguous and scattered, one profiled
    max_new = spec_steps * (k + 1) + 1
    return max_new, prompt_len + max_new + k + 2


# ---------------------------------------------------------------- the machine


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--shape", default="smollm2", help=" | ".join(SHAPES) + " | LlamaConfig kwargs as JSON (default: %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="rows decoded together (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=400, help="longest prompt; row i has 3i tokens fewer (default: %(default)s)")
    p.add_argument("--k", type=int, default=3, help="draft steps per speculative step (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=16384, help="draft vocabulary size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="steps per timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timings per row (the min–max is the noise)")
    p.add_argument("--profile", action="store_true", help="append torch.profiler's table of one step")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--out", help="write the Markdown table here too")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU (torch " + torch.__version__ + ")")
    from transformers import LlamaConfig, LlamaForCausalLM

    from specgate.model.drafter import Eagle3Drafter, drafter_config
    from specgate.model.llama import LlamaRunner
    from specgate.model.spec_decode import Request, SpecDecoder
    from specgate.pipeline.capture import default_layers
    from specgate.runtime import keep_freed_memory

    keep_freed_memory()  # as the acceptance stage does: per-step tensors stay in the heap
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape_fields(args.shape))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    n_layers = cfg.num_hidden_layers
    # clamped so that tiny test shapes (fewer than 5 layers) still get three valid layers
    aux_layers = [min(max(layer, 0), n_layers - 1) for layer in default_layers(n_layers)]
    draft_vocab = min(args.draft_vocab, cfg.vocab_size)
    drafter = Eagle3Drafter(drafter_config(cfg, draft_vocab, aux_layers))
    drafter.init_from_target(model, torch.arange(draft_vocab))
    drafter = drafter.to(device, dtype).eval()

    max_new, max_len = token_budget(prompt_len=args.prompt_len, k=args.k, steps=args.steps, repeats=args.repeats)
    decoder = SpecDecoder(LlamaRunner(model, aux_layers), drafter, slots=args.batch, max_len=max_len)
    gen = torch.Generator().manual_seed(0)
    lengths = [max(4, args.prompt_len - 3 * i) for i in range(args.batch)]
    reqs = [Request(i, torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist(), max_new, ignore_eos=True)
            for i, n in enumerate(lengths)]  # fmt: skip
    sync(device)
    t0 = time.perf_counter()
    for r in reqs:
        decoder.prefill(r)
    sync(device)
    prefill_s = time.perf_counter() - t0

    def spec_ms(rows: list) -> float:
        sync(device)
        t = time.perf_counter()
        for _ in range(args.steps):
            decoder.spec_step(rows, args.k)
        sync(device)
        return 1e3 * (time.perf_counter() - t) / args.steps

    def verify_ms() -> float:
        slots = torch.arange(args.batch)
        base = decoder.target_cache.lengths[slots].clone()
        ids = torch.zeros(args.batch, args.k + 1, dtype=torch.long, device=device)
        sync(device)
        t = time.perf_counter()
        for _ in range(args.steps):
            decoder.target.forward(ids, decoder.target_cache, slots)
            decoder.target_cache.truncate(slots, base)  # as a verify that accepts nothing: the KV stays put
        sync(device)
        return 1e3 * (time.perf_counter() - t) / args.steps

    scattered = reqs[::2]
    for _ in range(WARMUP_STEPS):  # every path once or more first: kernels, allocator, SDPA's choice of backend
        decoder.spec_step(reqs, args.k)
        decoder.spec_step(scattered, args.k)
    verify_ms()
    timings = {"contiguous": [], "scattered": [], "verify": []}
    for i in range(args.repeats):
        timings["contiguous"].append(spec_ms(reqs))
        timings["scattered"].append(spec_ms(scattered))
        timings["verify"].append(verify_ms())
        print(f"repeat {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in timings.items()), file=sys.stderr)
    rows = [
        [f"spec step (k = {args.k}), contiguous slots", args.batch, ms_cell(timings["contiguous"])],
        [f"spec step (k = {args.k}), scattered slots", len(scattered), ms_cell(timings["scattered"])],
        [f"target verify only ({args.k + 1} tokens per row)", args.batch, ms_cell(timings["verify"])],
    ]

    profile = ""
    if args.profile:
        from torch.profiler import ProfilerActivity

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            decoder.spec_step(scattered, args.k)
            sync(device)
        sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        profile = (f"\nOne scattered-slot step (batch {len(scattered)}) by op, sorted by {sort}:\n\n```text\n"
                   f"{prof.key_averages().table(sort_by=sort, row_limit=15)}\n```\n")  # fmt: skip

    shape = shape_name(args.shape)
    text = "\n".join([
        "# Acceptance decoder: time per batched speculative step",
        "",
        f"`python {shlex.join(sys.argv if argv is None else ['benchmarks/acceptance_step.py', *argv])}` · "
        f"{machine(device)} · {versions()} · {args.repeats} repeats of {args.steps} steps per row",
        "",
        f"Random-init target {shape} in {str(dtype).removeprefix('torch.')}, aux layers {aux_layers}, draft vocabulary "
        f"{draft_vocab}; prompts of {min(lengths)}–{max(lengths)} tokens (prefill of all {args.batch}, one at a time: "
        f"{prefill_s:.2f} s).",
        "",
        markdown_table(["step", "batch", "ms per step, median (min–max)"], rows),
        profile,
    ])  # fmt: skip
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
