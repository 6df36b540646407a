"""Chat helpers: prompt ids, end-of-reply ids, and tokenization with a loss mask over the assistant
text and its end-of-turn token.

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


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int,
                          mask_end_of_turn: bool = True) -> tuple[list[int], list[int]]:  # fmt: skip
    """input_ids and loss mask, truncated to max_length.

    Mask 1 on the assistant-content tokens and on the special token that closes each reply
    (`<|im_end|>`, `<|eot_id|>`, ...): the target predicts that token too, so the drafter must
    learn it and the draft vocabulary must hold it, or every reply ends on a rejected draft."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets, ids = enc["offset_mapping"], enc["input_ids"]
    mask = [int(any(s <= a and b <= e and a < b for s, e in spans)) for a, b in offsets]
    if mask_end_of_turn:
        # The token right after each reply's last content token, when it is a special token.
        # Found by position, not by character offset: some tokenizer versions give special
        # tokens the offset (0, 0).
        special = set(tokenizer.all_special_ids)
        for start, end in spans:
            inside = [i for i, (a, b) in enumerate(offsets) if start <= a and b <= end and a < b]
            after = inside[-1] + 1 if inside else None
            if after is not None and after < len(ids) and ids[after] in special:
                mask[after] = 1
    return ids[:max_length], mask[:max_length]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt ending in the assistant generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends a reply: the tokenizer's EOS and the generation config's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return frozenset(i for i in [tokenizer.eos_token_id, *configured] if i is not None)
