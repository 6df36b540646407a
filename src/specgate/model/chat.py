"""Chat helpers: prompt ids, end-of-reply ids, and tokenization with a loss mask that covers exactly the assistant text.

The template is rendered once for the whole conversation and once per assistant
turn for the prefix that precedes it (history + generation prompt). The assistant
content starts where that prefix ends; tokens whose character span lies inside an
assistant content span get mask 1. This works for any template that renders a
conversation as a prefix-stable string (ChatML/Qwen, Llama-3, SmolLM2, ...).
"""

from __future__ import annotations


class TemplateError(ValueError):
    pass


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant contents."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if not text.startswith(prefix):
            raise TemplateError(f"chat template is not prefix-stable at message {i}")
        start = text.find(m["content"], len(prefix))
        if start < 0 or text[len(prefix) : start].strip():
            raise TemplateError(f"assistant content of message {i} not found right after its prompt")
        spans.append((start, start + len(m["content"])))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """input_ids and loss mask (1 on assistant-content tokens), truncated to max_length."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e and a < b for s, e in spans)) for a, b in enc["offset_mapping"]]
    return enc["input_ids"][:max_length], mask[:max_length]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt ending in the assistant generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return frozenset(i for i in [tokenizer.eos_token_id, *configured] if i is not None)
