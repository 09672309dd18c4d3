"""The PTX of kernel configurations, hashed, to show that a change left kernels unchanged.

    python -m tools.ptx_compare --out new.json                 # this tree's kernels
    (cd /tmp/old && python -m tools.ptx_compare --out old.json) # a worktree of the old commit
    python -m tools.ptx_compare --diff old.json new.json        # which configurations differ
    ... --params                                                 # kernel parameters renumbered

Without a GPU: each configuration is compiled for its architecture (file cache off) and its PTX
kept; ``.loc`` / ``.file`` lines (source positions, which move with any edit above them) are
dropped before hashing. Equal PTX means equal SASS (the same ptxas). The configurations: the
final kernel's DeepSeek-V4 calls on both architectures (common/warmup.py) and every stage's
dense head-dim-128 kernel on both (the backward, stage F, on sm90, its one architecture);
``--wide`` adds the sm90 compile-budget tests' configurations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile

_DEBUG = re.compile(r"^\s*\.(loc|file)\b.*$", re.M)
_PARAM_DECL = re.compile(r"^[ \t]*\.param\b[^\n]*_param_\d+[^\n]*\n", re.M)
_PARAM_REF = re.compile(r"\b\w+_param_(\d+)\b")


def normalize(ptx: str) -> str:
    """The PTX without what does not reach the SASS's instructions: ``.loc`` / ``.file`` lines, the
    kernel's parameter declarations, and its parameter names, renumbered in order of first use
    (``--params``). So a change that only adds or drops unused kernel parameters, or passes the
    same values in another order, hashes equal; a load of another type or offset does not."""
    ptx = _DEBUG.sub("", ptx)
    if os.environ.get("PTX_COMPARE_PARAMS") != "1":
        return ptx
    ptx = _PARAM_DECL.sub("", ptx)
    seen: dict = {}
    return _PARAM_REF.sub(lambda m: f"param_{seen.setdefault(m.group(0), len(seen))}", ptx)



def _sm90_budget_cases() -> list:
    """The sm90 compile-budget tests' configurations (tests/test_{d1,d34,d5,e}_cpu.py: every head
    dim, K = V and not, P in SMEM, windows, lengths, varlen, sink, entries, top-k, positions)."""
    import importlib.util
    import pathlib

    tests = pathlib.Path(__file__).resolve().parents[1] / "tests"
    out = []
    for name, stage_id in (("test_d1_cpu", "d1"), ("test_d34_cpu", None), ("test_d5_cpu", "d5"), ("test_e_cpu", "e")):
        spec = importlib.util.spec_from_file_location(f"_ptx_{name}", tests / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for case in mod.CASES:
            if stage_id == "d1":
                dtype, head_dim, options = case
                out.append(("sm90", "d1", dtype, head_dim, options))
            elif stage_id is None:
                sid, head_dim, options = case
                out.append(("sm90", sid, "bfloat16", head_dim, options))
            else:
                head_dim, options = case
                out.append(("sm90", stage_id, "bfloat16", head_dim, options))
    return out


def configurations(wide: bool = False) -> list:
    from dsv4_attention import stages
    from dsv4_attention.common import warmup

    out = []
    for arch in ("sm90", "sm100"):
        for _, stage_id, _, dtype, head_dim, _, options in warmup.configurations(warmup.dsv4_calls(), arch):
            out.append((arch, stage_id, str(dtype).removeprefix("torch."), head_dim, options))
        for s in stages.ALL_STAGES:  # the backward (stage F) where it has a kernel: sm90
            if 128 in s.head_dims and arch in s.module.KERNELS:
                out.append((arch, s.id, "bfloat16", 128, {}))
    if wide:
        out += _sm90_budget_cases()
    return out


def ptx_hash(config) -> tuple:
    import torch

    from dsv4_attention import stages
    from dsv4_attention.common import jit
    from dsv4_attention.common.arch import target_arch

    arch, stage_id, dtype_name, head_dim, options = config
    mod = stages.get(stage_id).module
    dtype = getattr(torch, dtype_name)
    args = mod.example_args(dtype, head_dim, **options)
    with tempfile.TemporaryDirectory() as d, target_arch(arch):
        ptx = jit.compile_ptx(mod.make_kernel(arch, dtype, head_dim, **options), args, arch, d)
    name = f"{arch} {stage_id} {dtype_name} hd{head_dim} {json.dumps(options, sort_keys=True)}"
    return name, hashlib.sha256(normalize(ptx).encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--diff", nargs=2)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--wide", action="store_true", help="also the sm90 compile-budget tests' configurations")
    ap.add_argument("--params", action="store_true", help="renumber kernel parameters by first use (normalize)")
    a = ap.parse_args(argv)
    if a.diff:
        old, new = (json.load(open(p)) for p in a.diff)
        same = [k for k in new if old.get(k) == new[k]]
        for k in sorted(set(old) | set(new)):
            if old.get(k) != new.get(k):
                print(f"DIFFERS  {k}")
        print(f"{len(same)} of {len(new)} configurations have identical PTX")
        return 0
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
    os.environ["PTX_COMPARE_PARAMS"] = "1" if a.params else "0"
    configs = configurations(a.wide)
    with ProcessPoolExecutor(a.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        hashes = dict(pool.map(ptx_hash, configs))
    with open(a.out, "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    print(f"{len(hashes)} configurations hashed into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
