import json

import pytest
import torch
from conftest import kill_9_when

from specgate.files import stage_log
from specgate.pipeline.capture import (
    CaptureDataset,
    balanced_shard_tokens,
    capture_batch,
    capture_hidden_states,
    default_layers,
    load_target,
    pad_batch,
    plan_batches,
    plan_shards,
    run_capture_job,
)
from specgate.pipeline.tokenize import TokenizedDataset


@pytest.fixture
def target(tiny_target):
    return tiny_target


@pytest.fixture
def tokens(tiny_tokens):
    return tiny_tokens


def test_manifest_records_weights_and_shape(target):
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["num_hidden_layers"] == 8 and manifest["hidden_size"] == 64
    assert manifest["dtype"] == "float32" and manifest["tie_word_embeddings"] is True
    assert len(manifest["weights"]["model.safetensors"]) == 64


def test_captured_layers_follow_sglang_numbering(target):
    model = load_target(target, "cpu")
    layers = default_layers(8)
    assert layers == [1, 3, 4]
    seqs = [torch.randint(0, 1000, (n,)) for n in (7, 3)]
    ids = pad_batch(seqs, "cpu")
    with torch.inference_mode():
        aux, final = capture_batch(model, layers, ids, [7, 3], torch.float32)
        ref = model(input_ids=ids, output_hidden_states=True)
        body = model.model(input_ids=ids).last_hidden_state
        head = model.lm_head(final)
    # SGLang layer id L = output of decoder layer L = HF hidden_states[L + 1]
    expect_aux = torch.cat([ref.hidden_states[layer + 1] for layer in layers], dim=-1)
    valid = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])
    torch.testing.assert_close(aux, expect_aux[valid])
    torch.testing.assert_close(final, body[valid])
    # the final normed state reproduces the target logits through lm_head
    torch.testing.assert_close(head, ref.logits[valid], rtol=1e-4, atol=1e-4)


def _job(target, tokens, out, **over):
    job = {"target_dir": str(target), "tokens_path": str(tokens), "index_out": str(out / "index.json"), "layers": None,
           "dtype": "bfloat16", "batch_tokens": 512, "shard_tokens": 1024, "device": "cpu"}  # fmt: skip
    return job | over


def _all_tensors(index):
    ds = CaptureDataset(index)
    return {seq_id: t for seq_id, t in ds.iter_sequences()}


def test_resume_after_kill_9(tmp_path, target, tokens):
    ref = tmp_path / "ref"
    capture_hidden_states(**_job(target, tokens, ref))
    n_shards = len(json.loads((ref / "index.json").read_text())["shards"])
    assert n_shards >= 10

    out = tmp_path / "killed"
    shards = out / "shards"
    kill_9_when("specgate.pipeline.capture", _job(target, tokens, out), tmp_path / "job.json",
                lambda: len(list(shards.glob("shard_*.safetensors"))) >= 3)  # fmt: skip
    done_before = sorted(p.name for p in shards.glob("shard_*.safetensors"))
    assert 3 <= len(done_before) < n_shards, "the kill must land mid-run"
    assert not (out / "index.json").exists()
    mtimes = {name: (shards / name).stat().st_mtime_ns for name in done_before}
    # a half-written shard as a kill during a write leaves it: must be discarded, never read
    (shards / "shard_00001.safetensors.tmp-deadbeef").write_bytes(b"partial")

    capture_hidden_states(**_job(target, tokens, out))
    assert {name: (shards / name).stat().st_mtime_ns for name in done_before} == mtimes, "finished shards are reused"
    assert not list(shards.glob("*.tmp-*"))
    got, want = _all_tensors(out / "index.json"), _all_tensors(ref / "index.json")
    assert got.keys() == want.keys() == set(range(len(TokenizedDataset(tokens))))
    for seq_id in want:
        for name in want[seq_id]:
            assert torch.equal(got[seq_id][name], want[seq_id][name]), (seq_id, name)


def test_changed_settings_do_not_reuse_old_shards(tmp_path, target, tokens):
    out = tmp_path / "cap"
    capture_hidden_states(**_job(target, tokens, out))
    first = json.loads((out / "index.json").read_text())
    capture_hidden_states(**_job(target, tokens, out, layers=[0, 2, 5]))
    second = json.loads((out / "index.json").read_text())
    assert second["fingerprint"] != first["fingerprint"]
    assert second["last_run"]["tokens"] == second["tokens"], "everything recaptured"
    assert second["hidden_state_indices_hf"] == [1, 3, 6]


def test_fails_clearly_when_disk_is_short(tmp_path, target, tokens, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10, 10, 1000))
    with pytest.raises(OSError, match="capture needs .* GiB"):
        capture_hidden_states(**_job(target, tokens, tmp_path / "cap"))


@pytest.mark.slow
def test_two_processes_write_their_own_shards_and_match_one(tmp_path, target, tokens):
    one, two = tmp_path / "one", tmp_path / "two"
    capture_hidden_states(**_job(target, tokens, one))
    with stage_log(tmp_path / "capture.log"):  # as the rule runs it
        run_capture_job(2, **_job(target, tokens, two))  # two CPU ranks over gloo
    log_text = (tmp_path / "capture.log").read_text()
    assert "rank 0: captured" in log_text and "rank 1: captured" in log_text  # the ranks' lines reach the rule's log
    index = json.loads((two / "index.json").read_text())
    assert index["world_size"] == 2 and len(index["shards"]) >= 4
    got, want = _all_tensors(two / "index.json"), _all_tensors(one / "index.json")
    assert got.keys() == want.keys()
    for seq_id in want:
        for name in want[seq_id]:
            assert torch.equal(got[seq_id][name], want[seq_id][name]), (seq_id, name)


def test_shards_split_evenly_over_ranks():
    """Two GPUs: 1.6M tokens, shards of at most 1M, two ranks."""
    lengths = [700 + (i * 37) % 600 for i in range(1600)]
    total = sum(lengths)
    for world in (1, 2, 3, 8):
        size = balanced_shard_tokens(total, 1_048_576, world)
        assert size <= 1_048_576
        shards = plan_shards(plan_batches(lengths, 65536), lengths, size)
        per_rank = [sum(lengths[i] for k in range(r, len(shards), world) for b in shards[k] for i in b) for r in range(world)]
        assert sum(per_rank) == total
        assert max(per_rank) <= total / world + 65536, (world, per_rank)  # within one batch; before: [1.07M, 0.54M] at world 2
