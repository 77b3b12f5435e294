"""Checks of the JAX library against the float64 NumPy reference and the closed forms.

Shared by `python -m sera_jax.verification` (which prints them as a table) and by
tests/test_verification.py (which asserts them at a larger size). Each check
returns a `CheckResult`; a failing one lists its first offending cases
precisely (problem seed, prompt index, library and reference values).

Random problems (`sample_problem`) cycle deterministically through the
success-probability families and prompt counts, so that every family meets
every size; everything else is drawn from a per-problem seeded generator.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from sera_jax.method import scaling
from sera_jax.method.allocation import allocate
from sera_jax.method.estimators import expected_scale
from sera_jax.verification import reference

# Prompt counts: a fixed list, because the jitted allocator compiles once per M.
SIZES = (1, 2, 3, 5, 8, 17, 64, 127, 256, 1000, 2049, 4096)
FAMILIES = ("beta", "uniform", "log_uniform", "near_one", "ties", "mixture")
BASELINE_NS = (2, 4, 16, 128)
N_MAX_FACTORS = (1, 2, 4)
THRESHOLDS = (0.05, 0.05, 0.05, 0.05, 0.0, 0.2, 0.5, 1.0)
MAX_LISTED_FAILURES = 5


class Problem(NamedTuple):
  """One allocation problem; `seed` identifies it (see `sample_problem`)."""
  seed: int
  family: str
  log_p: np.ndarray
  baseline_n: int
  n_min: int
  n_max: int
  threshold: float

  def describe(self) -> str:
    return (f"seed={self.seed} family={self.family} M={self.log_p.size} N0={self.baseline_n} "
            f"n_min={self.n_min} n_max={self.n_max} threshold={self.threshold}")


class CheckResult(NamedTuple):
  """One row of the verification table."""
  name: str
  cases: int
  error: str  # the worst error or the number of mismatches, as text.
  failures: tuple[str, ...]

  @property
  def passed(self) -> bool:
    return not self.failures

  def report(self) -> str:
    return "\n".join((f"{self.name}: {self.cases} cases, {self.error}",) + self.failures)


def _family_log_p(rng: np.random.Generator, family: str, size: int) -> np.ndarray:
  """log p of `size` prompts from one family (p = 0 draws are moved to 1e-300)."""
  if family == "beta":
    return np.log(np.maximum(rng.beta(0.3, 1.5, size), 1e-300))
  if family == "uniform":
    return np.log(np.maximum(rng.uniform(0.0, 1.0, size), 1e-300))
  if family == "log_uniform":
    return rng.uniform(np.log(1e-12), np.log(1e-1), size)
  if family == "near_one":  # 1 - p around 1e-9.
    return np.log1p(-(10.0 ** rng.uniform(-10.0, -8.0, size)))
  if family == "ties":  # a few distinct values, each shared by many prompts.
    values = _family_log_p(rng, "mixture", int(rng.integers(1, 5)))
    return values[rng.integers(0, values.size, size)]
  if family == "mixture":  # every prompt from a random family.
    pools = [_family_log_p(rng, name, size) for name in FAMILIES[:4]]
    return np.choose(rng.integers(0, len(pools), size), pools)
  raise ValueError(f"unknown family {family!r}")


def sample_problem(seed: int, sizes: Sequence[int] = SIZES) -> Problem:
  """The problem with this seed: family and M cycle with the seed, the rest is random."""
  rng = np.random.default_rng(seed)
  family = FAMILIES[seed % len(FAMILIES)]
  size = sizes[(seed // len(FAMILIES)) % len(sizes)]
  baseline_n = int(rng.choice(BASELINE_NS))
  return Problem(
      seed=seed, family=family, log_p=_family_log_p(rng, family, size),
      baseline_n=baseline_n, n_min=int(rng.integers(1, 3)),
      n_max=baseline_n * int(rng.choice(N_MAX_FACTORS)),
      threshold=float(rng.choice(THRESHOLDS)))


def clamp_to_float32(problem: Problem) -> Problem:
  """The problem with p clamped to float32's [tiny, 1 - ulp] and log p rounded to float32.

  The float32 library clamps in float32, which would otherwise move p near 1
  (1 - 1e-9 becomes 1 - 6e-8); comparing the allocators on the same inputs
  measures their numerics, not the clamp.
  """
  f32 = np.finfo(np.float32)
  lo, hi = np.float32(np.log(f32.tiny)), np.float32(np.log1p(-f32.epsneg))
  log_p = np.clip(problem.log_p.astype(np.float32), lo, hi)
  return problem._replace(log_p=log_p)


def run_reference(problem: Problem, mode: str, **flags) -> reference.Allocation:
  return reference.allocate(
      problem.log_p.astype(np.float64), problem.baseline_n, problem.n_min, problem.n_max,
      mode=mode, threshold=problem.threshold, **flags)


def run_library(problem: Problem, mode: str, **flags):
  """The library's allocation as NumPy arrays (in the dtype of problem.log_p)."""
  result = allocate(problem.log_p, baseline_n=problem.baseline_n, n_min=problem.n_min,
                    n_max=problem.n_max, mode=mode, threshold=problem.threshold, **flags)
  return jax.tree.map(np.asarray, result)


