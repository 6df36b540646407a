import json

from conftest import write_conversations

from specgate.files import read_jsonl
from specgate.pipeline.regenerate import regenerate_stage
from specgate.pipeline.target import materialize_target


def test_assistant_turns_are_replaced_by_the_targets_replies_and_resume(tmp_path, tiny_llama_dir):
    target = tmp_path / "target"
    materialize_target(target, source="hf_dir", path=str(tiny_llama_dir), dtype="float32")
    chats = write_conversations(tmp_path / "chats.jsonl", 6)
    settings = dict(seed=0, device="cpu", max_new_tokens=6, temperature=0.0, batch_size=4, chunk_size=4)
    out = tmp_path / "regen.jsonl"
    summary = regenerate_stage(chats, target, out, tmp_path / "s.json", **settings)
    original, regenerated = read_jsonl(chats), read_jsonl(out)
    assert summary["input"] == 6 and summary["kept"] + summary["dropped_empty_reply"] == 6
    by_prompt = {r["messages"][0]["content"]: r for r in original}
    for rec in regenerated:
        before = by_prompt[rec["messages"][0]["content"]]["messages"]
        assert [m["content"] for m in rec["messages"] if m["role"] == "user"] == \
            [m["content"] for m in before if m["role"] == "user"][: len(rec["messages"]) // 2]  # fmt: skip
        assert all(m["content"] != b["content"] for m, b in zip(rec["messages"], before) if m["role"] == "assistant")
    # parts are reused on a rerun: delete the output, keep the parts, get the same result
    parts = sorted((tmp_path / "regen.parts").glob("part_*.jsonl"))
    assert len(parts) == 2
    mtimes = [p.stat().st_mtime_ns for p in parts]
    out.unlink()
    regenerate_stage(chats, target, out, tmp_path / "s.json", **settings)
    assert read_jsonl(out) == regenerated
    assert [p.stat().st_mtime_ns for p in parts] == mtimes
    assert json.loads((tmp_path / "s.json").read_text())["kept"] == summary["kept"]
