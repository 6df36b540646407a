import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specgate.cli import main as cli
from specgate.pipeline.export import DraftContractError, check_draft, export_drafter
from specgate.pipeline.train import train_drafter


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_target, tiny_capture):
    d = tmp_path_factory.mktemp("export")
    index, vocab = tiny_capture
    train_drafter(str(index), str(vocab), str(tiny_target), str(d / "w.safetensors"), str(d / "m.csv"),
                  ttt_length=2, epochs=1, steps=2, batch_tokens=1024, device="cpu", precision="fp32")  # fmt: skip
    export_drafter(str(d / "w.safetensors"), str(d / "drafter"), str(tiny_target))
    return d / "drafter"


def test_export_layout_matches_sglang(exported, tiny_target):
    cfg = json.loads((exported / "config.json").read_text())
    target = json.loads((tiny_target / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == target["vocab_size"] and cfg["target_hidden_size"] == target["hidden_size"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["rope_parameters"] == target["rope_parameters"]
    names = set(load_file(exported / "model.safetensors"))
    assert names == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight",
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
    }  # fmt: skip
    assert cli(["check-draft", str(exported), "--target", str(tiny_target)]) == 0


def _broken(exported, tmp_path, *, config=None, tensors=None):
    out = tmp_path / "broken"
    shutil.copytree(exported, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(out / "model.safetensors")
        tensors(state)
        save_file(state, str(out / "model.safetensors"))
    return out


def _rename(state, old, new):
    state[new] = state.pop(old)


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), None, "architectures is ['LlamaForCausalLM']"),
        (lambda c: c.update(num_hidden_layers=2), None, "num_hidden_layers is 2, expected 1"),
        (lambda c: c.update(tie_word_embeddings=True), None, "tie_word_embeddings is True"),
        (lambda c: c.update(vocab_size=123), None, "vocab_size is 123"),
        (lambda c: c.update(target_hidden_size=32), None, "target_hidden_size is 32"),
        (lambda c: c["rope_parameters"].update(rope_theta=1.0), None, "rope_parameters is"),
        (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 99]), None, "eagle_aux_hidden_state_layer_ids"),
        (lambda c: c.update(draft_vocab_size=0), None, "draft_vocab_size 0"),
        (None, lambda s: _rename(s, "midlayer.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight"),
         "unexpected tensor 'layers.1.self_attn.q_proj.weight'"),
        (None, lambda s: s.pop("norm.weight"), "missing tensor 'norm.weight'"),
        (None, lambda s: s.update({"fc.weight": s["fc.weight"][:, :-1].contiguous()}), "fc.weight has shape"),
        (None, lambda s: s.update(d2t=s["d2t"].to(torch.int32)), "d2t has dtype torch.int32"),
        (None, lambda s: s.update(t2d=s["t2d"].to(torch.uint8)), "t2d has dtype torch.uint8"),
        (None, lambda s: s.update({"norm.weight": s["norm.weight"].half()}), "mixed weight dtypes"),
        (None, lambda s: s.update(d2t=-torch.arange(len(s["d2t"]))), "d2t offsets do not map"),
        (None, lambda s: s["t2d"].__setitem__(0, not bool(s["t2d"][0])), "t2d does not mark exactly"),
    ],
)
def test_checker_rejects_each_violation(exported, tiny_target, tmp_path, config, tensors, message):
    broken = _broken(exported, tmp_path, config=config, tensors=tensors)
    with pytest.raises(DraftContractError) as err:
        check_draft(broken, tiny_target)
    assert message in str(err.value)
    assert cli(["check-draft", str(broken), "--target", str(tiny_target)]) == 1
