"""The attention sink's corner cases, shared by the host checks of every sink path.

FlashMLA's own test draws sinks with a third of the heads -inf and a third +inf, and rows with no
valid key; the library's contract for them (every kernel epilogue, the split-KV merge, torch's
``apply_sink`` / ``merge.sink_scale`` and the float64 reference):

    row empty (LSE = -inf)    O = 0 for any sink, +-inf included
    sink = -inf               O as without a sink (factor 1)
    sink = +inf               O = 0 (factor 0)
    LSE                       never includes the sink

``bare_sigmoid_factor`` is the negative control: the formula without its empty-row case, which
the checks must reject (it is NaN where LSE = sink = -inf).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

#: (LSE, sink) pairs: every combination of an empty / non-empty row with a finite, -inf, +inf sink,
#: plus sinks far above and below the LSE (the factor's two saturations in fp32)
PAIRS = [(lse, sink) for lse in (-math.inf, -40.0, 0.0, 1.5, 40.0)
         for sink in (-math.inf, math.inf, -30.0, 0.0, 1.5, 30.0)]


def factor(lse: float, sink: float) -> float:
    """exp(LSE) / (exp(LSE) + exp(sink)) by its definition, the empty row's case first."""
    if lse == -math.inf:
        return 0.0
    if sink == -math.inf:
        return 1.0
    if sink == math.inf:
        return 0.0
    d = sink - lse
    return 0.0 if d > 700 else 1.0 / (1.0 + math.exp(d))


@cute.jit
def bare_sigmoid_factor(lse: cutlass.Float32, sink: cutlass.Float32) -> cutlass.Float32:
    """Wrong on purpose: sigmoid(LSE - sink) with no empty-row case (the shipped form before the fix)."""
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp2(
        (sink - lse) * cutlass.Float32(1.4426950408889634), fastmath=True))
