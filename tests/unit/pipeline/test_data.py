import json

import pytest

from specgate.files import read_jsonl
from specgate.pipeline.data import (
    Malformed,
    iter_json_array,
    prepare_data,
    prompt_key,
    to_messages,
    user_prompts,
)

FILTERS = {"min_turns": 1, "max_turns": 4, "max_chars": 10_000}


def _sharegpt(i, human="hello", n_turns=1):
    conv = []
    for t in range(n_turns):
        conv += [{"from": "human", "value": f"{human} {i} {t}"}, {"from": "gpt", "value": f"answer {i} {t}"}]
    return {"id": f"r{i}", "conversations": conv}


def test_truncated_json_array_keeps_every_complete_record(tmp_path):
    records = [_sharegpt(i) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"r4"')  # cut inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    from collections import Counter

    bad = Counter()
    got = list(iter_json_array(path, bad))
    assert [rid for rid, _ in got] == ["r0", "r1", "r2", "r3"]
    assert bad["truncated_tail"] == 1
    # an intact file reads whole with no truncation counted
    path.write_text(text)
    bad = Counter()
    assert len(list(iter_json_array(path, bad))) == 5 and not bad


def test_real_sharegpt_wheel_is_read_record_by_record(tmp_path):
    summary = prepare_data([{"name": "sg", "kind": "sharegpt", "path": None, "train": 10, "eval": 5}], FILTERS, 0,
                           tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path / "s.json")  # fmt: skip
    stats = summary["sources"]["sg"]
    assert 17_000 < stats["read"] < 18_000
    assert stats["malformed"]["truncated_tail"] == 1
    assert summary["train"] == 10 and summary["eval"] == 5


@pytest.mark.parametrize(
    "record, reason",
    [
        ([], "not_an_object"),
        ({"messages": []}, "no_messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "bad_role"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no_assistant"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"},
                       {"role": "assistant", "content": "a"}]}, "not_alternating"),  # fmt: skip
    ],
)
def test_malformed_records_name_their_reason(record, reason):
    with pytest.raises(Malformed, match=reason):
        to_messages(record)


def test_malformed_and_invalid_lines_are_counted_not_dropped_silently(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = [json.dumps(good), "{not json", json.dumps({"messages": [{"role": "user", "content": "q"}]}), ""]
    path.write_text("\n".join(lines) + "\n")
    summary = prepare_data([{"name": "j", "kind": "jsonl", "path": str(path), "messages_field": "messages",
                             "train": 5, "eval": 0}], FILTERS, 0, tmp_path / "t", tmp_path / "e", tmp_path / "s")  # fmt: skip
    stats = summary["sources"]["j"]
    assert stats["read"] == 2 and stats["train"] == 1
    assert stats["malformed"] == {"invalid_json": 1, "no_assistant": 1}
    assert json.loads((tmp_path / "s").read_text())["sources"]["j"]["malformed"]["invalid_json"] == 1


def test_split_is_seeded_deduplicated_and_disjoint(tmp_path):
    records = [_sharegpt(i % 150, n_turns=1 + i % 3) for i in range(200)]  # 50 duplicated prompts
    records += [_sharegpt(1000 + i, human="Continue") for i in range(20)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    src = [{"name": "sg", "kind": "sharegpt", "path": str(path), "train": 80, "eval": 30}]

    def run(seed, tag):
        out = tmp_path / tag
        summary = prepare_data(src, FILTERS, seed, out / "train.jsonl", out / "eval.jsonl", out / "s.json")
        return summary, read_jsonl(out / "train.jsonl"), read_jsonl(out / "eval.jsonl")

    summary, train, evals = run(0, "a")
    assert summary["sources"]["sg"]["duplicates"] == 50
    assert len(train) == 80 and len(evals) == 30
    train_prompts = {prompt_key(p) for r in train for p in user_prompts(r["messages"])}
    eval_prompts = {prompt_key(p) for r in evals for p in user_prompts(r["messages"])}
    assert not train_prompts & eval_prompts
    assert run(0, "b")[1:] == (train, evals)  # same seed, same split
    assert run(1, "c")[2] != evals  # another seed, another split


def test_filters_turns_and_length(tmp_path):
    records = [_sharegpt(0, n_turns=1), _sharegpt(1, n_turns=5), {"id": "long", "conversations": [
        {"from": "human", "value": "x" * 500}, {"from": "gpt", "value": "y"}]}]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    filters = {"min_turns": 1, "max_turns": 2, "max_chars": 100}
    summary = prepare_data([{"name": "sg", "kind": "sharegpt", "path": str(path), "train": 10, "eval": 0}], filters, 0,
                           tmp_path / "t", tmp_path / "e", tmp_path / "s")  # fmt: skip
    assert summary["sources"]["sg"]["filtered"] == {"turns_truncated_kept": 1, "too_long": 1}
    kept = read_jsonl(tmp_path / "t")
    assert sorted(sum(m["role"] == "assistant" for m in r["messages"]) for r in kept) == [1, 2]


def test_all_data_all_turns_and_replaced_replies_not_judged_by_length(tmp_path):
    long_reply = {"id": "long_reply", "conversations": [{"from": "human", "value": "short question"},
                                                        {"from": "gpt", "value": "y" * 500}]}  # fmt: skip
    records = [_sharegpt(i, n_turns=1 + i % 6) for i in range(12)] + [long_reply]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    src = [{"name": "sg", "kind": "sharegpt", "path": str(path), "train": "all", "eval": 2}]
    filters = {"min_turns": 1, "max_turns": None, "max_chars": 300}

    def run(replaced):
        summary = prepare_data(src, filters, 0, tmp_path / "t", tmp_path / "e", tmp_path / "s", replies_replaced=replaced)
        return summary, {r["id"]: r for r in read_jsonl(tmp_path / "t") + read_jsonl(tmp_path / "e")}

    summary, kept = run(False)  # the original 500-character reply is judged: too long
    assert summary["sources"]["sg"]["filtered"] == {"too_long": 1} and "sg:long_reply" not in kept
    assert (summary["train"], summary["eval"]) == (10, 2)  # "all": every conversation not held out
    assert sorted(sum(m["role"] == "assistant" for m in r["messages"]) for r in kept.values()) == sorted(
        1 + i % 6 for i in range(12))  # no turn cut
    summary, kept = run(True)  # the target writes the replies: only the question counts
    assert summary["sources"]["sg"]["filtered"] == {} and "sg:long_reply" in kept and summary["train"] == 11


def test_local_files_through_datasets(tmp_path):
    import pandas as pd

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(6)]
    pd.DataFrame(rows).to_parquet(tmp_path / "chats.parquet")
    src = [{"name": "pq", "kind": "datasets", "path": str(tmp_path / "chats.parquet"), "format": "parquet",
            "messages_field": "messages", "train": 4, "eval": 2}]  # fmt: skip
    summary = prepare_data(src, FILTERS, 0, tmp_path / "t", tmp_path / "e", tmp_path / "s")
    assert summary["train"] == 4 and summary["eval"] == 2


def test_humaneval_from_wheel(tmp_path):
    src = [{"name": "he", "kind": "humaneval", "path": None, "train": 0, "eval": 10}]
    summary = prepare_data(src, FILTERS, 0, tmp_path / "t", tmp_path / "e", tmp_path / "s")
    assert summary["sources"]["he"]["read"] == 164
    rec = read_jsonl(tmp_path / "e")[0]
    assert rec["messages"][1]["content"].startswith("```python\n")
