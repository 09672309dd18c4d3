"""Validate once per input signature: the host work of a call that depends only on what the inputs
are (shapes, strides, dtypes, devices, the options given), done on the first call of each
signature and replayed on the next ones.

A call's slow path validates everything, picks the architecture and the compile-time options,
finds the compiled function and launches it. Everything it decided is a function of the
call's *signature*: each tensor's (shape, strides, dtype, device), whether K and V are one
memory, and every scalar option with its type (``1`` and ``True`` differ: one of them may be
refused). So after a launch the slow path records a :class:`Plan` under that signature: the
compiled function and its argument list, in which every tensor the call passed is a numbered
slot. A later call with the same signature checks what the signature does not hold (the
16-byte alignment of its data pointers) and calls the function with its own tensors in the
slots: no checks repeated, no options rebuilt, no kernel lookup.

What is never planned: a call whose validation reads tensor *values* (per-request lengths,
variable-length offsets, top-k lists: their bounds are checked on every call), a call with no
key (decided on the host, no launch), and any argument list holding a tensor that is not one
of the call's slots (a plan must never keep a caller's tensor alive or reuse it).
"""

from __future__ import annotations

import torch

from dsv4_attention.common import jit

_PLANS: dict = {}
#: plans kept at most (a signature per shape: a server's distinct shapes are far fewer)
LIMIT = 4096


def meta(t):
    """A tensor's part of the signature (None stays None)."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def typed(*values) -> tuple:
    """Scalar options with their types: 1, 1.0 and True are different calls."""
    return values, tuple(map(type, values))


def aligned(*tensors) -> bool:
    """Every given [batch, seqlen, heads, dim] tensor's data pointer is 16-byte aligned (what TMA
    and the signature assume; the others need 4 bytes, which their dtypes give)."""
    bits = 0
    for t in tensors:
        if t is not None and t.dim() == 4:
            bits |= t.data_ptr()
    return not bits & 15


class Plan:
    """The compiled function with its arguments: slots 0-4 are q, k, v, o, lse; ``slots`` maps
    each further argument position to an index into the call's extra tensors."""

    __slots__ = ("fn", "tail", "slots", "lse_shape")

    def __init__(self, fn, tail: list, slots: tuple, lse_shape: tuple):
        self.fn, self.tail, self.slots, self.lse_shape = fn, tail, slots, lse_shape

    def __call__(self, q, k, v, out, lse_out, extra):
        o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if lse_out is None else lse_out
        tail = self.tail
        if self.slots:
            tail = list(tail)
            for pos, i in self.slots:
                tail[pos] = extra[i]
        self.fn(q, k, v, o, lse, *tail)
        return o, lse


def key_of(stage_id: str, q, k, v, softmax_scale, out, lse_out, plan, extra: tuple):
    """A call's signature (``plan``: the caller's options, already ``typed``), or None where one
    cannot be formed (an input that is not a tensor, an unhashable option: the call's checks
    will say why)."""
    try:
        key = (stage_id, meta(q), meta(k), meta(v), k.data_ptr() == v.data_ptr(), meta(out), meta(lse_out),
               typed(softmax_scale), plan, tuple(map(meta, extra)))
        hash(key)
        return key
    except (AttributeError, TypeError, RuntimeError):
        return None


def lookup(stage_id: str, q, k, v, softmax_scale, out, lse_out, plan, extra: tuple) -> tuple:
    """(signature, result): the planned call's (o, lse) when the signature has a plan and the data
    pointers are aligned, else None, with the signature for the full path to ``record``."""
    key = key_of(stage_id, q, k, v, softmax_scale, out, lse_out, plan, extra)
    planned = None if key is None else _PLANS.get(key)
    if planned is None or not aligned(q, k, v, out, *extra):
        return key, None
    return key, planned(q, k, v, out, lse_out, extra)


def record(key, fn, args: list, extra: tuple) -> None:
    """Keep the plan of a call that launched ``fn`` on ``args`` (jit's list: q, k, v, o, lse, then
    the rest), unless an argument is a tensor that is not one of the call's ``extra`` tensors."""
    if key is None:
        return
    tail, slots = [], []
    for pos, a in enumerate(jit.call_args(args)[5:]):
        if isinstance(a, torch.Tensor):
            i = next((i for i, t in enumerate(extra) if t is a), None)
            if i is None:
                return  # a tensor made by this call (or not the caller's): not replayable
            slots.append((pos, i))
            a = None
        tail.append(a)
    if len(_PLANS) >= LIMIT:
        _PLANS.clear()
    _PLANS[key] = Plan(fn, tail, tuple(slots), tuple(args[4].shape))


def clear() -> None:
    _PLANS.clear()


def size() -> int:
    return len(_PLANS)
