"""dsv4_attention: staged CuTeDSL attention kernels for DeepSeek-V4-class models on Hopper (sm90)
and Blackwell (sm100).

    from dsv4_attention import attention           # the library's attention (the newest stage)
    from dsv4_attention.stages import STAGES       # every stage, in order, each with its forward
    import dsv4_attention.stages.ops               # the stages as torch custom ops

One import name for the whole library, so that installing it claims nothing generic. The package
is real on disk: ``dsv4_attention/common/`` and ``dsv4_attention/stages/`` are its subpackages, in a
checkout as in the wheel, so static tools (pyright, an editor) resolve every import as Python does.
The design card's top-level ``common/`` and ``stages/`` are links at the repository's root to those
folders, for reading; nothing imports through them.
"""

__all__ = ["attention", "STAGES"]


def __getattr__(name):
    # lazily: importing the package (e.g. by the compile child for one kernel) loads no stage
    if name in __all__:
        from dsv4_attention import stages

        value = getattr(stages, name)
        globals()[name] = value  # once: later lookups skip this hook (host time per call)
        return value
    raise AttributeError(f"module 'dsv4_attention' has no attribute {name!r}")
