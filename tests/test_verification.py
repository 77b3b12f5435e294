"""The JAX library against the independent float64 NumPy reference (sera_jax/verification/).

* x64: `allocate` equals the reference exactly (counts, active; floats to 1e-12)
  on 216 random problems per mode, every family of p meeting every M three times.
* float32: exact budget, bounds, >= 99% of counts within 1 of the reference, and (outside
  "sera") >= 97% of the problems given exactly the reference's counts.
* `expected_scale`: the reference's sum over K equals the closed forms, and the
  library equals the reference, for every estimator.
* The reference itself on hand-worked cases.
"""

import math

import mpmath
import numpy as np
import pytest

from sera_jax.verification import __main__ as cli
from sera_jax.verification import checks, reference

MODES = reference.MODES
X64_SEEDS = range(216)  # 216 = 6 families x 12 sizes x 3.
FLOAT32_SIZES = (1, 17, 1000, 4096)
FLOAT32_SEEDS = range(144)  # 6 families x 4 sizes x 6.


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_allocate_x64_equals_reference(mode):
  result = checks.allocation_x64(mode, X64_SEEDS)
  assert result.cases == len(X64_SEEDS)
  assert result.passed, result.report()


@pytest.mark.parametrize("flags", [{"normalize_by_rho": True},
                                   {"normalize_by_rollout_count": False, "normalize_by_rho": True}])
def test_allocate_x64_weight_options_equal_reference(flags):
  # The flags are static: one compilation per (flags, M), so a single M here.
  result = checks.allocation_x64("sera", range(12), sizes=(127,), flags=flags)
  assert result.passed, result.report()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_allocate_float32_meets_budget_and_stays_near_reference(mode):
  result = checks.allocation_float32(mode, FLOAT32_SEEDS, sizes=FLOAT32_SIZES)
  assert result.passed, result.report()


