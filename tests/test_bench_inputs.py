"""The benchmark's DeepSeek-V4 inputs (tools/bench.py ``dsv4_layer``) are what the rows claim: each
token's top-k list holds min(k, visible) distinct visible entries and -1 after them, as an indexer
builds it (a list of invisible or repeated entries would time another function)."""

import torch

from tools.bench import dsv4_layer


def test_topk_lists_are_distinct_visible_entries_then_minus_one():
    c = dsv4_layer("cpu", 2, 300, 4096, 512)
    lists, count = c["topk_indices"], c["count"]
    assert lists.shape == (2, 300, 512) and lists.dtype == torch.int32
    assert c["compressed_kv"].shape[1] == 4096 // 4 and c["compress_ratio"] == 4
    for row, n in zip(lists.reshape(-1, 512), count.repeat(2), strict=True):
        kept = row[row >= 0]
        assert len(kept) == min(512, int(n)) and len(kept.unique()) == len(kept)
        assert bool((kept < n).all()) and bool((row[len(kept):] == -1).all())


def test_hca_layer_sees_every_entry_it_may():
    c = dsv4_layer("cpu", 1, 2, 65536, None)
    assert c["topk_indices"] is None and c["compress_ratio"] == 128
    assert c["compressed_kv"].shape[1] == 512 and c["count"].tolist() == [511, 512]
