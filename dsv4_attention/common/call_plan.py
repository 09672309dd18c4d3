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

The library's entry (``dsv4_attention.attention``) keeps its own plans, keyed by the arguments as
the caller gave them (:func:`entry_key`), so a repeated call skips the layers between the entry
and the kernel (the stage's keyword passing, the option normalisation, the signature above):
the plan its first call recorded or replayed is filed under that key as well (:func:`entry_run`).

A split-KV call (common/split_kv.py: ``num_splits`` other than 1) is planned as a
:class:`SplitPlan`: the kernel's plan, whose fp32 partial buffers are two more slots that each
call allocates afresh, then the merge (with the sink). Its split count, chosen once per
signature where ``num_splits`` is None, is kept in the plan; :func:`last_splits` says what the
current thread's last call ran with.

What is never planned: a call whose validation reads tensor *values* (per-request lengths,
variable-length offsets, top-k lists: their bounds are checked on every call), a call with no
key (decided on the host, no launch), and any argument list holding a tensor that is not one
of the call's slots (a plan must never keep a caller's tensor alive or reuse it).
"""

from __future__ import annotations

import threading

import torch

from dsv4_attention.common import jit

_PLANS: dict = {}
#: the library entry's plans (``dsv4_attention.attention``), keyed by the call's own arguments
_ENTRY: dict = {}
#: the plan the current thread's last call recorded or replayed (what the entry keeps)
_last = threading.local()
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
    each further argument's place, (position, field: None or its index in a bundle of
    common/seams.py), to an index into the call's extra tensors."""

    __slots__ = ("fn", "tail", "slots", "lse_shape", "device")

    def __init__(self, fn, tail: list, slots: tuple, lse_shape: tuple, device):
        self.fn, self.tail, self.slots, self.lse_shape, self.device = fn, tail, slots, lse_shape, device

    def __call__(self, q, k, v, out, lse_out, extra):
        o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
        lse = torch.empty(*self.lse_shape, dtype=torch.float32, device=self.device) if lse_out is None else lse_out
        tail = self.tail
        if self.slots:
            tail = list(tail)
            for pos, field, i in self.slots:
                if field is None:
                    tail[pos] = extra[i]
                else:  # a bundle's field: a new bundle (the plan's own stays as recorded)
                    values = list(tail[pos])
                    values[field] = extra[i]
                    tail[pos] = type(tail[pos])._make(values)
        self.fn(q, k, v, o, lse, *tail)
        return o, lse


#: a split call's extra tensors: the stage's plan tensors (the sink first), padded to this many, then
#: the partial O and LSE buffers (``SplitPlan``)
SPLIT_EXTRA = 3


class SplitPlan:
    """A split-KV call's plan: ``inner`` (the kernel's :class:`Plan`, the partial buffers in its
    extra slots ``SPLIT_EXTRA`` and ``SPLIT_EXTRA + 1``) run on fresh partial buffers, then their
    merge into O and LSE with the sink (extra tensor 0), as the full path does."""

    __slots__ = ("inner", "splits", "merge")

    def __init__(self, inner: Plan, splits: int):
        self.inner, self.splits = inner, splits
        self.merge = None  # the compiled merge (split_kv.merge_for), resolved by the first replay

    def __call__(self, q, k, v, out, lse_out, extra):
        from dsv4_attention.common import split_kv

        b, sq, h, _ = q.shape
        o_part, lse_part = split_kv.partial_buffers(self.splits, tuple(q.shape), (b, h, sq), q.device)
        extra = (*extra, *(None,) * (SPLIT_EXTRA - len(extra)), o_part, lse_part)
        o, lse = self.inner(q, k, v, out, lse_out, extra)
        if self.merge is None:
            self.merge = split_kv.merge_for(o_part, lse_part, o, lse, extra[0])
        return self.merge(o_part, lse_part, o, lse, extra[0])


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
    _last.plan = planned
    _last.splits = getattr(planned, "splits", 1)
    return key, planned(q, k, v, out, lse_out, extra)


