"""Capture the target's hidden states for EAGLE-3 training.

Per token we store the outputs of three target layers (low, mid, high; concatenated
as `aux_hidden` [T, 3H]) and the final normed hidden state (`final_hidden` [T, H]),
from which training recomputes the target logits through the target lm_head.

Layer numbering follows SGLang: EAGLE-3 layer id L means "the output of decoder
layer L", which is Hugging Face `hidden_states[L + 1]`. SGLang's default is
[1, N//2 - 1, N - 4].

Shards are planned deterministically from the sequence lengths, written to a
temporary name and renamed, so a rerun after a kill skips every finished shard
and never reads a partial one. Under `accelerate launch`, rank r writes shards
r, r + world, ...; rank 0 writes the index once all shards exist.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specgate.files import ShardDir, atomic_path, sha256_file, stable_hash, write_json
from specgate.pipeline.tokenize import TokenizedDataset
from specgate.runtime import keep_freed_memory, run_data_parallel, worker_main

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_layers(num_layers: int) -> list[int]:
    """SGLang's EAGLE-3 default aux layers (layer outputs)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def hf_hidden_state_indices(layers: list[int]) -> list[int]:
    return [layer + 1 for layer in layers]


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sequence ids by length so that each padded batch holds at most batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and lengths[current[0]] * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def balanced_shard_tokens(total: int, shard_tokens: int, world: int) -> int:
    """Shard size for `total` tokens: at most shard_tokens, with a shard count that is a multiple
    of the ranks, so each rank captures the same number of tokens. (Without this, 1.6M tokens in
    shards of at most 1M come out as 1.07M + 0.54M on two GPUs, and one GPU sits idle half the time.)"""
    n_shards = -(-max(1, -(-total // shard_tokens)) // world) * world
    return max(1, -(-total // n_shards))


def plan_shards(batches: list[list[int]], lengths: list[int], shard_tokens: int) -> list[list[list[int]]]:
    # close shard k once the running total reaches (k + 1) * shard_tokens: overshoots do not add up
    shards, current, tokens = [], [], 0
    for batch in batches:
        current.append(batch)
        tokens += sum(lengths[i] for i in batch)
        if tokens >= (len(shards) + 1) * shard_tokens:
            shards.append(current)
            current = []
    if current:
        shards.append(current)
    return shards


@contextmanager
def hooked_layers(model, layers: list[int]):
    """Record the outputs of the given decoder layers of an HF causal LM during forward."""
    store: dict[int, torch.Tensor] = {}
    decoder = model.get_decoder()

    def hook(idx):
        def fn(_module, _args, output):
            store[idx] = output[0] if isinstance(output, tuple) else output

        return fn

    handles = [decoder.layers[layer].register_forward_hook(hook(layer)) for layer in layers]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def pad_batch(seqs: list[torch.Tensor], device) -> torch.Tensor:
    """Right-pad token sequences. No attention mask is needed: with causal attention a
    real token never attends to the padding after it."""
    width = max(len(s) for s in seqs)
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        out[row, : len(s)] = s
    return out.to(device)


def capture_batch(model, layers, input_ids: torch.Tensor, lengths: list[int], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target body (no lm_head) once; return unpadded aux [T, 3H] and final [T, H] on CPU."""
    with hooked_layers(model, layers) as store:
        final = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    aux = torch.cat([store[layer] for layer in layers], dim=-1)
    valid = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    for row, n in enumerate(lengths):
        valid[row, :n] = True
    return aux[valid].to(dtype).cpu(), final[valid].to(dtype).cpu()


def load_target(target_dir, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="auto").to(device).eval()
    return model


def _bytes_per_token(hidden: int, dtype) -> int:
    return 4 * hidden * torch.finfo(dtype).bits // 8 + 4 + 1


def check_disk(out_dir: Path, need_bytes: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    log.info("capture needs ~%.2f GiB more in %s (%.1f GiB free)", need_bytes / 2**30, out_dir, free / 2**30)
    print(f"disk estimate: {need_bytes / 2**30:.2f} GiB for the remaining shards, {free / 2**30:.1f} GiB free")
    if free < need_bytes * 1.05:
        raise OSError(
            f"capture needs ~{need_bytes / 2**30:.2f} GiB in {out_dir} but only {free / 2**30:.2f} GiB is free; "
            "free space, lower data sizes or capture.dtype"
        )


def capture_hidden_states(
    target_dir: str,
    tokens_path: str,
    index_out: str,
    *,
    layers: list[int] | None,
    dtype: str,
    batch_tokens: int,
    shard_tokens: int,
    device: str = "auto",
) -> dict | None:
    """Capture every sequence of the tokenized set; resume from the shards already written."""
    from accelerate import PartialState

    keep_freed_memory()
    state = PartialState(cpu=device == "cpu")
    rank, world = state.process_index, state.num_processes
    out_dir = Path(index_out).parent
    manifest = json.loads((Path(target_dir) / "manifest.json").read_text())
    n_layers, hidden = manifest["num_hidden_layers"], manifest["hidden_size"]
    layers = list(layers) if layers else default_layers(n_layers)
    if max(layers) >= n_layers:
        raise ValueError(f"config key 'capture.layers': {layers} out of range for a {n_layers}-layer target")
    store_dtype = DTYPES[dtype]

    data = TokenizedDataset(tokens_path)
    lengths = [data.length(i) for i in range(len(data))]
    per_shard = balanced_shard_tokens(sum(lengths), shard_tokens, world)
    shards = plan_shards(plan_batches(lengths, batch_tokens), lengths, per_shard)
    fingerprint = stable_hash(
        {"tokens": sha256_file(tokens_path), "target": manifest["weights"], "layers": layers, "dtype": dtype,
         "batch_tokens": batch_tokens, "shard_tokens": per_shard}
    )  # fmt: skip
    if state.is_main_process:
        ShardDir(out_dir / "shards", fingerprint)
    state.wait_for_everyone()
    shard_dir = ShardDir(out_dir / "shards", fingerprint, reset=False)
    names = [f"shard_{k:05d}.safetensors" for k in range(len(shards))]
    mine = [k for k in range(len(shards)) if k % world == rank]
    todo = [k for k in mine if not shard_dir.done(names[k])]
    shard_tokens_of = [sum(lengths[i] for b in shards[k] for i in b) for k in range(len(shards))]
    if len(todo) < len(mine):
        print(f"rank {rank}: resuming, {len(mine) - len(todo)} of {len(mine)} shards already written")
    check_disk(out_dir, sum(shard_tokens_of[k] for k in todo) * _bytes_per_token(hidden, store_dtype))

    model = load_target(target_dir, state.device)
    bar = tqdm(total=sum(shard_tokens_of[k] for k in todo), unit="tok", desc=f"capture[{rank}]", mininterval=5)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1) as writer, torch.inference_mode():
        pending = None
        for k in todo:
            seq_ids, aux_parts, final_parts = [], [], []
            for batch in shards[k]:
                seqs = [data[i][0] for i in batch]
                aux, final = capture_batch(model, layers, pad_batch(seqs, state.device), [len(s) for s in seqs], store_dtype)
                aux_parts.append(aux)
                final_parts.append(final)
                seq_ids += batch
                bar.update(aux.shape[0])
            tensors = {
                "seq_ids": torch.tensor(seq_ids, dtype=torch.int64),
                "seq_lens": torch.tensor([lengths[i] for i in seq_ids], dtype=torch.int32),
                "input_ids": torch.cat([data[i][0] for i in seq_ids]),
                "loss_mask": torch.cat([data[i][1] for i in seq_ids]),
                "aux_hidden": torch.cat(aux_parts),
                "final_hidden": torch.cat(final_parts),
            }
            if pending is not None:
                pending.result()  # at most one shard in flight: bounded memory
            pending = writer.submit(_write_shard, shard_dir.path(names[k]), tensors)
        if pending is not None:
            pending.result()
    bar.close()
    elapsed = time.perf_counter() - t0
    done_tokens = sum(shard_tokens_of[k] for k in todo)
    print(f"rank {rank}: captured {done_tokens} tokens in {elapsed:.1f} s ({done_tokens / max(elapsed, 1e-9):.0f} tok/s)")
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    index = {
        "layers_sglang": layers,
        "hidden_state_indices_hf": hf_hidden_state_indices(layers),
        "num_hidden_layers": n_layers,
        "hidden_size": hidden,
        "dtype": dtype,
        "fingerprint": fingerprint,
        "sequences": len(lengths),
        "tokens": sum(lengths),
        "loss_tokens": int(data.loss_mask.sum()),
        "bytes": sum((shard_dir.path(n)).stat().st_size for n in names),
        "world_size": world,
        "last_run": {"tokens": done_tokens, "seconds": round(elapsed, 2), "tokens_per_s_rank0": round(done_tokens / max(elapsed, 1e-9), 1)},
        "shards": [{"file": f"shards/{n}", "sequences": sum(map(len, shards[k])), "tokens": shard_tokens_of[k]} for k, n in enumerate(names)],
    }  # fmt: skip
    write_json(index_out, index)
    return index


def _write_shard(path: Path, tensors: dict) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))


class CaptureDataset:
    """Read side: the captured shards of one index, sequence by sequence."""

    def __init__(self, index_path: str | Path):
        self.root = Path(index_path).parent
        self.index = json.loads(Path(index_path).read_text())

    def iter_shards(self):
        for shard in self.index["shards"]:
            with safe_open(str(self.root / shard["file"]), framework="pt") as f:
                yield {name: f.get_tensor(name) for name in f.keys()}

    def iter_sequences(self):
        for t in self.iter_shards():
            start = 0
            for seq_id, n in zip(t["seq_ids"].tolist(), t["seq_lens"].tolist()):
                end = start + n
                yield seq_id, {k: t[k][start:end] for k in ("input_ids", "loss_mask", "aux_hidden", "final_hidden")}
                start = end


class OnlineCapture:
    """capture.mode online: the same hidden states as the shards hold, computed by the target for each
    training batch on the training device; nothing is written. Sequences come from the tokenized set."""

    def __init__(self, tokens_path: str | Path, target_dir: str | Path, device, *, layers: list[int] | None = None,
                 dtype: str = "bfloat16"):  # fmt: skip
        manifest = json.loads((Path(target_dir) / "manifest.json").read_text())
        n_layers = manifest["num_hidden_layers"]
        self.layers = list(layers) if layers else default_layers(n_layers)
        if max(self.layers) >= n_layers:
            raise ValueError(f"config key 'capture.layers': {self.layers} out of range for a {n_layers}-layer target")
        self.dtype = DTYPES[dtype]
        self.data = TokenizedDataset(tokens_path)
        self.model = load_target(target_dir, device).requires_grad_(False)
        # what a checkpoint's fingerprint and the drafter's config read from an offline index
        fingerprint = stable_hash({"tokens": sha256_file(tokens_path), "target": manifest["weights"],
                                   "layers": self.layers, "dtype": dtype, "mode": "online"})  # fmt: skip
        self.index = {"fingerprint": fingerprint, "layers_sglang": self.layers}

    def __len__(self) -> int:
        return len(self.data)

    def length(self, i: int) -> int:
        return self.data.length(i)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        input_ids, loss_mask = self.data[i]
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    @torch.no_grad()
    def fill(self, batch: dict[str, torch.Tensor]) -> None:
        fill_hidden_states(self.model, self.layers, batch, self.dtype)


def fill_hidden_states(model, layers: list[int], batch: dict[str, torch.Tensor], dtype) -> None:
    """Add aux_hidden [B, T, 3H] and final_hidden [B, T, H] to a collated batch, in `dtype` and zero on
    padding, as a batch read from shards has them."""
    with hooked_layers(model, layers) as store:
        final = model.get_decoder()(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    keep = batch["valid"].unsqueeze(-1)
    batch["aux_hidden"] = torch.cat([store[layer] for layer in layers], dim=-1).to(dtype) * keep
    batch["final_hidden"] = final.to(dtype) * keep


def run_capture_job(num_processes: int | str, **job) -> None:
    run_data_parallel("specgate.pipeline.capture", capture_hidden_states, job, num_processes, Path(job["index_out"]).parent)


if __name__ == "__main__":
    worker_main(capture_hidden_states)
