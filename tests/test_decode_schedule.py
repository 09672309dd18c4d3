"""The decode schedule (``e_fused.DecodeSchedule``, stages/e_fused/decode_schedule.py) on the host:
the views a replayed step builds are the ones the full path builds (the same memory, shape and
strides; the lists cut alike), the signature tells apart every change a replay must not survive,
and a foreign ``sched_meta`` is refused by name before anything else. Its GPU half, a replayed step
bit for bit the full path's: tests/test_e_decode_gpu.py."""

from __future__ import annotations

import pytest
import torch

from dsv4_attention.common import kv_cache as kc
from dsv4_attention.common.testing import fresh_generator
from dsv4_attention.stages import e_fused
from dsv4_attention.stages.e_fused import decode_schedule as sched

pytestmark = [pytest.mark.stage_e]


def step(g, batch=3, s_q=2, heads=64, page=64, pages=4, topk=40):
    """A CPU decode step's tensors: q, one MODEL1 cache, its lists (-1 padded) and lengths."""
    cache = kc.quantize_kv_cache((torch.randn(pages, page, 1, 512, generator=g) / 4).to(torch.bfloat16))
    lists = torch.randint(0, pages * page, (batch, s_q, topk), generator=g, dtype=torch.int32)
    lists[torch.rand(lists.shape, generator=g) < 0.1] = -1
    length = torch.randint(0, topk + 1, (batch,), generator=g, dtype=torch.int32)
    q = torch.randn(batch, s_q, heads, 512, generator=g).to(torch.bfloat16)
    return q, cache, lists, length


@pytest.mark.parametrize("page", [64, 2])
def test_replayed_views_are_the_full_paths(page):
    """``cache_bytes`` / ``step_lists`` against ``paged_source`` / ``cut_lists`` + ``index_source``,
    the full path's own functions: the same bytes at the same address with the same strides, the
    same lists. Negative controls: lists not cut at their lengths, and the bytes of another page
    size's layout, differ."""
    g = fresh_generator()
    q, cache, lists, length = step(g, page=page, pages=6)
    b, s_q, h, d = q.shape
    n, k = b * s_q, lists.shape[2]
    tokens = q.reshape(n, h, d)
    raw, tokens_a_page = e_fused.paged_source(tokens, cache)
    used = raw.shape[2]
    view = sched.cache_bytes(cache, used)
    assert tokens_a_page == page
    assert view.data_ptr() == raw.data_ptr() and view.shape == raw[None].shape and view.stride() == raw[None].stride()
    assert torch.equal(view, raw[None])
    cut = e_fused.cut_lists(lists, length, True, "topk_length")
    _, _, idx = e_fused.index_source(tokens, cache, cut.reshape(n, 1, k), None, True)
    mine = sched.step_lists(lists, length, n)
    assert mine.shape == idx.shape == (1, n, k) and mine.is_contiguous()
    assert torch.equal(mine, idx)
    assert (length < k).any() and not torch.equal(sched.step_lists(lists, None, n), idx)  # control: uncut
    other = kc.page_layout(page // 2).used_bytes  # control: a smaller page's layout reads other bytes
    assert other != used and sched.cache_bytes(cache, other).shape != raw[None].shape


def test_signature_tells_apart_what_a_replay_must_not_survive():
    """Equal for fresh tensors of the same shapes (a new step), different for every shape, stride,
    dtype or option a recorded step depends on; 1 and True differ; a non-tensor gives None."""
    g = fresh_generator()
    q, cache, lists, length = step(g)
    _, ext, ext_lists, ext_len = step(g, page=2, pages=100, topk=64)
    sink = torch.randn(q.shape[2], generator=g)

    def sig(**over):
        a = {"q": q, "k_cache": cache, "indices": lists, "topk_length": length, "attn_sink": sink,
             "extra_k_cache": ext, "extra_indices": ext_lists, "extra_topk_length": ext_len, "softmax_scale": None,
             "num_splits": None, "one_launch": None}
        a.update(over)
        return sched.signature(**a)

    base = sig()
    assert base is not None and hash(base) is not None
    assert sig(q=q.clone(), indices=lists.clone(), extra_topk_length=ext_len.clone()) == base  # a new step
    changed = {
        "q batch": {"q": torch.cat([q, q[:1]])},
        "q strides": {"q": q.transpose(1, 2).contiguous().transpose(1, 2)},
        "q dtype": {"q": q.half()},
        "cache pages": {"k_cache": torch.cat([cache, cache[:1]])},
        "list width": {"indices": lists[..., :-1]},
        "list dtype": {"indices": lists.long()},
        "no lengths": {"topk_length": None},
        "no sink": {"attn_sink": None},
        "extra cache": {"extra_k_cache": ext[:-1]},
        "extra lists": {"extra_indices": ext_lists[..., :8]},
        "extra lengths": {"extra_topk_length": None},
        "scale": {"softmax_scale": 0.05},
        "splits": {"num_splits": 2},
        "splits typed": {"num_splits": True},
        "form": {"one_launch": True},
    }
    keys = {name: sig(**over) for name, over in changed.items()}
    for name, key in keys.items():
        assert key != base, name
    assert sig(num_splits=1) != sig(num_splits=True)
    assert sig(indices=[[0]]) is None


def test_decode_refuses_a_foreign_sched_meta():
    """Before any check of the tensors (a CPU call would be refused for its device after it)."""
    g = fresh_generator()
    q, cache, lists, _ = step(g)
    with pytest.raises(ValueError, match="sched_meta must be a DecodeSchedule"):
        e_fused.decode(q, cache, lists, sched_meta=object())
    assert repr(e_fused.DecodeSchedule()) == "DecodeSchedule(empty)"
