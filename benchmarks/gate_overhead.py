#!/usr/bin/env python3
"""What the load gate costs inside SGLang, on a given model shape with dummy weights.

For each variant this starts one SGLang server on random weights, drives it closed-loop with
random input ids at each concurrency level, stops it, and writes one Markdown table:

  nospec            plain decoding, no draft model: the baseline
  trueoff           EAGLE-3 with specgate's true-off gate; off at every level >= --disable-at
  trueoff_synced    the same, with spec v2's per-step seq_lens sync instead of the host mirror
  always            EAGLE-3 always drafting (3 steps, topk 1, 4 draft tokens), no gate
  steps0            SGLang's own adaptive speculation pinned at 0 draft steps (no specgate plugin)

With the gate off a variant should decode as fast as nospec; the ratio columns show how close it
gets. Dummy draft weights make drafting useless, so "always" is an upper bound on what drafting costs.

With --rounds R >= 2 the two variants' servers share the GPU and are measured side by side: at each
level they take turns, R blocks each, in the order A B B A A B ..., so a drift in the GPU's clocks or
the host hits both alike. Each round's ratio pairs the two blocks of that round; the table gives the
mean ratio with its range over rounds, and the spread of the baseline's own blocks (its noise).

With --backend flashinfer the first server on a host compiles its attention kernels (a minute or
two); each server gets 15 minutes to become ready.

Needs a GPU host with SGLang and specgate installed (pip install -e .). Example:
  python benchmarks/gate_overhead.py --shape llama-3.1-8b --backend triton \
      --variants nospec,trueoff,steps0 --concurrency 16,64,128 --out gate_overhead.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

from specgate.sglang.plugin import ENV as GATE_ENV
from specgate.sweep.managed_server import ManagedServer, ServerFailed, free_port

VARIANTS = ("nospec", "trueoff", "trueoff_synced", "always", "steps0")
GATED = ("trueoff", "trueoff_synced")
LLAMA3_ROPE = {"rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
SHAPES = {
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                     "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], **LLAMA3_ROPE},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
}  # fmt: skip
LLAMA_DEFAULTS = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
                  "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "rope_theta": 10000.0,
                  "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "use_cache": True}  # fmt: skip
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")


class Fail(Exception):
    """One line for the user, then a non-zero exit."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Servers, logs and model configs go to --work-dir, which is kept.")  # fmt: skip
    p.add_argument("--shape", default="llama-3.1-8b", help=f"{' | '.join(SHAPES)} | path to a JSON of HF Llama config fields")
    p.add_argument("--backend", choices=("triton", "flashinfer"), default="triton", help="SGLang attention backend")
    p.add_argument("--variants", default="nospec,trueoff,steps0", help=f"comma list from {', '.join(VARIANTS)}")
    p.add_argument("--concurrency", default="16,64,128", help="comma list of closed-loop concurrency levels")
    p.add_argument("--seconds", type=float, default=10, help="seconds of issuing requests per level")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--rounds", type=int, default=1, help="with 2 variants: measure them side by side, R blocks each per level")
    p.add_argument("--disable-at", type=int, default=2, help="gate threshold for the trueoff variants (off at batch >= it)")
    p.add_argument("--work-dir", help="model configs and server logs (default: a new temp dir)")
    p.add_argument("--out", default="gate_overhead.md", help="Markdown table written here")
    p.add_argument("--dry-run", action="store_true", help="write the configs, print each server command, start nothing")
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if bad := [v for v in a.variants if v not in VARIANTS]:
        p.error(f"unknown variant(s) {bad}; choose from {VARIANTS}")
    a.concurrency = sorted({int(c) for c in a.concurrency.split(",")})
    if a.rounds < 1 or (a.rounds > 1 and len(a.variants) != 2):
        p.error("--rounds must be >= 1, and above 1 it needs exactly two --variants (they share the GPU)")
    return a


def target_config(shape: str) -> dict:
    if shape in SHAPES:
        fields = SHAPES[shape]
    else:
        try:
            fields = json.loads(Path(shape).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise Fail(f"--shape {shape!r} is neither {' nor '.join(SHAPES)} nor a readable JSON file ({e})") from e
        if missing := [k for k in REQUIRED if k not in fields]:
            raise Fail(f"--shape {shape}: missing Llama config fields {missing}")
    return {**LLAMA_DEFAULTS, **fields}


def draft_config(target: dict) -> dict:
    """A one-layer EAGLE-3 head of the target's width; SGLang derives the rest from the target."""
    draft = copy.deepcopy(target)
    draft.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, tie_word_embeddings=False,
                 target_hidden_size=target["hidden_size"], draft_vocab_size=min(32000, target["vocab_size"]))  # fmt: skip
    return draft


