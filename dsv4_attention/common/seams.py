"""The trailing operands of stage D1's kernel and those built on it, one bundle per seam.

Stage D1's kernel (both architectures) is the skeleton every later stage switches seams on in.
Its host entry takes, after Q, K, V, O, LSE, the scale and the stream, five operands; each
belongs to the stage that introduces it, and D1 only passes it on to that stage's hooks:

    lengths   D3: per-request key counts, variable-length offsets          :class:`Lengths`
    window    D4: the window bounds (causal: right = 0)                     :class:`Window`
    sink      D5: the attention sink, [heads] fp32, or None (a tensor, not a bundle)
    entries   E: the compressed entries, their top-k lists, positions      :class:`Entries`
    partials  split-KV: the partial outputs and the split count            :class:`SplitParts`

Every bundle is always passed whole: an unused tensor is None and an unused integer 0, so one
compiled kernel serves every value (the stage's compile-time options say which fields it reads;
the others compile out) and an exported C signature (common/kernel_cache.py) has no optional
integer. The same NamedTuples carry torch tensors on the host, fake tensors at compile time
(common/jit.compile_args maps their fields) and CuTe values in the kernel: CuTeDSL's TVM-FFI
calling convention takes a tuple argument field by field. Plain Python (no DSL import): a call
served from the kernel cache builds them too.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Lengths(NamedTuple):
    """D3: ``seqused_k`` [batch] int32 (each request's key count), the variable-length offsets
    ``cu_seqlens_q`` / ``cu_seqlens_k`` [requests + 1] int32 and ``max_seqlen_q`` (0 unless varlen)."""
    seqused_k: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    max_seqlen_q: Any = 0


class Window(NamedTuple):
    """D4: the window bounds, key j visible to token i' iff i' - left <= j <= i' + right (each
    used only where the stage's ``has_left`` / ``has_right`` says it exists)."""
    left: Any = 0
    right: Any = 0


class Entries(NamedTuple):
    """E: ``compressed`` [batch, entries, kv_heads, d] (K = V rows), the ratio, ``topk`` [batch,
    seqlen_q, k] int32 lists (or None), ``kv_start`` (the absolute position of raw key 0),
    ``positions`` [batch or 1, seqlen_q] int32 (or None), ``cu_seqlens_c`` (varlen: each request's
    first entry, or None); serving's second source (index mode over paged FP8 caches: decode's
    extra cache): ``extra`` that cache's bytes [1, pages, 1, page bytes] uint8 and ``extra_topk``
    [batch, seqlen_q, k_b] int32 its lists, a token's keys being both lists (or None, None)."""
    compressed: Any = None
    ratio: Any = 0
    topk: Any = None
    kv_start: Any = 0
    positions: Any = None
    cu_seqlens_c: Any = None
    extra: Any = None
    extra_topk: Any = None


class SplitParts(NamedTuple):
    """Split-KV (common/split_kv.py): the fp32 partial O [splits x batch, seqlen_q, heads, d] and
    LSE [splits x batch, heads, seqlen_q], and the split count (0 where unsplit)."""
    o: Any = None
    lse: Any = None
    num_splits: Any = 0


#: the bundles' order after the stream, and their names (as D1's ``__call__`` takes them)
TAIL = ("lengths", "window", "sink", "entries", "partials")


def tail(lengths: Lengths | None = None, window: Window | None = None, sink=None, entries: Entries | None = None,
         partials: SplitParts | None = None) -> tuple:
    """The trailing operands of a call, every bundle whole (None: its unused form)."""
    return (lengths or Lengths(), window or Window(), sink, entries or Entries(), partials or SplitParts())
