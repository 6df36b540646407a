import copy

import pytest
from fixtures.templates import LLAMA3, LLAMA3_SPECIAL_TOKENS, QWEN25

from specgate.model.chat import assistant_spans, tokenize_conversation

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a loop in Python."},
        {"role": "assistant", "content": "```python\nfor i in range(3):\n    print(i)\n```"},
        {"role": "user", "content": "And in C?"},
        {"role": "assistant", "content": "for (int i = 0; i < 3; i++) {\n  printf(\"%d\\n\", i);\n}"},
    ],
    [{"role": "user", "content": "Dis bonjour 👋"}, {"role": "assistant", "content": "Bonjour ! Ça va ? 😀\n\n— Très bien."}],
]


@pytest.fixture(params=["smollm2", "llama3", "qwen25"])
def tokenizer(request, smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    if request.param == "llama3":
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL_TOKENS})
        tok.bos_token = "<|begin_of_text|>"
        tok.chat_template = LLAMA3
    elif request.param == "qwen25":
        tok.chat_template = QWEN25
    tok.template_name = request.param
    return tok


def _runs(ids, mask):
    """Contiguous runs of masked token ids."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


END_OF_TURN = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "qwen25": "<|im_end|>"}


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_masked_tokens_decode_to_exactly_the_assistant_text_and_its_end_of_turn(tokenizer, messages):
    ids, mask = tokenize_conversation(tokenizer, messages, max_length=10_000)
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    decoded = [tokenizer.decode(run) for run in _runs(ids, mask)]
    assert decoded == [content + END_OF_TURN[tokenizer.template_name] for content in assistant]
    # and nothing else is masked: every unmasked token lies outside the assistant spans
    text, spans = assistant_spans(tokenizer, messages)
    assert sum(e - s for s, e in spans) == sum(map(len, assistant))


def test_truncation_keeps_prefix(smollm2_tokenizer):
    ids, mask = tokenize_conversation(smollm2_tokenizer, CONVERSATIONS[1], max_length=10_000)
    short_ids, short_mask = tokenize_conversation(smollm2_tokenizer, CONVERSATIONS[1], max_length=20)
    assert short_ids == ids[:20] and short_mask == mask[:20]