def _relative_error(got, want) -> np.ndarray:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want) / np.maximum(1.0, np.abs(want))


def _describe_differences(name, index, got, want, log_p) -> str:
  """Where `got` and `want` differ: the first indices, both values, and log p there."""
  shown = index[:MAX_LISTED_FAILURES]
  got, want = np.asarray(got)[shown].tolist(), np.asarray(want)[shown].tolist()
  text = (f"{name} differ at {index.size} entries, first indices {shown.tolist()}: "
          f"library {got}, reference {want}")
  if name != "target_fidelity":  # the one scalar; the rest are per prompt.
    text += f", log_p {np.asarray(log_p)[shown].tolist()}"
  return text


def _compare_exact(problem: Problem, mode: str, flags: dict, tolerance: float
                   ) -> tuple[list[str], float]:
  """Differences between library and reference on one problem, and the worst float error."""
  want = run_reference(problem, mode, **flags)
  got = run_library(problem, mode, **flags)
  where = f"[{mode}{' ' + str(flags) if flags else ''}] {problem.describe()}: "
  differences = []
  for name in ("counts", "active"):
    index = np.flatnonzero(getattr(got, name) != getattr(want, name))
    if index.size:
      differences.append(where + _describe_differences(
          name, index, getattr(got, name), getattr(want, name), problem.log_p))
  worst = 0.0
  for name in ("weights", "continuous", "fidelity", "coverage", "target_fidelity"):
    error = np.atleast_1d(_relative_error(getattr(got, name), getattr(want, name)))
    worst = max(worst, float(error.max()))
    index = np.flatnonzero(error > tolerance)
    if index.size:
      differences.append(where + _describe_differences(
          name, index, np.atleast_1d(getattr(got, name)), np.atleast_1d(getattr(want, name)),
          problem.log_p))
  return differences, worst


def allocation_x64(mode: str, seeds: Iterable[int], *, sizes: Sequence[int] = SIZES,
                   flags: dict | None = None, tolerance: float = 1e-12) -> CheckResult:
  """x64 library == reference: counts and active exactly, floats to `tolerance` (relative, >= 1)."""
  flags = flags or {}
  failures, worst, cases, mismatched = [], 0.0, 0, 0
  with jax.enable_x64(True):
    for seed in seeds:
      problem_failures, error = _compare_exact(sample_problem(seed, sizes), mode, flags, tolerance)
      failures += problem_failures
      mismatched += bool(problem_failures)
      worst, cases = max(worst, error), cases + 1
  suffix = "".join(f" {k}={v}" for k, v in flags.items())
  return CheckResult(f"allocate x64 == reference ({mode}{suffix})", cases,
                     f"{mismatched} problems differ, max float err {worst:.1e}",
                     tuple(failures[:MAX_LISTED_FAILURES]))


