"""Measured refinement (docs/refinement.md): improve a plan by timing its kernels on the
machine that will run it, for one world size or several.
"""
