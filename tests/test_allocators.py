"""Baseline allocators of sera_jax.method.allocators: Knapsack-RL, GVM-RAFT, adaptive sampling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from sera_jax.method import allocators


def _value(p, n):
  """Knapsack-RL's v(n, p) = (1 - p^n - (1 - p)^n) p (1 - p)^2, in float64 NumPy.

  1 - x^n is taken as -expm1(n log1p(x - 1)) for the larger of p and 1 - p, so
  that p = 1e-12 keeps its digits.
  """
  p, n = np.broadcast_arrays(np.asarray(p, np.float64), np.asarray(n, np.float64))
  q = 1 - p
  small = np.minimum(p, q)
  mixed = -np.expm1(n * np.log1p(-small)) - small**n
  return np.where(n > 1, np.maximum(mixed, 0.0), 0.0) * p * q**2  # exactly 0 at n <= 1


def _dp_optimum(p, budget, n_min, n_max):
  """max sum_q v(n_q, p_q) s.t. sum_q n_q = budget, n_min <= n_q <= n_max: a DP over prompts.

  best[b] is the best value of the prompts so far with b rollouts spent in all.
  """
  best = np.full(budget + 1, -np.inf)
  best[0] = 0.0
  counts = np.arange(n_min, min(n_max, budget) + 1)
  for p_q in p:
    new = np.full(budget + 1, -np.inf)
    for n, value in zip(counts, _value(p_q, counts), strict=True):
      new[n:] = np.maximum(new[n:], best[:budget + 1 - n] + value)
    best = new
  return best[budget]


def _random_p(rng, size):
  """p in [0, 1] with exact 0 and 1, ties, and values near the ends."""
  kind = rng.integers(4)
  if kind == 0:
    return rng.uniform(0, 1, size)
  if kind == 1:
    return rng.choice([0.0, 0.25, 1 / 3, 0.5, 1.0], size)  # ties and p in {0, 1}
  if kind == 2:
    return rng.choice([0.0, 1.0, 1e-12, 1 - 1e-9, 0.3], size)
  p = rng.uniform(0, 1, size)
  p[rng.integers(size)] = rng.choice([0.0, 1.0])
  return p


def _log(p):
  with np.errstate(divide="ignore"):
    return np.log(np.asarray(p, np.float64))


def _call(mode, log_p, baseline_n, n_min, n_max, key=None):
  if mode == "knapsack":
    return allocators.knapsack(log_p, baseline_n=baseline_n, n_min=n_min, n_max=n_max)
  if mode == "gvm":
    return allocators.gvm(log_p, None, baseline_n=baseline_n, n_min=n_min, n_max=n_max)
  key = jax.random.key(0) if key is None else key
  outcomes = allocators.bernoulli_outcomes(key, jnp.ravel(jnp.asarray(log_p, jnp.float32)), n_max)
  return allocators.adaptive(outcomes, log_p, baseline_n=baseline_n, n_min=n_min, n_max=n_max,
                             round_size=2)


def _check_invariants(a, log_p, baseline_n, n_min, n_max):
  counts = np.asarray(a.counts)
  assert a.counts.dtype == jnp.int32
  assert counts.sum() == len(log_p) * baseline_n
  assert np.all(counts >= n_min) and np.all(counts <= n_max)
  assert np.all(np.asarray(a.active))
  np.testing.assert_allclose(a.weights, baseline_n / counts, rtol=1e-6)
  # kappa and pass@n on p clamped to [tiny, 1 - ulp] of float32, in float64 NumPy.
  finfo = np.finfo(np.float32)
  p = np.exp(np.clip(np.asarray(log_p, np.float64), np.log(finfo.tiny), np.log1p(-finfo.epsneg)))
  fidelity = -np.expm1((counts - 1) * np.log1p(-p))
  np.testing.assert_allclose(a.fidelity, fidelity, rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(a.coverage, -np.expm1(counts * np.log1p(-p)), rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(a.target_fidelity, fidelity.min(), rtol=1e-5, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Knapsack-RL.


_log_gain = jax.jit(allocators._log_marginal_gain)
_knapsack_value = jax.jit(allocators.knapsack_value)


def test_knapsack_marginal_gains_are_the_non_increasing_differences_of_v():
  # The greedy is exact only because v(n + 1) - v(n) is non-increasing in n >= 1 for every p.
  p = np.concatenate([[0.0, 1.0], np.linspace(0.001, 0.999, 301), np.logspace(-12, -1, 23),
                      1 - np.logspace(-12, -1, 23)])
  n = np.arange(1, 200)
  gains = np.diff(_value(p[:, None], n[None, :]), axis=1)  # v(n + 1) - v(n), n = 1..198
  assert np.all(np.diff(gains, axis=1) <= 1e-16)
  with jax.enable_x64(True):
    log_p = jnp.asarray(_log(p))[:, None]
    log_gain = _log_gain(log_p, jnp.asarray(n[:-1], jnp.float64)[None, :])
    np.testing.assert_allclose(np.exp(np.asarray(log_gain)), gains, rtol=1e-9, atol=1e-16)
    np.testing.assert_allclose(_knapsack_value(log_p, jnp.asarray(n)[None, :]),
                               _value(p[:, None], n[None, :]), rtol=1e-9, atol=1e-16)
  # From n = 0 they are not (v(0) = v(1) = 0 < v(2)): n_min >= 1 matters.
  assert _value(0.5, 2) - _value(0.5, 1) > _value(0.5, 1) - 0.0


# (M, N0, n_min, n_max): few shapes, each compiled once and vmapped over a batch of problems.
KNAPSACK_CASES = [(1, 3, 1, 5), (3, 4, 2, 16), (5, 2, 2, 6), (6, 4, 1, 16),
                  (6, 1, 1, 3), (4, 2, 2, 2)]


@pytest.mark.parametrize("case", KNAPSACK_CASES, ids=str)
def test_knapsack_total_value_equals_the_dp_optimum(case):
  num_prompts, baseline_n, n_min, n_max = case
  rng = np.random.default_rng(sum(case))
  p = np.stack([_random_p(rng, num_prompts) for _ in range(16)])
  with jax.enable_x64(True):
    batched = jax.vmap(lambda lp: allocators.knapsack(lp, baseline_n=baseline_n, n_min=n_min,
                                                      n_max=n_max))(jnp.asarray(_log(p)))
  counts = np.asarray(batched.counts)
  budget = num_prompts * baseline_n
  for row, n in zip(p, counts, strict=True):
    assert n.sum() == budget and n.min() >= n_min and n.max() <= n_max
    optimum = _dp_optimum(row, budget, n_min, n_max)
    value = _value(row, n).sum()
    assert abs(value - optimum) <= 1e-9 * optimum, (row, n, value, optimum)
    zero_value = (row == 0) | (row == 1)
    if n_max * np.sum(~zero_value) >= budget - n_min * np.sum(zero_value):
      assert np.all(n[zero_value] == n_min)  # room elsewhere: p in {0, 1} keep n_min


def _knapsack_5(p):
  return allocators.knapsack(jnp.asarray(_log(p), jnp.float32), baseline_n=4, n_min=2, n_max=16)


def test_knapsack_float32_is_optimal_and_ties_go_round_robin_by_index():
  p = np.array([0.3, 0.0, 0.3, 1.0, 0.3])
  a = _knapsack_5(p)
  # Zero-value prompts keep n_min; equal p share 16 as 6 + 5 + 5, the extra one to index 0.
  np.testing.assert_array_equal(a.counts, [6, 2, 5, 2, 5])
  assert np.isclose(_value(p, a.counts).sum(), _dp_optimum(p, 20, 2, 16), rtol=1e-6)
  # Only p in {0, 1}: nothing has value; the budget goes round-robin, not to prompt 0 first.
  np.testing.assert_array_equal(_knapsack_5([0.0, 1.0, 0.0, 0.0, 1.0]).counts, [4] * 5)
  # The value factor p (1 - p)^2 peaks at p = 1/3: the hard and the easy prompt get less.
  counts = np.asarray(_knapsack_5([0.01, 1 / 3, 0.95, 0.6, 0.2]).counts)
  assert counts[1] == counts.max() and counts[0] == counts[2] == 2


# ---------------------------------------------------------------------------------------------
# GVM-RAFT.


def test_gvm_defaults_and_score_follow_the_reference():
  assert (allocators.GVM_ALPHA, allocators.GVM_BETA) == (1e-3, 2.0)
  rng = np.random.default_rng(3)
  p, g = rng.uniform(1e-4, 1, 32), rng.uniform(0.1, 5, 32)
  alpha, beta = 1e-3, 2.5
  want = g / np.sqrt(p + alpha / p ** (beta - 1))  # RLHFlow/GVM calc_sample_ratio
  with jax.enable_x64(True):
    got = np.exp(jax.jit(allocators.gvm_log_score)(jnp.asarray(np.log(p)), jnp.asarray(g),
                                                   alpha, beta))
  np.testing.assert_allclose(got, want, rtol=1e-12)


def _gvm_4(p, grad_norm):
  return allocators.gvm(jnp.asarray(_log(p), jnp.float32), jnp.asarray(grad_norm, jnp.float32),
                        baseline_n=4, n_min=2, n_max=8)


def test_gvm_is_proportional_and_rounds_by_largest_remainder():
  half = [0.5] * 4
  np.testing.assert_array_equal(_gvm_4(half, [1.0, 1, 3, 3]).counts, [2, 2, 6, 6])
  # Clipping honoured: prompt 3 is capped at 8, the rest share 8 / 3 each; the two
  # remaining rollouts go to the equal fractions in index order.
  clipped = _gvm_4(half, [1.0, 1, 1, 100])
  np.testing.assert_allclose(clipped.continuous, [8 / 3, 8 / 3, 8 / 3, 8], rtol=1e-6)
  np.testing.assert_array_equal(clipped.counts, [3, 3, 2, 8])
  # Harder prompts (smaller p) get more, as G / sqrt(p + alpha / p) says near p = 1.
  counts = np.asarray(_gvm_4([0.9, 0.6, 0.3, 0.1], [1.0] * 4).counts)
  assert np.all(np.diff(counts) >= 0) and counts[3] > counts[0]


def test_gvm_zero_scores_get_n_min_or_the_rest():
  p = [0.0, 0.3, 0.6, 0.9]
  a = _gvm_4(p, [1.0, 0.0, 1, 1])  # p = 0 and G = 0 have score 0
  np.testing.assert_array_equal(a.counts, [2, 2, 7, 5])  # 6.60 and 5.40, largest remainder
  np.testing.assert_array_equal(_gvm_4(p, [0.0] * 4).counts, [4, 4, 4, 4])  # no score: uniform
  # The only scored prompt is capped at 8: the rest (8) is split evenly, 8 / 3 each.
  capped = _gvm_4(p, [0.0, 0.0, 1.0, 0.0])
  np.testing.assert_allclose(capped.continuous, [8 / 3, 8 / 3, 8, 8 / 3], rtol=1e-6)
  np.testing.assert_array_equal(capped.counts, [3, 3, 8, 2])


def test_gvm_random_problems():
  rng = np.random.default_rng(5)
  baseline_n, n_min, n_max, num_prompts = 4, 2, 16, 12  # the shapes of the transforms test
  unclipped_seen = clipped_seen = 0
  for trial in range(16):
    p = (np.exp(rng.uniform(np.log(1e-4), 0, num_prompts)) if trial % 2
         else rng.uniform(0.01, 1, num_prompts))
    g = rng.uniform(0.1, 10, num_prompts)
    log_p = np.log(p).astype(np.float32)
    a = allocators.gvm(jnp.asarray(log_p), jnp.asarray(g, jnp.float32), baseline_n=baseline_n,
                       n_min=n_min, n_max=n_max)
    _check_invariants(a, log_p, baseline_n, n_min, n_max)
    continuous, counts = np.asarray(a.continuous, np.float64), np.asarray(a.counts)
    np.testing.assert_allclose(continuous.sum(), num_prompts * baseline_n, rtol=1e-5)
    assert np.all(np.abs(counts - continuous) < 1)
    score = g / np.sqrt(p + 1e-3 / p)
    free = (continuous > n_min + 1e-4) & (continuous < n_max - 1e-4)
    if free.sum() >= 2:
      ratio = continuous[free] / score[free]
      np.testing.assert_allclose(ratio, ratio.mean(), rtol=1e-4)
      # A clipped prompt's unclipped share lies beyond its bound.
      assert np.all(score[continuous >= n_max - 1e-4] * ratio.mean() >= n_max * (1 - 1e-4))
      assert np.all(score[continuous <= n_min + 1e-4] * ratio.mean() <= n_min * (1 + 1e-4))
      unclipped_seen += 1
    clipped_seen += np.any(~free)
  assert unclipped_seen >= 8 and clipped_seen >= 4


# ---------------------------------------------------------------------------------------------
# Adaptive sampling.


def test_adaptive_stops_mixed_groups():
  # p = 0 and p = 1 never mix; p = 0.5 with round_size 2 mixes after round 1 with prob 1/2.
  log_p = jnp.asarray(_log([0.0] * 4 + [1.0] * 4 + [0.5] * 56), jnp.float32)
  rounds_of = jax.jit(allocators._adaptive_rounds, static_argnums=(1, 2, 3, 4))
  outcomes = allocators.bernoulli_outcomes(jax.random.key(1), log_p, 32)
  counts, successes, rounds = map(np.asarray, rounds_of(outcomes, 8 * 64, 2, 32, 2))
  mixed = (successes > 0) & (successes < counts)
  assert np.mean((mixed & (counts <= 4))[8:]) >= 0.7  # expected 1/2 + 1/2 * 3/4
  assert np.all(counts[mixed] <= counts[~mixed].min())  # a mixed group stops
  np.testing.assert_array_equal(successes[:8], [0] * 4 + [32] * 4)
  np.testing.assert_array_equal(counts[:8], 32)  # never mixed: sampled up to n_max
  assert np.all(counts % 2 == 0) and int(rounds) == 16


def test_adaptive_spreads_the_leftover_round_robin_lowest_p_first():
  spread = jax.jit(allocators._spread_leftover, static_argnums=(3, 4))
  log_p = jnp.log(jnp.asarray([0.9, 0.1, 0.5, 0.3]))
  # Top-up of prompt 3 to n_min = 2, one pass over the prompts with room (sum 18), then
  # the last 2 to the lowest p with room left: prompts 3 (0.3) and 2 (0.5).
  np.testing.assert_array_equal(spread(jnp.asarray([2, 8, 3, 1]), log_p, 20, 2, 8),
                                [3, 8, 5, 4])
  np.testing.assert_array_equal(spread(jnp.zeros(4, jnp.int32), log_p, 11, 2, 8), [2, 3, 3, 3])


def test_adaptive_is_reproducible_and_spends_the_budget():
  rng = np.random.default_rng(9)
  log_p = jnp.asarray(np.log(rng.uniform(0.01, 1, 12)), jnp.float32)
  draws = [allocators.adaptive(allocators.bernoulli_outcomes(jax.random.key(k % 6), log_p, 16),
                               log_p, baseline_n=4, n_min=2, n_max=16, round_size=2)
           for k in range(7)]
  np.testing.assert_array_equal(draws[0].counts, draws[6].counts)  # the same key
  assert len({np.asarray(a.counts).tobytes() for a in draws}) > 1  # outcomes are random
  for a in draws:
    _check_invariants(a, np.asarray(log_p), 4, 2, 16)


# ---------------------------------------------------------------------------------------------
# All three: exact budget, bounds, weights; jit and vmap with static shapes.


class AllocatorsUnderTransformsTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*allocators.MODES)
  def test_budget_bounds_jit_and_vmap(self, mode):
    baseline_n, n_min, n_max, num_prompts = 4, 2, 16, 12
    traces = []

    @self.variant
    def allocate(log_p, key):
      traces.append(None)
      return _call(mode, log_p, baseline_n, n_min, n_max, key)

    rng = np.random.default_rng(11)
    p = np.stack([_random_p(rng, num_prompts) for _ in range(4)])
    log_p = jnp.asarray(_log(p), jnp.float32)
    keys = jax.random.split(jax.random.key(4), 4)
    singles = [allocate(row, key) for row, key in zip(log_p, keys, strict=True)]
    batched = jax.vmap(allocate)(log_p, keys)
    for i, single in enumerate(singles):
      _check_invariants(single, np.asarray(log_p[i]), baseline_n, n_min, n_max)
      chex.assert_trees_all_close(jax.tree.map(lambda x, i=i: x[i], batched), single, rtol=1e-6)
    if len(traces) < len(singles) + 1:  # un-jitted: traced on every call
      assert len(traces) == 1  # jitted: one trace for every row and for vmap (static shapes)


@pytest.mark.parametrize("mode", allocators.MODES)
@pytest.mark.parametrize("kwargs,message", [
    (dict(n_min=0), "n_min must be >= 1"),
    (dict(n_min=5), "n_min must be <= baseline_n"),
    (dict(n_max=3), "baseline_n must be <= n_max"),
    (dict(log_p=[-1.0, float("nan")]), "log_p.*NaN"),
    (dict(log_p=[-1.0, 0.5]), "log_p.*positive"),
    (dict(log_p=[[-1.0, -2.0]]), "log_p must have rank 1"),
])
def test_rejects_bad_input(mode, kwargs, message):
  args = dict(log_p=[-1.0, -2.0], baseline_n=4, n_min=2, n_max=8) | kwargs
  log_p = jnp.asarray(args.pop("log_p"))
  with pytest.raises(ValueError, match=message):
    _call(mode, log_p, args["baseline_n"], args["n_min"], args["n_max"])


def test_rejects_bad_gvm_and_adaptive_arguments():
  log_p = jnp.log(jnp.asarray([0.2, 0.5]))
  bounds = dict(baseline_n=4, n_min=2, n_max=8)
  with pytest.raises(ValueError, match="grad_norm must hold finite values >= 0"):
    allocators.gvm(log_p, jnp.asarray([1.0, -1.0]), **bounds)
  with pytest.raises(ValueError, match="shape mismatch"):
    allocators.gvm(log_p, jnp.ones(3), **bounds)
  with pytest.raises(ValueError, match="alpha must be >= 0"):
    allocators.gvm(log_p, None, alpha=-1.0, **bounds)
  outcomes = jnp.ones((2, 8), bool)
  with pytest.raises(ValueError, match="round_size must be >= 1"):
    allocators.adaptive(outcomes, log_p, round_size=0, **bounds)
  with pytest.raises(ValueError, match=r"outcomes must be \[M = 2, >= n_max = 8\]"):
    allocators.adaptive(outcomes[:, :7], log_p, round_size=2, **bounds)
  with pytest.raises(TypeError, match="n_max must be an int"):
    allocators.knapsack(log_p, baseline_n=4, n_min=2, n_max=8.0)