def write_models(work: Path, target: dict) -> dict[str, Path]:
    paths = {"target": work / "target", "draft": work / "draft", "steps0": work / "adaptive_steps0.json"}
    for name, cfg in (("target", target), ("draft", draft_config(target))):
        paths[name].mkdir(parents=True, exist_ok=True)
        (paths[name] / "config.json").write_text(json.dumps(cfg, indent=1))
    # one tier, from batch 1 up, with zero draft steps: SGLang's own "drafting off"
    paths["steps0"].write_text(json.dumps({"1": {"candidate_steps": [0]}}))
    return paths


def kv_tokens_needed(a: argparse.Namespace) -> int:
    """KV slots for the top level with every request at full length, plus headroom for the draft tokens."""
    return max(a.concurrency) * (a.input_len + a.output_len + 8) + 4096


def memory_flags(a: argparse.Namespace, slot: int) -> list[str]:
    """One server owns the GPU: 0.8 of it. Side by side, each server's KV pool is capped at what the top
    level needs; the first reserves 0.55 of the memory for the second, which reserves only its own
    activations (SGLang's static fraction counts the memory the other server already holds as used)."""
    if a.rounds == 1:
        return ["--mem-fraction-static", "0.8"]
    return ["--mem-fraction-static", ("0.45", "0.85")[slot], "--max-total-tokens", str(kv_tokens_needed(a))]


def server_command(variant: str, a: argparse.Namespace, paths: dict, port: int, slot: int = 0) -> tuple[list[str], dict[str, str]]:
    """The launch command and the extra environment for one variant (`slot`: its place when servers share the GPU)."""
    top = max(a.concurrency)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--model-path", str(paths["target"]), "--load-format", "dummy", "--skip-tokenizer-init",
           "--attention-backend", a.backend, "--tp-size", str(a.tp),
           # the sampler and grammar backends that need no extra packages or JIT
           "--sampling-backend", "pytorch", "--grammar-backend", "none",
           *memory_flags(a, slot), "--context-length", str(max(4096, a.input_len + a.output_len + 64)),
           # explicit, or SGLang lowers it under EAGLE and the top level would queue instead of run
           "--max-running-requests", str(top), "--cuda-graph-max-bs-decode", str(top), "--disable-prefill-cuda-graph"]  # fmt: skip
    if variant == "nospec":
        return cmd, {}
    cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(paths["draft"]),
            "--speculative-draft-load-format", "dummy"]  # fmt: skip
    if variant == "steps0":  # no --speculative-num-steps: the adaptive config alone sets the steps
        return cmd + ["--speculative-adaptive", "--speculative-adaptive-config", str(paths["steps0"])], {}
    cmd += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    if variant == "always":
        return cmd, {}
    gate = {"mode": "true-off", "num_steps": 3, "disable_at": a.disable_at}
    if variant == "trueoff_synced":
        gate["sync_free_seq_lens"] = False
    return cmd, {"SGLANG_PLUGINS": "specgate_gate", GATE_ENV: json.dumps(gate),
                 "SPECGATE_STATS_DIR": str(Path(a.work_dir) / f"gate_stats_{variant}")}  # fmt: skip


def format_table(results: dict, variants: list[str], concurrency: list[int]) -> str:
    """results[variant][conc] = {"tok_s": client tok/s, "decode_tok_s": server log median or None}."""

    def cell(variant, conc, key):
        value = results.get(variant, {}).get(conc, {}).get(key)
        if value is None:
            return "-"
        base = results.get("nospec", {}).get(conc, {}).get(key)
        return f"{value:,.1f}" + (f" ({value / base:.2f})" if base and variant != "nospec" else "")

    head = ["concurrency"] + [f"{v} {k}" for v in variants for k in ("tok/s", "decode tok/s")]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in concurrency:
        rows.append("| " + " | ".join([str(c)] + [cell(v, c, k) for v in variants for k in ("tok_s", "decode_tok_s")]) + " |")
    return "\n".join(rows)


async def closed_loop(url: str, conc: int, seconds: float, a, vocab: int, rng: random.Random, osl: int, nmax=None) -> float:
    """`conc` clients, each sending its next request when the last one returns; output tok/s."""
    import aiohttp

    done, issued = [], [0]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()

        async def client():
            while time.perf_counter() < t0 + seconds and (nmax is None or issued[0] < nmax):
                issued[0] += 1
                ids = [rng.randrange(100, vocab) for _ in range(a.input_len)]
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": osl, "temperature": 0, "ignore_eos": True}}
                async with session.post(f"{url}/generate", json=body) as r:
                    if r.status != 200:
                        raise Fail(f"/generate answered {r.status}: {(await r.text())[:200]}")
                    done.append((time.perf_counter(), (await r.json())["meta_info"]["completion_tokens"]))

        await asyncio.gather(*(client() for _ in range(conc)))
    # wall time runs to the last answer, so the tail of each level's last wave is paid for
    return sum(n for _, n in done) / (max(t for t, _ in done) - t0)


