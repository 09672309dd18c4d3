"""Which kernel architecture a tensor's device runs, and which GPUs are present."""

from __future__ import annotations

import contextlib
import functools

ARCHS = ("sm90", "sm100")
# CuTeDSL's --gpu-arch target for each of our architectures
GPU_ARCH = {"sm90": "sm_90a", "sm100": "sm_100a"}
# compute capability major -> our architecture
_MAJOR = {9: "sm90", 10: "sm100"}


@contextlib.contextmanager
def target_arch(arch: str):
    """CuTeDSL targets ``arch`` ('sm90' / 'sm100') while the block runs, whatever GPU is present.

    A compile given ``--gpu-arch`` names its target; anything built outside one (an atom at
    Python level, a kernel's constructor) is checked against CUTE_DSL_ARCH or, unset, the GPU,
    so an sm100 atom fails on a Hopper machine. Restores the previous setting on exit.
    """
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    # _arch, not .arch: reading .arch probes the driver, and None (not yet detected) must stay
    # None (nvidia-cutlass-dsl 4.8.1's EnvironmentVarManager)
    saved = envar._arch
    envar.arch = GPU_ARCH[arch]
    try:
        yield
    finally:
        envar._arch = saved


def arch_of_capability(major: int, minor: int) -> str | None:
    if (major, minor) == (9, 0):
        return "sm90"
    if major == 10 and minor in (0, 3):
        return "sm100"
    return None


def arch_of_device(device) -> str:
    """The architecture whose kernel serves tensors on ``device``; ValueError if none does."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"tensors must be on a CUDA device (Hopper sm90 or Blackwell sm100); got device {device}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    arch = arch_of_capability(major, minor)
    if arch is None:
        raise ValueError(
            f"device {device} has compute capability {major}.{minor}; these kernels run on "
            "9.0 (Hopper, sm90) and 10.x (Blackwell, sm100) only"
        )
    return arch


@functools.cache
def present_arch() -> str | None:
    """The architecture of GPU 0, or None when there is no GPU we serve."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return arch_of_capability(*torch.cuda.get_device_capability(0))
    except Exception:  # noqa: BLE001 - no driver, no GPU
        return None


def gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None
