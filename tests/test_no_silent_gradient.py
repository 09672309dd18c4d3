"""No silent missing gradient (common/autograd.py): every call that launches a kernel refuses,
under grad mode, an input that requires grad, naming the call and the argument, before it
validates or launches; without grad mode, or with the input detached, it runs as before. The
torch-only pieces (``merge_attention``, ``apply_sink``) are differentiable by torch and their
gradient is checked against the float64 reference's. CPU (the refusal comes before the device
check; the ops on meta tensors); on a GPU, the refused call leaves its poisoned output untouched
and the same call without grad mode equals the detached one bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4_attention.stages.ops as ops
from dsv4_attention import attention, stages
from dsv4_attention.common import reference
from dsv4_attention.common.autograd import NotDifferentiableError
from dsv4_attention.common.merge import merge_attention
from dsv4_attention.common.testing import attention_inputs, gpu_arch_params, poison_
from dsv4_attention.stages.d5_sink_merge import apply_sink

ATTENTION = [s for s in stages.STAGES if s.id != "a"]


def cpu_inputs(d=128, grad=("q",)):
    q = torch.randn(1, 8, 4, d, dtype=torch.bfloat16)
    k = torch.randn(1, 16, 4, d, dtype=torch.bfloat16)
    v = torch.randn(1, 16, 4, d, dtype=torch.bfloat16)
    named = {"q": q, "k": k, "v": v}
    for n in grad:
        named[n].requires_grad_(True)
    return q, k, v


@pytest.mark.parametrize("stage", ATTENTION, ids=[s.id for s in ATTENTION])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_stage_forward_refuses_grad(stage, which):
    q, k, v = cpu_inputs(grad=(which,))
    with pytest.raises(NotDifferentiableError, match=rf"stage {stage.id}'s forward .* {which} requires grad"):
        stage.forward(q, k, v)


@pytest.mark.parametrize("stage", ATTENTION, ids=[s.id for s in ATTENTION])
def test_without_grad_mode_the_call_goes_on(stage):
    # negative control: the same inputs reach the next check (the device's) without grad mode,
    # under no_grad, under inference_mode and detached under grad mode
    q, k, v = cpu_inputs(grad=("q", "k", "v"))
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx(), pytest.raises(ValueError, match="cuda|CUDA|GPU"):
            stage.forward(q, k, v)
    with pytest.raises(ValueError, match="cuda|CUDA|GPU"):
        stage.forward(q.detach(), k.detach(), v.detach())


def test_qk_stage_refuses_grad():
    q, k, _ = cpu_inputs(grad=("k",))
    with pytest.raises(NotDifferentiableError, match="stage a's forward .* k requires grad"):
        stages.get("a").forward(q, k)


@pytest.mark.parametrize("name", ["q", "k", "compressed_kv", "learnable_sink"])
def test_attention_names_the_argument(name):
    q, k, _ = cpu_inputs(d=512, grad=())
    ckv = torch.randn(1, 4, 4, 512, dtype=torch.bfloat16)
    sink = torch.zeros(4)
    named = {"q": q, "k": k, "compressed_kv": ckv, "learnable_sink": sink}
    named[name].requires_grad_(True)
    with pytest.raises(NotDifferentiableError, match=rf"^attention has no backward yet, but {name} requires grad"):
        attention(q, k, compressed_kv=ckv, compress_ratio=4, learnable_sink=sink)


@pytest.mark.parametrize("name", ["q", "kv", "attn_sink"])
def test_index_attention_is_differentiable_or_names_why(name):
    """Index mode has a backward (stage F's torch-composed index_backward): with any input requiring
    grad a call takes the differentiable path (on CPU tensors its forward then refuses the device,
    a ValueError, not a missing gradient); with ``out`` given or a paged FP8 cache it refuses naming
    why."""
    q = torch.randn(3, 64, 512, dtype=torch.bfloat16)
    kv = torch.randn(10, 1, 512, dtype=torch.bfloat16)
    idx = torch.zeros(3, 1, 4, dtype=torch.int32)
    sink = torch.zeros(64)
    named = {"q": q, "kv": kv, "attn_sink": sink}
    named[name].requires_grad_(True)
    index_attention = stages.get("e").module.index_attention
    with pytest.raises(ValueError, match="CUDA"):
        index_attention(q, kv, idx, attn_sink=sink)
    with pytest.raises(NotDifferentiableError, match="index_attention cannot be differentiated here: out is given"):
        index_attention(q, kv, idx, attn_sink=sink, out=torch.empty_like(q))
    if name != "kv":
        pages = torch.zeros(2, 64, 1, 584, dtype=torch.uint8)
        with pytest.raises(NotDifferentiableError, match="a paged FP8 cache has no gradient"):
            index_attention(q, pages, idx, attn_sink=sink)


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("stage_id", [s.id for s in ATTENTION])
def test_ops_refuse_grad(stage_id):
    """An option stage F's backward does not cover (kv_start) refuses by the argument's name; a
    dense call on tensors it does not serve (meta, not CUDA) refuses naming why."""
    q, k = meta(2, 10, 8, 128), meta(2, 30, 2, 128)
    k.requires_grad_(True)
    with pytest.raises(NotDifferentiableError, match=r"op dsv4_attention::.* has no backward yet, but k requires grad"):
        ops.OPS[stage_id](q, k, k, kv_start=5)
    with pytest.raises(NotDifferentiableError, match=r"op dsv4_attention::.* cannot be differentiated here: .*CUDA"):
        ops.OPS[stage_id](q, k, k)
    with torch.no_grad():  # negative control: the op's fake forward runs
        o, _ = ops.OPS[stage_id](q, k, k)
    assert o.shape == q.shape


@pytest.mark.parametrize("stage_id", [s.id for s in ATTENTION])
def test_op_gradient_plumbing_on_meta(stage_id, monkeypatch):
    """With stage F told it serves meta tensors, the attention ops' autograd rule saves what the
    backward needs and routes loss.backward() through the f_backward op's fake implementation:
    q, k (passed as k and v: both gradients into one leaf) and the sink get gradients of their
    shapes and dtypes; LSE is not differentiable."""
    monkeypatch.setattr(stages.get("f").module, "serves", lambda q, k, v: None)
    q, k = meta(2, 10, 8, 128).requires_grad_(True), meta(2, 30, 2, 128).requires_grad_(True)
    sink = meta(8, dtype=torch.float32).requires_grad_(True)
    o, lse = ops.OPS[stage_id](q, k, k, causal=True, learnable_sink=sink)
    assert o.grad_fn is not None and not lse.requires_grad
    o.float().sum().backward()
    assert q.grad.shape == q.shape and q.grad.dtype == q.dtype
    assert k.grad.shape == k.shape and sink.grad.shape == (8,) and sink.grad.dtype == torch.float32


class _OpLog(TorchDispatchMode):
    """Records every op dispatched inside it, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage_id", [s.id for s in ATTENTION if "cu_seqlens_q" in ops.TAKES[s.id]])
def test_op_gradient_plumbing_on_meta_varlen(stage_id, monkeypatch):
    """The same on a variable-length batch (packed [total, heads, d] q and k, lse [heads, total]):
    the backward runs the f_backward op with the forward's offsets and maxima, and each leaf gets
    a gradient of its shape. Negative control: a call without the offsets passes none."""
    monkeypatch.setattr(stages.get("f").module, "serves", lambda q, k, v: None)

    def backward_call(**varlen):
        q, k = meta(40, 8, 128).requires_grad_(True), meta(70, 2, 128).requires_grad_(True)
        if not varlen:
            q, k = meta(1, 40, 8, 128).requires_grad_(True), meta(1, 70, 2, 128).requires_grad_(True)
        o, lse = ops.OPS[stage_id](q, k, k, causal=True, **varlen)
        assert o.grad_fn is not None and not lse.requires_grad
        with _OpLog() as log:
            o.float().sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
        (call,) = [c for c in log.calls if "f_backward" in c[0]]
        return list(call[1]) + list(call[2].values())

    cu_q, cu_k = meta(3, dtype=torch.int32), meta(3, dtype=torch.int32)
    args = backward_call(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30, max_seqlen_k=50)
    ints = [a for a in args if type(a) is int]
    assert any(a is cu_q for a in args) and any(a is cu_k for a in args) and 30 in ints and 50 in ints
    plain = backward_call()
    assert not any(isinstance(a, torch.Tensor) and a.dtype == torch.int32 for a in plain)


def test_qk_op_refuses_and_index_op_differentiates():
    """Stage A's op has no backward; the index op's runs the f_index_backward op (on meta tensors
    its fake): q, kv and the sink get gradients of their shapes; a paged FP8 cache refuses."""
    q, k = meta(2, 10, 8, 64), meta(2, 30, 8, 64)
    q.requires_grad_(True)
    with pytest.raises(NotDifferentiableError, match="op dsv4_attention::a_qk_gemm .* q requires grad"):
        ops.OPS["a"](q, k)
    q, kv, idx = meta(3, 64, 512).requires_grad_(True), meta(10, 1, 512).requires_grad_(True), \
        meta(3, 1, 4, dtype=torch.int32)
    sink = meta(64, dtype=torch.float32).requires_grad_(True)
    o, lse = ops.OPS["e_index"](q, kv, idx, None, sink)
    assert o.grad_fn is not None and not lse.requires_grad
    with _OpLog() as log:
        o.float().sum().backward()
    assert any("f_index_backward" in c[0] for c in log.calls)
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape and sink.grad.shape == (64,)
    pages = meta(2, 64, 1, 584, dtype=torch.uint8)
    with pytest.raises(NotDifferentiableError, match="a paged FP8 cache has no gradient"):
        ops.OPS["e_index"](meta(3, 64, 512).requires_grad_(True), pages, idx)


def test_torch_merge_and_sink_carry_the_gradient():
    """merge_attention and apply_sink are torch: the gradient of the merged, sink-scaled output of
    two disjoint key halves equals the float64 reference's over all keys."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 5, 2, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 12, 2, 16, dtype=torch.float64, generator=g)
    v = torch.randn(1, 12, 2, 16, dtype=torch.float64, generator=g)
    sink = torch.tensor([0.3, -1.0], dtype=torch.float64)
    w = torch.randn(1, 5, 2, 16, dtype=torch.float64, generator=g)
    o1, l1 = reference.attention(q, k[:, :7], v[:, :7])
    o2, l2 = reference.attention(q, k[:, 7:], v[:, 7:])
    o, lse = merge_attention(o1, l1, o2, l2)
    o = apply_sink(o, lse, sink)
    (grad,) = torch.autograd.grad((o * w).sum(), q)
    o_ref, _ = reference.attention(q, k, v, learnable_sink=sink)
    (grad_ref,) = torch.autograd.grad((o_ref * w).sum(), q)
    assert torch.allclose(o.double(), o_ref, atol=1e-5), (o.double() - o_ref).abs().max()
    assert torch.allclose(grad, grad_ref, atol=1e-5), (grad - grad_ref).abs().max()


@pytest.mark.parametrize("arch", gpu_arch_params())
def test_refused_call_launches_nothing(arch):
    q, k, v, _ = attention_inputs(1, 200, 300, 8, 8, 128, torch.bfloat16)
    o = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(1, 8, 200, dtype=torch.float32, device=q.device))
    qg = q.clone().requires_grad_(True)
    with pytest.raises(NotDifferentiableError):
        attention(qg, k, v, out=o, lse_out=lse, causal=True)
    torch.cuda.synchronize()
    assert torch.isnan(o).all() and torch.isnan(lse).all()  # untouched: nothing ran
    with torch.no_grad():
        o_ng, lse_ng = attention(qg, k, v, causal=True)
    o_d, lse_d = attention(q, k, v, causal=True)
    assert torch.equal(o_ng, o_d) and torch.equal(lse_ng, lse_d)
    assert o_d.grad_fn is None and not o_d.requires_grad
