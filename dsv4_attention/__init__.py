"""dsv4_attention: staged CuTeDSL attention kernels for DeepSeek-V4-class models on Hopper (sm90)
and Blackwell (sm100).

    from dsv4_attention import attention           # the library's attention (the newest stage)
    from dsv4_attention.stages import STAGES       # every stage, in order, each with its forward
    import dsv4_attention.stages.ops               # the stages as torch custom ops

One import name for the whole library, so that installing it claims nothing generic. In a source
checkout ``common/`` and ``stages/`` sit at the top of the repository (the design card's layout)
and this package reaches them by adding the repository to its ``__path__``; the wheel installs
them inside the package (pyproject's package-dir), where nothing needs adding.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "common")):  # source checkout
    __path__.append(_os.path.dirname(_here))  # noqa: F821 - a package's __path__

__all__ = ["attention", "STAGES"]


def __getattr__(name):
    # lazily: importing the package (e.g. by the compile child for one kernel) loads no stage
    if name in __all__:
        from dsv4_attention import stages

        value = getattr(stages, name)
        globals()[name] = value  # once: later lookups skip this hook (host time per call)
        return value
    raise AttributeError(f"module 'dsv4_attention' has no attribute {name!r}")
