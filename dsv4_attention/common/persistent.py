"""The persistent grid of the SM90 seesaw kernels: one CTA per SM, each looping over Q tiles.

Stage D1's seesaw (head dims 384 and 512, K = V; every later stage's DeepSeek-V4 shape) launches
``min(tiles, ctas)`` CTAs. CTA c takes tiles c, c + ctas, c + 2 ctas, ... of the launch's tile
order (the Q tile index fastest, then the head, then the batch entry: neighbouring CTAs read the
same KV rows at the same time, and each tile's decode is two divisions), so the next tile's KV
loads, and the producer's index reads, overlap this tile's epilogue, and a CTA's launch, barrier
setup and descriptor prefetch are paid once per SM instead of once per tile (stage E's HCA layer
visits 2-6 KV tiles per Q tile: its prologue and epilogue were 28 % of its stall samples).

``ctas`` is the device's SM count (torch's view of the current device; 132 on H100 SXM and H200,
and where no GPU is visible: CI compiles for sm_90a on a CPU). It is baked into the compiled
kernel, so it is part of a persistent kernel's configuration key (``common.tiles.uses_seesaw``
says which configurations are; ``common.jit.config_key``), in this process and in the kernel
cache: a kernel compiled for one SM count is never served to a device with another.
``cta_limit(n)`` lowers it, for tests that want many tiles per CTA on small shapes.
"""

from __future__ import annotations

import contextlib

DEFAULT_CTAS = 132  # H100 SXM, H200
_limit: list = []  # the innermost cta_limit, if any
_sms: dict = {}  # device index -> SM count (read once: calls that are never planned key every launch)


def device_sms() -> int:
    """SMs of the current CUDA device, or DEFAULT_CTAS where none is visible."""
    try:
        import torch

        if torch.cuda.is_available():
            dev = torch.cuda.current_device()
            if dev not in _sms:
                _sms[dev] = int(torch.cuda.get_device_properties(dev).multi_processor_count)
            return _sms[dev]
    except (ImportError, RuntimeError, AssertionError):
        pass
    return DEFAULT_CTAS


def grid_ctas() -> int:
    """CTAs a persistent kernel compiled now launches (at most)."""
    return _limit[-1] if _limit else device_sms()


@contextlib.contextmanager
def cta_limit(n: int):
    """Kernels compiled inside launch at most ``n`` CTAs (each then runs more tiles). Their
    configuration key differs, so they never serve calls outside; the call plans recorded outside
    are cleared on entry and exit (a plan holds its compiled function)."""
    from dsv4_attention.common import call_plan

    if n < 1:
        raise ValueError(f"cta_limit needs n >= 1, got {n}")
    call_plan.clear()
    _limit.append(int(n))
    try:
        yield
    finally:
        _limit.pop()
        call_plan.clear()
