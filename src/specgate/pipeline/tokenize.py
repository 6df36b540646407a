"""Stage `tokenize`: chat conversations to one safetensors file of flat token arrays with a loss mask.

The loss mask covers the assistant text and the token that ends each reply
(`specgate.model.chat.tokenize_conversation`).
`TokenizedDataset` is the read side, used by capture and vocab.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specgate.files import atomic_path, read_jsonl, write_json
from specgate.model.chat import TemplateError, tokenize_conversation

log = logging.getLogger(__name__)


def tokenize_dataset(conversations: str | Path, tokenizer_dir: str | Path, out: str | Path, max_length: int, summary_out,
                     mask_end_of_turn: bool = True):  # fmt: skip
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
            seq, mask = tokenize_conversation(tokenizer, rec["messages"], max_length, mask_end_of_turn)
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
        "mask_end_of_turn": mask_end_of_turn,
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
