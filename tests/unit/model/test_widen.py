"""Widening a target and its drafter changes their cost, not what they compute (fp32)."""

import json

import pytest
import torch
from conftest import counting_prompt

from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, generate_batch, load_drafter
from specgate.model.widen import Widening, check_widening
from specgate.pipeline.export import check_draft, widen_drafter
from specgate.pipeline.widen import widen_target

# counting target: hidden 64, 8 layers, MLP 128, 4 query heads over 2 KV heads (head_dim 16).
# Wider everywhere, 3 query heads per KV head instead of 2, head_dim kept (12 x 16 = 192 != 96).
WIDEN = {"hidden_size": 96, "num_layers": 10, "intermediate_size": 200, "num_heads": 12, "num_kv_heads": 4}


@pytest.fixture(scope="module")
def widened(tmp_path_factory, counting_target, tiny_drafter):
    d = tmp_path_factory.mktemp("widened")
    manifest = widen_target(counting_target, d / "target", WIDEN)
    widen_drafter(str(tiny_drafter), str(d / "drafter"), str(d / "target"))
    return d / "target", d / "drafter", manifest


def test_manifest_and_config_record_the_widening(widened, counting_target):
    target, drafter, manifest = widened
    cfg = json.loads((target / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]) == (96, 10, 12, 16)
    assert cfg["rms_norm_eps"] == pytest.approx(
        json.loads((counting_target / "config.json").read_text())["rms_norm_eps"] * 64 / 96
    )
    assert manifest["widened_to"] == WIDEN
    assert manifest["widened_from"]["shape"] == {"hidden_size": 64, "num_layers": 8, "intermediate_size": 128,
                                                 "num_heads": 4, "num_kv_heads": 2}  # fmt: skip
    assert json.loads((target / "manifest.json").read_text()) == manifest
    assert manifest["num_parameters"] > manifest["widened_from"]["num_parameters"]
    check_draft(drafter, target)  # the widened drafter fits the widened target's contract


def test_widened_target_has_the_same_logits_and_greedy_output(widened, counting_target):
    from transformers import AutoModelForCausalLM

    narrow = AutoModelForCausalLM.from_pretrained(counting_target, dtype=torch.float32)
    wide = AutoModelForCausalLM.from_pretrained(widened[0], dtype=torch.float32)
    assert wide.config.hidden_size == 96 and sum(p.numel() for p in wide.parameters()) > 1.4 * sum(
        p.numel() for p in narrow.parameters())  # fmt: skip
    ids = torch.tensor([counting_prompt(s, 12) for s in (5, 700, 1500)] + [[17, 4023, 9, 311, 28, 5000, 77, 8, 1, 2, 3, 4]])
    with torch.no_grad():
        a, b = narrow(ids).logits, wide(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(narrow.generate(ids, **gen), wide.generate(ids, **gen))


def test_widened_drafter_on_widened_target_drafts_what_the_narrow_pair_drafts(widened, counting_target, tiny_drafter):
    from transformers import AutoModelForCausalLM

    def run(target_dir, draft_dir):
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        drafter = load_drafter(str(draft_dir))
        runner = LlamaRunner(model, drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"])
        decoder = SpecDecoder(runner, drafter, slots=4, max_len=128)
        reqs = [Request(i, counting_prompt(s), 40, [0]) for i, s in enumerate((3, 400, 1200, 2030))]
        generate_batch(decoder, reqs, 3, {})
        return [r.output for r in reqs], [(r.accepted_tokens, r.verify_steps) for r in reqs]

    narrow_out, narrow_acc = run(counting_target, tiny_drafter)
    wide_out, wide_acc = run(widened[0], widened[1])
    assert wide_out == narrow_out
    assert wide_acc == narrow_acc
    tau = sum(a for a, _ in narrow_acc) / sum(s for _, s in narrow_acc)
    assert tau > 1.5  # the drafter drafts something real, so the identity above means something


def test_a_narrower_widening_names_the_key(counting_target):
    cfg = json.loads((counting_target / "config.json").read_text())
    with pytest.raises(ValueError, match=r"'target.widen.hidden_size': 32 is below the model's 64"):
        check_widening(cfg, Widening(32, 8, 128, 4, 2))
    with pytest.raises(ValueError, match=r"cannot hold the model's groups of 2"):
        check_widening(cfg, Widening(64, 8, 128, 4, 4))
