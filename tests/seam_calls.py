"""Host tests call a kernel's seams as the kernel does (common/seams.py; stage D1's hooks): these
build the bundles from the plain numbers a proof is written in."""

from __future__ import annotations

import importlib
import inspect

from dsv4_attention.common.seams import Window


def _arch(kernel) -> str:
    return "sm100" if type(kernel).__module__.endswith("sm100") or "Sm100" in type(kernel).__name__ else "sm90"


def request_entries(kernel, count, topk=None, ratio=0, kv_start=0, positions=None, c_row0=0, mC=None, atom=None):
    """Stage E's per-request entries (``RequestEntries`` of the kernel's architecture), as its
    ``request_entries`` would give them for a request with ``count`` entries."""
    cls = importlib.import_module(f"dsv4_attention.stages.e_fused.{_arch(kernel)}").RequestEntries
    given = {"atom": atom, "mC": mC, "mC_mem": None, "count": count, "c_row0": c_row0, "topk": topk,
             "positions": positions, "ratio": ratio, "kv_start": kv_start}
    # each arch's own fields, by name (decode's second cache: its defaults, None)
    return cls(**{f: given[f] for f in cls._fields if f in given})


def span(kernel, m_block, rows, seqlen_k, left=0, right=0, ratio=0, n_compressed=0, topk=None, kv_start=0,
         positions=None):
    """The kernel's ``kv_span`` of Q tile ``m_block``: D4's window (left, right) and, for a kernel with
    entries or positions (stage E), the request's entries."""
    entries = None
    if getattr(kernel, "has_compressed", False) or positions is not None:
        entries = request_entries(kernel, n_compressed, topk, ratio, kv_start, positions)
    return kernel.kv_span(m_block, rows, seqlen_k, Window(left, right), entries)


def span_arguments(args: tuple) -> dict:
    """``span``'s positional arguments after the kernel, by name."""
    return dict(zip(list(inspect.signature(span).parameters)[1:], args, strict=False))
