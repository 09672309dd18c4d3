"""What every stage's tests share: error metrics, poisoning, inputs, architecture marks.

Error metrics compare a kernel output with a float64 reference:
- ``rel_fro``: ||out - ref||_F / ||ref||_F over the whole tensor;
- ``row_rel``: the same per row of the last dim, worst row reported, so one bad
  row cannot hide in a large tensor (the origin's statistics landed on wrong rows);
- ``max_abs``: the largest absolute difference.
NaN or Inf anywhere in the output makes every metric infinite: NaN never passes.

An element of a 16-bit output within one subnormal step of the reference counts as exact
(``subnormal_step``): a row of values near the dtype's smallest normal (fp16: 6.1e-5) cannot be
represented more finely than that step, so its relative error would measure the format, not the
kernel (an fp16 row of 1.5e-6 keeps 1.1e-2 of row error when exactly rounded). The step is
absolute and tiny (fp16: 6e-8, bf16: 9e-41), so it forgives nothing in a normal row.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from dsv4_attention.common.arch import ARCHS, gpu_name, present_arch

POISON = float("nan")


@dataclasses.dataclass
class Errors:
    rel_fro: float
    row_rel: float
    max_abs: float
    worst_row: tuple

    def within(self, rel: float, row: float) -> bool:
        return self.rel_fro <= rel and self.row_rel <= row

    def __str__(self) -> str:
        return (
            f"rel_fro={self.rel_fro:.3e} worst_row_rel={self.row_rel:.3e} at {self.worst_row} "
            f"max_abs={self.max_abs:.3e}"
        )


def subnormal_step(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s subnormal numbers (its smallest positive value): the finest
    difference an output of that dtype can show near zero. 0 for float64 (the reference's own)."""
    if dtype == torch.float64 or not dtype.is_floating_point:
        return 0.0
    f = torch.finfo(dtype)
    return f.smallest_normal * f.eps