def record(key, fn, args: list, extra: tuple) -> None:
    """Keep the plan of a call that launched ``fn`` on ``args`` (jit's list: q, k, v, o, lse, then
    the rest), unless an argument is a tensor that is not one of the call's ``extra`` tensors."""
    _last.splits = 1
    if key is None:
        return
    tail, slots = [], []

    def slot(a, pos, field):  # a tensor's slot (None: not the caller's), else the value as is
        if not isinstance(a, torch.Tensor):
            return a
        i = next((i for i, t in enumerate(extra) if t is a), None)
        if i is None:
            raise LookupError
        slots.append((pos, field, i))
        return None

    try:
        for pos, a in enumerate(jit.call_args(args)[5:]):
            if isinstance(a, tuple):
                a = type(a)._make([slot(x, pos, f) for f, x in enumerate(a)])
            else:
                a = slot(a, pos, None)
            tail.append(a)
    except LookupError:
        return  # a tensor made by this call (or not the caller's): not replayable
    if len(_PLANS) >= LIMIT:
        _PLANS.clear()
    _PLANS[key] = _last.plan = Plan(fn, tail, tuple(slots), tuple(args[4].shape), args[0].device)


def record_split(key, splits: int) -> None:
    """A split call's full path ran: the plan its kernel launch recorded under ``key`` (its partial
    buffers in the extra slots ``SPLIT_EXTRA`` ..) becomes a :class:`SplitPlan`; the thread's last
    call ran ``splits`` units a Q tile either way."""
    _last.splits = splits
    inner = None if key is None else _PLANS.get(key)
    if isinstance(inner, Plan):
        _PLANS[key] = _last.plan = SplitPlan(inner, splits)


def note_splits(splits: int | None) -> None:
    """Set what :func:`last_splits` reports for the current thread (None: the call has launched
    nothing yet; the full path notes its count once it launches)."""
    _last.splits = splits


def forget_last_plan() -> None:
    """Before a full path whose plan the caller keeps (``entry_run``, a decode schedule): the
    current thread's last plan is cleared, so that :func:`last_plan` after it is that call's."""
    _last.plan = None


def last_plan():
    """The plan the current thread's last call recorded or replayed (None: it could not be planned,
    or launched nothing)."""
    return getattr(_last, "plan", None)


def last_splits() -> int | None:
    """The split count (common/split_kv.py) the current thread's last attention call ran with: 1
    unsplit, S > 1 where each Q tile's keys went over S units and were merged (what
    ``num_splits=None`` chose). None before any call, and after one that launched nothing (no
    key at all)."""
    return getattr(_last, "splits", None)


def entry_key(q, k, v, a, b, c, d, scalars: tuple, window):
    """The signature of a call at the library's entry, from its arguments as given: q, k, v (None:
    K = V), four further tensors (each None or a tensor), the ``scalars`` with their types, and the
    ``window`` pair with its elements' types (1 and True differ there too). Written out flat: it
    is most of a planned call's Python time. None where one cannot be formed (an input that is not
    a tensor): the full path then says why; an unhashable one (a list for the window) finds no
    plan and takes the full path too."""
    try:
        return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
                None if v is None else (v.shape, v.stride(), v.dtype, v.device, v.data_ptr() == k.data_ptr()),
                None if a is None else (a.shape, a.stride(), a.dtype, a.device),
                None if b is None else (b.shape, b.stride(), b.dtype, b.device),
                None if c is None else (c.shape, c.stride(), c.dtype, c.device),
                None if d is None else (d.shape, d.stride(), d.dtype, d.device),
                scalars, tuple(map(type, scalars)), window, tuple(map(type, window)))
    except (AttributeError, TypeError, RuntimeError):
        return None


def entry_call(key, q, k, v, out, lse_out, extra: tuple):
    """The entry's planned call: (o, lse), or None when ``key`` has no plan or a data pointer is
    not 16-byte aligned (the full path then runs, and refuses what it must)."""
    try:
        planned = _ENTRY.get(key)
    except TypeError:  # unhashable
        return None
    if planned is None:
        return None
    bits = q.data_ptr() | k.data_ptr() | v.data_ptr() | (0 if out is None else out.data_ptr())
    for t in extra:
        if t is not None and t.dim() == 4:
            bits |= t.data_ptr()
    if bits & 15:
        return None
    _last.splits = getattr(planned, "splits", 1)
    return planned(q, k, v, out, lse_out, extra)


def entry_run(key, full_path):
    """Run the entry's full path; file the plan it recorded or replayed under ``key``."""
    forget_last_plan()
    result = full_path()
    planned = last_plan()
    if key is not None and planned is not None:
        try:
            hash(key)
        except TypeError:  # e.g. a list for the window: never planned
            return result
        if len(_ENTRY) >= LIMIT:
            _ENTRY.clear()
        _ENTRY[key] = planned
    return result


def plan_of(key):
    """The plan recorded under a signature (``key_of``), or None: for a benchmark that times the
    compiled function alone."""
    return _PLANS.get(key)


def clear() -> None:
    _PLANS.clear()
    _ENTRY.clear()


def size() -> int:
    return len(_PLANS)
