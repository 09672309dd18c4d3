"""Stage D3 on SM90, on the host (CPU, no GPU): what a request is, run with the kernel's own seams.

1. Variable-length views. The kernel's ``row_views`` (D2's packed rows) and ``request_views`` (D3's
   seam) are compiled into a host function for sm_90a and *run on the CPU* over coordinate tensors
   of Q's, K's and LSE's shapes ([1, total, heads, d], [1, total_k, kv_heads, d], [1, heads,
   total]): an element of such a view is the (batch, token, head, column) it addresses. For random
   offsets (requests of 0 queries, 0 keys, one token, several tiles) and pack groups 1, 8 and 128,
   every packed row r of every request b and KV head hk must address token cu_q[b] + r // g, head
   hk g + r % g in Q, O (both of its views) and LSE, key j of the request key cu_k[b] + j of head
   hk in K and V, and the
   request's row and key counts must be (cu_q[b + 1] - cu_q[b]) g and cu_k[b + 1] - cu_k[b].
   Negative control: a request offset by cu_q[b] packed rows (the group forgotten).
2. Per-request key counts. The consumer warpgroups' masking of one Q tile is replayed with the D3
   kernel's ``request_views`` (the request's row count and its key count: ``kv_length``,
   seqused_k[b] clamped to [0, seqlen_k]), ``kv_span``, QK partition and ``mask_s``
   (``tests/sm90_mask_replay.py``) for the three consumer layouts; the kept (row, key) pairs of
   the real rows must be exactly the keys j < min(seqused_k[b], seqlen_k), each kept once, a
   request with no key keeps nothing, and the other requests' entries (different counts) are not
   read. Negative control: a kernel whose ``kv_length`` ignores seqused_k.
"""

from __future__ import annotations

import functools
import random

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32
from sm90_mask_replay import MAX_VISITS, kept_keys, mask_replayer, pair_mismatch, replay_buffers

from dsv4_attention.common.layouts import request_rows
from dsv4_attention.common.pack_heads import packed_row
from dsv4_attention.common.seams import Window

pytestmark = [pytest.mark.arch("sm90"), pytest.mark.stage_d3, pytest.mark.proof]

HK, D = 2, 64  # KV heads; columns of the coordinate tensors (the views never look at the head dim)
COLS = (0, 37)
ROWS_MAX = 1024  # packed rows recorded per request (the cases stay under it)


def kernel_class(wrong: str | None = None):
    from dsv4_attention.stages.d3_lengths.sm90 import FlashAttentionD3Sm90

    if wrong is None:
        return FlashAttentionD3Sm90
    if wrong == "ungrouped_offset":
        class Ungrouped(FlashAttentionD3Sm90):
            """Wrong on purpose: the request's first row at cu_q[b] packed rows, not cu_q[b] g."""

            def request_views(self, batch, mQ, mK, mV, mO, mO_mem, mLSE, mSeqUsedK, mCuSeqlensQ, mCuSeqlensK):
                row0, k0, n_rows, n_k = request_rows(mCuSeqlensQ, mCuSeqlensK, batch, 1)
                mQ, mO, mO_mem = (cute.domain_offset((row0, 0, 0, 0), t) for t in (mQ, mO, mO_mem))
                mK, mV = (cute.domain_offset((k0, 0, 0, 0), t) for t in (mK, mV))
                return mQ, mK, mV, mO, mO_mem, cute.domain_offset((0, 0, row0), mLSE), 0, \
                    n_rows * self.pack_group, n_k
        return Ungrouped
    if wrong == "ignores_seqused":
        class Ignores(FlashAttentionD3Sm90):
            """Wrong on purpose: every key of the tensor, whatever seqused_k says."""

            def kv_length(self, mSeqUsedK, batch, seqlen_k):
                return seqlen_k
        return Ignores
    raise ValueError(wrong)


# ---- 1. variable-length views ------------------------------------------------------------------

