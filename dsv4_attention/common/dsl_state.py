"""Kernel-side objects that DSL control flow carries: one implementation of the DSL's protocol.

A runtime loop (``cutlass.range``) or branch (``if`` on a DSL value) passes the objects it uses
through its IR values. An object takes part by ``__extract_mlir_values__`` (its dynamic fields'
values, flattened) and ``__new_from_mlir_values__`` (a copy with those fields rebuilt from the
loop's values). Every such class here (the KV span, the online softmax's statistics, the barrier
rings) has a few dynamic fields (DSL integers, tensors, pointers, or objects with the protocol)
and otherwise static ones (Python ints and bools: compile-time choices). :class:`DslState` does
the protocol once from the class's list of dynamic fields, ``_DYNAMIC``; a static field is
copied as is, and a dynamic field that is None or a Python int (a compile-time value in that
instance) carries no IR value.
"""

from __future__ import annotations

import cutlass


class DslState:
    """Base of an object that DSL control flow carries; ``_DYNAMIC`` names its dynamic fields."""

    _DYNAMIC: tuple = ()

    def __extract_mlir_values__(self):
        values, counts = [], []
        for name in self._DYNAMIC:
            x = getattr(self, name)
            v = [] if x is None or isinstance(x, int) else cutlass.extract_mlir_values(x)
            counts.append(len(v))
            values += v
        self._counts = counts  # read back by __new_from_mlir_values__ on this same object
        return values

    def __new_from_mlir_values__(self, values):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        at = 0
        for name, n in zip(self._DYNAMIC, self._counts, strict=True):
            if n:
                setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name), values[at:at + n]))
            at += n
        return new