def allocation_float32(mode: str, seeds: Iterable[int], *, sizes: Sequence[int] = SIZES,
                       min_within_one: float = 0.99, min_identical: float = 0.97) -> CheckResult:
  """float32 library: exact budget, bounds, >= 99% of counts within 1 of the reference, and
  outside mode "sera" >= 97% of the problems given the reference's counts exactly.

  float32 solves the problem clamped to float32 at float32's waterline, so a count may differ
  at a rounding edge; in "sera" a prompt's mixed probability at the threshold decides a whole
  active set, so there only the share within 1 is required.
  """
  failures, cases, close, total, identical = [], 0, 0, 0, 0
  for seed in seeds:
    problem = clamp_to_float32(sample_problem(seed, sizes))
    got = run_library(problem, mode)
    want = run_reference(problem, mode)
    counts = got.counts.astype(np.int64)
    where = f"[{mode} float32] {problem.describe()}: "
    budget = problem.log_p.size * problem.baseline_n
    if counts.sum() != budget:
      failures.append(where + f"sum(counts) = {counts.sum()} != budget {budget}")
    in_bounds = (counts >= problem.n_min) & (counts <= problem.n_max)
    if mode != "sera":
      in_bounds &= got.active
    bad = np.flatnonzero(~np.where(got.active, in_bounds, counts == 0))
    if bad.size:
      failures.append(where + f"counts out of bounds at {bad[:MAX_LISTED_FAILURES].tolist()}: "
                      f"{counts[bad[:MAX_LISTED_FAILURES]].tolist()}")
    if not np.all(np.isfinite(got.weights)) or not np.all(np.isfinite(got.continuous)):
      failures.append(where + "non-finite weights or continuous solution")
    close += int((np.abs(counts - want.counts) <= 1).sum())
    identical += int(np.array_equal(counts, want.counts))
    total += counts.size
    cases += 1
  fraction = close / total
  if fraction < min_within_one:
    failures.append(f"[{mode} float32] only {fraction:.4%} of counts within 1 of the reference "
                    f"(need {min_within_one:.0%})")
  if mode != "sera" and identical < min_identical * cases:
    failures.append(f"[{mode} float32] only {identical} of {cases} problems get the "
                    f"reference's counts (need {min_identical:.0%})")
  return CheckResult(f"allocate float32 budget/bounds/near ref ({mode})", cases,
                     f"{total - close} of {total} counts off by > 1 ({fraction:.4%} within 1), "
                     f"{identical} problems identical", tuple(failures[:MAX_LISTED_FAILURES]))


# Probabilities and group sizes on which the scale functions are compared.
SCALE_LOG_P = np.concatenate([
    np.log([1e-12, 1e-6, 1e-3, 0.05, 0.3, 0.5, 0.7, 0.95]),
    np.log1p(-np.array([1e-3, 1e-6]))])
SCALE_N = np.array([1, 2, 3, 8, 64, 256])


