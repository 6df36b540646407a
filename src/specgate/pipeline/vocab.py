"""Draft vocabulary: the most frequent target tokens under the loss mask.

EAGLE-3 drafters predict over a reduced vocabulary. SGLang maps a draft id i back to
the target id i + d2t[i] (d2t holds offsets, int64) and t2d marks, over the target
vocabulary, which ids the draft can emit (bool).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from specgate.files import atomic_path, write_json
from specgate.pipeline.tokenize import TokenizedDataset

log = logging.getLogger(__name__)


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (token_ids ascending, d2t offsets, t2d mask) for the top-`draft_vocab_size` ids.

    When fewer distinct ids were seen, the smallest unused ids pad the set, so the
    draft vocabulary always has exactly `draft_vocab_size` entries.
    """
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"config key 'vocab.draft_vocab_size': {draft_vocab_size} > target vocab {vocab_size}")
    seen = int((counts > 0).sum())
    # Stable sort by descending count keeps ties in id order, so the result is deterministic.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    chosen = order[: min(seen, draft_vocab_size)]
    if chosen.numel() < draft_vocab_size:
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().squeeze(1)[: draft_vocab_size - chosen.numel()]])
    token_ids = torch.sort(chosen).values
    d2t = token_ids - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[token_ids] = True
    return token_ids, d2t, t2d


def masked_token_counts(tokens_path: str, vocab_size: int) -> torch.Tensor:
    data = TokenizedDataset(tokens_path)
    ids = data.input_ids[data.loss_mask.bool()].to(torch.int64)
    return torch.bincount(ids, minlength=vocab_size)


def build_vocab_stage(tokens_path: str, target_dir: str, out: str, summary_out: str, draft_vocab_size: int) -> dict:
    vocab_size = json.loads((Path(target_dir) / "manifest.json").read_text())["vocab_size"]
    counts = masked_token_counts(tokens_path, vocab_size)
    token_ids, d2t, t2d = build_draft_vocab(counts, draft_vocab_size)
    with atomic_path(out) as tmp:
        save_file({"d2t": d2t, "t2d": t2d, "token_ids": token_ids, "counts": counts}, str(tmp))
    total = int(counts.sum())
    summary = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": vocab_size,
        "masked_tokens": total,
        "distinct_masked_tokens": int((counts > 0).sum()),
        "coverage": float(counts[t2d].sum()) / max(total, 1),
        "padded_with_unused_ids": max(0, draft_vocab_size - int((counts > 0).sum())),
    }
    write_json(summary_out, summary)
    log.info("draft vocab: %s", summary)
    return summary
