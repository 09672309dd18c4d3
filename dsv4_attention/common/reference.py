"""float64 torch references, one per stage contract.

Every kernel is compared against these on upcast inputs. They take the user
layout ``[batch, seqlen, heads, head_dim]`` and return float64 on the inputs'
device, so the comparison itself adds no rounding.
"""

import math

import torch


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, s, hk, d) -> (b, s, heads, d): query head h reads kv head h // (heads // hk)."""
    hk = x.shape[2]
    if heads % hk:
        raise ValueError(f"kv heads ({hk}) must divide query heads ({heads})")
    return x.repeat_interleave(heads // hk, dim=2)


def qk_scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None) -> torch.Tensor:
    """Stage A: S[b, h, i, j] = scale * sum_d q[b, i, h, d] k[b, j, hk(h), d], float64."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    q64 = q.to(torch.float64)
    k64 = _expand_kv(k, q.shape[2]).to(torch.float64)
    return torch.einsum("bihd,bjhd->bhij", q64, k64) * scale


def visibility(seqlen_q: int, seqlen_k: int, seqused_k=None, window_size=(None, None), device=None):
    """[batch or 1, 1, seqlen_q, seqlen_k] bool: key j visible to query i (stages D3, D4), the
    formula of common/kv_span.py written with tensors: j < seqused_k[b] (default seqlen_k), and
    with i' = i + n_k - seqlen_q (n_k the request's key count, bottom-right alignment),
    i' - left <= j <= i' + right for the bounds that are not None."""
    left, right = window_size
    n_k = (torch.full((1,), seqlen_k, device=device) if seqused_k is None else seqused_k.to(device).long())
    i = torch.arange(seqlen_q, device=device)[None, :, None]
    j = torch.arange(seqlen_k, device=device)[None, None, :]
    n = n_k[:, None, None]
    ip = i + n - seqlen_q
    vis = j < n
    if left is not None:
        vis = vis & (j >= ip - left)
    if right is not None:
        vis = vis & (j <= ip + right)
    return vis[:, None]


def _sink_scale(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """exp(LSE) / (exp(LSE) + exp(sink)) in float64, by its definition: a row with no visible key
    (LSE = -inf) has O = 0 for any sink, +-inf included; sink = -inf leaves O as it is (1);
    sink = +inf takes the whole row (0). (The bare sigmoid(LSE - sink) is NaN at LSE = sink = -inf.)"""
    sink = sink.to(device=lse.device, dtype=torch.float64)
    scale = torch.sigmoid(lse - sink)
    return torch.where(torch.isneginf(lse), torch.zeros_like(scale), scale)


def attention(q, k, v, softmax_scale: float | None = None, *, seqused_k=None, causal: bool = False,
              window_size=(None, None), learnable_sink=None):
    """Softmax attention with its log-sum-exp, float64.

    O[b, i, h, :] = sum_j softmax_j(S[b, h, i, :]) v[b, j, hk(h), :] and
    LSE[b, h, i] = log sum_j exp(S[b, h, i, j]) (natural log), over the visible keys
    (``visibility``; causal is window right = 0). A row with no visible key gives O = 0 and
    LSE = -inf. ``learnable_sink`` ([heads]: a logit in the denominator only, stage D5):
    O[b, i, h] *= exp(LSE) / (exp(LSE) + exp(sink[h])) = sigmoid(LSE - sink[h]); LSE is returned
    without the sink.
    """
    s = qk_scores(q, k, softmax_scale)
    left, right = window_size
    if causal:
        right = 0
    if seqused_k is not None or left is not None or right is not None:
        vis = visibility(q.shape[1], k.shape[1], seqused_k, (left, right), device=q.device)
        s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhij,bjhd->bihd", p, _expand_kv(v, q.shape[2]).to(torch.float64))
    if learnable_sink is not None:
        o = o * _sink_scale(lse, learnable_sink[None, :, None]).transpose(1, 2)[..., None]
    return o, lse


def fused_attention(q, kv, v=None, *, compressed_kv=None, compress_ratio=None, topk_indices=None,
                    softmax_scale=None, seqused_k=None, causal: bool = False, window_size=(None, None),
                    learnable_sink=None, positions=None, kv_start: int = 0):
    """Stage E: one softmax over the window's keys and the compressed entries, float64.

    Query i of batch b sits at t' = i + n_k - seqlen_q (n_k = seqused_k[b] or seqlen_k: D4's
    bottom-right alignment) in the raw keys' frame, or, with ``positions`` ([seqlen_q] or [b,
    seqlen_q], absolute positions), at t' = positions[b, i] - kv_start, and sees raw key j iff j < n_k and
    t' - left <= j <= t' + right (bounds that are not None; causal: right = 0), and compressed
    entry j iff j < floor((kv_start + t' + 1) / compress_ratio) (> 0: ``kv_start`` is the absolute
    position of raw key 0, when kv holds only a sequence's last rows): all of them, or with
    ``topk_indices`` [b, seqlen_q, k] only the listed ones (-1: none; a listed entry not yet
    visible stays hidden). ``v`` None: K = V. Returns (O [b, sq, h, d], LSE [b, h, sq]) as
    ``attention``, the sink applied to O only."""
    v = kv if v is None else v
    b, sq, h, _ = q.shape
    sk = kv.shape[1]
    left, right = window_size
    if causal:
        right = 0
    dev = q.device
    n_k = (torch.full((b,), sk, device=dev) if seqused_k is None else seqused_k.to(dev).long())
    if positions is None:
        tp = torch.arange(sq, device=dev)[None, :] + (n_k - sq)[:, None]  # [b, sq]
    else:
        tp = positions.to(dev).long().reshape(-1, sq).expand(b, sq) - kv_start
    j = torch.arange(sk, device=dev)[None, None, :]
    t3 = tp[:, :, None]
    vis = j < n_k[:, None, None]
    if left is not None:
        vis = vis & (j >= t3 - left)
    if right is not None:
        vis = vis & (j <= t3 + right)
    s = qk_scores(q, kv, softmax_scale).masked_fill(~vis[:, None], -math.inf)  # [b, h, sq, sk]
    v64 = _expand_kv(v, h).to(torch.float64)
    parts = [(s, lambda p: torch.einsum("bhij,bjhd->bihd", p, v64))]  # (scores, P -> its part of O)
    if compressed_kv is not None:
        nc = compressed_kv.shape[1]
        count = torch.clamp(t3 + kv_start + 1, min=0) // compress_ratio  # [b, sq, 1]
        if topk_indices is None:
            jc = torch.arange(nc, device=dev)[None, None, :]
            s_c = qk_scores(q, compressed_kv, softmax_scale).masked_fill(~(jc < count)[:, None], -math.inf)
            c64 = _expand_kv(compressed_kv, h).to(torch.float64)
            parts.append((s_c, lambda p: torch.einsum("bhij,bjhd->bihd", p, c64)))
        else:
            idx = topk_indices.to(dev).long()  # [b, sq, k]
            # a listed position past the entries (none at all: a request with no entry) gathers a zero
            # row, masked below; the gather itself clamps into the tensor
            src = compressed_kv if nc else compressed_kv.new_zeros(b, 1, *compressed_kv.shape[2:])
            # one list a token, shared by its heads; head h reads kv head n = h // g's entries (heads
            # grouped as [kv head n, x < g], never expanded: [b, sq, k, h, d] in float64 would not fit)
            rows = torch.stack([src[i, idx[i].clamp(min=0, max=max(nc - 1, 0))] for i in range(b)])  # [b, sq, k, hk, d]
            rows = rows.to(torch.float64)
            hk = rows.shape[3]
            grouped = q.to(torch.float64).reshape(b, sq, hk, h // hk, q.shape[-1])
            scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
            s_c = torch.einsum("binxd,biknd->bnxik", grouped, rows).reshape(b, h, sq, -1) * scale
            ok = (idx >= 0) & (idx < torch.clamp(count, max=nc))

            def listed(p, rows=rows, hk=hk):
                pg = p.reshape(b, hk, h // hk, sq, -1)
                return torch.einsum("bnxik,biknd->binxd", pg, rows).reshape(b, sq, h, -1)

            parts.append((s_c.masked_fill(~ok[:, None], -math.inf), listed))
    lse = torch.logsumexp(torch.cat([p[0] for p in parts], dim=-1), dim=-1)
    o = sum(part(torch.exp(sc - lse[..., None]).nan_to_num(0.0)) for sc, part in parts)
    if learnable_sink is not None:
        o = o * _sink_scale(lse, learnable_sink[None, :, None]).transpose(1, 2)[..., None]
    return o, lse


def dsv4_index_attention(q, kv, idx, idx_len, sink, scale=512 ** -0.5):
    """DeepSeek-V4's index-mode function (docs/function.md), in float64: q [T, H, d], kv [N, d]
    (K = V), idx [T, K] int32 rows of kv (-1 = none), idx_len [T] (entries past it ignored), sink
    [H] or None. Returns (O [T, H, d], LSE [T, H]); a row with no valid index: O = 0, LSE = -inf."""
    T, K = idx.shape
    valid = (idx >= 0) & (torch.arange(K, device=idx.device)[None] < idx_len[:, None])
    g = kv[idx.clamp(min=0).long()].to(torch.float64)  # [T, K, d]
    s = torch.einsum("thd,tkd->thk", q.to(torch.float64), g) * scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("thk,tkd->thd", torch.exp(s - lse[..., None]).nan_to_num(0.0), g)
    if sink is not None:
        o = o * _sink_scale(lse, sink)[..., None]
    return o, lse


def attention_backward(q, k, v, do, softmax_scale: float | None = None, *, causal: bool = False,
                       window_size=(None, None), seqused_k=None, o=None, learnable_sink=None):
    """Gradients of ``attention`` in float64, written out rather than autograd's, so that a row
    with no visible key is exact (its P is 0: no gradient, no NaN):

        P = softmax(S) over the visible keys, D_i = dO_i . O_i, dV = P^T dO, dP = dO V^T,
        dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q

    with a KV head's gradient summed over its query heads. Returns (dq, dk, dv) float64 in the
    inputs' shapes; where v is k the caller adds dk and dv. With ``learnable_sink`` the sink is one
    more key with value 0: P and D above use the softmax over the keys and the sink (LSE' =
    logaddexp(LSE, sink[h]), O the sink-scaled output), and the call returns (dq, dk, dv, dsink)
    with dsink[h] = - sum over batch and rows of exp(sink[h] - LSE') D (0 where LSE' = -inf, a row
    that sees neither a key nor a finite sink). ``o``: take D from this output (the
    forward kernel's, rounded to 16 bits) instead of the exact one, as every FlashAttention-style
    backward does: where a row's softmax is nearly one-hot, dP - D cancels and O's rounding decides
    that row's dQ; a kernel is judged row by row against the gradient of the O it was given.
    tests/test_f_cpu.py checks it against torch.autograd on the forward reference, and that
    reference by finite differences."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    h, hk = q.shape[2], k.shape[2]
    o_exact, lse = attention(q, k, v, scale, causal=causal, window_size=window_size, seqused_k=seqused_k,
                             learnable_sink=learnable_sink)
    o = o_exact if o is None else o.to(torch.float64)
    if learnable_sink is not None:  # the sink joins the normalizer: P below is the softmax over keys and sink
        lse = torch.logaddexp(lse, learnable_sink.to(torch.float64)[None, :, None])
    s = qk_scores(q, k, scale)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # hidden keys: exp(-inf) = 0; empty rows: NaN -> 0
    left, right = window_size
    if causal:
        right = 0
    if seqused_k is not None or left is not None or right is not None:
        p = p * visibility(q.shape[1], k.shape[1], seqused_k, (left, right), device=q.device)
    do64 = do.to(torch.float64)
    q64 = q.to(torch.float64)
    k64 = _expand_kv(k, h).to(torch.float64)
    v64 = _expand_kv(v, h).to(torch.float64)
    dsum = (do64 * o).sum(-1).transpose(1, 2)  # [b, h, sq]
    dv = torch.einsum("bhij,bihd->bjhd", p, do64)
    dp = torch.einsum("bihd,bjhd->bhij", do64, v64)
    ds = p * (dp - dsum[..., None])
    dq = torch.einsum("bhij,bjhd->bihd", ds, k64) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, q64) * scale

    def per_kv_head(x):  # [b, sk, h, d] -> [b, sk, hk, d]: the sum over each KV head's group
        return x.unflatten(2, (hk, h // hk)).sum(3)

    if learnable_sink is None:
        return dq, per_kv_head(dk), per_kv_head(dv)
    p_sink = torch.exp(learnable_sink.to(torch.float64)[None, :, None] - lse).nan_to_num(0.0)  # [b, h, sq]
    return dq, per_kv_head(dk), per_kv_head(dv), -(p_sink * dsum).sum((0, 2))
