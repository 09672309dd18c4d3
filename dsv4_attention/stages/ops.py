"""Every stage's ``forward`` as a torch custom op, so that ``torch.compile`` (fullgraph) traces
through calls to it and CUDA graphs capture it.

    import dsv4_attention.stages.ops                                    # registers the ops once
    o, lse = torch.ops.dsv4_attention.d4_causal_window(q, k, v, causal=True, window_left=127)
    s = torch.ops.dsv4_attention.a_qk_gemm(q, k)

One op per stage, named ``dsv4_attention::<id>_<name>``. The attention stages share one schema

    (q, k, v, softmax_scale=None, causal=False, window_left=None, window_right=None,
     seqused_k=None, pack_gqa=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
     max_seqlen_k=None, learnable_sink=None, compressed_kv=None, compress_ratio=None,
     topk_indices=None, kv_start=None, positions=None, cu_seqlens_compressed=None,
     check_indices=True, num_splits=1) -> (o, lse)

(a window is two optional ints, as a schema cannot hold a tuple with None); an argument a stage
does not take must keep its default (ValueError otherwise, from the op as from ``forward``).
Each op has a fake (meta) implementation that gives the outputs' shapes and dtypes without a GPU:
o like q (contiguous), lse [batch, heads, seqlen_q] fp32 ([heads, total_q] for a variable-length
batch, q [total_q, heads, d]); stage A's scores [batch, heads, seqlen_q, seqlen_k] fp32. The ops
never alias or mutate their inputs. K = V is still detected from the tensors the op receives
(the same tensor passed as k and v).

Gradients (common/autograd.py): the attention stages' ops are differentiable in q, k, v and
``learnable_sink`` where stage F's backward serves the call (dense attention with a scale, causal,
a window, ``seqused_k``, variable-length batches and the sink; sm90, head dims 64 / 128), through
the op

    dsv4_attention::f_backward(q, k, v, o, lse, do, softmax_scale=None, causal=False,
                               window_left=None, window_right=None, learnable_sink=None,
                               seqused_k=None, cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=None, max_seqlen_k=None)
        -> (dq, dk, dv, dsink)          (dsink [heads] fp32; empty without a sink)

which has a fake implementation, so ``torch.compile(fullgraph=True)`` traces forward and
backward. Calls with compressed entries, or that stage F's kernel does not serve (another head
dim, dtype or architecture), take stage F's torch-composed backward through the op
``dsv4_attention::f_fused_backward``; the index op's backward is ``f_index_backward`` (both with
fake implementations; the queries' frame and a variable-length batch's offsets in index mode's form
of the layer, as for ``attention``). Any other call with an input that requires grad under grad mode raises
``NotDifferentiableError`` from the op's autograd rule, as does stage A's op.
"""

import inspect

import torch

from dsv4_attention import stages
from dsv4_attention.common.autograd import refuse_op_grad, register_attention_op_grad, register_index_op_grad

NAMESPACE = "dsv4_attention"
OPS: dict = {}
#: each stage's forward keyword parameters, read once (not per call)
TAKES = {s.id: frozenset(inspect.signature(s.forward).parameters) for s in stages.STAGES}


#: the op's defaults of the arguments a stage may not take (the others default to None)
DEFAULTS = {"causal": False, "check_indices": True, "num_splits": 1}


def _stage_kwargs(stage, softmax_scale, causal, window_left, window_right, seqused_k, pack_gqa,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                  learnable_sink=None, compressed_kv=None, compress_ratio=None, topk_indices=None,
                  kv_start=None, positions=None, cu_seqlens_compressed=None, check_indices=True,
                  num_splits=1) -> dict:
    """The forward keyword arguments of ``stage`` for the op's arguments (those it takes)."""
    takes = TAKES[stage.id]
    given = {"softmax_scale": softmax_scale, "causal": causal, "seqused_k": seqused_k, "pack_gqa": pack_gqa,
             "check_indices": check_indices, "num_splits": num_splits}
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                        ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("learnable_sink", learnable_sink), ("compressed_kv", compressed_kv),
                        ("compress_ratio", compress_ratio), ("topk_indices", topk_indices), ("kv_start", kv_start),
                        ("positions", positions), ("cu_seqlens_compressed", cu_seqlens_compressed)):
        if value is not None:  # only passed when given: earlier stages do not take them
            given[name] = value
    if window_left is not None or window_right is not None:
        given["window_size"] = (window_left, window_right)
    kwargs = {}
    for name, value in given.items():
        default = DEFAULTS.get(name)
        if name in takes:
            kwargs[name] = value
        elif not (type(value) is type(default) and value == default):  # by type and value: 1 is not True
            raise ValueError(f"stage {stage.id} does not take {name} (got {value!r}); stages that do: "
                             f"{[s.id for s in stages.STAGES if name in TAKES[s.id]]}")
    return kwargs


