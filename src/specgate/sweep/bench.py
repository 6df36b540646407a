"""One sweep job: start a server for one variant, run every concurrency level, stop it.

The server is started by `ManagedServer`, so it is stopped on return, on error and on
SIGINT/SIGTERM, and dies with this process even on SIGKILL. Per-request records go to
JSONL and the per-level summary to CSV, both written whole or not at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request

import pandas as pd
from tqdm import tqdm

from specgate.files import atomic_path, read_jsonl, write_jsonl
from specgate.sweep.launcher import (
    GATE_ENV,
    ServeSettings,
    Variant,
    check_tensor_parallel,
    reference_command,
    sglang_command,
    variants,
)
from specgate.sweep.load_client import bench_prompts, sweep_levels
from specgate.sweep.managed_server import ManagedServer, exit_when_orphaned, free_port

log = logging.getLogger(__name__)


def variant_by_name(name: str, bench: dict):
    for v in variants(bench["thresholds"], bench["hysteresis"], bench["steps0_thresholds"], bench["auto"]):
        if v.name == name:
            v.min_dwell_steps = bench["min_dwell_steps"]
            return v
    raise ValueError(f"unknown sweep variant {name!r}: not in bench.thresholds / hysteresis / steps0_thresholds")


def serve_settings(serve: dict, target: str, drafter: str | None, device: str) -> ServeSettings:
    return ServeSettings(target=target, draft=drafter, num_steps=serve["num_steps"], max_running=serve["max_running"],
                         max_len=serve["max_len"], tp=serve["tp"], attention_backend=serve["attention_backend"],
                         extra_args=list(serve["extra_args"]), env={k: str(v) for k, v in serve["env"].items()},
                         device=device, dtype=serve["dtype"], gate_buffer_tokens=serve["gate_buffer_tokens"],
                         gate_sync_free_seq_lens=serve["gate_sync_free_seq_lens"],
                         gate_check_mirror_every=serve["gate_check_mirror_every"])  # fmt: skip


def requests_for(bench: dict):
    return lambda c: max(bench["min_requests"], bench["requests_per_concurrency"] * c)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def served_model(url: str) -> str:
    """The model name a server answers to (OpenAI API), for the requests' `model` field."""
    return _get_json(f"{url}/v1/models")["data"][0]["id"]


def run_variant(variant: dict, *, engine: str, serve: dict, bench: dict, target: str, drafter: str | None,
                eval_jsonl: str, records_out: str, summary_out: str, server_log: str, work_dir: str, device: str,
                seed: int, round: int = 0, on_ready=None) -> pd.DataFrame:  # fmt: skip
    """`variant`: a launcher.Variant as a dict; `bench`: the bench config (levels, requests, limits).
    `round`: which of the sweep's interleaved rounds this is; recorded with every row and request.

    `on_ready(url, model, prompts)`, if given, runs once the server is up, before the levels."""
    from specgate.runtime import pick_device

    exit_when_orphaned()  # a job whose Snakemake was killed stops its server and exits
    variant = Variant(**variant)
    name = variant.name
    device = str(pick_device(device))
    settings = serve_settings(serve, target, drafter if variant.speculative else None, device)
    port = free_port()
    if engine == "sglang":
        check_tensor_parallel(settings.tp, target, settings.draft)
        cmd, env = sglang_command(settings, variant, port, work_dir)
    else:
        cmd, env = reference_command(settings, variant, port)
    prompts = bench_prompts(list(read_jsonl(eval_jsonl)), bench["prompts"], seed)
    log.info("variant %s: %s", name, " ".join(cmd))
    bar = tqdm(total=len(bench["concurrency"]), desc=f"bench {name}", unit="level")

    def progress(row):
        bar.update()
        log.info("%s c=%d: %.1f tok/s, median TTFT %.0f ms, median ITL %.1f ms, accept %s, errors %d", name,
                 row["concurrency"], row["output_throughput"], row["median_ttft_ms"] or -1,
                 row["median_itl_ms"] or -1, row["accept_length"], row["failed"])  # fmt: skip

    with ManagedServer(cmd, port, server_log, ready_timeout=serve["ready_timeout"], env=env) as server:
        model = served_model(server.url)
        if on_ready is not None:
            on_ready(server.url, model, prompts)
        info = _get_json(f"{server.url}/server_info")
        # a gated server crosses its threshold once before measuring (see sweep_levels); the auto gate gets a
        # full wave, so every batch-size bucket up to max_running has its warm-up before the first level
        crossing = serve["max_running"] if variant.auto else min((variant.disable_at or 0) + 1, serve["max_running"])
        prime = crossing if variant.gated and bench["warmup_requests"] else 0
        records, rows = asyncio.run(sweep_levels(
            server.url, model, prompts, bench["concurrency"], variant=name, num_requests=requests_for(bench),
            warmup_requests=bench["warmup_requests"], max_tokens=bench["max_tokens"], ignore_eos=bench["ignore_eos"],
            max_error_rate=bench["max_error_rate"], timeout_s=bench["request_timeout"], progress=progress,
            prime=prime, length_spread=bench["length_spread"]))  # fmt: skip
    bar.close()
    summary = pd.DataFrame(rows)
    summary.insert(1, "engine", engine)
    summary.insert(2, "server_version", str(info.get("version")))
    summary.insert(3, "disable_at", variant.disable_at)
    summary.insert(4, "enable_at", variant.enable_at)
    summary.insert(5, "round", round)
    # the gate that ran: SGLang falls back to its own steps=0 path where true-off does not fit
    summary.insert(6, "gate_mode", json.loads(env.get(GATE_ENV, "{}")).get("mode") if engine == "sglang" and variant.gated
                   else variant.gate_mode if variant.gated else None)  # fmt: skip
    write_jsonl(records_out, [{**r, "round": round} for r in records])
    with atomic_path(summary_out) as tmp:
        summary.to_csv(tmp, index=False)
    return summary
