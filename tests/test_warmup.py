"""The warm-up (common/warmup.py), on the CPU: the configurations it compiles are the ones the
call path looks up, so after it a fresh process serves those calls from the kernel cache without
compiling (and without importing CuTeDSL); a call outside the warmed set still compiles there
(negative control: the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4_attention.common import warmup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CALLS = r"""
import torch
import dsv4_attention
def calls(dtype):
    q, k = torch.zeros(1, 200, 8, 64, dtype=dtype), torch.zeros(1, 300, 2, 64, dtype=dtype)
    qd, kv = torch.zeros(1, 256, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 256, 1, 512, dtype=torch.bfloat16)
    return [("dense gqa causal", lambda: dsv4_attention.attention(q, k, k.clone(), causal=True)),
            ("dsv4 window + sink", lambda: dsv4_attention.attention(qd, kv, window_size=(127, 0),
                                                                     learnable_sink=torch.zeros(64)))]
"""

SERVE_CHILD = CALLS + r"""
import json, sys
from dsv4_attention.common import interface, kernel_cache
interface.arch_of_device = lambda device: "sm90"  # CPU tensors: the lookup is what is checked
failed = []
for name, call in calls(getattr(torch, sys.argv[1])):
    try:
        call()  # the loaded function then refuses CPU tensors: its own checks, after the lookup
    except Exception as e:  # noqa: BLE001
        failed.append(type(e).__name__)
print(json.dumps({**kernel_cache.stats, "dsl_imported": "cutlass" in sys.modules, "refused": failed}))
"""


def serve(cache, dtype: str) -> dict:
    env = dict(os.environ, DSV4_ATTENTION_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", SERVE_CHILD, dtype], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.arch("sm90")
@pytest.mark.compile
def test_after_the_warm_up_a_fresh_process_compiles_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_ATTENTION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DSV4_ATTENTION_DISABLE_CACHE", raising=False)
    scope: dict = {}
    exec(CALLS, scope)
    totals = warmup.warm(scope["calls"](torch.bfloat16), "sm90", jobs=2, log=lambda s: None)
    assert totals["configs"] == 2 and totals["compiled"] == 2
    assert warmup.warm(scope["calls"](torch.bfloat16), "sm90", jobs=2, log=lambda s: None)["loaded"] == 2

    served = serve(tmp_path, "bfloat16")
    assert (served["compiled"], served["loaded"]) == (0, 2), served
    assert len(served["refused"]) == 2  # each call reached its loaded kernel
    if served["loaded_so"]:
        assert served["dsl_imported"] is False
    # negative control: fp16 was not warmed, so its dense call compiles in the fresh process
    other = serve(tmp_path, "float16")
    assert other["compiled"] == 1 and other["loaded"] == 1, other


def test_the_presets_cover_deepseek_v4_on_both_archs():
    """Which kernels each preset compiles: DeepSeek-V4's four call forms at 64 and 128 heads on
    both archs (sm100's top-k forms at 64 heads: one token a 128-row tile, half of it padding)."""
    refused: list = []
    for arch in ("sm90", "sm100"):
        configs = warmup.configurations(warmup.dsv4_calls(), arch, refused)
        assert len(configs) == 8 and not refused
        assert {dict(k[4])["pack_group"] for k, *_ in configs} == {64, 128}
        assert sum(dict(k[4]).get("index_mode", False) for k, *_ in configs) == 2
        assert sum(dict(k[4]).get("has_topk", False) and dict(k[4])["pack_group"] == 64 for k, *_ in configs) == 2
    assert len(warmup.configurations(warmup.dense_calls(), "sm90")) == 36


def test_the_serving_preset_covers_flashmla_decode_and_prefill_from_the_pages():
    """Serving: decode in one launch over a window cache in pages of 256 and an extra cache in
    pages of 64 or 2, at 64 and 128 heads, and index mode over pages of 64 (prefill): on sm90 the
    decode kernels split (a step of few requests) and unsplit (a full batch); on sm100 unsplit,
    its only form, nothing refused."""
    configs = warmup.configurations(warmup.serving_calls(), "sm90")
    options = [dict(k[4]) for k, *_ in configs]
    assert len(configs) == 10 and all(o["index_mode"] for o in options)
    assert {(o["pack_group"], o["kv_pages_extra"], bool(o.get("split_kv"))) for o in options if "kv_pages_extra" in o} \
        == {(g, n, s) for g in (64, 128) for n in (64, 2) for s in (False, True)}
    assert {o["pack_group"] for o in options if o["kv_pages"] == 64 and "kv_pages_extra" not in o} == {64, 128}
    refused: list = []
    configs = warmup.configurations(warmup.serving_calls(), "sm100", refused)
    options = [dict(k[4]) for k, *_ in configs]
    assert len(configs) == 6 and not refused and not any(o.get("split_kv") for o in options)
    assert {(o["pack_group"], o.get("kv_pages_extra")) for o in options} == {(g, n) for g in (64, 128)
                                                                                for n in (64, 2, None)}
