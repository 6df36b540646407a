"""Chat-template tokenization with a loss mask that covers exactly the assistant text.

The template is rendered once for the whole conversation and once per assistant
turn for the prefix that precedes it (history + generation prompt). The assistant
content starts where that prefix ends; tokens whose character span lies inside an
assistant content span get mask 1. This works for any template that renders a
conversation as a prefix-stable string (ChatML/Qwen, Llama-3, SmolLM2, ...).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specgate.files import atomic_path, read_jsonl, write_json

log = logging.getLogger(__name__)


class TemplateError(ValueError):
    pass


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant contents."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise TemplateError(f"chat template is not prefix-stable at message {i}")
        start = text.find(m["content"], len(prefix))
        if start < 0 or text[len(prefix) : start].strip():
            raise TemplateError(f"assistant content of message {i} not found right after its prompt")
        spans.append((start, start + len(m["content"])))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """input_ids and loss mask (1 on assistant-content tokens), truncated to max_length."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e and a < b for s, e in spans)) for a, b in enc["offset_mapping"]]
    return enc["input_ids"][:max_length], mask[:max_length]


def tokenize_dataset(conversations: str | Path, tokenizer_dir: str | Path, out: str | Path, max_length: int, summary_out):
    """Tokenize a JSONL of conversations into one safetensors file of flat arrays.

    Tensors: input_ids (int32, all sequences back to back), loss_mask (uint8),
    offsets (int64, n+1 sequence boundaries).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = read_jsonl(conversations)
    ids, masks, offsets = [], [], [0]
    skipped = {"template_error": 0, "no_assistant_tokens_after_truncation": 0}
    truncated = 0
    for rec in tqdm(records, desc="tokenize", mininterval=5):
        try:
            seq, mask = tokenize_conversation(tokenizer, rec["messages"], max_length)
        except TemplateError as e:
            log.warning("%s: %s", rec.get("id"), e)
            skipped["template_error"] += 1
            continue
        if not any(mask):  # a long prompt left no assistant token within max_length
            skipped["no_assistant_tokens_after_truncation"] += 1
            continue
        truncated += len(seq) == max_length
        ids += seq
        masks += mask
        offsets.append(len(ids))
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int32),
        "loss_mask": torch.tensor(masks, dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp))
    summary = {
        "conversations": len(records),
        "sequences": len(offsets) - 1,
        "skipped": skipped,
        "truncated_to_max_length": truncated,
        "tokens": len(ids),
        "loss_tokens": int(sum(masks)),
        "max_length": max_length,
    }
    write_json(summary_out, summary)
    log.info("tokenized: %s", summary)
    return summary


class TokenizedDataset:
    """Read side of `tokenize_dataset`: sequence i as (input_ids, loss_mask) tensors."""

    def __init__(self, path: str | Path):
        t = load_file(str(path))
        self.input_ids, self.loss_mask, self.offsets = t["input_ids"], t["loss_mask"], t["offsets"]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt ending in the assistant generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return frozenset(i for i in [tokenizer.eos_token_id, *configured] if i is not None)
