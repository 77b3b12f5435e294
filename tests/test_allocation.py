"""Invariants and edge cases of sera_jax.allocation.

See docs/method.md#the-waterline to docs/method.md#weights-and-the-loss.

Exact agreement with the float64 NumPy reference lives in test_verification.py.
"""

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sera_jax.method import allocation, ordering, scaling
from sera_jax.method.allocation import allocate
from sera_jax.verification import reference

# Few distinct shapes so hypothesis examples reuse compiled code.
SIZES = (1, 2, 5, 16, 33)
probabilities = st.floats(1e-9, 1 - 1e-6)


@st.composite
def problems(draw, distinct=False):
  size = draw(st.sampled_from(SIZES))
  p = draw(hnp.arrays(np.float64, size, elements=probabilities, unique=distinct))
  baseline_n = draw(st.sampled_from((2, 4, 16)))
  n_min = draw(st.sampled_from((1, 2)))
  n_max = baseline_n * draw(st.sampled_from((1, 2, 4)))
  return np.log(p), baseline_n, n_min, n_max


def _alloc(log_p, baseline_n, n_min, n_max, mode, **kw):
  return allocate(jnp.asarray(log_p, jnp.float32), baseline_n=baseline_n, n_min=n_min,
                  n_max=n_max, mode=mode, **kw)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(allocation.MODES), st.booleans())
def test_budget_bounds_and_weights(problem, mode, by_count):
  log_p, baseline_n, n_min, n_max = problem
  a = _alloc(log_p, baseline_n, n_min, n_max, mode, normalize_by_rollout_count=by_count)
  counts, active = np.asarray(a.counts), np.asarray(a.active)
  assert a.counts.dtype == jnp.int32
  assert counts.sum() == len(log_p) * baseline_n
  assert np.all(counts[active] >= n_min) and np.all(counts <= n_max)
  assert np.all(counts[~active] == 0)
  expected = baseline_n / np.maximum(counts, 1) if by_count else np.ones_like(counts)
  np.testing.assert_allclose(a.weights, np.where(active, expected, 0.0), rtol=1e-6)
  assert np.all(np.isfinite(a.continuous)) and np.isfinite(a.target_fidelity)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(problems())
def test_equalized_continuous_is_monotone_and_rounding_within_one(problem):
  log_p, baseline_n, n_min, n_max = problem
  a = _alloc(log_p, baseline_n, n_min, n_max, "equalized")
  order = np.argsort(log_p, kind="stable")  # ascending p
  continuous = np.asarray(a.continuous, np.float64)[order]
  assert np.all(np.diff(continuous) <= 1e-4 * continuous[1:]), "n(tau) must not grow with p"
  assert np.all(np.abs(np.asarray(a.counts) - np.asarray(a.continuous)) <= 1 + 1e-4)
  np.testing.assert_allclose(np.asarray(a.continuous).sum(), len(log_p) * baseline_n, rtol=1e-4)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(problems(distinct=True), st.sampled_from(allocation.MODES), st.randoms())
def test_permutation_equivariance_without_ties(problem, mode, random):
  log_p, baseline_n, n_min, n_max = problem
  perm = np.arange(len(log_p))
  random.shuffle(perm)
  with jax.enable_x64(True):
    a = allocate(jnp.asarray(log_p), baseline_n=baseline_n, n_min=n_min, n_max=n_max, mode=mode)
    b = allocate(jnp.asarray(log_p[perm]), baseline_n=baseline_n, n_min=n_min, n_max=n_max,
                 mode=mode)
  # Distinct p can still tie in marginal error after float rounding only
  # when the p are within a few ulps; hypothesis floats are far apart.
  np.testing.assert_array_equal(np.asarray(a.counts)[perm], b.counts)
  np.testing.assert_array_equal(np.asarray(a.active)[perm], b.active)


def test_equal_probabilities_give_equal_counts():
  a = _alloc(np.full(8, np.log(0.3)), 4, 2, 16, "equalized")
  np.testing.assert_array_equal(a.counts, np.full(8, 4))


