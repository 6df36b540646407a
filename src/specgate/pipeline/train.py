"""Train the EAGLE-3 drafter on captured target hidden states, with training-time test.

Step k = 0..K-1 of the unrolled test, at anchor position t of a sequence x:
    input token   x[t+1+k]          (its target embedding)
    input state   fc(aux[t]) at k = 0, else the draft's own pre-norm output of step k-1
    RoPE position t + k             (the position the query has at inference)
    target        the target's next-token distribution at position t+1+k, restricted to the
                  draft vocabulary and renormalised
    mask          loss_mask[t+2+k] and target argmax at t+1+k inside the draft vocabulary
Loss = sum_k decay^k * L_k (decay = train.loss_decay) with L_k the masked mean soft cross-entropy.

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
from specgate.model.drafter import Bf16Copy, Eagle3Drafter, drafter_config, ttt_attention
from specgate.pipeline.capture import OnlineCapture, plan_batches
from specgate.runtime import (keep_freed_memory, limit_gpu_host_threads, native_bf16, pick_device, release_freed_memory,
                              run_data_parallel, worker_main)  # fmt: skip

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- data


class CapturedSequences:
    """Random access to captured sequences; reads only the rows asked for (mmap slices). Sequence i is
    the tokenized set's sequence i, whatever shard holds it, so the shard layout never changes training
    (and online capture, which reads the tokenized set, trains the same drafter)."""

    def __init__(self, index_path: str | Path):
        root = Path(index_path).parent
        self.index = json.loads(Path(index_path).read_text())
        self.files = [str(root / s["file"]) for s in self.index["shards"]]
        where: dict[int, tuple[int, int, int]] = {}  # sequence -> (shard, start row, length)
        for shard_no, path in enumerate(self.files):
            with safe_open(path, framework="pt") as f:
                start = 0
                for seq_id, n in zip(f.get_tensor("seq_ids").tolist(), f.get_tensor("seq_lens").tolist(), strict=True):
                    where[seq_id] = (shard_no, start, n)
                    start += n
        self.where = [where[i] for i in range(len(where))]
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
    """Right-pad to the longest sequence; `valid` marks real tokens. Hidden states are padded where the
    items carry them (offline); online capture adds them to the batch afterwards."""
    width = max(len(x["input_ids"]) for x in items)
    out = {
        "input_ids": torch.zeros(len(items), width, dtype=torch.long),
        "loss_mask": torch.zeros(len(items), width, dtype=torch.bool),
        "valid": torch.zeros(len(items), width, dtype=torch.bool),
    }
    hidden = [k for k in ("aux_hidden", "final_hidden") if k in items[0]]
    for k in hidden:
        out[k] = torch.zeros(len(items), width, items[0][k].shape[-1], dtype=items[0][k].dtype)
    for row, x in enumerate(items):
        n = len(x["input_ids"])
        out["input_ids"][row, :n] = x["input_ids"].long()
        out["loss_mask"][row, :n] = x["loss_mask"].bool()
        out["valid"][row, :n] = True
        for k in hidden:
            out[k][row, :n] = x[k]
    return out


LENGTH_BUCKET = 32  # sequences this close in length may share a batch: each epoch batches them differently
TRIM_EVERY = 16  # steps between handing freed heap pages back to the OS (runtime.release_freed_memory)
# Tensors of 16 MiB or more (teacher logits, attention scores, the loss's [rows, draft vocab] terms) get
# their own mmap, returned when freed. Their sizes change with every batch, and kept in the heap they
# fragmented it: the embedded default's training peaked at 6.9 GB with them kept, 4.5 GB without, at
# 0.79-0.93 of the tokens/s (docs/benchmarks/training.md).
TRAIN_MMAP_ABOVE = 16 << 20


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of similar lengths, each at most batch_tokens padded, in an order and a composition that
    depend only on (seed, epoch): within a length bucket the sequences are shuffled before batching, so
    each epoch pairs them differently, and the batches are then shuffled."""
    rng = random.Random(f"{seed}:{epoch}")
    draw = [rng.random() for _ in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-(lengths[i] // LENGTH_BUCKET), draw[i]))
    batches, current, longest = [], [], 0
    for i in order:
        if current and max(longest, lengths[i]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


# ---------------------------------------------------------------- the TTT loss


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n], padding the end with `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


# rows of full-vocabulary teacher logits computed at once: 2^28 elements, 512 MiB in bf16
TEACHER_CHUNK_ELEMENTS = 2**28


@torch.no_grad()
def teacher(drafter: Eagle3Drafter, target_head: torch.Tensor, final_hidden: torch.Tensor, valid: torch.Tensor):
    """What the target says at every position, flattened to [B*T]: whether its argmax lies in the
    draft vocabulary (and the position is real), that argmax as a draft id (-1 outside), and its
    distribution restricted to the draft vocabulary and renormalised ([B*T, Vd], fp32).

    One matmul per chunk of rows gives both the full-vocabulary argmax and, by selecting columns,
    the draft-vocabulary logits. The head is cast to the compute dtype once per batch (autocast
    would re-cast it for every chunk), and not at all when the caller passes it in that dtype."""
    device = final_hidden.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else target_head.dtype
    head = target_head.to(dtype)
    token_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=device))
    rows = final_hidden.reshape(-1, final_hidden.shape[-1]).to(dtype)
    n, vocab = rows.shape[0], head.shape[0]
    full_argmax = torch.empty(n, dtype=torch.long, device=device)
    target_p = torch.empty(n, len(token_ids), dtype=torch.float32, device=device)
    chunk = max(1, TEACHER_CHUNK_ELEMENTS // vocab)
    for start in range(0, n, chunk):
        logits = rows[start : start + chunk] @ head.T
        full_argmax[start : start + chunk] = logits.argmax(-1)
        target_p[start : start + chunk] = torch.softmax(logits[:, token_ids].float(), dim=-1)
    in_vocab = drafter.t2d[full_argmax] & valid.reshape(-1)
    lookup = torch.full((drafter.t2d.numel(),), -1, dtype=torch.long, device=device)
    lookup[token_ids] = torch.arange(len(token_ids), device=device)
    return in_vocab, lookup[full_argmax], target_p


def loss_rows(loss_mask: torch.Tensor, in_vocab: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Flat indices b*T + t of the anchors in TTT step k's loss, k < steps, and their counts.

    Anchor t of step k counts when loss_mask[t+2+k] and the target's argmax at t+1+k is a draft
    token (t < T-2-k: shifting in False past the end covers that). All steps' rows come from one
    nonzero, so ttt_loss waits for the GPU once per batch rather than once per step."""
    if steps == 0:
        return [], torch.zeros(0, dtype=torch.long, device=loss_mask.device)
    masks = torch.stack([shift_left(loss_mask.bool(), 2 + k, False) & shift_left(in_vocab, 1 + k, False)
                         for k in range(steps)]).flatten(1)  # fmt: skip
    counts = masks.sum(1)
    _, flat = masks.nonzero(as_tuple=True)  # ordered by step, then position
    return list(flat.split(counts.tolist())), counts


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, -sum_v p_v log softmax(z)_v = logsumexp(z) - sum_v p_v z_v (sum p = 1), with z the
    logits in fp32 and p = target_p[targets]."""
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (target_p[targets] * z).sum(-1)


_FUSED_SOFT_CROSS_ENTROPY = None


def fused_soft_cross_entropy():
    """soft_cross_entropy compiled (once per process, for any number of rows) into fused kernels.

    Eager, each of the fp32 copy of the logits, the gather of p, their product, the logsumexp and
    the backward's softmax minus p is its own pass over [rows, draft vocab] in fp32, about twenty
    per TTT step; compiled, the forward and the backward each read the logits and p once."""
    global _FUSED_SOFT_CROSS_ENTROPY
    if _FUSED_SOFT_CROSS_ENTROPY is None:
        _FUSED_SOFT_CROSS_ENTROPY = torch.compile(soft_cross_entropy, dynamic=True)
    return _FUSED_SOFT_CROSS_ENTROPY


def ttt_loss(drafter: Eagle3Drafter, embed: torch.nn.Embedding, target_head: torch.Tensor, batch: dict,
             ttt_length: int, decay: float = 0.8, hits: list | None = None) -> tuple[torch.Tensor, list[dict]]:  # fmt: skip
    """Total loss and per-step stats {loss, correct, count} for one batch.

    With `hits` (a list), each step's hits are appended to it as a [B, T] bool by anchor position, False
    where the anchor is not in that step's loss: what a chain of drafts would accept, anchor by anchor.

    Pass target_head in the compute dtype (bf16 under bf16 autocast or a bf16 drafter) to save
    casting it once per batch. On a GPU, attention runs through flex_attention and the soft
    cross-entropy through compiled kernels; the first batches of a run pay the compilation."""
    ids = batch["input_ids"]
    b, t = ids.shape
    in_vocab, target_draft_id, target_p = teacher(drafter, target_head, batch["final_hidden"], batch["valid"])
    # anchors t < T-2-k have both a target (position t+1+k) and a next token (t+2+k)
    steps = max(0, min(ttt_length, t - 2))
    rows, counts = loss_rows(batch["loss_mask"], in_vocab.view(b, t), steps)
    soft_ce = fused_soft_cross_entropy() if ids.device.type == "cuda" else soft_cross_entropy
    positions = torch.arange(t, device=ids.device).unsqueeze(0).expand(b, t)
    h = batch["aux_hidden"].to(drafter.fc.weight.dtype)
    keys, total, stats = [], 0.0, []
    for k in range(steps):
        q, key, value, residual = drafter.begin(h, embed(shift_left(ids, 1 + k)).to(h.dtype), positions + k)
        keys.append((key, value))
        out = drafter.end(ttt_attention(q, keys), residual)
        h = out
        targets = rows[k] + 1 + k  # the position whose target distribution each anchor predicts
        logits = drafter.logits(out.reshape(b * t, -1).index_select(0, rows[k]))  # only rows that count
        loss_k = soft_ce(logits, target_p, targets).sum() / counts[k].clamp(min=1)
        hit = logits.detach().argmax(-1) == target_draft_id[targets]
        total = total + decay**k * loss_k
        stats.append({"loss": loss_k.detach(), "correct": hit.sum(), "count": counts[k]})
        if hits is not None:
            hits.append(torch.zeros(b * t, dtype=torch.bool, device=ids.device).index_put_((rows[k],), hit).view(b, t))
    return total, stats


# ---------------------------------------------------------------- the loop


def cosine_with_warmup(optimizer, warmup: int, total: int, min_lr_ratio: float = 0.0):
    """Linear warm-up over `warmup` steps, then cosine decay to `min_lr_ratio` x lr at step `total`.

    Counted in optimizer steps, not data: a short run and a long one warm up alike, and the floor
    keeps the last steps of a short run learning instead of spending them at lr ~ 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(warmup, 1)
        progress = (step - warmup) / max(total - warmup, 1)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = sorted(ckpt_dir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return done[-1] if done else None


def train_drafter(
    hidden_states: str, vocab_path: str, target_dir: str, out_weights: str, out_metrics: str, *,
    capture: dict | None = None,
    ttt_length: int = 4, epochs: int = 1, steps: int | None = None, batch_tokens: int = 4096, lr: float = 3e-4,
    warmup_steps: int = 20, min_lr_ratio: float = 0.1, weight_decay: float = 0.0, grad_clip: float = 0.5,
    loss_decay: float = 0.8, init: str = "random", checkpoint_every: int = 50, seed: int = 0, device: str = "auto",
    precision: str = "auto", heldout_sequences: int = 0, eval_every: int = 100,
) -> dict:  # fmt: skip
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import AutoConfig, AutoModelForCausalLM

    keep_freed_memory(mmap_above=TRAIN_MMAP_ABOVE)
    accelerator = Accelerator(cpu=pick_device(device).type == "cpu")  # "auto" on a host without GPUs: CPU ranks
    if accelerator.device.type == "cuda":
        limit_gpu_host_threads()
    if precision == "auto":  # bf16 weights with fp32 masters where bf16 runs natively, else fp32
        precision = "bf16" if native_bf16(accelerator.device) else "fp32"
    autocast = torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=precision == "autocast")
    compute_dtype = torch.bfloat16 if precision in ("bf16", "autocast") else torch.float32
    set_seed(seed)
    # offline: hidden_states is a capture index; online: the tokenized set, and the target runs here
    online = (capture or {}).get("mode") == "online"
    if online:
        data = OnlineCapture(hidden_states, target_dir, accelerator.device, **{k: v for k, v in capture.items() if k != "mode"})
    else:
        data = CapturedSequences(hidden_states)
    # sequences kept out of training: the TTT accuracies and tau_hat measured on them (heldout_*)
    heldout = heldout_split(len(data), heldout_sequences, seed)
    kept_out = set(heldout)
    train_ids = [i for i in range(len(data)) if i not in kept_out]
    lengths = [data.length(i) for i in train_ids]
    # batch_tokens is the global batch: each of N ranks takes 1/N of it, so N GPUs take the same
    # optimizer steps over the same global batches as one GPU and train the same drafter.
    world = accelerator.num_processes
    rank_tokens = max(1, batch_tokens // world)
    steps_per_epoch = len(epoch_batches(lengths, rank_tokens, seed, 0)) // world
    if steps_per_epoch == 0:
        raise ValueError(f"config key 'train.batch_tokens': {batch_tokens} tokens over {world} ranks leaves no full "
                         f"step in {len(lengths)} sequences")  # fmt: skip
    # A step budget (`steps`) cycles the data as often as it takes; otherwise `epochs` passes.
    total_steps = steps or steps_per_epoch * epochs
    settings = dict(ttt_length=ttt_length, epochs=epochs, steps=steps, batch_tokens=batch_tokens, lr=lr,
                    warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio, weight_decay=weight_decay,
                    grad_clip=grad_clip, loss_decay=loss_decay, init=init, seed=seed, precision=precision,
                    world=accelerator.num_processes, heldout_sequences=len(heldout), eval_every=eval_every)  # fmt: skip
    fingerprint = stable_hash({"capture": data.index["fingerprint"], "vocab": sha256_file(vocab_path), **settings})
    ckpt_dir = Path(out_weights).parent / "checkpoints"
    if accelerator.is_main_process:
        ShardDir(ckpt_dir, fingerprint)
    accelerator.wait_for_everyone()

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    vocab = load_file(vocab_path)
    cfg = drafter_config(AutoConfig.from_pretrained(target_dir), len(vocab["token_ids"]), data.index["layers_sglang"])
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(target, vocab["token_ids"], copy_head=init == "target_head")
    # frozen target pieces in the compute dtype once, not re-cast on every batch
    embed = target.get_input_embeddings().requires_grad_(False).to(accelerator.device, dtype=compute_dtype)
    target_head = target.get_output_embeddings().weight.detach().to(accelerator.device, dtype=compute_dtype)
    del target

    params = [p for p in drafter.parameters() if p.requires_grad]
    fused = accelerator.device.type == "cuda" or None  # one kernel for the whole update on a GPU
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=fused)
    scheduler = cosine_with_warmup(optimizer, min(warmup_steps, total_steps), total_steps, min_lr_ratio)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    # Not through prepare(): Accelerate's wrapper steps a scheduler once per rank on every call, so
    # N ranks would run the schedule N times faster (seen on 2 H200s: the lr reached 0 halfway).
    accelerator.register_for_checkpointing(scheduler)
    raw = accelerator.unwrap_model(drafter)
    # bf16: the forward and backward run on a bf16 copy; the optimizer updates fp32 masters (raw)
    bf16 = Bf16Copy(raw) if precision == "bf16" else None
    model = bf16.model if bf16 else raw

    step = 0
    latest = _latest_checkpoint(ckpt_dir)
    if latest is not None:
        accelerator.load_state(str(latest))
        if bf16:
            bf16.weights_from_master()
        step = json.loads((latest / "position.json").read_text())["step"]
        accelerator.print(f"resuming from {latest.name} (step {step} of {total_steps})")
    metrics_path = ckpt_dir / "metrics.csv"
    rows = _read_rows(metrics_path, upto=step)

    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process, mininterval=5)
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        batches = epoch_batches(lengths, rank_tokens, seed, epoch)
        mine = batches[accelerator.process_index :: world]
        # an epoch's batch count varies a little with its composition: every epoch takes steps_per_epoch steps
        mine = (mine * -(-steps_per_epoch // max(len(mine), 1)))[:steps_per_epoch]
        for ids in mine[in_epoch:]:
            if step >= total_steps:
                break
            t0 = time.perf_counter()
            batch = load_batch(data, [train_ids[j] for j in ids], accelerator.device, online)
            with autocast:
                loss, stats = ttt_loss(model, embed, target_head, batch, ttt_length, loss_decay)
            accelerator.backward(loss)
            if bf16:
                bf16.grads_to_master()
            average_gradients(params, accelerator.num_processes)
            accelerator.clip_grad_norm_(drafter.parameters(), grad_clip)
            optimizer.step()
            if bf16:
                bf16.weights_from_master()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens = accelerator.reduce(batch["valid"].sum(), "sum").item()
            lr_now, tok_s = scheduler.get_last_lr()[0], tokens / (time.perf_counter() - t0)
            row = _metrics_row(step, epoch, accelerator, stats, lr_now, tok_s, loss_decay)
            evaluate = heldout and (step % eval_every == 0 or step == total_steps)
            row |= heldout_row(ttt_length, heldout_stats(
                model, embed, target_head, data, heldout, rank_tokens, ttt_length, loss_decay, accelerator, online,
                autocast) if evaluate else None)  # fmt: skip
            rows.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{row['acc_0']:.3f}", tau=f"{row['tau_hat']:.2f}")
            if step % checkpoint_every == 0 or step == total_steps:
                _checkpoint(accelerator, ckpt_dir, step, rows)
            if step % TRIM_EVERY == 0:
                release_freed_memory()
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


def load_batch(data, ids: list[int], device, online: bool) -> dict[str, torch.Tensor]:
    batch = {k: v.to(device) for k, v in collate([data[i] for i in ids]).items()}
    if online:
        data.fill(batch)
    return batch


def heldout_split(n: int, wanted: int, seed: int) -> list[int]:
    """The sequences kept out of training, chosen by the seed: `wanted`, and at most a tenth of them."""
    return sorted(random.Random(f"{seed}:heldout").sample(range(n), min(wanted, n // 10)))


@torch.no_grad()
def heldout_stats(model, embed, target_head, data, heldout, rank_tokens, ttt_length, decay, accelerator, online,
                  autocast) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:  # fmt: skip
    """Over every held-out sequence, summed over the ranks: (correct, count) per TTT step, and (tokens, verify
    steps) of decoding its replies with 1..ttt_length drafts per step (decoded_path)."""
    batches = plan_batches([data.length(i) for i in heldout], rank_tokens)
    correct = torch.zeros(ttt_length, device=accelerator.device)
    count = torch.zeros(ttt_length, device=accelerator.device)
    path = torch.zeros(ttt_length, 2, device=accelerator.device)
    for ids in batches[accelerator.process_index :: accelerator.num_processes]:
        batch = load_batch(data, [heldout[j] for j in ids], accelerator.device, online)
        hits: list[torch.Tensor] = []
        with autocast:
            _, stats = ttt_loss(model, embed, target_head, batch, ttt_length, decay, hits=hits)
        for k, s in enumerate(stats):
            correct[k] += s["correct"].float()
            count[k] += s["count"].float()
        if hits:
            path[: len(hits)] += torch.tensor(decoded_path(torch.stack(hits), batch["loss_mask"]), device=path.device)
    correct, count = accelerator.reduce(correct, "sum"), accelerator.reduce(count, "sum")
    path = accelerator.reduce(path, "sum")
    return list(zip(correct.tolist(), count.tolist(), strict=True)), [tuple(p) for p in path.tolist()]


def decoded_path(hits: torch.Tensor, loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(tokens, verify steps) that greedy decoding with j = 1..k drafts per step takes over the replies, from
    teacher-forced hits [k, B, T] (ttt_loss's): the step from anchor t (the target's state at t, token t + 1
    known) keeps the leading hits of the drafts started at t and a bonus token, and the next step starts past
    them. Each reply (a run of loss_mask) is decoded from its first token, which the prefill gives.

    This is what the acceptance stage measures. The product of per-step accuracies reads higher: it counts
    hits after a miss, and it weighs every reply position as a draft start, while decoding starts fewer
    drafts inside the easy runs it jumps over."""
    leading = hits.int().cumprod(0).cumsum(0).cpu()  # [j - 1, b, t]: leading hits among the first j drafts
    mask = loss_mask.bool().cpu()
    out = [[0, 0] for _ in range(hits.shape[0])]
    for b in range(mask.shape[0]):
        m = mask[b].tolist() + [False]
        row = leading[:, b].tolist()
        starts = [t for t in range(len(m) - 1) if m[t] and (t == 0 or not m[t - 1])]
        ends = [t + 1 for t in range(len(m) - 1) if m[t] and not m[t + 1]]
        for j, acc in enumerate(row):
            for s, e in zip(starts, ends, strict=True):
                t = max(s - 1, 0)
                while t + 2 < e:  # the drafts started at t guess tokens t + 2 on
                    made = min(acc[t] + 1, e - t - 2)
                    out[j][0], out[j][1], t = out[j][0] + made, out[j][1] + 1, t + made
    return [tuple(x) for x in out]


def heldout_row(ttt_length: int, stats: tuple[list, list] | None) -> dict:
    """heldout_acc_k, heldout_tau_hat (the product of the per-step accuracies) and heldout_tau_{j} (decoded
    with j drafts per step, decoded_path), blank on steps without an evaluation."""
    if stats is None:
        return ({f"heldout_acc_{k}": "" for k in range(ttt_length)} | {"heldout_tau_hat": ""}
                | {f"heldout_tau_{j}": "" for j in range(1, ttt_length + 1)})  # fmt: skip
    accuracies, path = stats
    row, tau, running = {}, 1.0, 1.0
    for k, (correct, count) in enumerate(accuracies):
        row[f"heldout_acc_{k}"] = correct / max(count, 1)
        running *= row[f"heldout_acc_{k}"]
        tau += running
    row["heldout_tau_hat"] = tau
    for j, (tokens, steps) in enumerate(path, start=1):
        row[f"heldout_tau_{j}"] = tokens / steps if steps else ""
    return row


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


def _metrics_row(step, epoch, accelerator, stats, lr, tok_s, decay: float) -> dict:
    row = {"step": step, "epoch": epoch, "lr": lr, "tokens_per_s": round(tok_s, 1)}
    loss, tau, running = 0.0, 1.0, 1.0
    for k, s in enumerate(stats):
        correct = accelerator.reduce(s["correct"].float(), "sum").item()
        count = accelerator.reduce(s["count"].float(), "sum").item()
        row[f"loss_{k}"] = accelerator.reduce(s["loss"].float(), "mean").item()
        row[f"acc_{k}"] = correct / max(count, 1)
        loss += decay**k * row[f"loss_{k}"]  # the objective that was optimised
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
