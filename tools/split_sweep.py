"""Split-KV decode: the kernels' time, CUDA-graph replayed, for explicit split counts (the data
behind ``common/split_kv.choose_splits``): DeepSeek-V4's layers (window + HCA entries or CSA
top-512) and dense MQA decode (128 heads on one K = V head, every key visible), one token per
request. ``python -m tools.split_sweep [--modes hca csa dense] [--splits 1 2 4] [--sk 65536]``."""

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
    a = ap.parse_args()
    from dsv4_attention.stages import e_fused

    dev = torch.device("cuda")
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


if __name__ == "__main__":
    main()
