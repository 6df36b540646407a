"""Train the EAGLE-3 drafter on captured target hidden states, with training-time test.

Step k = 0..K-1 of the unrolled test, at anchor position t of a sequence x:
    input token   x[t+1+k]          (its target embedding)
    input state   fc(aux[t]) at k = 0, else the draft's own pre-norm output of step k-1
    RoPE position t + k             (the position the query has at inference)
    target        the target's next-token distribution at position t+1+k, restricted to the
                  draft vocabulary and renormalised
    mask          loss_mask[t+2+k] and target argmax at t+1+k inside the draft vocabulary
Loss = sum_k 0.8^k * L_k with L_k the masked mean soft cross-entropy.

Checkpoints hold model, optimizer, scheduler, RNG states and the data position, are
written to a temporary directory and renamed, and a rerun resumes from the newest one.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specgate.files import TMP_MARK, ShardDir, atomic_path, sha256_file, stable_hash
from specgate.model.drafter import Eagle3Drafter, drafter_config, ttt_attention
from specgate.pipeline.capture import plan_batches
from specgate.runtime import keep_freed_memory, limit_gpu_host_threads, pick_device, run_data_parallel, worker_main

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- data


class CapturedSequences:
    """Random access to captured sequences; reads only the rows asked for (mmap slices)."""

    def __init__(self, index_path: str | Path):
        root = Path(index_path).parent
        self.index = json.loads(Path(index_path).read_text())
        self.files = [str(root / s["file"]) for s in self.index["shards"]]
        self.where: list[tuple[int, int, int]] = []  # (shard, start row, length) per sequence
        for shard_no, path in enumerate(self.files):
            with safe_open(path, framework="pt") as f:
                start = 0
                for n in f.get_tensor("seq_lens").tolist():
                    self.where.append((shard_no, start, n))
                    start += n
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.where)

    def length(self, i: int) -> int:
        return self.where[i][2]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard_no, start, n = self.where[i]
        if shard_no not in self._open:
            self._open[shard_no] = safe_open(self.files[shard_no], framework="pt")
        f = self._open[shard_no]
        names = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")
        return {name: f.get_slice(name)[start : start + n] for name in names}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; `valid` marks real tokens."""
    width = max(len(x["input_ids"]) for x in items)
    out = {
        "input_ids": torch.zeros(len(items), width, dtype=torch.long),
        "loss_mask": torch.zeros(len(items), width, dtype=torch.bool),
        "valid": torch.zeros(len(items), width, dtype=torch.bool),
        "aux_hidden": torch.zeros(len(items), width, items[0]["aux_hidden"].shape[-1], dtype=items[0]["aux_hidden"].dtype),
        "final_hidden": torch.zeros(len(items), width, items[0]["final_hidden"].shape[-1], dtype=items[0]["final_hidden"].dtype),
    }  # fmt: skip
    for row, x in enumerate(items):
        n = len(x["input_ids"])
        out["input_ids"][row, :n] = x["input_ids"].long()
        out["loss_mask"][row, :n] = x["loss_mask"].bool()
        out["valid"][row, :n] = True
        out["aux_hidden"][row, :n] = x["aux_hidden"]
        out["final_hidden"][row, :n] = x["final_hidden"]
    return out


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches in a seeded order that depends only on (seed, epoch)."""
    batches = plan_batches(lengths, batch_tokens)
    random.Random(f"{seed}:{epoch}").shuffle(batches)
    return batches


# ---------------------------------------------------------------- the TTT loss


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n], padding the end with `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_loss(drafter: Eagle3Drafter, embed: torch.nn.Embedding, target_head: torch.Tensor, batch: dict,
             ttt_length: int, decay: float = 0.8) -> tuple[torch.Tensor, list[dict]]:  # fmt: skip
    """Total loss and per-step stats {loss, correct, count} for one batch."""
    ids, valid = batch["input_ids"], batch["valid"]
    b, t = ids.shape
    token_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=ids.device))
    with torch.no_grad():
        final = batch["final_hidden"].to(target_head.dtype)
        full_argmax = torch.cat([(c @ target_head.T).argmax(-1) for c in final.split(128, dim=1)], dim=1)
        in_vocab = drafter.t2d[full_argmax] & valid
        lookup = torch.full((drafter.t2d.numel(),), -1, dtype=torch.long, device=ids.device)
        lookup[token_ids] = torch.arange(len(token_ids), device=ids.device)
        target_draft_id = lookup[full_argmax]
        # the target's distribution restricted to the draft vocabulary and renormalised
        target_p = torch.softmax((final @ target_head[token_ids].T).float(), dim=-1)
    positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
    h = batch["aux_hidden"].to(drafter.fc.weight.dtype)
    keys, total, stats = [], 0.0, []
    for k in range(ttt_length):
        q, key, value, residual = drafter.begin(h, embed(shift_left(ids, 1 + k)).to(h.dtype), positions + k)
        keys.append((key, value))
        out = drafter.end(ttt_attention(q, keys), residual)
        h = out
        # anchors t = 0..m-1 have both a target (position t+1+k) and a next token (t+2+k)
        m = t - 2 - k
        if m <= 0:
            break
        mask = batch["loss_mask"][:, 2 + k : 2 + k + m] & in_vocab[:, 1 + k : 1 + k + m]
        logits = drafter.logits(out[:, :m][mask]).float()  # only rows that count
        p = target_p[:, 1 + k : 1 + k + m][mask]
        # soft cross-entropy  -sum p log q  =  logsumexp(z) - sum p z   (sum p = 1)
        ce = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
        count = mask.sum()
        loss_k = ce.sum() / count.clamp(min=1)
        hit = logits.argmax(-1) == target_draft_id[:, 1 + k : 1 + k + m][mask]
        total = total + decay**k * loss_k
        stats.append({"loss": loss_k.detach(), "correct": hit.sum(), "count": count})
    return total, stats


# ---------------------------------------------------------------- the loop


def cosine_with_warmup(optimizer, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = sorted(ckpt_dir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return done[-1] if done else None


def train_drafter(
    capture_index: str, vocab_path: str, target_dir: str, out_weights: str, out_metrics: str, *,
    ttt_length: int = 7, epochs: int = 1, batch_tokens: int = 4096, lr: float = 3e-4, warmup_ratio: float = 0.05,
    weight_decay: float = 0.0, grad_clip: float = 0.5, loss_decay: float = 0.8, checkpoint_every: int = 50,
    seed: int = 0, device: str = "auto", max_steps: int | None = None, precision: str = "auto",
) -> dict:  # fmt: skip
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoConfig, AutoModelForCausalLM

    keep_freed_memory()
    accelerator = Accelerator(cpu=pick_device(device).type == "cpu")  # "auto" on a host without GPUs: CPU ranks
    if accelerator.device.type == "cuda":
        limit_gpu_host_threads()
    if precision == "auto":  # the spec's default: bf16 autocast on GPU, fp32 on CPU
        precision = "bf16" if accelerator.device.type == "cuda" else "fp32"
    autocast = torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    set_seed(seed)
    data = CapturedSequences(capture_index)
    lengths = [data.length(i) for i in range(len(data))]
    # batch_tokens is the global batch: each of N ranks takes 1/N of it, so N GPUs take the same
    # optimizer steps over the same global batches as one GPU and train the same drafter.
    world = accelerator.num_processes
    rank_tokens = max(1, batch_tokens // world)
    steps_per_epoch = len(epoch_batches(lengths, rank_tokens, seed, 0)) // world
    total_steps = min(steps_per_epoch * epochs, max_steps or 10**12)
    settings = dict(ttt_length=ttt_length, epochs=epochs, batch_tokens=batch_tokens, lr=lr, warmup_ratio=warmup_ratio,
                    weight_decay=weight_decay, grad_clip=grad_clip, loss_decay=loss_decay, seed=seed,
                    max_steps=max_steps, precision=precision, world=accelerator.num_processes)  # fmt: skip
    fingerprint = stable_hash({"capture": data.index["fingerprint"], "vocab": sha256_file(vocab_path), **settings})
    ckpt_dir = Path(out_weights).parent / "checkpoints"
    if accelerator.is_main_process:
        ShardDir(ckpt_dir, fingerprint)
    accelerator.wait_for_everyone()

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    vocab = load_file(vocab_path)
    cfg = drafter_config(AutoConfig.from_pretrained(target_dir), len(vocab["token_ids"]), data.index["layers_sglang"])
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(target, vocab["token_ids"])
    embed = target.get_input_embeddings().requires_grad_(False).to(accelerator.device)
    target_head = target.get_output_embeddings().weight.detach().to(accelerator.device)
    del target

    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    scheduler = cosine_with_warmup(optimizer, int(warmup_ratio * total_steps), total_steps)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    # Not through prepare(): Accelerate's wrapper steps a scheduler once per rank on every call, so
    # N ranks would run the schedule N times faster (seen on 2 H200s: the lr reached 0 halfway).
    accelerator.register_for_checkpointing(scheduler)
    raw = accelerator.unwrap_model(drafter)

    step = 0
    latest = _latest_checkpoint(ckpt_dir)
    if latest is not None:
        accelerator.load_state(str(latest))
        step = json.loads((latest / "position.json").read_text())["step"]
        accelerator.print(f"resuming from {latest.name} (step {step} of {total_steps})")
    metrics_path = ckpt_dir / "metrics.csv"
    rows = _read_rows(metrics_path, upto=step)

    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process, mininterval=5)
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        batches = epoch_batches(lengths, rank_tokens, seed, epoch)
        mine = batches[accelerator.process_index :: world][:steps_per_epoch]
        for ids in mine[in_epoch:]:
            if step >= total_steps:
                break
            t0 = time.perf_counter()
            batch = {k: v.to(accelerator.device) for k, v in collate([data[i] for i in ids]).items()}
            with autocast:
                loss, stats = ttt_loss(raw, embed, target_head, batch, ttt_length, loss_decay)
            accelerator.backward(loss)
            average_gradients(params, accelerator.num_processes)
            accelerator.clip_grad_norm_(drafter.parameters(), grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens = accelerator.reduce(batch["valid"].sum(), "sum").item()
            row = _metrics_row(step, epoch, accelerator, stats, scheduler.get_last_lr()[0], tokens / (time.perf_counter() - t0))
            rows.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{row['acc_0']:.3f}", tau=f"{row['tau_hat']:.2f}")
            if step % checkpoint_every == 0 or step == total_steps:
                _checkpoint(accelerator, ckpt_dir, step, rows)
    bar.close()

    accelerator.wait_for_everyone()
    check_ranks_agree(params, accelerator)
    if accelerator.is_main_process:
        state = {k: v.detach().float().cpu().contiguous() for k, v in raw.state_dict().items() if not k.startswith("rotary")}
        state["d2t"], state["t2d"] = raw.d2t.cpu(), raw.t2d.cpu()
        with atomic_path(out_weights) as tmp:
            save_file(state, str(tmp), metadata={"config": cfg.to_json_string(), "fingerprint": fingerprint})
        _write_rows(out_metrics, rows)
    return rows[-1] if rows else {}


def average_gradients(params: list[torch.Tensor], world: int) -> None:
    """Mean of the gradients over the data-parallel ranks, in one collective.

    The TTT loss calls the drafter's own methods (begin/end/logits) step by step rather than its
    forward, so DDP's gradient hooks never arm; the reduction is done here instead."""
    if world <= 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat)
    flat /= world
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def check_ranks_agree(params: list[torch.Tensor], accelerator) -> None:
    """Fail loudly if the ranks' weights drifted apart: a multi-GPU drafter must be one model."""
    if accelerator.num_processes <= 1:
        return
    with torch.no_grad():
        local = torch.stack([p.detach().float().sum() for p in params]).to(accelerator.device)
    gathered = accelerator.gather(local[None]).view(accelerator.num_processes, -1)
    if not torch.allclose(gathered, gathered[0].expand_as(gathered), rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"data-parallel training: the ranks' weights differ after training "
                           f"(max |diff| of parameter sums {float((gathered - gathered[0]).abs().max()):.3g})")  # fmt: skip