def errors(out: torch.Tensor, ref: torch.Tensor, row_floor: float = 0.0) -> Errors:
    """Errors of ``out`` against ``ref`` (any shape; rows are the last dim). ``row_floor``: a row's
    relative error is taken against at least that fraction of the root-mean-square row norm
    (gradients, whose rows can vanish exactly: a query that sees one key has dQ = 0, computed as
    rounding noise). Each element's difference is reduced by one subnormal step of ``out``'s
    dtype (the module doc); ``max_abs`` is the plain difference."""
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64).to(o.device)
    if not torch.isfinite(o).all():
        bad = (~torch.isfinite(o)).nonzero()[0].tolist()
        return Errors(math.inf, math.inf, math.inf, tuple(bad[:-1]))
    raw = o - r
    step = subnormal_step(out.dtype)
    diff = raw.sign() * (raw.abs() - step).clamp_min(0) if step else raw
    rel = (diff.norm() / r.norm().clamp_min(1e-300)).item()
    # one row per index of the leading dims; a vector (a sink's gradient) or a scalar is one row
    rows = tuple(r.shape[:-1])
    width = r.shape[-1] if r.dim() else 1
    row_num = diff.reshape(-1, width).norm(dim=-1)
    row_den = r.reshape(-1, width).norm(dim=-1)
    row_den = row_den.clamp_min(max(row_floor * row_den.square().mean().sqrt().item(), 1e-300))
    row_err = row_num / row_den
    worst = int(row_err.argmax())
    worst_idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), rows)) if rows else ()
    return Errors(rel, row_err[worst].item(), raw.abs().max().item(), worst_idx)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output with NaN before a launch: any element left unwritten fails the check."""
    return t.fill_(POISON)


def random_bshd(batch, seqlen, heads, head_dim, dtype, device, *, magnitude=1.0, generator=None):
    """A [batch, seqlen, heads, head_dim] input with N(0, magnitude^2) entries.

    ``magnitude`` sets how large scores get: |s| grows like magnitude^2 * sqrt(head_dim) * scale.
    """
    x = torch.randn(batch, seqlen, heads, head_dim, generator=generator, dtype=torch.float32)
    return (x * magnitude).to(dtype=dtype, device=device)


def random_index_lists(tokens: int, k: int, rows: int, generator, *, pad: float = 0.0) -> torch.Tensor:
    """[tokens, k] int32 (CPU) index lists as a top-k selector gives them: each token's k distinct
    rows of ``rows`` (a random permutation's head: no duplicates), then a ``pad`` share set to -1.
    Needs k <= rows."""
    if tokens == 0:
        return torch.zeros(0, k, dtype=torch.int32)
    idx = torch.stack([torch.randperm(rows, generator=generator)[:k] for _ in range(tokens)]).int()
    idx[torch.rand(idx.shape, generator=generator) < pad] = -1
    return idx


def sinks_with_infinities(heads: int, generator, device="cuda") -> torch.Tensor:
    """[heads] fp32 attention sinks as FlashMLA's test draws them: N(0, 2^2), with heads 0, 3, 6, ...
    at -inf (no sink) and 1, 4, 7, ... at +inf (O = 0), so that every row meets each kind."""
    s = torch.randn(heads, generator=generator) * 2
    s[0::3], s[1::3] = -math.inf, math.inf
    return s.to(device)


def fresh_generator(seed: int | None = None) -> torch.Generator:
    """A generator with a fresh seed each call unless one is given; the seed is kept for messages."""
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)
    return g


def padded_view(t: torch.Tensor, fill=None) -> torch.Tensor:
    """``t``'s values in a view into a buffer padded in every dim (each + 1, the last + 128): the
    strided layout FlashMLA's tests pass every input in (kernelkit.non_contiguousify; a [s, 1, 512]
    bf16 kv gets strides (1280, 640, 1)). The padding holds ``fill`` (default NaN for floating
    tensors, 2^30 for integers): a read of it shows in the result."""
    if fill is None:
        fill = float("nan") if t.is_floating_point() else 2**30
    shape = [n + 128 if i == t.dim() - 1 else n + 1 for i, n in enumerate(t.shape)]
    view = torch.full(shape, fill, dtype=t.dtype, device=t.device)[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


# ---- architecture marks -----------------------------------------------------------------

def gpu_arch_params():
    """pytest params, one per architecture, each marked `gpu` and skipped where that GPU is absent."""
    here = present_arch()
    params = []
    for arch in ARCHS:
        reason = (
            f"needs a {'Hopper (sm90)' if arch == 'sm90' else 'Blackwell (sm100)'} GPU; "
            f"this machine has {gpu_name() or 'no GPU'}"
        )
        params.append(
            pytest.param(arch, id=arch, marks=[pytest.mark.gpu, pytest.mark.skipif(here != arch, reason=reason)])
        )
    return params


def cuda_device():
    return torch.device("cuda", 0)


# ---- one attention call against the float64 reference ------------------------------------

#: stage B's bounds, kept by every attention stage: O relative (Frobenius) error, worst row 3x
O_REL = {torch.bfloat16: 4e-3, torch.float16: 2e-3}
LSE_ABS = 1e-4


def attention_inputs(b, sq, sk, h, hk, d, dtype, *, kv_shared=False, magnitude=1.0):
    """Fresh random q [b, sq, h, d], k and v [b, sk, hk, d] on the GPU (v is k when
    ``kv_shared``), with the generator (its seed names the case in failure messages).
    ``magnitude`` scales q and k, so the scores grow with its square."""
    dev, g = cuda_device(), fresh_generator()
    q = random_bshd(b, sq, h, d, dtype, dev, magnitude=magnitude, generator=g)
    k = random_bshd(b, sk, hk, d, dtype, dev, magnitude=magnitude, generator=g)
    v = k if kv_shared else random_bshd(b, sk, hk, d, dtype, dev, generator=g)
    return q, k, v, g


#: forward options that change which keys a row sees; the reference takes them too
MASK_OPTIONS = ("seqused_k", "causal", "window_size", "learnable_sink")
#: stage E's compressed entries: with them the reference is ``reference.fused_attention``
COMPRESSED_OPTIONS = ("compressed_kv", "compress_ratio", "topk_indices", "kv_start", "positions")


def reference_for(q, k, v, options: dict):
    """The float64 reference of one call with these forward options: ``reference.attention``, or
    ``reference.fused_attention`` where compressed entries are given."""
    from dsv4_attention.common.reference import attention, fused_attention

    if options.get("compressed_kv") is not None or options.get("positions") is not None:
        return fused_attention(q, k, v, **{n: options[n] for n in MASK_OPTIONS + COMPRESSED_OPTIONS if n in options})
    return attention(q, k, v, **{n: options[n] for n in MASK_OPTIONS if n in options})


def recorded_options(options: dict) -> dict:
    """Options as the report records them: small tensors as lists, large ones by their shape."""
    return {n: (f"tensor{list(x.shape)}" if isinstance(x, torch.Tensor) and x.numel() > 256
                else x.tolist() if isinstance(x, torch.Tensor) else x) for n, x in options.items()}


def check_attention(forward, q, k, v, record, g, **case):
    """Run ``forward(q, k, v, out=, lse_out=)`` into NaN-poisoned outputs and assert O and LSE
    against the float64 reference, globally and row by row. ``case`` is recorded (and named in
    the failure message) with the errors; keyword options for ``forward`` go in ``case['options']``
    (the masking ones, MASK_OPTIONS, go to the reference too). Rows with no visible key must come
    back exactly O = 0 and LSE = -inf."""
    from dsv4_attention.common.interface import same_memory

    b, sq, h, _ = q.shape
    options = case.get("options", {})
    o = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(b, h, sq, dtype=torch.float32, device=q.device))
    forward(q, k, v, out=o, lse_out=lse, **options)
    torch.cuda.synchronize()
    o_ref, lse_ref = reference_for(q, k, v, options)
    e = errors(o, o_ref)
    empty = torch.isneginf(lse_ref)
    finite = ~empty
    lse_ok = bool(torch.isfinite(lse[finite]).all()) and bool(torch.isneginf(lse[empty]).all())
    lse_err = (lse.double()[finite] - lse_ref[finite]).abs().max().item() if lse_ok and finite.any() else 0.0
    if not lse_ok:
        lse_err = math.inf
    empty_rows_zero = bool((o.transpose(1, 2)[empty] == 0).all())
    recorded = recorded_options(options)
    case = dict(dtype=str(q.dtype), head_dim=q.shape[3], shape=list(q.shape), seqlen_k=k.shape[1],
                kv_shared=same_memory(k, v), lse_abs=lse_err, empty_rows=int(empty.sum()),
                **{**case, "options": recorded})
    record(e, **case)
    tol = O_REL[q.dtype]
    msg = f"{case}: {e} lse_abs={lse_err:.2e} (seed {g.initial_seed()})"
    assert e.within(tol, 3 * tol), msg
    assert lse_err <= LSE_ABS, msg
    assert empty_rows_zero, f"rows with no visible key must give O = 0: {msg}"


def varlen_inputs(q_lens, k_lens, heads, kv_heads, head_dim, dtype, *, kv_shared=False, pad=0):
    """A variable-length batch: q [total_q + pad, heads, d], k and v [total_k + pad, kv_heads, d]
    (v is k when ``kv_shared``; ``pad`` rows past the last request, which nothing may touch),
    cu_seqlens_q / cu_seqlens_k on the GPU, and the generator."""
    g = fresh_generator()
    dev = cuda_device()
    total_q, total_k = sum(q_lens) + pad, sum(k_lens) + pad
    q = random_bshd(1, total_q, heads, head_dim, dtype, dev, generator=g)[0]
    k = random_bshd(1, total_k, kv_heads, head_dim, dtype, dev, generator=g)[0]
    v = k if kv_shared else random_bshd(1, total_k, kv_heads, head_dim, dtype, dev, generator=g)[0]
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)  # noqa: E731
    return q, k, v, cu(q_lens), cu(k_lens), g


def check_varlen(forward, q, k, v, cu_q, cu_k, record, g, **case):
    """Run ``forward`` on a variable-length batch into NaN-poisoned outputs and assert each
    request's O and LSE against the float64 reference of that request alone (with the masks of
    ``case['options']``), globally over every request's rows and row by row; rows with no
    visible key exactly O = 0 and LSE = -inf; rows past the last request never written. Stage E's
    packed operands are cut per request too: ``compressed_kv`` [total_entries, kv_heads, d] by
    ``cu_seqlens_compressed`` (default floor(keys / ratio) entries a request), ``topk_indices``
    [total_q, k] and ``positions`` [total_q] by the request's tokens."""
    from dsv4_attention.common.interface import same_memory

    options = case.get("options", {})
    o = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device))
    forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, out=o, lse_out=lse, **options)
    torch.cuda.synchronize()
    masks = {n: options[n] for n in MASK_OPTIONS + COMPRESSED_OPTIONS if n in options}
    cq, ck = cu_q.tolist(), cu_k.tolist()
    ckv = options.get("compressed_kv")
    if ckv is not None:
        cc = options.get("cu_seqlens_compressed")
        cc = cc.tolist() if cc is not None else [0, *itertools.accumulate(
            (b - a) // options["compress_ratio"] for a, b in zip(ck, ck[1:], strict=False))]
    outs, refs, lse_err, empty_ok = [], [], 0.0, True
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        request = dict(masks)
        if ckv is not None:
            request["compressed_kv"] = ckv[None, cc[b]:cc[b + 1]]
        for name in ("topk_indices", "positions"):
            if name in options:
                request[name] = options[name][qs][None] if name == "topk_indices" else options[name][qs]
        o_ref, lse_ref = reference_for(q[None, qs], k[None, ks], v[None, ks], request)
        outs.append(o[None, qs])
        refs.append(o_ref)
        got = lse[:, qs][None]
        empty = torch.isneginf(lse_ref)
        finite = ~empty
        if not (bool(torch.isfinite(got[finite]).all()) and bool(torch.isneginf(got[empty]).all())):
            lse_err = math.inf
        elif finite.any():
            lse_err = max(lse_err, (got.double()[finite] - lse_ref[finite]).abs().max().item())
        empty_ok &= bool((o[None, qs].transpose(1, 2)[empty] == 0).all())
    e = errors(torch.cat(outs, 1), torch.cat(refs, 1)) if outs else None
    untouched = bool(o[cq[-1]:].isnan().all()) and bool(lse[:, cq[-1]:].isnan().all())
    recorded = recorded_options(options)
    case = dict(dtype=str(q.dtype), head_dim=q.shape[2], shape=list(q.shape), q_lens=[b - a for a, b in
                zip(cq, cq[1:], strict=False)], k_lens=[b - a for a, b in zip(ck, ck[1:], strict=False)],
                kv_shared=same_memory(k, v), lse_abs=lse_err, **{**case, "options": recorded})
    msg = f"{case}: {e} lse_abs={lse_err:.2e} (seed {g.initial_seed()})"
    if e is not None:
        record(e, **case)
        tol = O_REL[q.dtype]
        assert e.within(tol, 3 * tol), msg
    assert lse_err <= LSE_ABS, msg
    assert empty_ok, f"rows with no visible key must give O = 0: {msg}"
    assert untouched, f"rows past the last request were written: {msg}"


#: bad (q, k, v) every stage refuses, as ``make(q, k) -> (q, k, v)`` with the ValueError's pattern
#: (each stage's own cases are added beside them)
BAD_QKV = [
    (lambda q, k: (q, k, k[:, :-1]), r"v must have k's shape"),
    (lambda q, k: (q.float(), k, k), r"q\.dtype must be one of"),
]


def check_index_result(o, lse, o_ref, lse_ref, record, **case):
    """Index mode's (or decode's) result against the float64 reference: O within bf16's bounds
    globally and row by row (``errors``, recorded with ``case``), a row with no key (LSE_ref = -inf)
    O = 0 and LSE = -inf, every other row's LSE within LSE_ABS. ``o`` [..., d] and ``lse`` [...]
    index the same rows. Returns the errors."""
    e = errors(o, o_ref)
    record(e, **case)
    assert e.within(O_REL[torch.bfloat16], 3 * O_REL[torch.bfloat16]), e
    empty = torch.isneginf(lse_ref)
    assert bool(torch.isneginf(lse[empty]).all()) and bool((o[empty] == 0).all())
    assert (lse[~empty].double() - lse_ref[~empty]).abs().max().item() <= LSE_ABS
    return e


def compile_budget_test(stage_id: str, head_dims, tmem_columns=None, dtypes=("bfloat16", "float16")):
    """A stage's ``test_compiles_within_budget``: every (arch, dtype, head dim) compiled within the
    budgets (``common.compile.assert_within_budget``); ``tmem_columns(head_dim)``: the least TMEM an
    sm100 kernel must allocate (default 32)."""
    from dsv4_attention.common.compile import assert_within_budget

    @pytest.mark.compile
    @pytest.mark.parametrize("arch", ["sm90", "sm100"])
    @pytest.mark.parametrize("dtype", list(dtypes))
    @pytest.mark.parametrize("head_dim", list(head_dims))
    def test_compiles_within_budget(arch, dtype, head_dim):
        least = 32 if tmem_columns is None else tmem_columns(head_dim)
        assert_within_budget(stage_id, arch, dtype, head_dim, min_tmem_columns=least)

    return test_compiles_within_budget


def assert_long_keys_reach_dispatch(forward, head_dim: int) -> None:
    """A 20000-key call on CPU tensors passes every check and fails only on the device: no key
    count below the kernels' own limits is refused."""
    q = torch.randn(1, 8, 2, head_dim).bfloat16()
    k = torch.randn(1, 20000, 1, head_dim).bfloat16()
    with pytest.raises(ValueError, match="CUDA device"):
        forward(q, k, k)


def sanitizer_test(script: str, tools=("memcheck", "racecheck")):
    """A stage's ``test_compute_sanitizer``: ``script`` under each of ``tools``, per GPU architecture
    (``run_compute_sanitizer``)."""

    @pytest.mark.parametrize("arch", gpu_arch_params())
    @pytest.mark.parametrize("tool", list(tools))
    def test_compute_sanitizer(arch, tool):
        run_compute_sanitizer(tool, script)

    return test_compute_sanitizer


def run_compute_sanitizer(tool: str, script: str, marker: str = "sanitized case ran"):
    """Run ``script`` under compute-sanitizer's ``tool`` (memcheck, racecheck, synccheck, ...) from
    the repository root and assert it reports no error. The script ends by printing ``marker``
    (appended here, after a device sync, where it does not). Skips where the sanitizer is not
    installed."""
    if marker not in script:
        script += f"\nimport torch\ntorch.cuda.synchronize()\nprint({marker!r})\n"
    import os
    import shutil
    import subprocess
    import sys

    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("compute-sanitizer is not installed on this machine")
    import dsv4_attention

    # the directory holding the package (the repository, or site-packages when installed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(dsv4_attention.__file__)))
    # --report-api-errors=no: torch and the driver probe entry points (cuGetProcAddress) and
    # get CUDA_ERROR_INVALID_VALUE by design; only the kernels' device-side errors count here
    cmd = [exe, f"--tool={tool}", "--report-api-errors=no", "--error-exitcode=3", sys.executable, "-c", script]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and marker in out, out[-3000:]
    assert "ERROR SUMMARY: 0 errors" in out or "RACECHECK SUMMARY: 0 hazards" in out, out[-3000:]
