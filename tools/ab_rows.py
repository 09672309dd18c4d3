"""Dense attention at head dims 64, 128 and 256 (stage D1's rows layout, through stage D4, the newest
stage that serves plain attention) against FlashAttention-4 in one process, for an A/B of two
versions of the kernel code: non-causal at 1k-16k keys (stage C's benchmark cases), causal at 1k
and 8k, and a causal variable-length batch. ``--stage c`` times stage C's own kernel instead, on
the non-causal cases only; ``--causal`` keeps stage D4's causal cases only.

    AB_LABEL=old python -m tools.ab_rows out_old.json     # one process per version
    AB_LABEL=new python -m tools.ab_rows out_new.json

Run the versions alternating (old, new, old, new) on one warm GPU; FlashAttention-4's time in each
process is the yardstick that shows how much the machine moved between them. The old version can
be a commit, as for ``tools.ab_e`` (its docstring: ``git archive`` into ``ab_old/``, the old
process run from inside it). ``--quick`` keeps the 1k, 4k and 16k non-causal cases.

Each case starts after the GPU has idled ``PAUSE_S``: a case's time depends on the clocks the work
before it left (on 2026-11-27 an hd 256 row whose kernel was the same in both versions ran 11 %
faster in the processes where the case before it had become slower and drew less power), so
every case starts from the same state whatever ran before it."""

import argparse
import json
import os
import time

import torch

from tools.bench import attention_row, varlen_row

PAUSE_S = 1.0  # the GPU idles this long before each case (see the module doc)


def main(path: str, quick: bool = False, stage_c: bool = False, causal_only: bool = False) -> None:
    from dsv4_attention.stages import c_online_softmax, d4_causal_window

    stage = c_online_softmax if stage_c else d4_causal_window

    dev = torch.device("cuda")
    rows = []

    def settle():
        torch.cuda.synchronize()
        time.sleep(PAUSE_S)

    def keep(r, kind):
        settle()  # before the next case
        rows.append({"case": r["case"], "kind": kind, "ours_ms": r["ours_ms"], "ours_tflops": r["ours_tflops"],
                     "fa4_ms": r["peer_ms"].get("fa4"), "fa4_tflops": r["peers"].get("fa4"),
                     **({"graph_ms": r["graph_ms"]} if "graph_ms" in r else {})})

    seqlens = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 16384)
    settle()
    for d in () if causal_only else (64, 128, 256):
        for s in seqlens:
            keep(attention_row(stage, dev, max(1, 32768 // s), 16, s, s, d, peers=("fa4",)), "non-causal")
    if not stage_c:
        for d in (64, 128, 256):
            for s in (1024, 8192):
                keep(attention_row(stage, dev, max(1, 32768 // s), 16, s, s, d, peers=("fa4",), causal=True),
                     "causal")
        keep(varlen_row(stage, dev, 128, 32, 4), "varlen causal")
    out = {"label": os.environ.get("AB_LABEL"), "stage": stage.ID, "device": torch.cuda.get_device_name(),
           "rows": rows}
    print(json.dumps(out))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("path", help="where the process's rows go (JSON)")
    ap.add_argument("--stage", choices=("c", "d4"), default="d4", help="c: stage C's own kernel, non-causal cases")
    ap.add_argument("--quick", action="store_true", help="non-causal at 1k, 4k and 16k only")
    ap.add_argument("--causal", action="store_true", help="stage D4's causal cases only")
    a = ap.parse_args()
    main(a.path, quick=a.quick, stage_c=a.stage == "c", causal_only=a.causal)