@functools.cache
def views_runner(group: int, wrong: str | None = None):
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.layouts import seq_major

    kernel = kernel_class(wrong)(jit.cutlass_dtype(torch.bfloat16), 128, varlen=True, pack_group=group,
                                 kv_shared=False)

    @cute.jit
    def host(q_out: cute.Tensor, k_out: cute.Tensor, lse_out: cute.Tensor, info: cute.Tensor, cu_q: cute.Tensor,
             cu_k: cute.Tensor, total_q: Int32, total_k: Int32):
        heads = HK * group
        q_ids = seq_major(cute.make_identity_tensor((1, total_q, heads, D)))
        k_ids = seq_major(cute.make_identity_tensor((1, total_k, HK, D)))
        q, o, lse = kernel.row_views(q_ids, q_ids, cute.make_identity_tensor((1, heads, total_q)))
        for r in cutlass.range(cu_q.shape[0] - 1, unroll=1):
            for hk in cutlass.range(HK, unroll=1):
                mQ, mK, mV, mO, mO_mem, mLSE, bi, n_rows, n_keys = kernel.request_views(
                    r, q, k_ids, k_ids, o, o, lse, None, cu_q, cu_k)  # O's two views and V's: the same tensors
                info[r, hk, 0] = n_rows
                info[r, hk, 1] = n_keys
                for i in cutlass.range(cutlass.min(n_rows, ROWS_MAX), unroll=1):
                    for ci in cutlass.range_constexpr(len(COLS)):
                        for vi, view in enumerate((mQ, mO, mO_mem)):  # Q, O's TMA view, O's memory
                            crd = view[i, COLS[ci], hk, bi]
                            for a in cutlass.range_constexpr(4):
                                q_out[r, hk, i, ci, vi, a] = crd[a]
                    crd_l = mLSE[bi, hk, i]
                    for a in cutlass.range_constexpr(3):
                        lse_out[r, hk, i, a] = crd_l[a]
                for j in cutlass.range(cutlass.min(n_keys, ROWS_MAX), unroll=1):
                    for vi, view in enumerate((mK, mV)):
                        crd = view[j, COLS[1], hk, bi]
                        for a in cutlass.range_constexpr(4):
                            k_out[r, hk, j, vi, a] = crd[a]

    def buffers(requests):
        return (torch.full((requests, HK, ROWS_MAX, len(COLS), 3, 4), -1, dtype=torch.int32),
                torch.full((requests, HK, ROWS_MAX, 2, 4), -1, dtype=torch.int32),
                torch.full((requests, HK, ROWS_MAX, 3), -1, dtype=torch.int32),
                torch.full((requests, HK, 2), -1, dtype=torch.int32))

    # shapes dynamic (jit.as_cute): one compiled function serves every request count
    bufs = [jit.as_cute(b) for b in buffers(2)] + [jit.as_cute(torch.zeros(3, dtype=torch.int32))] * 2
    with target_arch("sm90"):
        fn = cute.compile(host, *bufs, Int32(1), Int32(1), options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return kernel, fn, buffers


def view_mismatches(group: int, lens_q: list, lens_k: list, wrong: str | None = None) -> list:
    from dsv4_attention.common import jit

    kernel, fn, buffers = views_runner(group, wrong)
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    bufs = buffers(len(lens_q))
    q_out, k_out, lse_out, info = bufs
    fn(*[jit.as_cute(b) for b in (*bufs, cu_q, cu_k)], Int32(int(cu_q[-1])), Int32(int(cu_k[-1])))
    bad = []
    for b in range(len(lens_q)):
        for hk in range(HK):
            n_rows, n_keys = info[b, hk].tolist()
            want = (lens_q[b] * group, lens_k[b])
            if (n_rows, n_keys) != want:
                bad.append(f"g{group} request {b} hk{hk}: counts {(n_rows, n_keys)}, want {want}")
                continue
            for r in range(n_rows):
                t, head = packed_row(r, group, hk)
                for ci, c in enumerate(COLS):
                    for vi, what in enumerate(("Q", "O", "O memory")):
                        got = tuple(q_out[b, hk, r, ci, vi].tolist())
                        if got != (0, int(cu_q[b]) + t, head, c):
                            bad.append(f"g{group} request {b} hk{hk} row {r} col {c}: {what} at {got}, want token "
                                       f"{int(cu_q[b]) + t} head {head}")
                got = tuple(lse_out[b, hk, r].tolist())
                if got != (0, head, int(cu_q[b]) + t):
                    bad.append(f"g{group} request {b} hk{hk} row {r}: LSE at {got}")
            for j in range(n_keys):
                for vi, what in enumerate(("K", "V")):
                    got = tuple(k_out[b, hk, j, vi].tolist())
                    if got != (0, int(cu_k[b]) + j, hk, COLS[1]):
                        bad.append(f"g{group} request {b} hk{hk} key {j}: {what} at {got}")
    return bad[:5]


def random_lengths(seed: int, requests: int, group: int) -> tuple[list, list]:
    """Random lengths with every kind the docstring names: request 0 spans several 128-row tiles
    (up to ROWS_MAX packed rows) and has keys, one request has no query and keys, the last has
    queries and no key; the rest 0, 1 or a random count of each."""
    rng = random.Random(seed)
    most = ROWS_MAX // group
    lens_q = [rng.choice([0, 1, rng.randint(1, most)]) for _ in range(requests)]
    lens_k = [rng.choice([0, 1, rng.randint(1, 400)]) for _ in range(requests)]
    lens_q[0], lens_k[0] = rng.randint(max(2, -(-300 // group)), most), rng.randint(130, 400)
    lens_q[1], lens_k[1] = 0, max(lens_k[1], 1)
    lens_q[-1], lens_k[-1] = max(lens_q[-1], 1), 0
    return lens_q, lens_k


@pytest.mark.parametrize("group", [1, 8, 128])
def test_varlen_views_address_each_requests_tokens(group):
    for seed in range(3):
        lens_q, lens_k = random_lengths(seed, 5, group)
        assert lens_q[0] * group > 2 * 128 and sum(lens_k) > 0
        assert view_mismatches(group, lens_q, lens_k) == [], (seed, lens_q, lens_k)


def test_checker_rejects_requests_offset_without_the_group():
    assert view_mismatches(8, [3, 2, 4], [5, 0, 9], "ungrouped_offset")


# ---- 2. per-request key counts -----------------------------------------------------------------

KERNELS = {  # name: (head_dim, options, (split, seesaw))
    "rows-g1": (128, {"pack_group": 1, "kv_shared": False}, (False, False)),
    "split-g8": (512, {"pack_group": 8, "kv_shared": False}, (True, False)),
    "seesaw-g128": (512, {"pack_group": 128, "kv_shared": True}, (True, True)),
}


@functools.cache
def mask_runner(name: str, wrong: str | None = None):
    from cutlass.cute.runtime import from_dlpack

    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import GPU_ARCH, target_arch
    from dsv4_attention.common.layouts import seq_major

    head_dim, options, layout = KERNELS[name]
    kernel = kernel_class(wrong)(jit.cutlass_dtype(torch.bfloat16), head_dim, seqused_k=True, **options)
    assert (kernel.col_split, kernel.seesaw) == layout, f"{name} is not the layout it is named for"
    replay = mask_replayer(kernel)

    @cute.jit
    def host(out: cute.Tensor, coords: cute.Tensor, info: cute.Tensor, used: cute.Tensor, m_block: Int32,
             seqlen_q: Int32, seqlen_k: Int32, batch: Int32):
        qk_mma, _ = kernel.make_mmas()
        # what the kernel takes a request to be: its own views and counts (request_views, which
        # calls kv_length on seqused_k), over coordinate tensors of Q's, K's and LSE's shapes
        heads = HK * kernel.pack_group
        q_ids = seq_major(cute.make_identity_tensor((used.shape[0], seqlen_q, heads, D)))
        k_ids = seq_major(cute.make_identity_tensor((used.shape[0], seqlen_k, HK, D)))
        q, o, lse = kernel.row_views(q_ids, q_ids, cute.make_identity_tensor((used.shape[0], heads, seqlen_q)))
        _, _, _, _, _, _, bi, n_rows, n_keys = kernel.request_views(batch, q, k_ids, k_ids, o, o, lse, used, None, None)
        span = kernel.kv_span(m_block, n_rows, n_keys, Window(0, 0), None)
        info[0] = span.origin
        info[1] = span.n_tiles
        info[2] = bi
        replay(qk_mma, span, m_block * kernel.tile_m, out, coords)

    bufs = (*replay_buffers(kernel), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    with target_arch("sm90"):
        fn = cute.compile(host, *[from_dlpack(b) for b in bufs], *([Int32(1)] * 4),
                          options=f"--gpu-arch={GPU_ARCH['sm90']}")
    return kernel, fn, bufs


def key_mismatches(name: str, wrong: str | None = None) -> list:
    from cutlass.cute.runtime import from_dlpack

    kernel, fn, (out, coords, info, used) = mask_runner(name, wrong)
    g, tile_n = kernel.pack_group, kernel.tile_n
    bad = []
    for seqlen_q, seqlen_k in ((70, 300), (5, 129), (3, 64)):
        # seqused_k per request: none, one, a tile's edge and past it, all, more than the tensor, negative
        for b, n_used in enumerate((0, 1, tile_n, tile_n + 1, 2 * tile_n + 3, seqlen_k, seqlen_k + 9, -4)):
            batch = b % 3  # the request's own entry is read: the others hold counts no case wants
            used.copy_(torch.tensor([5, 11, 17], dtype=torch.int32))
            used[batch] = n_used
            want_keys = max(min(n_used, seqlen_k), 0)
            tiles = -(-seqlen_q * g // kernel.tile_m)
            for m in sorted({0, tiles - 1}):
                out.zero_()
                fn(*[from_dlpack(x) for x in (out, coords, info, used)],
                   *[Int32(x) for x in (m, seqlen_q, seqlen_k, batch)])
                origin, n_tiles, bi = info.tolist()
                assert 1 <= n_tiles <= MAX_VISITS and bi == batch, info.tolist()

                def key_of(n, row, col, m=m, origin=origin, seqlen_q=seqlen_q):  # tile n: keys origin + n T ..
                    packed = m * kernel.tile_m + row
                    return (packed, origin + n * tile_n + col) if packed // g < seqlen_q else None

                kept = kept_keys(out, coords, n_tiles, key_of)
                rows = [r for r in range(m * kernel.tile_m, (m + 1) * kernel.tile_m) if r // g < seqlen_q]
                want = {(r, j) for r in rows for j in range(want_keys)}
                wrong_pairs = pair_mismatch(kept, want)
                if wrong_pairs:
                    bad.append(f"{name} sq{seqlen_q} sk{seqlen_k} seqused {n_used} m{m}: {wrong_pairs}")
    return bad[:5]


@pytest.mark.parametrize("name", list(KERNELS))
def test_kept_keys_are_the_requests_own(name):
    assert key_mismatches(name) == []


def test_checker_rejects_a_kernel_that_ignores_seqused_k():
    assert key_mismatches("rows-g1", "ignores_seqused")
