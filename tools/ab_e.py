"""Stage E's cases in one process, for an A/B of two versions of the kernel code: index mode
against FlashMLA (4 cases, ``bench.index_row``), two HCA layers (``bench.fused_row``) and two CSA
layers (``bench.topk_row``).

    AB_LABEL=old python -m tools.ab_e out_old.json     # one process per version, caches off:
    AB_LABEL=new python -m tools.ab_e out_new.json     # DSV4_ATTENTION_DISABLE_CACHE=1 CUTE_DSL_DISABLE_FILE_CACHING=1

``--dense`` adds stage D1's dense hd 512 K = V seesaw (128 heads, seqlen 4k and 8k) first.

The versions alternate (old, new, old, new) on one warm GPU; FlashMLA's time in each process is
the yardstick that shows how much the machine moved between them. The old version can be a
commit: ``git archive REV dsv4_attention common stages tools | tar -x -C ab_old`` (list ``ab_old/``
in .git/info/exclude and name it in the device call's carry), then run the old process from
inside it (``cd ab_old && source ../.device/env.sh && AB_LABEL=old python3 -m tools.ab_e ...``:
env.sh puts the current folder first on PYTHONPATH). Keep only the JSON files under $OUT (a call
brings back at most 8 files): send each process's log to /tmp and print its tail. The runs of 2026-11-25 are in
``docs/results/experiments/ab_e_gather_h100.json`` and ``ab_e_lead_split_h100.json`` (stage E's
page: the profile and what was tried), those of 2026-11-26 in ``ab_split_handoff_h200.json``."""

import json
import os
import sys

import torch

from tools.bench import attention_row, fused_row, index_row, topk_row


def main(path: str, dense: bool = False) -> None:
    dev = torch.device("cuda")
    rows = []
    if dense:  # D1's seesaw on the dense shape (hd 512, K = V, 128 heads on one KV head)
        from dsv4_attention.stages import d1_smem_p

        for s in (4096, 8192):
            r = attention_row(d1_smem_p, dev, 1, 128, s, s, 512, kv_heads=1, kv_shared=True, peers=())
            rows.append({"case": r["case"], "ours_ms": r["ours_ms"], "ours_tflops": r["ours_tflops"]})
    for h, k in ((64, 512), (128, 1024)):
        for s_kv in (8192, 32768):
            r = index_row(dev, h, k, s_kv)
            rows.append({"case": r["case"], "ours_ms": r["ours_ms"], "flashmla_ms": r["peer_ms"].get("flashmla"),
                         "diff": r.get("max_abs_diff_vs_flashmla")})
            torch.cuda.empty_cache()
    for s in (8192, 32768):  # the HCA layer (window + every visible entry at ratio 128)
        r = fused_row(dev, s)
        rows.append({"case": r["case"], "ours_ms": r["ours_ms"], "ours_tflops": r["ours_tflops"]})
        torch.cuda.empty_cache()
    for s, k in ((8192, 1024), (32768, 512)):
        r = topk_row(dev, s, k)
        rows.append({"case": r["case"], "ours_ms": r["ours_ms"], "ours_tflops": r["ours_tflops"]})
        torch.cuda.empty_cache()
    out = {"label": os.environ.get("AB_LABEL"), "rows": rows}
    print(json.dumps(out))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], dense="--dense" in sys.argv[2:])