def test_problems_cover_every_family_and_size():
  drawn = [checks.sample_problem(seed) for seed in X64_SEEDS]
  assert {(p.family, p.log_p.size) for p in drawn} == {
      (f, m) for f in checks.FAMILIES for m in checks.SIZES}
  assert {p.baseline_n for p in drawn} == set(checks.BASELINE_NS)
  assert {(p.n_min, p.n_max // p.baseline_n) for p in drawn} == {
      (n_min, f) for n_min in (1, 2) for f in checks.N_MAX_FACTORS}
  assert all(np.isfinite(p.log_p).all() and (p.log_p <= 0).all() for p in drawn)
  ties = [p for p in drawn if p.family == "ties" and p.log_p.size > 4]
  assert all(np.unique(p.log_p).size <= 4 for p in ties)
  near_one = np.concatenate([p.log_p for p in drawn if p.family == "near_one"])
  assert np.all((-np.expm1(near_one) > 9e-11) & (-np.expm1(near_one) < 1.1e-8))


def test_problems_are_reproducible():
  first, again = checks.sample_problem(123), checks.sample_problem(123)
  np.testing.assert_array_equal(first.log_p, again.log_p)
  assert first._replace(log_p=None) == again._replace(log_p=None)


def test_scaling_x64_equals_reference():
  result = checks.scaling_x64()
  assert result.passed, result.report()


def test_reference_expected_scale_equals_closed_forms():
  result = checks.expected_scale_closed_forms(tolerance=1e-12)
  assert result.passed, result.report()


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_library_expected_scale_equals_reference(eps):
  result = checks.expected_scale_library(eps, tolerance=1e-12)
  assert result.passed, result.report()


def test_reference_invariants():
  result = checks.reference_invariants(range(72))
  assert result.passed, result.report()


def test_command_passes_and_fails(monkeypatch, capsys):
  failing = checks.CheckResult("made-up check", 1, "1 mismatch", ("seed=0: wrong",))
  passing = failing._replace(name="fine", failures=())
  monkeypatch.setattr(cli, "run_checks", lambda: iter([passing]))
  assert cli.main() == 0
  monkeypatch.setattr(cli, "run_checks", lambda: iter([passing, failing]))
  assert cli.main() == 1
  output = capsys.readouterr().out
  assert "FAIL" in output and "seed=0: wrong" in output


# --- The reference on hand-worked cases ---
# (docs/method.md#the-waterline to docs/method.md#weights-and-the-loss).


def test_reference_equal_p_gives_equal_counts():
  for mode in MODES:
    result = reference.allocate(np.log([0.3, 0.3]), baseline_n=4, n_min=2, n_max=16, mode=mode)
    np.testing.assert_array_equal(result.counts, [4, 4])
    np.testing.assert_array_equal(result.weights, [1.0, 1.0])
    assert result.target_fidelity == pytest.approx(1 - 0.7**3, rel=1e-14)


def test_reference_waterline_hand_worked():
  # lam = ln 2 and 2 ln 2: n = 1 + tau / lam sums to 8 at tau = 4 ln 2, giving n = 5 and 3 and
  # kappa(1/2, 5) = kappa(3/4, 3) = 15/16.
  result = reference.allocate(np.log([0.5, 0.75]), baseline_n=4, n_min=1, n_max=16,
                              mode="equalized")
  np.testing.assert_allclose(result.continuous, [5.0, 3.0], rtol=1e-14)
  np.testing.assert_array_equal(result.counts, [5, 3])
  assert result.target_fidelity == pytest.approx(15 / 16, rel=1e-14)
  np.testing.assert_allclose(result.fidelity, [15 / 16, 15 / 16], rtol=1e-14)
  np.testing.assert_allclose(result.weights, [4 / 5, 4 / 3], rtol=1e-15)
  np.testing.assert_allclose(result.coverage, [1 - 0.5**5, 1 - 0.25**3], rtol=1e-14)


def test_reference_degenerate_budget():
  # N0 == n_min: the budget is M * n_min, everyone gets n_min, the target is the worst kappa.
  log_p = np.log([0.1, 0.5, 0.9])
  result = reference.allocate(log_p, baseline_n=2, n_min=2, n_max=8, mode="equalized")
  np.testing.assert_array_equal(result.counts, [2, 2, 2])
  np.testing.assert_array_equal(result.continuous, [2.0, 2.0, 2.0])
  assert result.target_fidelity == pytest.approx(0.1, rel=1e-14)


def test_reference_all_at_n_max():
  result = reference.allocate(np.log([0.2, 0.6]), baseline_n=8, n_min=2, n_max=8,
                              mode="equalized")
  np.testing.assert_array_equal(result.counts, [8, 8])


def test_reference_rounding_ties_go_to_the_smaller_index():
  log_p = np.log([0.3, 0.3, 0.3])
  counts = reference.round_to_budget(log_p, np.full(3, 2.5), log_gap=np.log(0.4), budget=8,
                                     n_min=2, n_max=4)
  np.testing.assert_array_equal(counts, [3, 3, 2])


def test_reference_rounding_prefers_smallest_marginal_error():
  # Target 0.5: one more rollout moves kappa(0.5, 2) = 0.5 away from it (+), and
  # kappa(0.1, 5) = 0.3439 -> kappa(0.1, 6) = 0.40951 towards it (-): the second prompt wins.
  counts = reference.round_to_budget(np.log([0.5, 0.1]), np.array([2.2, 5.7]),
                                     log_gap=np.log(0.5), budget=8, n_min=2, n_max=10)
  np.testing.assert_array_equal(counts, [2, 6])


@pytest.mark.parametrize("tau", [0.2, 3.0, 40.0, 70.0])
def test_reference_marginal_error_keys_sort_as_the_exact_errors(tau):
  """The keys sort as the errors (kappa(n + 1) - t)^2 - (kappa(n) - t)^2 do in 60 digits, for
  candidates from p = e^-30 to 1 - 1e-12 at their floors of the waterline tau (and n_min = 1
  or 4 above it), up to waterlines t = 1 - e^-70 where every kappa rounds to 1 in float64."""
  mpmath.mp.dps = 60
  rng = np.random.default_rng(int(tau * 10))
  log_p = -np.exp(rng.uniform(np.log(1e-12), np.log(30.0), 200))
  n_min = np.where(np.arange(200) % 2, 1, 4)
  counts = np.maximum(np.floor(1 + tau / reference.failure_rate(log_p)), n_min)
  candidate = counts < 400  # below n_max: the prompts the rounding compares
  log_p, counts = log_p[candidate], counts[candidate].astype(int)
  keys = reference.marginal_error_keys(log_p, counts, -tau)
  gap = mpmath.exp(-tau)

  def exact(log_p, n):
    q = 1 - mpmath.exp(mpmath.mpf(float(log_p)))
    return (gap - q ** int(n)) ** 2 - (gap - q ** int(n - 1)) ** 2

  errors = [exact(*pair) for pair in zip(log_p, counts, strict=True)]
  assert len(errors) >= 50 and len(set(errors)) == len(errors)  # distinct: one order
  np.testing.assert_array_equal(np.argsort(keys, kind="stable"),
                                sorted(range(len(errors)), key=errors.__getitem__))


def test_reference_sera_switches_off_a_hopeless_prompt():
  log_p = np.array([np.log(0.5)] * 3 + [-700.0])
  sera = reference.allocate(log_p, baseline_n=4, n_min=2, n_max=16)
  np.testing.assert_array_equal(sera.active, [True, True, True, False])
  np.testing.assert_array_equal(sera.counts, [6, 5, 5, 0])
  np.testing.assert_array_equal(sera.weights, [4 / 6, 4 / 5, 4 / 5, 0.0])
  assert sera.fidelity[3] == 0.0 and sera.coverage[3] == 0.0
  # "equalized" gives the hopeless prompt all it can: the others sit at n_min.
  equalized = reference.allocate(log_p, baseline_n=4, n_min=2, n_max=16, mode="equalized")
  np.testing.assert_array_equal(equalized.counts, [2, 2, 2, 10])


def test_reference_sera_keeps_required_prompts_when_none_is_eligible():
  # p = 1 - 1e-9: never a mixed group, eligible = 0 < required = ceil(12 / 4) = 3.
  log_p = np.log1p(-np.full(6, 1e-9))
  result = reference.allocate(log_p, baseline_n=2, n_min=1, n_max=4)
  np.testing.assert_array_equal(result.counts, [4, 4, 4, 0, 0, 0])
  np.testing.assert_array_equal(result.active, [True] * 3 + [False] * 3)


def test_reference_sera_normalize_by_rho():
  log_p = np.log([0.05, 0.2, 0.6])
  plain = reference.allocate(log_p, baseline_n=4, n_min=2, n_max=16)
  by_rho = reference.allocate(log_p, baseline_n=4, n_min=2, n_max=16, normalize_by_rho=True)
  rho = plain.coverage[plain.active].mean()
  np.testing.assert_allclose(by_rho.weights, plain.weights / rho, rtol=1e-15)
  unit = reference.allocate(log_p, baseline_n=4, n_min=2, n_max=16,
                            normalize_by_rollout_count=False)
  np.testing.assert_array_equal(unit.weights, plain.active.astype(float))


def test_reference_uniform():
  log_p = np.log([0.01, 0.5])
  result = reference.allocate(log_p, baseline_n=4, n_min=2, n_max=16, mode="uniform",
                              normalize_by_rho=True)
  np.testing.assert_array_equal(result.counts, [4, 4])
  np.testing.assert_array_equal(result.weights, [1.0, 1.0])  # rho is ignored in uniform.
  assert result.target_fidelity == pytest.approx(1 - 0.99**3, rel=1e-14)


def test_reference_clamps_p_to_tiny_and_one_minus_ulp():
  result = reference.allocate(np.array([0.0, -1e4, np.log(0.5)]), baseline_n=4, n_min=2,
                              n_max=16, mode="equalized")
  assert np.all(np.isfinite(result.weights)) and result.counts.sum() == 12
  np.testing.assert_array_equal(reference.clamp_log_p([0.0, -1e4]),
                                [reference.LOG_P_MAX, reference.LOG_P_MIN])


@pytest.mark.parametrize("kwargs, message", [
    ({"n_min": 0}, "n_min must be >= 1"),
    ({"n_min": 5}, "n_min must be <= baseline_n"),
    ({"n_max": 3}, "baseline_n must be <= n_max"),
    ({"mode": "greedy"}, "mode must be one of"),
    ({"threshold": 1.5}, "threshold must lie in"),
    ({"threshold": -0.1}, "threshold must lie in"),
])
def test_reference_rejects_bad_arguments(kwargs, message):
  arguments = {"baseline_n": 4, "n_min": 2, "n_max": 16} | kwargs
  with pytest.raises(ValueError, match=message):
    reference.allocate(np.log([0.5, 0.2]), **arguments)


@pytest.mark.parametrize("log_p", [[np.nan], [0.5], [-np.inf]])
def test_reference_rejects_bad_log_p(log_p):
  with pytest.raises(ValueError, match="log_p"):
    reference.allocate(np.array(log_p), baseline_n=4, n_min=2, n_max=16)


def test_reference_scale_functions_hand_values():
  log_p = np.log(0.25)
  assert reference.fidelity(log_p, 3) == pytest.approx(1 - 0.75**2, rel=1e-15)
  assert reference.fidelity(log_p, 1) == 0.0 and reference.fidelity(log_p, 0) == 0.0
  assert reference.coverage(log_p, 3) == pytest.approx(1 - 0.75**3, rel=1e-15)
  assert reference.mixed(log_p, 3) == pytest.approx(1 - 0.75**3 - 0.25**3, rel=1e-15)
  assert reference.mixed(np.log(0.75), 3) == pytest.approx(1 - 0.75**3 - 0.25**3, rel=1e-15)
  assert reference.mixed(log_p, 0) == 0.0 and reference.coverage(log_p, 0) == 0.0
  # Extreme ends stay accurate: p = e^-1000 and p = 1 - 1e-12.
  assert reference.fidelity(-1000.0, 3) == pytest.approx(2 * math.exp(-1000), rel=1e-12)
  assert reference.mixed(math.log1p(-1e-12), 2) == pytest.approx(2e-12, rel=1e-9)


def test_reference_expected_scale_hand_values():
  # n = 2, p = 1/2: in a mixed group (probability 1/2) GRPO gives +-(1/2) / (1/2) = +-1, so
  # c = (1/2) * (1/2) * [1 * 1 - 1 * (-1) * 1] = 1/2 at eps = 0.
  assert reference.expected_scale("grpo", np.log(0.5), 2, eps=0.0) == pytest.approx(0.5)
  # The sample std of a mixed pair is sqrt(2 (1/4) / 1) = 1/sqrt(2): +-1/sqrt(2), so
  # c = (1/2) 2 p (1 - p) [1/sqrt(2) + (1/sqrt(2)) p / (1 - p)] = p / sqrt(2).
  assert reference.expected_scale("grpo_sample_std", np.log(0.3), 2, eps=0.0) == pytest.approx(
      0.3 / math.sqrt(2))
  assert reference.expected_scale("grpo_sample_std", np.log(0.3), 1, eps=0.0) == 0.0
  assert reference.expected_scale("rloo", np.log(0.3), 1, eps=0.0) == 0.0
  assert reference.expected_scale("maxrl", np.log(0.3), 0) == 0.0
  with pytest.raises(ValueError, match="estimator"):
    reference.expected_scale("ppo", np.log(0.3), 4)
