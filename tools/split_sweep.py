"""Split-KV decode: the kernels' time, CUDA-graph replayed, for explicit split counts (the data
behind ``common/split_kv.choose_splits``): DeepSeek-V4's layers (window + HCA entries or CSA
top-512) and dense MQA decode (128 heads on one K = V head, every key visible), one token per
request; and FP8 decode from paged caches (``--fp8``: FlashMLA's MODEL1 CONFIG1-4 through
``e_fused.decode``, each list cut into S, or with ``--forms one`` both lists in one launch cut
into S, beside FlashMLA's time on the same caches).
``python -m tools.split_sweep [--modes hca csa dense] [--splits 1 2 4] [--sk 65536] [--fp8 [--forms two one]]``."""

from __future__ import annotations

import argparse

import torch

from tools.bench import decode_layer_kwargs, dsv4_layer, graph_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["hca", "csa", "dense"])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--sk", type=int, nargs="+", default=[65536])
    ap.add_argument("--fp8", action="store_true", help="FP8 decode (FlashMLA's CONFIG1-4) instead of --modes")
    ap.add_argument("--forms", nargs="+", choices=["two", "one"], default=["two"],
                    help="FP8 decode's forms: two launches + merge, or one launch (one_launch=True)")
    a = ap.parse_args()
    from dsv4_attention.stages import e_fused

    dev = torch.device("cuda")
    if a.fp8:
        fp8_sweep(dev, a.batch, a.splits, a.forms)
        return
    for mode in a.modes:
        for sk in a.sk:
            for b in a.batch:
                c = dsv4_layer(dev, b, 1, sk, 512 if mode == "csa" else None)
                kw = decode_layer_kwargs(c, mode)
                ref = e_fused.forward(c["q"], c["kv"], **kw)[0].float()
                out = []
                for s in a.splits:
                    o = e_fused.forward(c["q"], c["kv"], num_splits=s, **kw)[0].float()
                    diff = (o - ref).abs().max().item()
                    ms = graph_ms([lambda s=s, c=c, kw=kw: e_fused.forward(c["q"], c["kv"], num_splits=s, **kw)],
                                  per_graph=16)
                    out.append(f"S={s}: {ms * 1e3:.1f} us ({diff:.2g})")
                print(f"{mode} b{b} sk{sk}: " + ", ".join(out), flush=True)
                del c
                torch.cuda.empty_cache()



def fp8_sweep(dev, batches, splits, forms=("two",)):
    """``e_fused.decode`` over FlashMLA's MODEL1 CONFIG1-4 caches with S splits a list (S 0: the
    automatic choice) in each of ``forms`` ("two": two launches and a merge; "one":
    ``one_launch=True``), graph-replayed, and FlashMLA's decode on the same caches."""
    from tools.bench_decode import FP8_CONFIGS

    for config in FP8_CONFIGS:
        for b in batches:
            print(f"fp8 CONFIG{config} b{b}: " + ", ".join(fp8_case(dev, config, b, splits, forms)), flush=True)
            torch.cuda.empty_cache()


def fp8_case(dev, config: int, b: int, splits, forms=("two",)) -> list:
    """One CONFIG / batch: "S=<n>[ one]: <us> (<max |O - O(two launches, auto)|>)" per form and
    split count, then FlashMLA's time."""
    from dsv4_attention.stages import e_fused
    from tools.bench_decode import fp8_decode_step

    q, win, win_idx, kw = fp8_decode_step(dev, config, b)
    sink, ext, ext_idx, ext_len = (kw[k] for k in ("attn_sink", "extra_k_cache", "extra_indices", "extra_topk_length"))
    ref = e_fused.decode(q, win, win_idx, **kw)[0].float()
    out = []
    for form in forms:
        one = form == "one"
        for s in splits:
            n = None if s == 0 else s
            o = e_fused.decode(q, win, win_idx, num_splits=n, one_launch=one, **kw)[0].float()
            ms = graph_ms([lambda n=n, one=one: e_fused.decode(q, win, win_idx, num_splits=n, one_launch=one, **kw)])
            diff = (o - ref).abs().max().item()
            out.append(f"S={s or 'auto'}{' one' if one else ''}: {ms * 1e3:.1f} us ({diff:.2g})")
    try:
        import flashmla_peer as fm  # pyright: ignore[reportMissingImports] (GPU peer)

        meta = fm.FlashMLASchedMeta()
        peer_ms = graph_ms([lambda: fm.with_kvcache_sparse(q, win, win_idx, None, sink, ext, ext_idx, ext_len,
                                                           softmax_scale=512 ** -0.55, sched_meta=meta)])
        out.append(f"flashmla: {peer_ms * 1e3:.1f} us")
    except Exception as e:  # noqa: BLE001 - the sweep reports what it could time
        out.append(f"flashmla failed: {type(e).__name__}: {e}"[:200])
    return out


if __name__ == "__main__":
    main()
