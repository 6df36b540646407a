"""drafter.path: a drafter from elsewhere, checked against the target and linked in."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specgate.pipeline.drafter import take_drafter
from specgate.pipeline.export import DraftContractError


def foreign_copy(drafter, dest, *, config=None, tensors=None):
    """The exported drafter as if it came from elsewhere: another directory, no specgate files."""
    dest.mkdir()
    cfg = json.loads((drafter / "config.json").read_text()) | (config or {})
    (dest / "config.json").write_text(json.dumps(cfg))
    weights = load_file(drafter / "model.safetensors")
    if tensors:
        weights = tensors(weights)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_a_drafter_from_elsewhere_is_checked_and_linked(tmp_path, tiny_drafter, counting_target):
    src = foreign_copy(tiny_drafter, tmp_path / "hub_drafter")
    out = tmp_path / "drafter"
    info = take_drafter(str(src), str(out), str(counting_target))
    assert info["path"] == str(src.resolve())
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").resolve() == src / "model.safetensors"
    assert json.loads((out / "origin.json").read_text())["path"] == str(src.resolve())


def test_a_drafter_saved_with_its_embedding_and_the_newer_layer_names_passes(tmp_path, tiny_drafter, counting_target):
    # SpecForge saves the drafter's embedding; newer SGLang names the layer layers.0
    vocab, hidden = (json.loads((tiny_drafter / "config.json").read_text())[k] for k in ("vocab_size", "hidden_size"))

    def respell(w):
        w = {k.replace("midlayer.", "layers.0.", 1): v for k, v in w.items()}
        return w | {"embed_tokens.weight": torch.zeros(vocab, hidden)}

    src = foreign_copy(tiny_drafter, tmp_path / "specforge", tensors=respell)
    info = take_drafter(str(src), str(tmp_path / "drafter"), str(counting_target))
    assert info["path"] == str(src.resolve())
    assert (tmp_path / "drafter" / "model.safetensors").resolve() == src / "model.safetensors"


@pytest.mark.parametrize("edit, field", [
    (dict(config={"hidden_size": 32}), "hidden_size is 32"),
    (dict(config={"vocab_size": 1000}), "vocab_size is 1000"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 99]}}), "eagle_aux_hidden_state_layer_ids"),
    (dict(tensors=lambda w: {k: v for k, v in w.items() if k != "d2t"}), "missing tensor 'd2t'"),
])  # fmt: skip
def test_a_drafter_that_does_not_fit_the_target_names_the_key_and_the_field(tmp_path, tiny_drafter, counting_target,
                                                                          edit, field):  # fmt: skip
    src = foreign_copy(tiny_drafter, tmp_path / "other", **edit)
    with pytest.raises(DraftContractError) as e:
        take_drafter(str(src), str(tmp_path / "drafter"), str(counting_target))
    assert str(e.value).startswith("config key 'drafter.path':") and field in str(e.value)
    assert not (tmp_path / "drafter").exists()  # nothing half-written


def test_a_drafter_in_pytorch_bin_form_is_told_to_use_safetensors(tmp_path, tiny_drafter, counting_target):
    src = tmp_path / "bin_drafter"
    src.mkdir()
    shutil.copy(tiny_drafter / "config.json", src)
    (src / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(DraftContractError, match="pytorch_model.bin.*safetensors"):
        take_drafter(str(src), str(tmp_path / "drafter"), str(counting_target))