@torch.library.custom_op(f"{NAMESPACE}::f_backward", mutates_args=(), device_types="cuda")
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                       window_left: int | None = None, window_right: int | None = None,
                       learnable_sink: torch.Tensor | None = None,
                       seqused_k: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                       cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """Stage F's backward as an op: (dq, dk, dv, dsink); dsink is empty ([0] fp32) without a sink."""
    grads = stages.get("f").module.backward(q, k, v, o, lse, do, softmax_scale=softmax_scale, causal=causal,
                                            window_size=(window_left, window_right), learnable_sink=learnable_sink,
                                            seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    dsink = grads[3] if learnable_sink is not None else q.new_empty((0,), dtype=torch.float32)
    return grads[0], grads[1], grads[2], dsink


@attention_backward.register_fake
def _(q, k, v, o, lse, do, softmax_scale=None, causal=False, window_left=None, window_right=None,
      learnable_sink=None, seqused_k=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
      max_seqlen_k=None):
    dsink = q.new_empty((0,) if learnable_sink is None else tuple(learnable_sink.shape), dtype=torch.float32)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dsink)


@torch.library.custom_op(f"{NAMESPACE}::f_fused_backward", mutates_args=(), device_types="cuda")
def fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, compressed_kv: torch.Tensor | None = None, compress_ratio: int | None = None,
                   topk_indices: torch.Tensor | None = None, softmax_scale: float | None = None, causal: bool = False,
                   window_left: int | None = None, window_right: int | None = None,
                   learnable_sink: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, kv_start: int | None = None,
                   cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                   cu_seqlens_compressed: torch.Tensor | None = None,
                   max_seqlen_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """Stage F's torch-composed backward of stage E's attention as an op: (dq, dk, dv, dcompressed,
    dsink); dcompressed and dsink are empty ([0]) without entries, without a sink. The queries'
    frame (seqused_k, positions, kv_start) and a variable-length batch's offsets where the layer
    has index mode's form (``fused.lists_cover``)."""
    dq, dk, dv, dc, dsink = stages.get("f").module.fused_backward(
        q, k, v, o, lse, do, compressed_kv=compressed_kv, compress_ratio=compress_ratio, topk_indices=topk_indices,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        learnable_sink=learnable_sink, seqused_k=seqused_k, positions=positions, kv_start=kv_start or 0,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, cu_seqlens_compressed=cu_seqlens_compressed,
        max_seqlen_k=max_seqlen_k)
    empty = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, empty if dc is None else dc, empty if dsink is None else dsink


@fused_backward.register_fake
def _(q, k, v, o, lse, do, compressed_kv=None, compress_ratio=None, topk_indices=None, softmax_scale=None,
      causal=False, window_left=None, window_right=None, learnable_sink=None, seqused_k=None, positions=None,
      kv_start=None, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_compressed=None, max_seqlen_k=None):
    empty = q.new_empty((0,), dtype=torch.float32)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            empty if compressed_kv is None else torch.empty_like(compressed_kv, memory_format=torch.contiguous_format),
            empty if learnable_sink is None else q.new_empty(tuple(learnable_sink.shape), dtype=torch.float32))


