import torch

from specgate.pipeline.vocab import build_draft_vocab


def test_top_tokens_sorted_with_offsets_and_mask():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[3, 7, 11, 15, 2]] = torch.tensor([50, 10, 40, 1, 40])
    ids, d2t, t2d = build_draft_vocab(counts, 4)
    assert ids.tolist() == [2, 3, 7, 11]  # the four most frequent, ascending (ties by id)
    assert d2t.dtype == torch.int64 and d2t.tolist() == [2, 2, 5, 8]  # d2t[i] = id[i] - i
    assert (torch.arange(4) + d2t).tolist() == ids.tolist()
    assert t2d.dtype == torch.bool and t2d.nonzero().squeeze(1).tolist() == [2, 3, 7, 11]


def test_pads_with_unused_ids_when_too_few_distinct_tokens():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[4, 8]] = 3
    ids, d2t, t2d = build_draft_vocab(counts, 5)
    assert ids.tolist() == [0, 1, 2, 4, 8]
    assert int(t2d.sum()) == 5 and len(set(ids.tolist())) == 5
