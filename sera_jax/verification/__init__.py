"""Verification of sera_jax against an independent float64 NumPy reference.

* `sera_jax.verification.reference`: docs/method.md#the-estimator-and-its-scale in plain
  vectorized NumPy (no JAX): the scale functions, the allocator (docs/method.md#the-waterline to
  docs/method.md#weights-and-the-loss) and the exact expected scale of every group estimator.
  It is the oracle of the checks and the CPU speed baseline of the allocator.
* `sera_jax.verification.checks`: the comparisons of the JAX library with it and with
  the closed forms, shared by the tests and the command below.
* `python -m sera_jax.verification`: prints the table of checks, exits 1 on any failure.

The reference stays independent of the code it checks: it imports only NumPy,
SciPy and the standard library, and nothing in the library's layers imports this
package (tests/test_layout.py holds both). This package's own `__init__` imports
nothing; importing any of its modules loads `sera_jax` first, and with it JAX.
"""