def warm_up(url: str, a, vocab: int, rng: random.Random) -> None:
    import aiohttp

    async def twice():  # the repeat hits the prefix cache: flashinfer compiles its cascade kernel now, not mid-level
        ids = [rng.randrange(100, vocab) for _ in range(a.input_len)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            for _ in range(2):
                async with s.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}) as r:
                    await r.read()

    asyncio.run(twice())
    top = max(a.concurrency)  # one wave at the top level: CUDA graphs and allocator warm before any timing
    asyncio.run(closed_loop(url, top, 600, a, vocab, rng, osl=32, nmax=top))


def decode_median(log_text: str, conc: int) -> float | None:
    """Median of SGLang's own decode throughput lines at exactly this batch size (no prefill in them)."""
    values = [float(m[2]) for m in DECODE_LINE.finditer(log_text) if int(m[1]) == conc]
    return round(statistics.median(values), 1) if values else None


MAX_TOKENS_LINE = re.compile(r"max_total_num_tokens=(\d+)")


def start_server(variant: str, a, paths: dict, stack: contextlib.ExitStack, slot: int = 0) -> tuple[str, Path]:
    """Start one variant's server (stopped when `stack` closes) and check what it came up with."""
    port = free_port()  # at most 55535: SGLang also binds port + 10000
    cmd, extra = server_command(variant, a, paths, port, slot)
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", GATE_ENV)} | extra
    log_path = Path(a.work_dir) / f"server_{variant}.log"
    log_path.unlink(missing_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {variant}: starting server, log {log_path}", flush=True)
    try:
        server = stack.enter_context(ManagedServer(cmd, port, log_path, ready_timeout=900, env=env))
    except ServerFailed as e:
        raise Fail(f"{variant}: {str(e).splitlines()[0]}; see {log_path}") from e
    text = log_path.read_text(errors="replace")
    if variant in GATED and (bad := re.search(r".*specgate.*(refused|not installed).*", text)):
        raise Fail(f"{variant}: the gate plugin did not install ({bad[0].strip()[:200]}); see {log_path}")
    # side by side, a pool too small for the top level would queue requests there and measure the queue
    if a.rounds > 1 and (m := MAX_TOKENS_LINE.search(text)) and int(m[1]) < kv_tokens_needed(a) - 4096:
        raise Fail(f"{variant}: its KV pool holds {m[1]} tokens, fewer than the top level needs; see {log_path}")
    return server.url, log_path


def measure_level(url: str, log_path: Path, conc: int, a, vocab: int, rng: random.Random) -> dict:
    """One closed-loop block: client tok/s and the median of the server's own decode lines during it."""
    offset = log_path.stat().st_size
    tok_s = asyncio.run(closed_loop(url, conc, a.seconds, a, vocab, rng, osl=a.output_len))
    time.sleep(0.5)  # let the last decode log line land
    with open(log_path, errors="replace") as f:
        f.seek(offset)
        return {"tok_s": tok_s, "decode_tok_s": decode_median(f.read(), conc)}


def run_variant(variant: str, a, paths: dict, vocab: int) -> dict:
    """One server alone on the GPU, each level once: results[conc] = {"tok_s", "decode_tok_s"}."""
    import aiohttp

    rng, results = random.Random(1234), {}
    try:
        with contextlib.ExitStack() as stack:
            url, log_path = start_server(variant, a, paths, stack)
            warm_up(url, a, vocab, rng)
            for conc in a.concurrency:
                results[conc] = measure_level(url, log_path, conc, a, vocab, rng)
                print(f"  c={conc}: {results[conc]['tok_s']:,.1f} tok/s, server decode {results[conc]['decode_tok_s']}", flush=True)
    except (aiohttp.ClientError, OSError, KeyError, ValueError) as e:
        raise Fail(f"{variant}: benchmark failed ({type(e).__name__}: {e}); see {a.work_dir}") from e
    return results


def run_side_by_side(a, paths: dict, vocab: int, results: dict) -> None:
    """Both variants' servers up at once; at each level they take turns A B B A ...: fills
    results[variant][conc] with one {"tok_s", "decode_tok_s"} per round, so a failure keeps what ran."""
    import aiohttp

    results.update({v: {c: [] for c in a.concurrency} for v in a.variants})
    try:
        with contextlib.ExitStack() as stack:
            servers = {v: start_server(v, a, paths, stack, slot) for slot, v in enumerate(a.variants)}
            rngs = {v: random.Random(1234) for v in a.variants}
            for v, (url, _) in servers.items():
                warm_up(url, a, vocab, rngs[v])
            for conc in a.concurrency:
                for r in range(a.rounds):
                    for v in a.variants if r % 2 == 0 else a.variants[::-1]:
                        url, log_path = servers[v]
                        block = measure_level(url, log_path, conc, a, vocab, rngs[v])
                        results[v][conc].append(block)
                        print(f"  c={conc} round {r + 1} {v}: {block['tok_s']:,.1f} tok/s, server decode "
                              f"{block['decode_tok_s']}", flush=True)  # fmt: skip
    except (aiohttp.ClientError, OSError, KeyError, ValueError) as e:
        raise Fail(f"side by side: benchmark failed ({type(e).__name__}: {e}); see {a.work_dir}") from e


def format_rounds_table(results: dict, variants: list[str], concurrency: list[int]) -> str:
    """Per level: each variant's mean over rounds, the paired ratio's mean [range] over rounds, and the
    baseline's own spread over its blocks, (max - min) / mean."""
    base, other, mean = *variants, statistics.fmean
    head = ["c", f"{base} tok/s", f"{base} decode tok/s", f"{other} tok/s", f"{other} decode tok/s",
            "ratio, client", "ratio, decode lines", f"{base} spread, client / decode"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in concurrency:
        cells = [str(c)]
        for v in variants:
            for key in ("tok_s", "decode_tok_s"):
                xs = [b[key] for b in results[v][c] if b[key] is not None]
                cells.append(f"{mean(xs):,.1f}" if xs else "-")
        for key in ("tok_s", "decode_tok_s"):
            pairs = [(o[key], b[key]) for o, b in zip(results[other][c], results[base][c]) if o[key] and b[key]]
            ratios = [o / b for o, b in pairs]
            cells.append(f"{mean(ratios):.3f} [{min(ratios):.3f}–{max(ratios):.3f}]" if ratios else "-")
        spread = []
        for key in ("tok_s", "decode_tok_s"):
            xs = [b[key] for b in results[base][c] if b[key] is not None]
            spread.append(f"{(max(xs) - min(xs)) / mean(xs):.3f}" if len(xs) > 1 else "-")
        cells.append(" / ".join(spread))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def header(a, versions: str) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"
    return (f"`{shlex.join(['python', 'benchmarks/gate_overhead.py', *sys.argv[1:]])}`\n\n"
            f"{a.tp} x {gpu}; {versions}; shape {a.shape}, dummy weights, {a.backend} attention; "
            f"{a.input_len} random input ids, {a.output_len} output tokens, closed loop for {a.seconds:g} s per level; "
            + ("one run per configuration. " if a.rounds == 1 else
               f"both servers on the GPU at once, {a.rounds} blocks each per level, taking turns. ")
            + f"tok/s is measured by the client (prefill included); decode tok/s is the median "
            f"of SGLang's own decode log lines at that batch size"
            + ("; (x.xx) is the ratio to nospec.\n" if a.rounds == 1 else ".\n"))  # fmt: skip


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        target = target_config(a.shape)
        a.work_dir = a.work_dir or tempfile.mkdtemp(prefix="gate_overhead-")
        paths = write_models(Path(a.work_dir), target)
        if a.dry_run:
            print(f"# model configs in {a.work_dir}")
            for slot, v in enumerate(a.variants):
                cmd, env = server_command(v, a, paths, port=30000, slot=slot)
                print(f"# {v}\n" + " ".join(f"{k}={shlex.quote(val)}" for k, val in env.items()) + (" " if env else "")
                      + shlex.join(cmd))  # fmt: skip
            return 0
        try:
            import aiohttp  # noqa: F401
            import sglang
        except ImportError as e:
            raise Fail(f"{e.name or e} is not importable; install SGLang on the GPU host, or use --dry-run") from None
        if set(a.variants) & set(GATED) and "specgate_gate" not in entry_points(group="sglang.srt.plugins").names:
            raise Fail("the specgate_gate SGLang plugin is not registered; run `pip install -e .` in the specgate checkout")
        if low := [c for c in a.concurrency if c < a.disable_at]:
            print(f"note: the gate is on at concurrency {low} (below --disable-at {a.disable_at})", file=sys.stderr)
        import torch

        versions = f"SGLang {sglang.__version__}, torch {torch.__version__}"
        results = {}
        try:
            if a.rounds > 1:
                run_side_by_side(a, paths, target["vocab_size"], results)
            else:
                for v in a.variants:
                    results[v] = run_variant(v, a, paths, target["vocab_size"])
        finally:  # what finished is kept even when a later variant fails
            if results:
                table = (format_rounds_table(results, a.variants, a.concurrency) if a.rounds > 1
                         else format_table(results, a.variants, a.concurrency))  # fmt: skip
                table = header(a, versions) + "\n" + table + "\n"
                Path(a.out).write_text(table)
                print("\n" + table + f"\nwritten to {a.out}; logs in {a.work_dir}")
    except Fail as e:
        print(f"gate_overhead: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
