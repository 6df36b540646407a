"""Self-distillation: replace assistant turns with the target's own greedy (or sampled) responses.

A drafter learns to predict the target, so training on the target's own outputs
raises acceptance. Turns are regenerated in order, each conditioned on the already
regenerated history. Work is done in chunks, each written atomically, so a killed
run resumes at the first missing chunk.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from specgate.files import ShardDir, read_jsonl, sha256_file, stable_hash, write_json, write_jsonl
from specgate.model.chat import eos_ids, prompt_ids
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, generate_batch
from specgate.runtime import keep_freed_memory, pick_device

log = logging.getLogger(__name__)


def generate_replies(decoder: SpecDecoder, tokenizer, eos, histories: list[list[dict]], max_new_tokens: int,
                     temperature: float, batch_size: int) -> list[str]:  # fmt: skip
    """One reply per history; batches of similar prompt length decode together, one KV slot each."""
    prompts = [prompt_ids(tokenizer, h) for h in histories]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    replies = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        reqs = [Request(slot, prompts[i], max_new_tokens, eos, temperature=temperature) for slot, i in enumerate(idx)]
        generate_batch(decoder, reqs, None)
        for i, r in zip(idx, reqs):
            replies[i] = tokenizer.decode(r.output, skip_special_tokens=True).strip()
    return replies


def regenerate_conversations(decoder, tokenizer, eos, records: list[dict], **gen) -> tuple[list[dict], int]:
    """Regenerate assistant turns in order; a conversation ends at its first empty reply.

    Returns the conversations with at least one reply, and how many had none.
    """
    users = [[m for m in r["messages"] if m["role"] == "user"] for r in records]
    done = [[m for m in r["messages"][:1] if m["role"] == "system"] for r in records]
    alive = list(range(len(records)))
    for turn in range(max(map(len, users), default=0)):
        alive = [i for i in alive if turn < len(users[i])]
        histories = [done[i] + [users[i][turn]] for i in alive]
        replies = generate_replies(decoder, tokenizer, eos, histories, **gen) if alive else []
        survivors = []
        for i, history, reply in zip(alive, histories, replies):
            if reply:
                done[i] = history + [{"role": "assistant", "content": reply}]
                survivors.append(i)
        alive = survivors
    out = [{**r, "messages": d} for r, d in zip(records, done) if any(m["role"] == "assistant" for m in d)]
    return out, len(records) - len(out)


def regenerate_stage(conversations: str, target_dir: str, out: str, summary_out: str, *, seed: int, device: str,
                     max_new_tokens: int, temperature: float, batch_size: int, chunk_size: int) -> dict:  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = read_jsonl(conversations)
    settings = {"max_new_tokens": max_new_tokens, "temperature": temperature, "batch_size": batch_size}
    fingerprint = stable_hash({"data": sha256_file(conversations), "target": sha256_file(Path(target_dir) / "manifest.json"),
                               "seed": seed, "chunk": chunk_size, **settings})  # fmt: skip
    parts = ShardDir(Path(out).with_suffix(".parts"), fingerprint)
    keep_freed_memory()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").to(pick_device(device)).eval()
    longest = max((len(prompt_ids(tokenizer, r["messages"])) for r in records), default=0)
    decoder = SpecDecoder(LlamaRunner(model), None, slots=batch_size, max_len=longest + max_new_tokens + 1)
    eos = eos_ids(model, tokenizer)
    chunks = [records[i : i + chunk_size] for i in range(0, len(records), chunk_size)]
    kept, empty = [], 0
    for k, chunk in enumerate(tqdm(chunks, desc="regenerate", unit="chunk")):
        name = f"part_{k:05d}.jsonl"
        if not parts.done(name):
            torch.manual_seed(seed + k)  # sampling is reproducible per chunk, also after a resume
            regenerated, n_empty = regenerate_conversations(decoder, tokenizer, eos, chunk, **settings)
            write_jsonl(parts.path(name), regenerated + [{"_empty_replies": n_empty}])
        part = read_jsonl(parts.path(name))
        kept += part[:-1]
        empty += part[-1]["_empty_replies"]
    write_jsonl(out, kept)
    summary = {"input": len(records), "kept": len(kept), "dropped_empty_reply": empty, **settings}
    write_json(summary_out, summary)
    log.info("regenerated: %s", summary)
    return summary
