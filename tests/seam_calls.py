"""Host tests call a kernel's seams as the kernel does (common/seams.py; stage D1's hooks): these
build the bundles from the plain numbers a proof is written in."""

from __future__ import annotations

import importlib

from dsv4_attention.common.seams import Window


def _arch(kernel) -> str:
    return "sm100" if type(kernel).__module__.endswith("sm100") or "Sm100" in type(kernel).__name__ else "sm90"


def request_entries(kernel, count, topk=None, ratio=0, kv_start=0, positions=None, c_row0=0, mC=None, atom=None):
    """Stage E's per-request entries (``RequestEntries`` of the kernel's architecture), as its
    ``request_entries`` would give them for a request with ``count`` entries."""
    mod = importlib.import_module(f"dsv4_attention.stages.e_fused.{_arch(kernel)}")
    if _arch(kernel) == "sm100":
        return mod.RequestEntries(atom, mC, count, c_row0, topk, positions, ratio, kv_start)
    return mod.RequestEntries(atom, mC, None, count, topk, positions, ratio, kv_start)


def span(kernel, m_block, rows, seqlen_k, left=0, right=0, ratio=0, n_compressed=0, topk=None, kv_start=0,
         positions=None):
    """The kernel's ``kv_span`` of Q tile ``m_block``: D4's window (left, right) and, for a kernel with
    entries or positions (stage E), the request's entries."""
    entries = None
    if getattr(kernel, "has_compressed", False) or positions is not None:
        entries = request_entries(kernel, n_compressed, topk, ratio, kv_start, positions)
    return kernel.kv_span(m_block, rows, seqlen_k, Window(left, right), entries)
