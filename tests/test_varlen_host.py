"""Host proof (CPU, no GPU): a variable-length batch's rows, where the host puts them and where the
backward's kernel reads and writes them (common/varlen.py, stages/f_backward/sm90.py).

The kernel offsets a packed tensor to request b's first row cu[b] (``batch_rows``) and a padded
one (LSE, D, the dQ accumulator; dK, dV) to ``padded_start(cu[b], b, tile)``; the host scatters
request b's row i to ``padded_index(cu)[cu[b] + i]`` and gathers it back from there. For random
offsets (empty requests included): the kernel's coordinate of (request b, tile m, row r), traced
through ``batch_rows`` and ``cute.local_tile`` as the kernel calls them, is the host's row; each
request's whole tiles lie inside its own padded rows (a tile written for request b never touches
request b + 1's) and inside ``padded_total``. Negative control: padding without the request term
((cu[b] // tile) tile) lets a request's last tile overlap the next request's rows.
"""

from __future__ import annotations

import random

import cutlass.cute as cute
import pytest
import torch

from dsv4_attention.common.layout_proof import trace
from dsv4_attention.common.varlen import batch_rows, padded_index, padded_start, padded_total

pytestmark = [pytest.mark.stage_f, pytest.mark.proof, pytest.mark.arch("sm90")]


def offsets(seed: int, requests: int, longest: int) -> list[int]:
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, rng.randrange(longest), longest]) for _ in range(requests)]
    return [sum(lengths[:i]) for i in range(requests + 1)]


def kernel_rows(cu: list[int], tile: int, head_dim: int = 64) -> dict:
    """(b, m, r) -> (packed row read, padded row written): the kernel's coordinates of row r of Q
    tile m of request b, from its own ``batch_rows`` and ``padded_start`` on TMA-like coordinate
    tensors (rows, d, heads, 1)."""
    total = cu[-1]

    def body():
        rows = {}
        packed = cute.make_identity_tensor((max(total, 1), head_dim, 2, 1))
        padded = cute.make_identity_tensor((padded_total(total, len(cu) - 1, tile), head_dim, 2, 1))
        for b in range(len(cu) - 1):
            length = cu[b + 1] - cu[b]
            g_in = cute.local_tile(batch_rows(packed, 0, cu[b])[None, None, 1], (tile, head_dim), (None, 0))
            g_out = cute.local_tile(batch_rows(padded, 0, padded_start(cu[b], b, tile))[None, None, 1],
                                    (tile, head_dim), (None, 0))
            for m in range(-(-length // tile)):
                for r in range(tile):
                    rows[(b, m, r)] = (int(g_in[r, 0, m][0]), int(g_out[r, 0, m][0]))
        return rows

    return trace(body, arch="sm90")


def failures(cu: list[int], tile: int, start=padded_start) -> list:
    bad = []
    requests, total = len(cu) - 1, cu[-1]
    index = padded_index(torch.tensor(cu, dtype=torch.int32), total, tile).tolist()
    owner = {}
    for (b, m, r), (read, written) in kernel_rows(cu, tile).items():
        i = m * tile + r  # the request's row
        if read != cu[b] + i:
            bad.append(("read", b, m, r, read))
        if i < cu[b + 1] - cu[b] and index[cu[b] + i] != written:
            bad.append(("host row", b, i, index[cu[b] + i], written))
        mine = start(cu[b], b, tile) + i  # the rows a tile of request b covers, by the padding rule checked
        if mine in owner and owner[mine] != b or mine >= padded_total(total, requests, tile):
            bad.append(("overlap", b, m, r, mine))
        owner[mine] = b
    return bad


@pytest.mark.parametrize("tile", [64, 128])
@pytest.mark.parametrize("seed", range(4))
def test_requests_rows_are_where_the_kernel_reads_and_writes(tile, seed):
    cu = offsets(seed, 6, 300)
    bad = failures(cu, tile)
    assert not bad, f"cu {cu}: {bad[:5]}"


def test_padding_without_the_request_term_is_rejected():
    def unpadded(start, batch, tile):
        return start // tile * tile

    assert any(failures(offsets(seed, 6, 300), 64, start=unpadded) for seed in range(4))
