"""The stage of `target.widen`: the target widened to a larger shape that computes the same
function (`specgate.model.widen`). A small model's outputs at a large model's step cost: the
served target of a deployment whose real weights are not at hand. Export widens the drafter
the same way (`specgate.pipeline.export.widen_drafter`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from specgate.files import atomic_path, sha256_file, write_json
from specgate.model.widen import Widening, check_widening, widen_target_tensors, widened_config

log = logging.getLogger(__name__)


SHARD_BYTES = 4 << 30  # safetensors files of at most ~4 GiB, as Hugging Face shards


def widen_target(narrow_dir: str | os.PathLike, out_dir: str | os.PathLike, widen: dict) -> dict:
    """Write the target of `narrow_dir` widened to the shape `widen` (config key target.widen) to `out_dir`.

    Tokenizer and chat template are copied; weights are written shard by shard, so memory holds
    one shard of the widened model at a time. manifest.json records both shapes.
    """
    narrow_dir = Path(narrow_dir)
    cfg = json.loads((narrow_dir / "config.json").read_text())
    narrow = json.loads((narrow_dir / "manifest.json").read_text())
    to = Widening(**widen)
    check_widening(cfg, to)
    state = {}
    for file in sorted(narrow_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open is not a dict)

    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for file in narrow_dir.iterdir():  # tokenizer, chat template, generation config
            if file.suffix != ".safetensors" and file.name not in (
                "config.json",
                "manifest.json",
                "model.safetensors.index.json",
            ):
                shutil.copy(file, tmp / file.name)
        shards, shard, size, weight_map, total, total_bytes = [], {}, 0, {}, 0, 0
        for name, tensor in widen_target_tensors(state, cfg, to):
            shard[name] = tensor.contiguous()
            size += tensor.numel() * tensor.element_size()
            total += tensor.numel()
            total_bytes += tensor.numel() * tensor.element_size()
            if size >= SHARD_BYTES:
                shards.append(shard)
                save_file(shard, str(tmp / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
                shard, size = {}, 0
        if shard:
            shards.append(shard)
            save_file(shard, str(tmp / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        for i, (name, part) in enumerate(zip(names, shards, strict=True), start=1):
            (tmp / f"shard-{i:05d}.safetensors").rename(tmp / name)
            weight_map |= dict.fromkeys(part, name)
        write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
        write_json(tmp / "config.json", widened_config(cfg, to))
        manifest = {
            # the widened model is a new checkpoint here, not the narrow one served in place
            **{k: v for k, v in narrow.items() if k not in ("in_place", "path", "revision")},
            "num_hidden_layers": to.num_layers,
            "hidden_size": to.hidden_size,
            "num_parameters": total,
            "weights": {name: sha256_file(tmp / name) for name in names},
            "widened_from": {
                "path": narrow.get("path", str(narrow_dir)),
                "shape": asdict(Widening.of(cfg)),
                "weights": narrow["weights"],
                "num_parameters": narrow["num_parameters"],
            },  # fmt: skip
            "widened_to": asdict(to),
        }
        write_json(tmp / "manifest.json", manifest)
    log.info("widened target written to %s: %s -> %s, %.2f B parameters", out_dir, Widening.of(cfg), to, total / 1e9)
    return manifest
