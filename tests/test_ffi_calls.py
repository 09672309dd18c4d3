"""The TVM-FFI calling convention (common/jit.py), on the CPU: the argument lists the stages build
are accepted by the compiled functions' own wrappers. Each function is compiled as a first call
compiles it (``jit.compile_kernel`` on the call's list) and called with that list minus the stream,
its tensors CPU tensors that claim to live on cuda:0 (their DLPack device patched): every argument
check (arity, dtypes, ranks, alignment, int32 ranges, None where compiled None) runs, then the
wrapper stops at its CUDA initialisation, which a machine without a driver cannot do. So "failed
at CUDA" means every argument was accepted. Negative controls: a wrong dtype, a tensor where the
kernel was compiled with None, and a misaligned Q are refused before that point.

Only where no GPU is present: on a GPU machine the patched tensors would reach a real launch."""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch

pytestmark = [pytest.mark.compile, pytest.mark.skipif(torch.cuda.is_available(),
                                                      reason="CPU only: patched tensors would reach a real launch")]


def fake_cuda(t: torch.Tensor, offset_bytes: int = 0):
    """``t`` as a tvm_ffi tensor claiming device cuda:0 (data never touched)."""
    import tvm_ffi

    class Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class Head(ctypes.Structure):  # a DLManagedTensor starts with its DLTensor
        _fields_ = [("data", ctypes.c_void_p), ("device", Device)]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    cap = torch.utils.dlpack.to_dlpack(t)
    head = Head.from_address(get(cap, b"dltensor"))
    head.device.device_type, head.device.device_id = 2, 0  # kDLCUDA
    head.data += offset_bytes
    return tvm_ffi.from_dlpack(cap)


def attention_args(d, *, kv_shared=True, heads=8, kv_heads=1, compressed=False, topk=False, seqused=False,
                   varlen=False, sink=False, left=None, right=None, kv_start=0):
    """A call's argument list as ``interface.masked_attention_forward`` builds it (+ the seams'
    bundles, common/seams.py)."""
    from dsv4_attention.common import jit, seams

    b, sq, sk = (1, 37, 37) if varlen else (2, 5, 300)
    q = torch.empty(b, sq, heads, d, dtype=torch.bfloat16)
    k = torch.empty(b, sk, kv_heads, d, dtype=torch.bfloat16)
    v = k if kv_shared else torch.empty_like(k)
    lse = torch.empty(b, heads, sq)
    cu = torch.tensor([0, 17, 37], dtype=torch.int32) if varlen else None
    extra = seams.tail(seams.Lengths(torch.full((b,), 100, dtype=torch.int32) if seqused else None, cu, cu,
                                     20 if varlen else 0),
                       seams.Window(left or 0, right or 0), torch.zeros(heads) if sink else None,
                       seams.Entries(torch.empty(b, 40, kv_heads, d, dtype=torch.bfloat16) if compressed else None,
                                     4 if compressed else 0,
                                     torch.zeros(b, sq, 70, dtype=torch.int32) if topk else None, kv_start))
    return [q, k, v, torch.empty_like(q), lse, 0.1, jit.STREAM, *extra]


CASES = {  # stage, head_dim, kernel options, argument options
    "c": ("c", 128, {}, None),
    "d3-varlen": ("d3", 128, {"kv_shared": True, "varlen": True}, {"varlen": True}),
    "d4-seqused-window": ("d4", 128, {"kv_shared": True, "seqused_k": True, "has_left": True, "has_right": True},
                          {"seqused": True, "left": 127, "right": 0}),
    # hd 128 (a third of hd 512's compile; the wrapper's checks do not depend on it), hd 512 below
    "e-hca-sink": ("e", 128, {"kv_shared": True, "pack_group": 8, "has_left": True, "has_right": True,
                              "has_sink": True, "has_compressed": True},
                   {"compressed": True, "sink": True, "left": 127, "right": 0, "kv_start": 4000}),
    "e-topk": ("e", 512, {"kv_shared": True, "pack_group": 128, "has_left": True, "has_right": True,
                          "has_compressed": True, "has_topk": True},
               {"heads": 128, "compressed": True, "topk": True, "left": 127, "right": 0}),
}


@functools.cache
def compiled(name):
    from dsv4_attention import stages
    from dsv4_attention.common import jit, kernel_cache
    from dsv4_attention.common.arch import target_arch

    stage, d, options, arg_options = CASES[name]
    plain = stage == "c"
    args = (stages.get(stage).module.example_args(torch.bfloat16, d) if plain
            else attention_args(d, **(arg_options or {})))
    with target_arch("sm90"):
        fn = jit.compile_kernel(stages.get(stage).module.make_kernel("sm90", torch.bfloat16, d, **options), args,
                                "sm90")
    return kernel_cache.raw_function(fn), args


def call(fn, args, patch=None):
    """Call with the tensors claiming cuda:0; returns the error text (there is always one here)."""
    from dsv4_attention.common import jit

    values = [jit.map_leaves(lambda a: fake_cuda(a) if isinstance(a, torch.Tensor) else a, a)
              for a in jit.call_args(args)]
    if patch is not None:
        patch(values)
    with pytest.raises(Exception) as e:  # noqa: PT011 - the wrapper's own error types
        fn(*values)
    return str(e.value)


def accepted(message: str) -> bool:
    return "cuda" in message.lower() and "mismatch" not in message.lower() and "expected" not in message.lower()


@pytest.mark.parametrize("name", list(CASES))
def test_stage_arguments_pass_the_wrapper(name):
    fn, args = compiled(name)
    msg = call(fn, args)
    assert accepted(msg), msg


def test_wrapper_refuses_what_the_kernel_was_not_compiled_for():
    fn, args = compiled("e-hca-sink")
    from dsv4_attention.common import jit

    wrong_dtype = lambda v: v.__setitem__(0, fake_cuda(torch.empty(2, 5, 8, 128, dtype=torch.float16)))  # noqa: E731
    assert not accepted(call(fn, args, wrong_dtype))
    # a bundle's field is checked too: the compressed entries in the wrong dtype
    wrong_entries = lambda v: v.__setitem__(9, v[9]._replace(  # noqa: E731
        compressed=fake_cuda(torch.empty(2, 40, 1, 128, dtype=torch.float16))))
    assert not accepted(call(fn, args, wrong_entries))
    assert jit.call_args(args)[6].seqused_k is None  # D3's Lengths: seqused_k compiled as None
    not_none = lambda v: v.__setitem__(6, v[6]._replace(seqused_k=fake_cuda(torch.zeros(2, dtype=torch.int32))))  # noqa: E731
    assert not accepted(call(fn, args, not_none))
    misaligned = lambda v: v.__setitem__(0, fake_cuda(torch.empty(2 * 5 * 8 * 128 + 8, dtype=torch.bfloat16)[1:]  # noqa: E731
                                                      .view(-1)[: 2 * 5 * 8 * 128].view(2, 5, 8, 128)))
    assert not accepted(call(fn, args, misaligned))
