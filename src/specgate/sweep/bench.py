"""A sweep job: start the servers, run every load level on them in turns, block by block, stop them.

Servers measured minutes apart differ by more than the gate's effect (the host drifts, and one
server's run differs from the next), so every figure the report decides on is a ratio of two
blocks measured seconds apart on the same requests, one of them on a no-spec server. Two designs:

- `switched` (one job for the sweep): one no-spec server and one speculative server, whose gate the
  sweep switches between blocks (always on, each threshold, each hysteresis pair, auto). Two server
  starts for the whole sweep; every variant runs on the same speculative server. Adding a variant
  reruns the job, since the variants share that server's turns.
- `paired` (one job per variant): the variant's server beside a no-spec server of its own. Adding a
  variant runs only its job. The `nospec` job pairs two no-spec servers: its ratio is the noise floor.

Servers are started by `ManagedServer`, so they are stopped on return, on error and on
SIGINT/SIGTERM, and die with this process even on SIGKILL. Per-request records go to JSONL and
the per-block summary to CSV, both written whole or not at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from specgate.files import atomic_path, read_jsonl, write_jsonl
from specgate.sweep.launcher import (
    GATE_ENV,
    ServeSettings,
    Variant,
    check_tensor_parallel,
    gate_mode,
    gate_settings,
    reference_command,
    sglang_command,
    true_off_adapter,
    variants,
)
from specgate.sweep.load_client import Entry, Load, bench_requests, reply_lengths, sweep_blocks
from specgate.sweep.managed_server import ManagedServer, exit_when_orphaned, free_port

log = logging.getLogger(__name__)


SWITCHED = "all"  # the variant wildcard of the switched design's one job


def sweep_variants(bench: dict) -> list[Variant]:
    out = variants(bench["thresholds"], bench["hysteresis"], bench["steps0_thresholds"], bench["auto"],
                   bench.get("sglang_adaptive", False))
    for v in out:
        v.min_dwell_steps = bench["min_dwell_steps"]
    return out


def switched_jobs(bench: dict) -> list[str]:
    """The switched design's jobs per round: one for all, and one for each variant that needs a server of its
    own (SGLang's own adaptive speculation)."""
    return [SWITCHED] + [v.name for v in sweep_variants(bench) if not v.switchable]


def variant_by_name(name: str, bench: dict):
    for v in sweep_variants(bench):
        if v.name == name:
            return v
    raise ValueError(f"unknown sweep variant {name!r}: not in bench.thresholds / hysteresis / steps0_thresholds")


def serve_settings(serve: dict, target: str, drafter: str | None, device: str) -> ServeSettings:
    return ServeSettings(target=target, draft=drafter, num_steps=serve["num_steps"], max_running=serve["max_running"],
                         max_len=serve["max_len"], tp=serve["tp"], attention_backend=serve["attention_backend"],
                         extra_args=list(serve["extra_args"]), env={k: str(v) for k, v in serve["env"].items()},
                         device=device, dtype=serve["dtype"], gate_buffer_tokens=serve["gate_buffer_tokens"],
                         gate_sync_free_seq_lens=serve["gate_sync_free_seq_lens"],
                         gate_check_mirror_every=serve["gate_check_mirror_every"])  # fmt: skip


def request_lengths(bench: dict, replies: list[str], target: str) -> list[int]:
    """bench.lengths "replies": each prompt's eval reply length in the target's tokens, truncated at
    max_tokens; "fixed": max_tokens for all."""
    if bench["lengths"] == "fixed":
        return [bench["max_tokens"]] * len(replies)
    from transformers import AutoTokenizer

    return reply_lengths(replies, AutoTokenizer.from_pretrained(target), bench["max_tokens"])


def loads(bench: dict) -> list[Load]:
    return [Load(concurrency=c) for c in bench["concurrency"]] + [Load(rate=r) for r in bench["request_rates"]]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def served_model(url: str) -> str:
    """The model name a server answers to (OpenAI API), for the requests' `model` field."""
    return _get_json(f"{url}/v1/models")["data"][0]["id"]


def run_variant(variant: dict | list[dict], *, engine: str, serve: dict, bench: dict, target: str,
                drafter: str | None, eval_jsonl: str, records_out: str, summary_out: str, server_log: str,
                work_dir: str, device: str, seed: int, round: int = 0, on_ready=None) -> pd.DataFrame:  # fmt: skip
    """`variant`: a launcher.Variant as a dict (design paired), or the list of every variant (switched);
    `bench`: the bench config (levels, blocks, limits). `round`: which of the sweep's rounds this is;
    recorded with every row and request.

    `on_ready(url, model, prompts)`, if given, runs once the servers are up, before the levels."""
    import contextlib

    from specgate.runtime import pick_device

    exit_when_orphaned()  # a job whose Snakemake was killed stops its servers and exits
    switched = isinstance(variant, list)
    chosen = [Variant(**v) for v in variant] if switched else [Variant(**variant)]
    device = str(pick_device(device))
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    control = str(Path(work_dir) / f"gate_control.round{round}.json") if switched else None

    def command(v: Variant, control: str | None = None):
        settings = serve_settings(serve, target, drafter if v.speculative else None, device)
        port = free_port()
        if engine == "sglang":
            check_tensor_parallel(settings.tp, target, settings.draft)
            return (*sglang_command(settings, v, port, work_dir, control), port)
        return (*reference_command(settings, v, port, control), port)

    requests = bench_requests(list(read_jsonl(eval_jsonl)), bench["prompts"], seed)
    prompts = [p for p, _ in requests]
    lengths = request_lengths(bench, [r for _, r in requests], target)
    log.info("request lengths (%s): median %d, range %d-%d over %d prompts", bench["lengths"],
             int(pd.Series(lengths).median()), min(lengths), max(lengths), len(lengths))  # fmt: skip
    all_loads = loads(bench)
    label = "all variants" if switched else chosen[0].name
    bar = tqdm(total=len(all_loads), desc=f"bench {label}", unit="level")

    def progress(load, rows):
        bar.update()
        for name in dict.fromkeys(r["variant"] for r in rows):
            mine = [r for r in rows if r["variant"] == name]
            log.info("%s %s: steady %.1f tok/s; ÷ no-spec beside it %s; median ITL %.1f ms; accept %s", name,
                     load.name, pd.Series([r["output_throughput"] for r in mine]).median(),
                     " ".join(f"{r['ratio']:.3f}" for r in mine if r.get("ratio") is not None) or "-",
                     mine[-1]["median_itl_ms"] or -1, mine[-1]["accept_length"])  # fmt: skip

    def prime_at(v: Variant) -> int:
        # a gated server crosses its threshold once before measuring; the auto gate gets a full wave, so
        # every batch-size bucket up to max_running has its warm-up before the first level
        if not v.gated:
            return 0
        return serve["max_running"] if v.auto else min((v.disable_at or 0) + 1, serve["max_running"])

    def start(cmd, env, port, log_path):
        log.info("server: %s", " ".join(cmd))
        return stack.enter_context(ManagedServer(cmd, port, log_path, ready_timeout=serve["ready_timeout"], env=env))

    base_log = server_log.replace(".server.log", ".baseline.server.log")
    with contextlib.ExitStack() as stack:
        if switched:
            nospec = next(v for v in chosen if not v.speculative)
            spec = start(*command(Variant("always", True), control), server_log)
            base = start(*command(nospec), base_log)
            entries = [Entry(nospec.name, base.url, baseline=True)] + [
                Entry(v.name, spec.url, gate=gate_settings(v), control=control, prime=prime_at(v))
                for v in chosen if v.speculative
            ]  # fmt: skip
            info = _get_json(f"{spec.url}/server_info")
        else:
            v = chosen[0]
            server = start(*command(v), server_log)
            entries = [Entry(v.name, server.url, prime=prime_at(v))]
            if bench["side_by_side"]:
                base = start(*command(variants([])[0]), base_log)
                entries.append(Entry("nospec", base.url, baseline=True, emit=False))
            info = _get_json(f"{server.url}/server_info")
        model = served_model(entries[0].url)
        if on_ready is not None:
            on_ready(entries[-1].url if switched else entries[0].url, model, prompts)
        records, rows = asyncio.run(sweep_blocks(
            entries, model, prompts, lengths, all_loads, blocks=bench["blocks"], warmup_s=bench["warmup_s"],
            window_s=bench["window_s"], rate_window_s=bench["rate_window_s"], ignore_eos=bench["ignore_eos"],
            max_error_rate=bench["max_error_rate"], seed=seed + 7919 * round, timeout_s=bench["request_timeout"],
            slo=bench["slo"], order=bench["order"], stagger=bench["stagger"], progress=progress))  # fmt: skip
    bar.close()
    by_name = {v.name: v for v in chosen}
    summary = pd.DataFrame(rows)
    summary.insert(1, "engine", engine)
    summary.insert(2, "server_version", str(info.get("version")))
    summary.insert(3, "disable_at", [by_name[n].disable_at for n in summary.variant])
    summary.insert(4, "enable_at", [by_name[n].enable_at for n in summary.variant])
    summary.insert(5, "round", round)
    summary.insert(6, "design", "switched" if switched else "paired" if bench["side_by_side"] else "serial")
    # the gate that ran: SGLang falls back to its own steps=0 path where true-off does not fit
    summary.insert(7, "gate_mode", [(gate_mode(by_name[n]) if engine == "sglang" else by_name[n].gate_mode)
                                    if by_name[n].gated or not by_name[n].switchable else None
                                    for n in summary.variant])  # fmt: skip
    if engine == "sglang":  # which adapter the true-off gate ran through
        summary.insert(8, "gate_adapter", [true_off_adapter() if m == "true-off" else None for m in summary.gate_mode])
    write_jsonl(records_out, [{**r, "round": round} for r in records])
    with atomic_path(summary_out) as tmp:
        summary.to_csv(tmp, index=False)
    return summary
