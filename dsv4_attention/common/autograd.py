"""What the library differentiates, and the refusal everywhere else.

Differentiable (stage F's backward, sm90): ``attention(q, k, v)`` with ``softmax_scale``,
``causal``, ``window_size``, ``seqused_k``, ``cu_seqlens_q`` / ``cu_seqlens_k`` (the forward's
variable-length batches) and ``learnable_sink``, head dims 64 and 128, GQA / MQA, K = V (one
gradient, dK + dV): :func:`dense_attention` wraps the forward in a ``torch.autograd.Function``
that saves q, k, v, O, LSE and the sink (never P) and runs stage F's kernel in backward; the
sink's gradient comes with it. LSE is returned without a gradient.

Every other call launches forward kernels only. A torch function that returns an output without a
``grad_fn`` while its input requires grad would let a training loop run on silently: the loss's
gradient never reaches q, k, v, the compressed entries or the sink. So every call that launches a
kernel first asks :func:`refuse_grad`: under grad mode (``torch.is_grad_enabled()``), a tensor
argument that requires grad raises :class:`NotDifferentiableError`, naming the call and the
argument, before any validation or launch. Under ``torch.no_grad()`` / ``torch.inference_mode()``,
or with detached inputs, the calls run as before.

The torch custom ops (stages/ops.py) get the same rule through their autograd registration: the
attention stages' ops are differentiable on the calls stage F serves (:func:`register_attention_op_grad`;
the backward is the op ``dsv4_attention::f_backward``, with a fake implementation, so that
``torch.compile(fullgraph=True)`` traces forward and backward), and refuse the rest; the other ops
refuse (:func:`refuse_op_grad`). torch runs an op's autograd context after its forward, so there
the error comes after the kernel ran, still at the forward call and never as a missing gradient.

Index mode (``e_fused.index_attention``, DeepSeek-V4's sparse attention) is differentiable in q,
kv and the sink through :func:`index_attention`, whose backward is stage F's torch-composed
``index_backward`` (no kernel yet). The backward (issue 44) replaces these refusals call by call;
docs/training.md lists what is differentiable.
"""

from __future__ import annotations

import torch


class NotDifferentiableError(RuntimeError):
    """A call that has no backward got an input that requires grad under grad mode."""


def _message(what: str, name: str) -> str:
    return (f"{what} has no backward yet, but {name} requires grad under grad mode: no gradient would reach "
            f"it. Call it under torch.no_grad() or torch.inference_mode(), or pass {name}.detach() "
            f"(docs/training.md)")


