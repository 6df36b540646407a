"""The reference engine: lossless under any gate, and acceptance survives gate-off periods."""

import threading

import pytest
import torch
from conftest import counting_prompt

from specgate.engine.reference import Engine, EngineConfig
from specgate.gate import GateConfig
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, load_drafter


def _prompts(tokenizer, n):
    return [counting_prompt(97 * i + 5) for i in range(n)]


def run_engine(engine: Engine, prompts) -> list[list[int]]:
    """Submit all prompts at once; request i wants 8 + 3 i tokens, so the load falls step by step."""
    outputs = [[] for _ in prompts]
    remaining, errors, all_done = [len(prompts)], [], threading.Event()

    def on_done(reason, error):  # runs on the engine thread: must not block
        if error:
            errors.append(error)
        remaining[0] -= 1
        if remaining[0] == 0:
            all_done.set()

    for i, p in enumerate(prompts):
        engine.submit(p, 8 + 3 * i, True, outputs[i].extend, on_done)
    assert all_done.wait(300), "requests did not finish"
    assert not errors
    return outputs


@pytest.fixture(scope="module")
def nospec_outputs(counting_target):
    engine = Engine(EngineConfig(str(counting_target), None, max_running=8, max_len=256))
    try:
        return run_engine(engine, _prompts(engine.tokenizer, 12))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("disable_at", [None, 1, 3, 6])
def test_outputs_equal_no_speculation_at_any_threshold(counting_target, tiny_drafter, nospec_outputs, disable_at):
    engine = Engine(EngineConfig(str(counting_target), str(tiny_drafter), 3, GateConfig(disable_at), max_running=8, max_len=256))
    try:
        outputs = run_engine(engine, _prompts(engine.tokenizer, 12))
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert outputs == nospec_outputs
    gate = stats["gate"]
    resumed_steps, resumed_tokens = stats["spec_verify_steps_resumed"], stats["spec_accepted_tokens_resumed"]
    if disable_at is None:
        assert gate["steps_off"] == 0 and stats["avg_spec_accept_length"] > 1.5
        assert resumed_steps == 0  # never off: nothing to resume from
    elif disable_at == 1:
        assert gate["steps_on"] == 0 and stats["spec_verify_steps"] == 0 and resumed_steps == 0
    else:
        assert gate["steps_on"] > 0 and gate["steps_off"] > 0 and gate["switches"] >= 1
        # the load starts above the threshold and falls: every speculative step here follows an off period,
        # and the caught-up draft accepts as well as a drafter that never stopped
        assert 0 < resumed_steps <= stats["spec_verify_steps"]
        assert resumed_tokens / resumed_steps > 1.5


@pytest.mark.parametrize("sync_draft", [True, False], ids=["draft-extend-every-step", "true-off-then-catch-up"])
def test_acceptance_survives_gate_off_periods(counting_target, tiny_drafter, sync_draft):
    """tau with forced on->off->on transitions stays within 5% of always-on, whether the draft KV follows
    every off step or (true off) waits and catches up in one extend when drafting resumes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(counting_target)
    drafter = load_drafter(str(tiny_drafter))
    tokenizer = AutoTokenizer.from_pretrained(counting_target)
    prompts = _prompts(tokenizer, 32)

    def tau(schedule):
        decoder = SpecDecoder(LlamaRunner(model, drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"]),
                              drafter, slots=32, max_len=400)  # fmt: skip
        reqs = [Request(i, p, 56, frozenset(), ignore_eos=True) for i, p in enumerate(prompts)]
        for r in reqs:
            decoder.prefill(r, sync_draft=schedule(0) or sync_draft)
        step = 0
        while live := [r for r in reqs if not r.done]:
            if schedule(step):
                decoder.spec_step(live, 3)
            else:
                before = decoder.draft.cache.lengths.clone()
                decoder.plain_step(live, sync_draft=sync_draft)
                if not sync_draft:  # true off: no draft work at all, unless a request hit the catch-up window
                    assert torch.equal(decoder.draft.cache.lengths, before)
            step += 1
        decoder.catch_up(reqs)
        return sum(r.accepted_tokens for r in reqs) / sum(r.verify_steps for r in reqs), reqs, decoder

    always, ref, _ = tau(lambda s: True)
    gated, out, decoder = tau(lambda s: (s // 3) % 2 == 0)  # 3 steps on, 3 off, ...
    assert always > 1.5, "the drafter must accept something for this test to mean anything"
    assert abs(gated - always) / always < 0.05, (gated, always)
    assert [r.output for r in out] == [r.output for r in ref]

    # why: the draft KV after gated decoding equals a fresh draft-extend over the same tokens
    fresh = SpecDecoder(LlamaRunner(model, drafter.config.eagle_config["eagle_aux_hidden_state_layer_ids"]),
                        drafter, slots=1, max_len=400)  # fmt: skip
    r = out[0]
    whole = Request(0, r.prompt + r.output[:-1], 1, frozenset(), ignore_eos=True)
    fresh.prefill(whole)
    n = len(r.prompt) + len(r.output) - 1
    assert int(decoder.draft.cache.lengths[0]) >= n
    torch.testing.assert_close(decoder.draft.cache.k[0, 0, :, :n], fresh.draft.cache.k[0, 0, :, :n], rtol=1e-4, atol=1e-4)

