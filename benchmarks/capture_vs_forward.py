"""Hidden-state capture throughput against a plain target forward over the same batches.

    python benchmarks/capture_vs_forward.py --target results/target --out capture.md
    python benchmarks/capture_vs_forward.py --shape llama-3.1-8b --out capture-8b.md   # GPU

Plain forward is what serving prefill runs: the full model with logits for the last position
only. Capture is the capture stage's per-batch work: the target body with layer hooks,
unpadding, dtype conversion, and shard serialisation on a writer thread. Both run in one
process on identical batches and alternate within every repeat, so the ratio is measured side
by side and slow drift of the machine hits both equally. The capture stage is meant to keep
at least 0.85 of plain-forward throughput.

The target is either a materialised target directory (what the target stage writes) or a
random-init model built from a config (`--shape`): bf16 on a GPU, fp32 on a CPU. Speed does
not depend on the weights, so a random model of a shape stands in for the real one. Token ids
come from a tokenized set; only the sequence lengths matter, and ids beyond a shape's
vocabulary are wrapped into it.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import SHAPES, emit, machine, markdown_table, parser, shape_fields, shape_name, sync, versions

# ---------------------------------------------------------------- the pure pieces


COLUMNS = ["repeat", "plain forward tok/s", "capture tok/s", "capture ÷ plain"]


def result_rows(tokens_per_pass: int, timings: list[tuple[float, float]]) -> list[list[str]]:
    """One row per repeat from (plain seconds, capture seconds), then the medians."""
    plain = [tokens_per_pass / p for p, _ in timings]
    capture = [tokens_per_pass / c for _, c in timings]
    ratio = [p / c for p, c in timings]  # capture tok/s ÷ plain tok/s = plain seconds ÷ capture seconds
    rows = [[str(i + 1), f"{plain[i]:.0f}", f"{capture[i]:.0f}", f"{ratio[i]:.3f}"] for i in range(len(timings))]
    rows.append(["**median**", f"{statistics.median(plain):.0f}", f"{statistics.median(capture):.0f}",
                 f"**{statistics.median(ratio):.3f}**"])  # fmt: skip
    return rows


# ---------------------------------------------------------------- the machine and the model


def random_target(shape: dict, device: torch.device):
    """A random-init Llama of the given shape, built directly on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    # bf16 is what a GPU serves and captures in; CPU bf16 matmuls are slow paths that would
    # distort the ratio, and the CPU pipeline runs fp32 targets
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    return model.eval()


# ---------------------------------------------------------------- the benchmark


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--target", default="results/target", help="materialised target directory (default: %(default)s)")
    which.add_argument("--shape", help="random-init target instead: " + " | ".join(SHAPES) + " | LlamaConfig kwargs as JSON")
    p.add_argument("--tokens", default="results/tokens/train.safetensors", help="tokenized set (default: %(default)s)")
    p.add_argument("--batches", type=int, default=6, help="batches per pass, spread over the length distribution")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per batch, as capture.batch_tokens")
    p.add_argument("--capture-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=3, help="plain/capture pass pairs (the spread is the noise)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--out", help="write the Markdown table here too")
    args = p.parse_args(argv)

    from specgate.pipeline.capture import (
        DTYPES,
        _write_shard,
        capture_batch,
        default_layers,
        load_target,
        pad_batch,
        plan_batches,
    )
    from specgate.pipeline.tokenize import TokenizedDataset
    from specgate.runtime import keep_freed_memory

    keep_freed_memory()  # as the capture stage does: without it a CPU pass pays page faults every batch
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no GPU (torch " + torch.__version__ + ")")
    if not Path(args.tokens).exists():
        sys.exit(f"error: no tokenized set at {args.tokens} (run the workflow's tokenize stage, or pass --tokens)")
    if args.shape:
        shape = shape_fields(args.shape)
        model = random_target(shape, device)
        target = f"random-init {shape_name(args.shape)}"
    else:
        if not (Path(args.target) / "config.json").exists():
            sys.exit(f"error: no target at {args.target} (run the workflow's target stage, or pass --shape)")
        model = load_target(args.target, device)
        target = f"`{args.target}`"
    n_layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    # clamped so that tiny test shapes (fewer than 5 layers) still get three valid layers
    layers = [min(max(layer, 0), n_layers - 1) for layer in default_layers(n_layers)]

    data = TokenizedDataset(args.tokens)
    lengths = [data.length(i) for i in range(len(data))]
    plan = plan_batches(lengths, args.batch_tokens)
    # batches spread over the length distribution, not only the longest
    picked = [plan[int(i * (len(plan) - 1) / max(args.batches - 1, 1))] for i in range(min(args.batches, len(plan)))]
    inputs = [(pad_batch([data[i][0].long() % vocab for i in b], device), [lengths[i] for i in b]) for b in picked]
    tokens_per_pass = sum(sum(n) for _, n in inputs)

    def plain() -> None:
        for ids, _ in inputs:
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    def capture(tmpdir: str) -> None:
        # the capture stage's loop: at most one shard in flight on the writer thread
        with ThreadPoolExecutor(max_workers=1) as writer:
            pending = None
            for k, (ids, lens) in enumerate(inputs):
                aux, final = capture_batch(model, layers, ids, lens, DTYPES[args.capture_dtype])
                if pending is not None:
                    pending.result()
                pending = writer.submit(_write_shard, Path(tmpdir) / f"s{k}.safetensors", {"aux": aux, "final": final})
            pending.result()

    def seconds(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    timings = []
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmpdir:
        plain(), capture(tmpdir)  # warm-up of both sides: kernels, allocator, writer thread
        for i in range(args.repeats):
            timings.append((seconds(plain), seconds(lambda: capture(tmpdir))))
            print(f"repeat {i + 1}/{args.repeats}: plain {timings[-1][0]:.3f} s, capture {timings[-1][1]:.3f} s", file=sys.stderr)

    params = sum(w.numel() for w in model.parameters()) / 1e6
    model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    text = "\n".join([
        "# Hidden-state capture vs plain forward",
        "",
        f"`python {shlex.join(sys.argv if argv is None else ['benchmarks/capture_vs_forward.py', *argv])}` · "
        f"{machine(device)} · {versions()} · {args.repeats} repeats, each one plain pass then one capture pass",
        "",
        f"Target {target}: {params:.1f} M parameters in {model_dtype}, layers {layers} captured as {args.capture_dtype}; "
        f"{len(inputs)} batches, {tokens_per_pass} tokens per pass. Goal: capture ÷ plain ≥ 0.85.",
        "",
        markdown_table(COLUMNS, result_rows(tokens_per_pass, timings)),
        "",
    ])  # fmt: skip
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