def _grid(log_p: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  log_p, n = np.meshgrid(log_p, n, indexing="ij")
  return log_p.ravel(), n.ravel()


def _max_error_check(name: str, pairs: Iterable[tuple[str, np.ndarray, np.ndarray]],
                     inputs: tuple[np.ndarray, np.ndarray], tolerance: float) -> CheckResult:
  """Compares (label, got, want) triples elementwise to an absolute-or-relative `tolerance`."""
  failures, worst, cases = [], 0.0, 0
  log_p, n = inputs
  for label, got, want in pairs:
    error = _relative_error(got, want)
    worst, cases = max(worst, float(error.max())), cases + error.size
    for i in np.flatnonzero(~(error <= tolerance))[:MAX_LISTED_FAILURES]:
      failures.append(f"{label}: log_p={log_p[i]!r} n={n[i]}: got {got[i]!r}, want {want[i]!r}")
  return CheckResult(name, cases, f"max err {worst:.1e}", tuple(failures[:MAX_LISTED_FAILURES]))


def scaling_x64(tolerance: float = 1e-13) -> CheckResult:
  """sera_jax.scaling fidelity / coverage / mixed_probability == reference (x64), log p to -1000."""
  log_p = np.concatenate([SCALE_LOG_P, [-1000.0, -700.0, -1e-12]])
  log_p, n = _grid(log_p, np.array([0, 1, 2, 3, 8, 64, 512]))
  functions = (("fidelity", scaling.fidelity, reference.fidelity),
               ("coverage", scaling.coverage, reference.coverage),
               ("mixed", scaling.mixed_probability, reference.mixed))
  with jax.enable_x64(True):
    pairs = [(label, np.asarray(lib(log_p, n)), ref(log_p, n)) for label, lib, ref in functions]
  return _max_error_check("scaling x64 == reference", pairs, (log_p, n), tolerance)


def expected_scale_closed_forms(tolerance: float = 1e-12) -> CheckResult:
  """Reference sum over K == kappa, coverage, (1 - 1/n) p, p at eps = 0.

  See docs/method.md#the-estimator-and-its-scale.
  """
  log_p, n = _grid(SCALE_LOG_P, SCALE_N)
  pairs = [(name, reference.expected_scale(name, log_p, n, eps=0.0),
            reference.closed_form_scale(name, log_p, n))
           for name in reference.CLOSED_FORM_ESTIMATORS]
  return _max_error_check("reference expected_scale == closed forms (eps=0)", pairs,
                          (log_p, n), tolerance)


def expected_scale_library(eps: float, tolerance: float = 1e-12,
                           library_scale: Callable = expected_scale) -> CheckResult:
  """sera_jax expected_scale == reference for every estimator (x64)."""
  log_p, n = _grid(SCALE_LOG_P, SCALE_N)
  with jax.enable_x64(True):
    pairs = [(name, np.asarray(library_scale(name, log_p, n, eps=eps)),
              reference.expected_scale(name, log_p, n, eps=eps))
             for name in reference.ESTIMATORS]
  return _max_error_check(f"expected_scale x64 == reference (eps={eps:g})", pairs,
                          (log_p, n), tolerance)


def reference_invariants(seeds: Iterable[int], *, sizes: Sequence[int] = SIZES) -> CheckResult:
  """The reference alone: exact budget, bounds, weights N0 / n, sera prompts mixed enough."""
  failures, cases = [], 0
  for seed in seeds:
    problem = sample_problem(seed, sizes)
    budget = problem.log_p.size * problem.baseline_n
    for mode in reference.MODES:
      result = run_reference(problem, mode)
      counts, active = result.counts, result.active
      where = f"[{mode}] {problem.describe()}: "
      if counts.sum() != budget:
        failures.append(where + f"sum {counts.sum()} != budget {budget}")
      if not np.array_equal(active, counts > 0) or not np.all(
          (counts[active] >= problem.n_min) & (counts[active] <= problem.n_max)):
        failures.append(where + "counts out of bounds or active != (counts > 0)")
      expected_weights = np.where(active, problem.baseline_n / np.maximum(counts, 1), 0.0)
      if not np.allclose(result.weights, expected_weights, rtol=1e-15, atol=0):
        failures.append(where + "weights != N0 / n on active prompts")
      if mode != "uniform" and not np.all(
          np.abs(result.continuous[active] - counts[active]) < 1 + 1e-9):
        failures.append(where + "integer counts not within 1 of the continuous solution")
      cases += 1
  return CheckResult("reference invariants (budget, bounds, weights)", cases,
                     f"{len(failures)} violations", tuple(failures[:MAX_LISTED_FAILURES]))