def refuse_grad(what: str, **tensors) -> None:
    """Raise :class:`NotDifferentiableError` if grad mode is on and one of ``tensors`` (name: tensor
    or None) requires grad. Costs one flag read when grad mode is off."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise NotDifferentiableError(_message(what, name))


def refuse_op_grad(op, what: str) -> None:
    """Register on the custom op ``op`` an autograd rule that refuses: its context setup (run by
    torch only when grad mode is on and a tensor input requires grad) raises
    :class:`NotDifferentiableError` naming the first such input, by the op's own parameter names
    (its dispatcher schema)."""
    names = [a.name for a in op._opoverload._schema.arguments]

    def setup_context(ctx, inputs, output):
        for name, t in zip(names, inputs, strict=False):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise NotDifferentiableError(_message(what, name))
        raise NotDifferentiableError(_message(what, "an input"))

    def backward(ctx, *grads):  # never reached: setup_context always raises
        raise NotDifferentiableError(_message(what, "an input"))

    op.register_autograd(backward, setup_context=setup_context)


#: the attention ops' arguments that stage F's backward does not cover: a call with one of them
#: given (not None) refuses gradients
_OP_UNCOVERED = ("compressed_kv", "compress_ratio", "topk_indices", "kv_start", "positions", "cu_seqlens_compressed")


#: options stage F's torch-composed backward (fused_backward) takes only where the layer has index
#: mode's form (fused.lists_cover): the queries' frame and a variable-length batch's offsets, which
#: its lists carry
_LISTS_ONLY = ("seqused_k", "kv_start", "positions", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_compressed")


def _given(value) -> bool:
    """An option given: a tensor, or a value other than None and 0 (``kv_start``'s default). Never
    ``value in (None, 0)``: that compares a tensor elementwise."""
    return isinstance(value, torch.Tensor) or (value is not None and value != 0)


def composed_options_covered(options: dict, lists_form: bool = False) -> bool:
    """``composed_covers``' rule on the call's options alone: one split, no ``out`` / ``lse_out``,
    and seqused_k, positions, kv_start and offsets only with ``lists_form``."""
    if options.get("num_splits") not in (1, None):
        return False
    uncovered = ("out", "lse_out") + (() if lists_form else _LISTS_ONLY)
    return not any(_given(options.get(n)) for n in uncovered)


def composed_covers(q, kernel_why, entries: bool, options: dict, lists_form: bool = False) -> bool:
    """Whether stage F's torch-composed backward (f_backward/fused.py) takes a call that needs a
    gradient: batched CUDA tensors with compressed entries (``entries``) or that its kernel does not
    serve (``kernel_why``: ``serves``' reason, None if it does), and none of the options it does
    not take (``options``: the call's named arguments; out, lse_out, splits; seqused_k, positions,
    kv_start and a variable-length batch's offsets (packed [total, heads, d] q) unless
    ``lists_form``: the call has index mode's form, ``fused.lists_cover``, and the caller passes
    them on, as ``attention`` does and the ops do not). The one rule for ``attention`` and the
    attention ops."""
    if not composed_options_covered(options, lists_form):
        return False
    if not (isinstance(q, torch.Tensor) and q.is_cuda and (q.dim() == 4 or (lists_form and q.dim() == 3))):
        return False
    return entries or kernel_why is not None


#: the op schema's tensors of the queries' frame and a packed batch's offsets, in composed_op's order
_OP_FRAME_TENSORS = ("seqused_k", "positions", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_compressed")


def _op_lists_form(f, args: dict) -> bool:
    """Whether an op call has index mode's form of the layer (``fused.lists_form``), asked only
    where the call gives one of the options only that form takes (under torch.compile the inputs
    are fake: K = V is then the same tensor passed twice)."""
    if not any(_given(args.get(n)) for n in _LISTS_ONLY):
        return False
    return f.lists_form(args["q"], args["k"], args["v"], args.get("compressed_kv"), args.get("compress_ratio"),
                        args.get("topk_indices"), bool(args.get("causal")),
                        (args.get("window_left"), args.get("window_right")), args.get("cu_seqlens_k"),
                        args.get("cu_seqlens_compressed"), args.get("max_seqlen_k"))


def register_attention_op_grad(op, what: str, backward_op, composed_op=None) -> None:
    """Register on the attention op ``op`` (stages/ops.py's shared schema) the autograd rule of
    dense attention: where stage F serves the call (no option of ``_OP_UNCOVERED``, one split,
    ``serves(q, k, v)``), save q, k, v, O, LSE, the sink, seqused_k and a variable-length batch's
    offsets and run ``backward_op`` (q, k, v, o, lse, do, softmax_scale, causal, window_left,
    window_right, learnable_sink, seqused_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) -> (dq, dk, dv, dsink) in
    backward; where it does not (compressed entries, or a head dim, dtype or architecture its kernel
    lacks) but stage F's torch-composed backward does, ``composed_op`` (q, k, v, o, lse, do,
    compressed_kv, compress_ratio, topk_indices, softmax_scale, causal, window_left, window_right,
    learnable_sink, seqused_k, positions, kv_start, cu_seqlens_q, cu_seqlens_k, cu_seqlens_compressed,
    max_seqlen_k) -> (dq, dk, dv, dcompressed, dsink) (the frame and offsets only in index mode's
    form of the layer, ``_op_lists_form``); elsewhere raise
    :class:`NotDifferentiableError` naming the input that requires grad. LSE is marked
    non-differentiable, as in :func:`dense_attention`."""
    names = [a.name for a in op._opoverload._schema.arguments]

    def setup_context(ctx, inputs, output):
        args = dict(zip(names, inputs, strict=False))
        grad_names = [n for n, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad]
        from dsv4_attention import stages

        f = stages.get("f").module
        why = f.serves(args["q"], args["k"], args["v"])
        entries = args.get("compressed_kv") is not None or args.get("topk_indices") is not None
        if composed_op is not None and composed_covers(args["q"], why, entries, args, _op_lists_form(f, args)):
            # stage F's torch-composed backward: compressed entries, or what its kernel lacks
            o, lse = output
            ctx.save_for_backward(args["q"], args["k"], args["v"], o, lse, args.get("compressed_kv"),
                                  args.get("topk_indices"), args.get("learnable_sink"),
                                  *(args.get(n) for n in _OP_FRAME_TENSORS))
            ctx.options = (args.get("compress_ratio"), args.get("softmax_scale"), bool(args.get("causal")),
                           args.get("window_left"), args.get("window_right"))
            ctx.frame = (args.get("kv_start"), args.get("max_seqlen_k"))
            ctx.composed = True
            ctx.mark_non_differentiable(lse)
            return
        ctx.composed = False
        uncovered = [n for n in _OP_UNCOVERED if args.get(n) is not None]
        if uncovered or args.get("num_splits") not in (1, None) or set(grad_names) - {"q", "k", "v", "learnable_sink"}:
            raise NotDifferentiableError(_message(what, grad_names[0] if grad_names else "an input"))
        if why is not None:
            raise NotDifferentiableError(f"{what} cannot be differentiated here: {why}. Call it under torch.no_grad() "
                                         f"or with detached inputs (docs/training.md)")
        o, lse = output
        ctx.save_for_backward(args["q"], args["k"], args["v"], o, lse, args.get("learnable_sink"),
                              args.get("seqused_k"), args.get("cu_seqlens_q"), args.get("cu_seqlens_k"))
        ctx.options = (args.get("softmax_scale"), bool(args.get("causal")), args.get("window_left"),
                       args.get("window_right"))
        ctx.max_seqlens = (args.get("max_seqlen_q"), args.get("max_seqlen_k"))
        ctx.mark_non_differentiable(lse)

    def backward(ctx, do, _dlse):
        if ctx.composed:
            q, k, v, o, lse, ckv, topk, sink, used, pos, cu_q, cu_k, cu_c = ctx.saved_tensors
            ratio, scale, causal, left, right = ctx.options
            kv_start, max_k = ctx.frame
            dq, dk, dv, dc, dsink = composed_op(q, k, v, o, lse, do.contiguous(), ckv, ratio, topk, scale, causal,
                                                left, right, sink, used, pos, kv_start, cu_q, cu_k, cu_c, max_k)
            grads = dict(q=dq, k=dk, v=dv, compressed_kv=dc if ckv is not None else None,
                         learnable_sink=dsink if sink is not None else None)
            return tuple(grads.get(n) for n in names)
        q, k, v, o, lse, sink, used, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv, dsink = backward_op(q, k, v, o, lse, do.contiguous(), *ctx.options, sink, used, cu_q, cu_k,
                                        *ctx.max_seqlens)
        grads = dict(q=dq, k=dk, v=dv, learnable_sink=dsink if sink is not None else None)
        return tuple(grads.get(n) for n in names)

    op.register_autograd(backward, setup_context=setup_context)


class _DenseAttention(torch.autograd.Function):
    """o, lse = run_forward(); backward: stage F's kernel on (q, k, v, o, lse, do, sink)."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, seqused_k, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                window_size, max_seqlens, run_forward):
        o, lse = run_forward()
        ctx.save_for_backward(q, k, v, o, lse, learnable_sink, seqused_k, cu_seqlens_q, cu_seqlens_k)
        ctx.options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           max_seqlen_q=max_seqlens[0], max_seqlen_k=max_seqlens[1])
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from dsv4_attention import stages  # the registry: a call-time lookup, not an import of the kernel

        q, k, v, o, lse, sink, used, cu_q, cu_k = ctx.saved_tensors
        grads = stages.get("f").module.backward(q, k, v, o, lse, do.contiguous(), learnable_sink=sink,
                                                seqused_k=used, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **ctx.options)
        dsink = grads[3] if sink is not None else None
        return (grads[0], grads[1], grads[2], dsink) + (None,) * 8


def dense_attention(q, k, v, softmax_scale, causal, window_size, run_forward, learnable_sink=None, seqused_k=None,
                    varlen=(None, None, None, None)):
    """``run_forward()`` (the forward kernel's (o, lse) for q, k, v and the sink) made
    differentiable in q, k, v and ``learnable_sink``; raises :class:`NotDifferentiableError` before
    any launch where stage F cannot serve the inputs. v may be k (K = V): autograd adds its two
    gradients. ``varlen``: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a
    variable-length batch (packed [total, heads, d] tensors), or Nones."""
    from dsv4_attention import stages

    why = stages.get("f").module.serves(q, k, v)
    if why is not None:
        raise NotDifferentiableError(f"attention cannot be differentiated here: {why}. Call it under torch.no_grad() "
                                     f"or with detached inputs (docs/training.md)")
    cu_q, cu_k, max_q, max_k = varlen
    return _DenseAttention.apply(q, k, v, learnable_sink, seqused_k, cu_q, cu_k, softmax_scale, causal, window_size,
                                 (max_q, max_k), run_forward)


class _IndexAttention(torch.autograd.Function):
    """o, lse = run_forward() (index mode's kernel); backward: stage F's ``index_backward``."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, softmax_scale, run_forward):
        o, lse = run_forward()
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, o, lse)
        ctx.softmax_scale = softmax_scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from dsv4_attention import stages

        q, kv, sink, indices, length, o, lse = ctx.saved_tensors
        dq, dkv, dsink = stages.get("f").module.index_backward(
            q, kv, indices, o, lse, do, topk_length=length, attn_sink=sink, softmax_scale=ctx.softmax_scale)
        return dq, dkv, dsink, None, None, None, None


def index_attention(q, kv, attn_sink, indices, topk_length, softmax_scale, run_forward):
    """``run_forward()`` (index mode's (o, lse) for q, kv and the sink) made differentiable in q,
    kv (K = V: one gradient, the keys' and the values' summed, scattered to the listed rows) and
    ``attn_sink`` by stage F's torch-composed ``index_backward``. kv must be bf16 / fp16 rows
    [rows, 1, d] (a paged FP8 cache has no gradient): the caller checks."""
    return _IndexAttention.apply(q, kv, attn_sink, indices, topk_length, softmax_scale, run_forward)


class _ComposedAttention(torch.autograd.Function):
    """o, lse = run_forward() (stage E's kernel); backward: stage F's torch-composed ``fused_backward``."""

    # options saved as tensors (None where absent)
    TENSORS = ("topk_indices", "seqused_k", "positions", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_compressed")

    @staticmethod
    def forward(ctx, q, k, v, compressed_kv, learnable_sink, run_forward, options):
        o, lse = run_forward()
        tensors = [options.get(n) for n in _ComposedAttention.TENSORS]
        ctx.save_for_backward(q, k, v, compressed_kv, learnable_sink, o, lse, *tensors)
        ctx.options = {n: x for n, x in options.items() if n not in _ComposedAttention.TENSORS}
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from dsv4_attention import stages

        q, k, v, ckv, sink, o, lse, *tensors = ctx.saved_tensors
        given = {n: t for n, t in zip(_ComposedAttention.TENSORS, tensors, strict=True) if t is not None}
        dq, dk, dv, dc, dsink = stages.get("f").module.fused_backward(
            q, k, v, o, lse, do, compressed_kv=ckv, learnable_sink=sink, **given, **ctx.options)
        return dq, dk, dv, dc, dsink, None, None


def composed_attention(q, k, v, compressed_kv, learnable_sink, run_forward, options: dict):
    """``run_forward()`` (stage E's (o, lse)) made differentiable in q, k, v (v may be k: K = V,
    its two gradients added by autograd), ``compressed_kv`` and ``learnable_sink`` by stage F's
    torch-composed ``fused_backward``; ``options``: compress_ratio, topk_indices, softmax_scale,
    causal, window_size, and where given seqused_k, positions, kv_start, a variable-length batch's
    offsets and max_seqlen_k. The caller checks that the call is within that backward's scope
    (``composed_covers``)."""
    return _ComposedAttention.apply(q, k, v, compressed_kv, learnable_sink, run_forward, options)


def register_index_op_grad(op, what: str, backward_op) -> None:
    """Register on the index-mode op ``op`` (q, kv, indices, topk_length, attn_sink, softmax_scale,
    ...) the autograd rule of :func:`index_attention`: save q, kv, the lists, the sink, O and LSE,
    and run ``backward_op`` (q, kv, indices, o, lse, do, topk_length, attn_sink, softmax_scale) ->
    (dq, dkv, dsink) in backward; a paged FP8 cache (no gradient) raises
    :class:`NotDifferentiableError`."""
    names = [a.name for a in op._opoverload._schema.arguments]

    def setup_context(ctx, inputs, output):
        args = dict(zip(names, inputs, strict=False))
        if args["kv"].element_size() == 1:
            raise NotDifferentiableError(f"{what} cannot be differentiated here: a paged FP8 cache has no gradient")
        o, lse = output
        ctx.save_for_backward(args["q"], args["kv"], args["indices"], args.get("topk_length"),
                              args.get("attn_sink"), o, lse)
        ctx.softmax_scale = args.get("softmax_scale")
        ctx.mark_non_differentiable(lse)

    def backward(ctx, do, _dlse):
        q, kv, indices, length, sink, o, lse = ctx.saved_tensors
        dq, dkv, dsink = backward_op(q, kv, indices, o, lse, do.contiguous(), length, sink, ctx.softmax_scale)
        grads = dict(q=dq, kv=dkv, attn_sink=dsink if sink is not None else None)
        return tuple(grads.get(n) for n in names)

    op.register_autograd(backward, setup_context=setup_context)
