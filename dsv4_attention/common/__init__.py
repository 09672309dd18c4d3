"""Shared pieces of the staged attention kernels, one concept per module.

Modules that import CuTeDSL (layouts, tmem, compile, layout_proof) are imported
on demand, so that `common.reference` and `common.testing` stay cheap.
"""
