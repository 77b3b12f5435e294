"""Verification of sera_jax against an independent float64 NumPy reference.

* `verification.reference`: docs/method.md#the-estimator-and-its-scale in plain vectorized NumPy
  (no JAX): the scale functions, the allocator (docs/method.md#the-waterline to
  docs/method.md#weights-and-the-loss) and the exact expected scale of every group estimator.
  It is the oracle of the checks and the CPU speed baseline of the allocator.
* `verification.checks`: the comparisons of the JAX library with it and with
  the closed forms, shared by the tests and the command below.
* `python -m verification`: prints the table of checks, exits 1 on any failure.

This package imports nothing at import time, so `verification.reference` can
be used (and timed) without loading JAX.
"""