def test_ties_break_towards_smaller_index():
  # Three equal prompts, budget 3 * 3 = 9 with n_min = n_max - 1 = 2 leaves
  # the remainder to the tie-break.
  a = _alloc(np.full(3, np.log(0.2)), 3, 2, 4, "equalized")
  assert a.counts.sum() == 9
  two = _alloc(np.full(2, np.log(0.2)), 3, 2, 5, "equalized")
  np.testing.assert_array_equal(two.counts, [3, 3])


@pytest.mark.parametrize("mode", ["equalized", "sera"])
def test_rounding_follows_the_errors_where_kappa_rounds_to_one(mode):
  """At p > 0.9 and n >= 9, (1 - p)^(n - 1) lies below float32's resolution and kappa rounds
  to 1. The errors are compared in a form that does not round, so the rollout left over goes
  to the prompt it brings nearest the waterline, as the float64 reference gives it, and not
  to the first prompt (with every error 0 it went there, and "sera" then found the second
  prompt's 5 rollouts too rarely mixed and switched it off: 14 and 0)."""
  log_p = np.log([0.9526436179, 0.9914450225])
  a = _alloc(log_p, 7, 2, 16, mode)
  assert float(a.target_fidelity) == 1.0  # the waterline itself rounds to 1 in float32
  np.testing.assert_allclose(a.continuous, [8.314, 5.686], atol=1e-3)
  np.testing.assert_array_equal(a.counts, [8, 6])
  np.testing.assert_array_equal(reference.allocate(log_p, 7, 2, 16, mode=mode).counts, [8, 6])


def test_budget_at_the_floor_gives_n_min_and_the_lowest_fidelity():
  log_p = np.log(np.array([0.01, 0.2, 0.9]))
  a = _alloc(log_p, 2, 2, 8, "equalized")
  np.testing.assert_array_equal(a.counts, [2, 2, 2])
  np.testing.assert_allclose(a.target_fidelity, scaling.fidelity(log_p.min(), 2), rtol=1e-6)


def test_hard_prompt_gets_more_and_fidelity_is_equalized():
  log_p = np.log(np.array([0.02, 0.1, 0.5, 0.9]))
  uniform = _alloc(log_p, 8, 2, 64, "uniform")
  equalized = _alloc(log_p, 8, 2, 64, "equalized")
  assert equalized.counts[0] > equalized.counts[3]
  assert np.ptp(equalized.fidelity) < np.ptp(uniform.fidelity)


def test_impossible_prompt_float32():
  # log p = -700: n_max under "equalized", 0 under "sera" unless forced.
  log_p = jnp.asarray([-700.0] + [float(np.log(0.3))] * 7, jnp.float32)
  eq = allocate(log_p, baseline_n=8, n_min=2, n_max=32, mode="equalized")
  sera = allocate(log_p, baseline_n=8, n_min=2, n_max=32, mode="sera")
  forced = allocate(log_p, baseline_n=8, n_min=2, n_max=32, mode="sera",
                    force_active=jnp.arange(8) == 0)
  assert int(eq.counts[0]) == 32 and int(sera.counts[0]) == 0 and bool(forced.active[0])
  assert int(forced.counts[0]) == 32
  for a in (eq, sera, forced):
    for leaf in jax.tree.leaves(a):
      assert np.all(np.isfinite(leaf))
    assert int(a.counts.sum()) == 64


def test_sera_switches_off_saturated_prompts():
  log_p = np.log(np.array([1 - 1e-9, 0.5, 0.3, 1e-9]))
  a = _alloc(log_p, 4, 2, 16, "sera")
  np.testing.assert_array_equal(a.active, [False, True, True, False])
  assert a.counts.sum() == 16


def test_rho_normalization_divides_by_mean_active_coverage():
  log_p = np.log(np.array([0.05, 0.2, 0.6]))
  plain = _alloc(log_p, 4, 2, 16, "sera")
  rho = _alloc(log_p, 4, 2, 16, "sera", normalize_by_rho=True)
  mean_coverage = np.asarray(plain.coverage)[np.asarray(plain.active)].mean()
  np.testing.assert_allclose(rho.weights, plain.weights / mean_coverage, rtol=1e-6)
  uniform = _alloc(log_p, 4, 2, 16, "uniform", normalize_by_rho=True)
  np.testing.assert_allclose(uniform.weights, 1.0)


