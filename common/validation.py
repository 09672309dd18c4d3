"""Input checks that turn bad input into a ValueError before any compile or launch.

Each message names the argument and what is accepted. The kernels rely on
what is checked here: 16-byte aligned base pointers and row strides (TMA),
head_dim contiguous, one dtype for all inputs, kv heads dividing query heads.
"""

from __future__ import annotations

import math

import torch

DTYPES = (torch.bfloat16, torch.float16)


def _name_dtypes() -> str:
    return ", ".join(str(d).replace("torch.", "") for d in DTYPES)


def check_scale(softmax_scale, head_dim: int) -> float:
    """None -> 1/sqrt(head_dim); otherwise a positive finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite float or None; got {softmax_scale!r}")
    return float(softmax_scale)


def check_bshd(name: str, t, head_dims, min_seqlen: int = 1) -> None:
    """One [batch, seqlen, heads, head_dim] input."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}.dtype must be one of {_name_dtypes()}; got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must have rank 4 [batch, seqlen, heads, head_dim]; got shape {tuple(t.shape)}"
        )
    b, s, h, d = t.shape
    if d not in head_dims:
        raise ValueError(f"{name} head_dim must be one of {sorted(head_dims)}; got {d}")
    if b < 1 or h < 1:
        raise ValueError(f"{name} needs batch >= 1 and heads >= 1; got shape {tuple(t.shape)}")
    if s < min_seqlen:
        raise ValueError(f"{name} needs seqlen >= {min_seqlen}; got shape {tuple(t.shape)}")
    if t.stride(3) != 1:
        raise ValueError(f"{name} must have head_dim contiguous (stride 1); got strides {t.stride()}")
    elem = t.element_size()
    for dim in (0, 1, 2):  # every TMA stride, even of an extent-1 dim, must be a multiple of 16 bytes
        if (t.stride(dim) * elem) % 16:
            raise ValueError(
                f"{name} stride of dim {dim} must be a multiple of 16 bytes (TMA); got strides {t.stride()}"
            )
    if t.data_ptr() % 16:
        raise ValueError(f"{name} data pointer must be 16-byte aligned (TMA); got {t.data_ptr():#x}")


def check_same(ref_name: str, ref, name: str, t) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}.dtype must equal {ref_name}.dtype ({ref.dtype}); got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device ({ref.device}); got {t.device}")


def check_qk(q, k, head_dims, min_seqlen_k: int = 1) -> None:
    """q [b, sq, h, d], k [b, sk, hk, d]: same dtype, device, batch, head_dim; hk divides h."""
    check_bshd("q", q, head_dims)
    check_bshd("k", k, head_dims, min_seqlen_k)
    check_same("q", q, "k", k)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k batch must equal q batch ({q.shape[0]}); got {k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k head_dim must equal q head_dim ({q.shape[3]}); got {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"k heads ({k.shape[2]}) must divide q heads ({q.shape[2]})")


def check_out(name: str, t, shape, dtype, device) -> None:
    """A caller-provided output: exactly this shape and dtype, contiguous, on the inputs' device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}; got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")


def check_qkv(q, k, v, head_dims, max_seqlen_k: int | None = None, too_long: str = "") -> None:
    """q, k, v of an attention stage: q/k as ``check_qk`` (seqlen_k = 0 allowed: every row is
    empty), v of k's shape, dtype and device, and seqlen_k at most ``max_seqlen_k``."""
    check_qk(q, k, head_dims, min_seqlen_k=0)
    check_bshd("v", v, head_dims, min_seqlen=0)
    check_same("k", k, "v", v)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    if max_seqlen_k is not None and k.shape[1] > max_seqlen_k:
        raise ValueError(f"seqlen_k must be at most {max_seqlen_k} for this stage; got {k.shape[1]}{too_long}")


def check_seqused_k(seqused_k, batch: int, seqlen_k: int, device) -> None:
    """[batch] int32 on the inputs' device, every value in [0, seqlen_k] (reads the values: one
    device sync, before any launch; skipped while a CUDA graph is captured, where the kernel's
    clamp to [0, seqlen_k] is what holds)."""
    if not isinstance(seqused_k, torch.Tensor):
        raise ValueError(f"seqused_k must be a torch.Tensor or None; got {type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32:
        raise ValueError(f"seqused_k.dtype must be int32; got {seqused_k.dtype}")
    if tuple(seqused_k.shape) != (batch,):
        raise ValueError(f"seqused_k must have shape [batch] = ({batch},); got {tuple(seqused_k.shape)}")
    if seqused_k.device != device:
        raise ValueError(f"seqused_k must be on {device} like q; got {seqused_k.device}")
    if seqused_k.stride(0) != 1 and batch > 1:
        raise ValueError(f"seqused_k must be contiguous; got stride {seqused_k.stride()}")
    if seqused_k.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # reading the values would synchronize inside a CUDA graph capture; the kernel clamps them
    lo, hi = int(seqused_k.min()), int(seqused_k.max())
    if lo < 0 or hi > seqlen_k:
        raise ValueError(f"seqused_k values must lie in [0, seqlen_k = {seqlen_k}]; got min {lo}, max {hi}")


def check_window(causal, window_size) -> tuple:
    """(left, right) with None for an unbounded side; causal means right = 0. Bounds are
    non-negative ints: no sentinel (such as -1) stands for "no window"."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool; got {causal!r}")
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints >= 0 or None; got {window_size!r}")
    left, right = window_size
    for name, w in (("left", left), ("right", right)):
        if w is None:
            continue
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"window_size {name} must be an int >= 0 or None (unbounded); got {w!r}")
        if w > 2**31 - 1:
            raise ValueError(f"window_size {name} must be below 2**31; got {w}")
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True means window right = 0; got window_size {tuple(window_size)}")
        right = 0
    return left, right