@torch.library.custom_op(f"{NAMESPACE}::f_index_backward", mutates_args=(), device_types="cuda")
def index_backward(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None,
                   softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index mode's torch-composed backward as an op: (dq, dkv, dsink); dsink empty without a sink."""
    dq, dkv, dsink = stages.get("f").module.index_backward(q, kv, indices, o, lse, do, topk_length=topk_length,
                                                           attn_sink=attn_sink, softmax_scale=softmax_scale)
    return dq, dkv, q.new_empty((0,), dtype=torch.float32) if dsink is None else dsink


@index_backward.register_fake
def _(q, kv, indices, o, lse, do, topk_length=None, attn_sink=None, softmax_scale=None):
    dsink = q.new_empty((0,) if attn_sink is None else tuple(attn_sink.shape), dtype=torch.float32)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format), dsink)


def _register_attention(stage):
    name = f"{NAMESPACE}::{stage.id}_{stage.name}"

    @torch.library.custom_op(name, mutates_args=(), device_types="cuda")
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
           causal: bool = False, window_left: int | None = None, window_right: int | None = None,
           seqused_k: torch.Tensor | None = None, pack_gqa: bool | None = None,
           cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
           max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
           learnable_sink: torch.Tensor | None = None, compressed_kv: torch.Tensor | None = None,
           compress_ratio: int | None = None, topk_indices: torch.Tensor | None = None,
           kv_start: int | None = None, positions: torch.Tensor | None = None,
           cu_seqlens_compressed: torch.Tensor | None = None,
           check_indices: bool = True, num_splits: int | None = 1) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = _stage_kwargs(stage, softmax_scale, causal, window_left, window_right, seqused_k, pack_gqa,
                               cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, learnable_sink, compressed_kv,
                               compress_ratio, topk_indices, kv_start, positions, cu_seqlens_compressed,
                               check_indices, num_splits)
        o, lse = stage.forward(q, k, v, **kwargs)
        return o, lse

    @op.register_fake
    def _(q, k, v, softmax_scale=None, causal=False, window_left=None, window_right=None, seqused_k=None,
          pack_gqa=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
          learnable_sink=None, compressed_kv=None, compress_ratio=None, topk_indices=None, kv_start=None,
          positions=None, cu_seqlens_compressed=None, check_indices=True, num_splits=1):
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        if cu_seqlens_q is not None:  # varlen: q [total_q, heads, d], lse [heads, total_q]
            return o, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        b, sq, h, _ = q.shape
        return o, q.new_empty((b, h, sq), dtype=torch.float32)

    register_attention_op_grad(op, f"op {name}", attention_backward, fused_backward)
    return op


def _register_qk(stage):
    @torch.library.custom_op(f"{NAMESPACE}::{stage.id}_{stage.name}", mutates_args=(), device_types="cuda")
    def op(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
        return stage.forward(q, k, softmax_scale=softmax_scale)

    @op.register_fake
    def _(q, k, softmax_scale=None):
        b, sq, h, _ = q.shape
        return q.new_empty((b, h, sq, k.shape[1]), dtype=torch.float32)

    refuse_op_grad(op, f"op {NAMESPACE}::{stage.id}_{stage.name}")
    return op


for _stage in stages.STAGES:
    OPS[_stage.id] = _register_qk(_stage) if _stage.id == "a" else _register_attention(_stage)


@torch.library.custom_op(f"{NAMESPACE}::e_index_attention", mutates_args=(), device_types="cuda")
def index_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None = None,
                    attn_sink: torch.Tensor | None = None,
                    softmax_scale: float | None = None, check_indices: bool = True,
                    num_splits: int | None = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage E's index mode (FlashMLA's sparse attention semantics) as an op: (o [tokens, heads, d],
    lse [tokens, heads])."""
    o, lse = stages.get("e").module.index_attention(q, kv, indices, topk_length=topk_length, attn_sink=attn_sink,
                                                    softmax_scale=softmax_scale, check_indices=check_indices,
                                                    num_splits=num_splits)
    return o, lse.contiguous()


@index_attention.register_fake
def _(q, kv, indices, topk_length=None, attn_sink=None, softmax_scale=None, check_indices=True, num_splits=1):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:2], dtype=torch.float32)


register_index_op_grad(index_attention, f"op {NAMESPACE}::e_index_attention", index_backward)
OPS["e_index"] = index_attention
