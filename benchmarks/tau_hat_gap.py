#!/usr/bin/env python3
"""Where training's predicted accept length (tau_hat) and the measured one (tau) part.

The train stage predicts tau from teacher-forced TTT accuracies on held-out training sequences:
tau_hat = 1 + sum_j prod_{i<=j} acc_i, each acc_i over its own anchors. The acceptance stage measures
tau by decoding eval prompts. Between the two lie three differences, and this script measures each:

1. the sequences: held-out training sequences against the eval prompts and the replies the decoder wrote;
2. the formula: a product of per-step accuracies against each draft's own run of leading hits (a draft
   stops at its first miss, so hits that follow a miss count in acc_i but not in tau);
3. the positions: every reply position as a draft start against the starts decoding visits (each verify
   step jumps past what it accepted).

For each eval source it decodes the acceptance stage's prompts with k drafts (the stage's code), then
scores the same prompt + reply sequences by teacher forcing (the train stage's TTT pass, hidden states
from the target over the whole sequence), and prints per row:
  tau            measured by the decoder;
  path           teacher-forced along the decoder's own path (each start jumps by its accepted + 1);
  chain          teacher-forced, every reply position a draft start, each counting its leading hits;
  tau_hat        the train stage's formula on the same sequences.
The held-out row scores the train stage's held-out sequences the same way; its path is the train stage's
tau_hat (heldout_tau_k), decoded from each reply's first token. If path matches tau on the decoder's own
replies, training and decoding compute the same drafts, and the held-out path differs from tau only by data.

    python benchmarks/tau_hat_gap.py --results results --config config/config.yaml --out tau_hat_gap.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import yaml
from common import emit, machine, markdown_table, parser, versions

from specgate.model.chat import eos_ids
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, generate_batch, load_drafter
from specgate.pipeline.acceptance import eval_prompts
from specgate.pipeline.capture import fill_hidden_states, load_target
from specgate.pipeline.tokenize import TokenizedDataset
from specgate.pipeline.train import collate, decoded_path, heldout_row, heldout_split, shift_left, ttt_loss
from specgate.runtime import pick_device


class Scores:
    """Teacher-forced hits of a drafter on sequences, summed three ways (see the module's docstring)."""

    def __init__(self, k: int):
        self.k, self.correct, self.count = k, [0] * k, [0] * k
        self.chain_hits, self.starts, self.path_tokens, self.path_steps = 0, 0, 0, 0

    def add(self, target, layers, drafter, embed, head, seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        device = head.device
        batch = {name: x.to(device) for name, x in collate([{"input_ids": i, "loss_mask": m} for i, m in seqs]).items()}
        hits: list[torch.Tensor] = []
        with torch.no_grad():
            fill_hidden_states(target, layers, batch, head.dtype)
            _, stats = ttt_loss(drafter, embed, head, batch, self.k, hits=hits)
        for j, s in enumerate(stats):
            self.correct[j] += int(s["correct"])
            self.count[j] += int(s["count"])
        # leading hits of the drafts started at each anchor whose first draft is a reply token
        hits = torch.stack(hits)
        leading = hits.int().cumprod(0).sum(0).cpu()
        starts = shift_left(batch["loss_mask"], 2, False).cpu()
        self.chain_hits += int(leading[starts].sum())
        self.starts += int(starts.sum())
        tokens, steps = decoded_path(hits, batch["loss_mask"])[-1]
        self.path_tokens, self.path_steps = self.path_tokens + tokens, self.path_steps + steps

    def tau_hat(self) -> float:
        return heldout_row(self.k, (list(zip(self.correct, self.count, strict=True)), []))["heldout_tau_hat"]

    def chain(self) -> float:
        return 1 + self.chain_hits / max(self.starts, 1)

    def path(self) -> float | None:
        return self.path_tokens / self.path_steps if self.path_steps else None


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--results", default="results", help="the workflow's results/ (target, drafter, data, tokens)")
    p.add_argument("--config", required=True, help="the run's config, for the acceptance and held-out settings")
    p.add_argument("--k", type=int, default=3, help="drafts per verify step")
    p.add_argument("--batch", type=int, default=8, help="sequences per teacher-forced pass")
    p.add_argument("--out")
    args = p.parse_args(argv)
    r = args.results
    needed = [f"{r}/target", f"{r}/drafter", f"{r}/data/eval.jsonl", f"{r}/tokens/train.safetensors", args.config]
    if missing := [path for path in needed if not Path(path).exists()]:
        sys.exit(f"tau_hat_gap: no {missing[0]}: run the workflow up to results/acceptance.csv first")
    cfg = yaml.safe_load(open(args.config))
    acc, train = cfg.get("acceptance", {}), cfg.get("train", {})
    prompts_per_source, max_new = acc.get("prompts_per_source", 32), acc.get("max_new_tokens", 96)
    device = pick_device(cfg.get("device", "auto"))
    t0 = time.perf_counter()

    from transformers import AutoTokenizer

    target = load_target(f"{r}/target", device).requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(f"{r}/target")
    drafter = load_drafter(f"{r}/drafter", device, next(target.parameters()).dtype)
    layers = drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings().weight.detach()
    eos = eos_ids(target, tokenizer)

    by_source = eval_prompts(f"{r}/data/eval.jsonl", tokenizer, prompts_per_source, 1024)  # the acceptance stage's
    decoder = SpecDecoder(LlamaRunner(target, layers), drafter, slots=args.batch, max_len=1024 + max_new + args.k + 2)

    rows = []
    for source, prompts in by_source.items():
        scores, steps, produced = Scores(args.k), 0, 0
        for start in range(0, len(prompts), args.batch):
            reqs = [Request(slot, ids, max_new, eos) for slot, ids in enumerate(prompts[start : start + args.batch])]
            generate_batch(decoder, reqs, args.k, {})
            steps += sum(q.verify_steps for q in reqs)
            produced += sum(q.accepted_tokens for q in reqs)
            seqs = [(torch.tensor(q.prompt + q.output), torch.tensor([0] * len(q.prompt) + [1] * len(q.output))) for q in reqs]
            scores.add(target, layers, drafter, embed, head, seqs)
        rows.append([f"eval {source}: {len(prompts)} prompts, the decoder's replies", f"{produced / max(steps, 1):.3f}",
                     f"{scores.path():.3f}", f"{scores.chain():.3f}", f"{scores.tau_hat():.3f}"])  # fmt: skip

    data = TokenizedDataset(f"{r}/tokens/train.safetensors")
    heldout = heldout_split(len(data), train.get("heldout_sequences", 64), cfg.get("seed", 0))
    scores = Scores(args.k)
    for start in range(0, len(heldout), args.batch):
        scores.add(target, layers, drafter, embed, head, [data[i] for i in heldout[start : start + args.batch]])
    rows.append([f"held-out training sequences ({len(heldout)})", "", f"{scores.path():.3f}", f"{scores.chain():.3f}",
                 f"{scores.tau_hat():.3f}"])  # fmt: skip

    text = "\n".join([
        f"tau_hat against tau at k = {args.k}: {args.results}, {args.config}",
        f"{machine(device)}; {versions()}; {time.perf_counter() - t0:.0f} s; command: {' '.join(sys.argv)}",
        "",
        markdown_table(["sequences", "tau (decoder)", "path (teacher-forced)", "chain (every start)", "tau_hat (train's formula)"], rows),
    ])  # fmt: skip
    emit(text, args.out)


if __name__ == "__main__":
    main()