def _metrics_row(step, epoch, accelerator, stats, lr, tok_s) -> dict:
    row = {"step": step, "epoch": epoch, "lr": lr, "tokens_per_s": round(tok_s, 1)}
    loss, tau, running = 0.0, 1.0, 1.0
    for k, s in enumerate(stats):
        correct = accelerator.reduce(s["correct"].float(), "sum").item()
        count = accelerator.reduce(s["count"].float(), "sum").item()
        row[f"loss_{k}"] = accelerator.reduce(s["loss"].float(), "mean").item()
        row[f"acc_{k}"] = correct / max(count, 1)
        loss += 0.8**k * row[f"loss_{k}"]
        running *= row[f"acc_{k}"]
        tau += running
    row["loss"], row["tau_hat"] = loss, tau
    return row


def _read_rows(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= upto]


def _write_rows(path, rows: list[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def _checkpoint(accelerator, ckpt_dir: Path, step: int, rows: list[dict]) -> None:
    """Full state to step_N via a temporary directory; older checkpoints are then removed."""
    tmp = ckpt_dir / f"step_{step}{TMP_MARK}save"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "position.json").write_text(json.dumps({"step": step}))
        _write_rows(ckpt_dir / "metrics.csv", rows)
        final = ckpt_dir / f"step_{step}"
        tmp.rename(final)
        for old in ckpt_dir.glob("step_*"):
            if old != final and TMP_MARK not in old.name:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()


def run_training_job(num_processes: int | str, **job) -> None:
    run_data_parallel("specgate.pipeline.train", train_drafter, job, num_processes, Path(job["out_weights"]).parent)


if __name__ == "__main__":
    worker_main(train_drafter)