def _bisect_100_steps(lam, active, budget, n_min, n_max):
  """The bisection of docs/method.md#the-waterline as written.

  100 halvings of [log tau_lo, log tau_hi], tau = exp(lo).
  """
  dtype = lam.dtype
  lam_min = jnp.min(jnp.where(active, lam, jnp.inf))
  tau_lo = jnp.where(n_min == 1, np.finfo(dtype).tiny, (n_min - 1) * lam_min)
  tau_hi = (n_max - 1) * jnp.max(jnp.where(active, lam, 0.0))

  def halve(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    continuous = jnp.clip(1 + jnp.exp(mid) / lam, n_min, n_max).astype(dtype)
    whole, fraction = allocation._total_rollouts(continuous, active)
    over = fraction > (budget - whole).astype(dtype)
    return jnp.where(over, lo, mid), jnp.where(over, mid, hi)

  lo, _ = jax.lax.fori_loop(0, 100, halve, (jnp.log(tau_lo), jnp.log(tau_hi)))
  return jnp.exp(lo)


@pytest.mark.parametrize("x64", [False, True], ids=["float32", "x64"])
def test_waterline_is_the_float_of_the_100_step_bisection(x64):
  # Newton + galloping must land on exactly the float that the bisection of
  # docs/method.md#the-waterline ends on, including n_min = 1, active subsets and the saturated
  # budget k * n_max.
  rng = np.random.default_rng(7)
  checked = saturated = 0
  with jax.enable_x64(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    fast = jax.jit(lambda *args: allocation._waterline(*args)[1])
    literal = jax.jit(_bisect_100_steps)
    lam_of = jax.jit(
        lambda log_p, n_min: allocation._prompts(allocation.clamp_log_p(log_p), n_min).lam)
    for trial in range(240):
      size = int(rng.choice([3, 17, 256, 1000]))
      p = [rng.beta(0.3, 1.5, size), rng.uniform(0, 1, size),
           np.exp(rng.uniform(np.log(1e-12), np.log(0.1), size)),
           np.round(rng.uniform(0, 1, size), 1)][trial % 4]
      log_p = np.log(np.clip(p, 1e-30, 1 - 1e-9)).astype(dtype)
      n_min = int(rng.choice([1, 2]))
      baseline_n = max(n_min, int(rng.choice([2, 4, 16])))
      n_max = baseline_n * int(rng.choice([1, 2, 4]))
      budget = size * baseline_n
      num_active = int(rng.integers(-(-budget // n_max), size + 1))
      if num_active * n_min == budget:
        continue  # the degenerate budget has no waterline (docs/method.md#the-waterline)
      active = np.zeros(size, bool)
      active[rng.permutation(size)[:num_active]] = True
      args = (lam_of(log_p, jnp.asarray(n_min)), jnp.asarray(active),
              jnp.asarray(budget), jnp.asarray(n_min), jnp.asarray(n_max))
      assert fast(*args) == literal(*args), (trial, size, n_min, baseline_n, n_max, num_active)
      checked += 1
      saturated += num_active * n_max == budget
  assert checked > 200 and saturated > 20


# Jitted once per length (at most 12): un-jitted, every example would trace a new lax.cond.
_first_smallest = jax.jit(ordering.first_smallest)
_all_among_first = jax.jit(ordering.all_among_first)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=12).flatmap(
    lambda keys: st.tuples(st.just(keys), st.lists(st.booleans(), min_size=len(keys),
                                                   max_size=len(keys)),
                           st.integers(0, len(keys)))))
def test_selection_is_a_stable_argsort_prefix(case):
  keys, members, count = case
  keys, members = jnp.asarray(keys, jnp.int32), np.asarray(members)
  first = np.zeros(len(keys), bool)
  first[np.argsort(np.asarray(keys), kind="stable")[:count]] = True
  chosen = _first_smallest(keys, jax.lax.sort(keys), jnp.asarray(count))
  np.testing.assert_array_equal(chosen, first)
  assert bool(_all_among_first(keys, jnp.asarray(members), jnp.asarray(count))) == (
      bool(np.all(first[members])))


def test_traced_once_for_one_shape():
  traced = jax.jit(chex.assert_max_traces(
      lambda lp, n0, lo, hi, t: allocate(lp, baseline_n=n0, n_min=lo, n_max=hi, threshold=t),
      n=1))
  rng = np.random.default_rng(0)
  for n0 in (2, 4, 8):
    traced(jnp.log(jnp.asarray(rng.uniform(0.01, 1, 12), jnp.float32)), n0, 1, 4 * n0, 0.05)
  before = allocation._allocate_jit._cache_size()
  for n0 in (2, 4, 8):
    allocate(jnp.log(jnp.asarray(rng.uniform(0.01, 1, 13), jnp.float32)), baseline_n=n0,
             n_min=2, n_max=2 * n0)
  assert allocation._allocate_jit._cache_size() == before + 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", allocation.MODES)
def test_vmap_equals_single_calls(mode):
  rng = np.random.default_rng(1)
  log_p = jnp.log(jnp.asarray(rng.beta(0.3, 1.5, (8, 24)) + 1e-6, jnp.float32))
  batched = jax.vmap(lambda lp: allocate(lp, baseline_n=8, n_min=2, n_max=32, mode=mode))(log_p)
  for i in range(8):
    single = allocate(log_p[i], baseline_n=8, n_min=2, n_max=32, mode=mode)
    row = jax.tree.map(lambda x, i=i: x[i], batched)
    chex.assert_trees_all_close(row, single, rtol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(log_p=[-1.0, float("nan")]), "log_p.*NaN"),
    (dict(log_p=[-1.0, 0.1]), "log_p.*positive"),
    (dict(log_p=[-1.0, -float("inf")]), "log_p.*-inf"),
    (dict(log_p=[[-1.0]]), "log_p must have rank 1"),
    (dict(log_p=jnp.zeros(0)), r"^log_p must hold at least one prompt; got shape \(0,\)\.$"),
    (dict(n_min=0), "n_min must be >= 1"),
    (dict(n_min=5), "n_min must be <= baseline_n"),
    (dict(n_max=3), "baseline_n must be <= n_max"),
    (dict(threshold=1.5), "threshold must lie in"),
    (dict(mode="greedy"), "mode must be one of"),
    (dict(force_active=[True]), "shape mismatch"),
    (dict(force_active=[2, 0]), "force_active must be boolean-like"),
])
def test_rejects_bad_input(kwargs, message):
  args = dict(log_p=[-1.0, -2.0], baseline_n=4, n_min=2, n_max=8) | kwargs
  log_p = args.pop("log_p")
  with pytest.raises(ValueError, match=message):
    allocate(jnp.asarray(log_p), **args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(baseline_n=4.5), "baseline_n must be an int"),
    (dict(threshold="0.1"), r"^threshold must be a number in \[0, 1\]; got '0.1'\.$"),
    # A string "False" is truthy: taken as True it would weight by rollout count.
    (dict(normalize_by_rollout_count="False"),
     r"^normalize_by_rollout_count must be True or False; got 'False' \(str\)\.$"),
    (dict(normalize_by_rho=1), r"^normalize_by_rho must be True or False; got 1 \(int\)\.$"),
])
def test_rejects_arguments_of_the_wrong_type(kwargs, message):
  with pytest.raises(TypeError, match=message):
    allocate(jnp.asarray([-1.0]), **dict(baseline_n=4, n_min=2, n_max=8) | kwargs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_log_p_is_allocated_in_float32(dtype):
  """bfloat16 logits (common on TPU) give bfloat16 log p: the same counts as its float32 value."""
  log_p = jnp.log(jnp.asarray([0.02, 0.1, 0.5, 0.9, 0.999, 0.3])).astype(dtype)
  for mode in allocation.MODES:
    low = allocate(log_p, baseline_n=8, n_min=2, n_max=32, mode=mode)
    high = allocate(log_p.astype(jnp.float32), baseline_n=8, n_min=2, n_max=32, mode=mode)
    np.testing.assert_array_equal(low.counts, high.counts)
    assert low.weights.dtype == jnp.float32
