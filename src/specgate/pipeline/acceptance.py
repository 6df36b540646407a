"""Offline acceptance length: greedy EAGLE-3 decoding of held-out prompts, no server.

tau = tokens produced by verify steps / verify steps (accepted drafts + 1 bonus per step),
which is what SGLang reports as accept length. Measured per eval source and per number of
draft steps k, next to the training-time prediction tau_hat (predicted_tau).
"""

from __future__ import annotations

import csv
import logging
import time
from collections import defaultdict

from specgate.files import atomic_path, read_jsonl
from specgate.model.chat import eos_ids, prompt_ids
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, generate_batch, load_drafter

log = logging.getLogger(__name__)


def predicted_tau(metrics_csv: str, k: int, last: int = 20) -> float | None:
    """tau_hat for k drafts: decoded over the held-out sequences at the last evaluation (train.heldout_sequences,
    `heldout_tau_{k}`: what this stage measures, on training's held-out data), else 1 + sum_j prod_{i<=j} acc_i
    from the per-step accuracies of the last `last` training steps."""
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))
    decoded = [r for r in rows if r.get(f"heldout_tau_{k}")]
    if decoded:
        return float(decoded[-1][f"heldout_tau_{k}"])
    rows = rows[-last:]
    if not rows or f"acc_{k - 1}" not in rows[0]:
        return None
    acc = [sum(float(r[f"acc_{i}"]) for r in rows) / len(rows) for i in range(k)]
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


def eval_prompts(eval_jsonl: str, tokenizer, prompts_per_source: int, max_prompt_tokens: int) -> dict[str, list[list[int]]]:
    """Per eval source, the token ids of its first `prompts_per_source` first user turns (after a system turn,
    if any) that fit in max_prompt_tokens."""
    by_source = defaultdict(list)
    for rec in read_jsonl(eval_jsonl):
        ids = prompt_ids(tokenizer, rec["messages"][:1] if rec["messages"][0]["role"] != "system" else rec["messages"][:2])
        if len(ids) <= max_prompt_tokens and len(by_source[rec["source"]]) < prompts_per_source:
            by_source[rec["source"]].append(ids)
    return by_source


def measure_acceptance(target_dir: str, draft_dir: str, eval_jsonl: str, metrics_csv: str | None, out_csv: str, *,
                       num_steps: list[int], max_new_tokens: int, prompts_per_source: int, batch_size: int = 16,
                       max_prompt_tokens: int = 1024, device: str = "cpu") -> list[dict]:  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgate.runtime import keep_freed_memory, pick_device

    keep_freed_memory()
    device = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").to(device)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = load_drafter(draft_dir, device, next(model.parameters()).dtype)
    target = LlamaRunner(model, drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"])
    eos = eos_ids(model, tokenizer)

    by_source = eval_prompts(eval_jsonl, tokenizer, prompts_per_source, max_prompt_tokens)
    max_len = max_prompt_tokens + max_new_tokens + max(num_steps) + 2
    decoder = SpecDecoder(target, drafter, slots=batch_size, max_len=max_len)
    rows = []
    for source, prompts in by_source.items():
        for k in num_steps:
            t0, steps, produced, timing = time.perf_counter(), 0, 0, {}
            for start in range(0, len(prompts), batch_size):
                reqs = [Request(slot, p, max_new_tokens, eos) for slot, p in enumerate(prompts[start : start + batch_size])]
                generate_batch(decoder, reqs, k, timing)
                steps += sum(r.verify_steps for r in reqs)
                produced += sum(r.accepted_tokens for r in reqs)
            row = {"source": source, "num_steps": k, "prompts": len(prompts), "verify_steps": steps,
                   "tau": round(produced / max(steps, 1), 4), "tau_hat_train": predicted_tau(metrics_csv, k) if metrics_csv else None,
                   "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
            log.info("acceptance %s", row)
            per_step_ms = 1e3 * timing["decode_s"] / max(timing["steps"], 1)
            log.info("acceptance %s k=%d: prefill %.1f s, %d batched steps in %.1f s (%.1f ms per step)", source, k,
                     timing["prefill_s"], timing["steps"], timing["decode_s"], per_step_ms)  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    with atomic_path(out_csv) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows
