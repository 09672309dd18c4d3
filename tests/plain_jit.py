"""A ``cute.jit`` method's body as plain Python, for host tests that run a kernel's own code with
recording stand-ins.

``method.__wrapped__`` is not enough: the first compile of a kernel in a process rewrites the
``__code__`` of each jit function it traces in place (the DSL's preprocessor turns ``for`` over
``cutlass.range`` into its own loop builders, which need an MLIR context), so a test that ran
after a GPU test of the same stage in the same pytest worker traced the rewritten code and failed
(on the device, 2026-11-25). The DSL keeps the source's code object as ``_original_code``."""

import types


def plain(method):
    """The function behind ``method`` (a jit-decorated function or method), with its original code."""
    f = getattr(method, "__wrapped__", method)
    code = getattr(f, "_original_code", f.__code__)
    g = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    return g
