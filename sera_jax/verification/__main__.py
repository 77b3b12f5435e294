"""`python -m sera_jax.verification`: the library against the NumPy reference and closed forms.

Prints one row per check (name, cases, worst error or mismatches, PASS/FAIL),
then the details of any failure, and exits 1 if a check failed. It runs the
checks of tests/test_verification.py at a smaller size (under a minute on two
CPU cores).
"""

import sys
import time

from sera_jax.verification import checks

# Smaller than the tests: fewer prompt counts (one compilation each) and problems.
X64_SIZES = (1, 2, 17, 127, 1000, 4096)
X64_SEEDS = range(72)  # every family meets every size twice.
FLOAT32_SIZES = (3, 127, 4096)
FLOAT32_SEEDS = range(36)
FLAG_SIZES = (5, 1000)
FLAG_SEEDS = range(12)
MODES = ("uniform", "equalized", "sera")


def run_checks():
  """Yields the results of every check, in table order."""
  yield checks.reference_invariants(X64_SEEDS, sizes=X64_SIZES)
  for mode in MODES:
    yield checks.allocation_x64(mode, X64_SEEDS, sizes=X64_SIZES)
  for flags in ({"normalize_by_rho": True}, {"normalize_by_rollout_count": False}):
    yield checks.allocation_x64("sera", FLAG_SEEDS, sizes=FLAG_SIZES, flags=flags)
  for mode in MODES:
    yield checks.allocation_float32(mode, FLOAT32_SEEDS, sizes=FLOAT32_SIZES)
  yield checks.scaling_x64()
  yield checks.expected_scale_closed_forms()
  for eps in (0.0, 1e-6):
    yield checks.expected_scale_library(eps)


def main() -> int:
  start = time.perf_counter()
  width = 68
  print(f"{'check':<{width}} {'cases':>6}  {'max error / mismatches':<48} result")
  print("-" * (width + 64))
  failed = []
  for result in run_checks():
    verdict = "PASS" if result.passed else "FAIL"
    print(f"{result.name:<{width}} {result.cases:>6}  {result.error:<48} {verdict}", flush=True)
    if not result.passed:
      failed.append(result)
  print("-" * (width + 64))
  for result in failed:
    print(f"\nFAIL {result.report()}")
  print(f"{'all checks passed' if not failed else f'{len(failed)} checks FAILED'} "
        f"in {time.perf_counter() - start:.1f} s")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
