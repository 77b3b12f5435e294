"""Classification as RL: logit-space gradients against autodiff and in expectation.

See docs/method.md#classification-as-rl.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from sera_jax import allocate
from sera_jax.method import estimators
from sera_jax.method.success import oracle_log_p
from sera_jax.settings.classification import gradients
from sera_jax.testing import monte_carlo_bias

M, C, N0 = 6, 5, 4


def _problem(seed=0):
  key = jax.random.key(seed)
  logits = 1.5 * jax.random.normal(key, (M, C))
  labels = jnp.arange(M) % C
  alloc = allocate(oracle_log_p(logits, labels), baseline_n=N0, n_min=2, n_max=4 * N0,
                   mode="equalized")
  return logits, labels, alloc


@pytest.mark.slow
class GradientTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("maxrl", "maxrl_plain", "grpo", "rloo", "reinforce")
  def test_logit_grad_equals_autodiff_of_the_surrogate_loss(self, estimator):
    logits, labels, alloc = _problem()
    width = 4 * N0

    @self.variant
    def both(key, logits):
      rollouts = gradients.sample_rollouts(key, logits, labels, alloc.counts,
                                                max_rollouts=width)
      adv = estimators.advantages(rollouts.rewards, rollouts.mask, estimator=estimator)

      def loss(lg):
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(lg), rollouts.actions, axis=1)
        return estimators.policy_loss(log_probs, adv, rollouts.mask, alloc.weights, N0)

      ours = gradients.rollout_logit_grad(logits, rollouts, adv, alloc.weights,
                                               baseline_n=N0)
      return ours, -jax.grad(loss)(logits)

    ours, autodiff = both(jax.random.key(3), logits)
    assert float(jnp.abs(ours).max()) > 0
    np.testing.assert_allclose(ours, autodiff, rtol=1e-5, atol=1e-5 * float(jnp.abs(ours).max()))

  @chex.variants(with_jit=True, without_jit=True)
  def test_exact_grad_is_the_gradient_of_the_mean_log_likelihood(self):
    logits, labels, _ = _problem(1)
    exact = self.variant(gradients.exact_logit_grad)(logits, labels)
    autodiff = jax.grad(lambda lg: jnp.mean(oracle_log_p(lg, labels)))(logits)
    np.testing.assert_allclose(exact, autodiff, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", [
    "maxrl", "grpo", estimators.estimator_spec("pkpo", k=4),
    estimators.estimator_spec("maclaurin", order=8)], ids=str)
@pytest.mark.parametrize("mode", ["sera", "uniform"])
def test_monte_carlo_mean_matches_expected_logit_grad(estimator, mode):
  logits, labels, _ = _problem(2)
  alloc = allocate(oracle_log_p(logits, labels), baseline_n=N0, n_min=2, n_max=4 * N0, mode=mode)
  draws = 10_000
  keys = jax.random.split(jax.random.key(7), draws)
  sample = jax.jit(jax.vmap(lambda k: gradients.estimate_logit_grad(
      k, logits, labels, alloc, baseline_n=N0, estimator=estimator, max_rollouts=4 * N0)))
  grads = np.asarray(sample(keys), np.float64)
  expected = gradients.expected_logit_grad(logits, labels, alloc, baseline_n=N0,
                                                estimator=estimator)
  # Every logit its own direction, and the expected gradient's (most sensitive to a wrong
  # scale c); a false alarm at most 1e-3 a case (8e-3 over the eight).
  directions = np.vstack([np.ravel(expected), np.eye(M * C)])
  report = monte_carlo_bias(grads, expected, directions=directions, false_alarm=1e-3)
  assert report.consistent, report


@pytest.mark.slow
def test_success_is_exact_in_law_for_tiny_p():
  """P(K >= 1) for p = 1e-6 and n = 512 matches 1 - (1 - p)^512 within 4 standard errors."""
  n, groups, chunk = 512, 100_000, 10_000
  log_p = np.log(1e-6)
  # Two classes: logits [0, log p - log(1 - p)] give softmax[1] = p exactly.
  logits = jnp.tile(jnp.asarray([[0.0, log_p - np.log1p(-1e-6)]], jnp.float32), (chunk, 1))
  labels = jnp.ones(chunk, jnp.int32)
  counts = jnp.full(chunk, n, jnp.int32)

  @jax.jit
  def hits(key):
    rollouts = gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=n)
    return jnp.sum(jnp.any(rollouts.rewards > 0, axis=1))

  total = sum(int(hits(k)) for k in jax.random.split(jax.random.key(0), groups // chunk))
  expected = -np.expm1(n * np.log1p(-1e-6))
  stderr = np.sqrt(expected * (1 - expected) / groups)
  assert abs(total / groups - expected) < 4 * stderr, (total / groups, expected)


@pytest.mark.slow
def test_failed_labels_follow_pi_on_the_wrong_classes():
  logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, 3.0]])
  labels = jnp.asarray([4])
  draws = 4096
  rollouts = gradients.sample_rollouts(jax.random.key(1), logits, labels,
                                            jnp.asarray([draws]), max_rollouts=draws)
  failed = np.asarray(rollouts.actions[0])[np.asarray(rollouts.rewards[0]) == 0]
  assert 4 not in failed
  pi = np.asarray(jax.nn.softmax(logits[0]))[:4]
  frequencies = np.bincount(failed, minlength=5)[:4] / len(failed)
  stderr = np.sqrt(pi / pi.sum() * (1 - pi / pi.sum()) / len(failed))
  assert np.all(np.abs(frequencies - pi / pi.sum()) < 4 * stderr)


def test_log_uniform_has_the_uniform_law_including_the_far_tail():
  log_u = np.asarray(gradients.log_uniform(jax.random.key(0), (4_000_000,)), np.float64)
  assert abs(log_u.mean() + 1) < 4 / np.sqrt(len(log_u))  # E[log U] = -1, Var = 1
  for level in (0.5, 1e-3, 1e-5):
    rate = np.mean(log_u < np.log(level))
    assert abs(rate - level) < 4 * np.sqrt(level * (1 - level) / len(log_u)), (level, rate)
  assert log_u.max() < 0


def test_leading_zeros_runs_across_words():
  words = jnp.asarray([[1 << 31, 0, 0], [0, 1, 5], [0, 0, 1 << 4], [0, 0, 0]], jnp.uint32)
  np.testing.assert_array_equal(gradients._leading_zeros(words), [0, 63, 91, 96])


def test_log_uniform_after_an_all_zero_first_word_continues_the_uniform_law():
  # Probability 2^-32 per draw, so forced here: then U 2^32 is again Uniform(0, 1),
  # its leading zeros coming from the three tail words.
  draws = 400_000
  leading = jnp.zeros(draws, jnp.uint32)
  mantissa = jax.random.bits(jax.random.key(1), (draws,), jnp.uint32)
  draw_tail = lambda key: jax.random.bits(key, (draws, 3), jnp.uint32)  # noqa: E731
  log_u = np.asarray(gradients._log_uniform_from_bits(
      leading, mantissa, draw_tail, jax.random.key(2), jnp.float32), np.float64)
  rescaled = log_u + 32 * np.log(2.0)
  assert rescaled.max() < 0
  assert abs(rescaled.mean() + 1) < 4 / np.sqrt(draws)
  for level in (0.5, 1e-3):
    rate = np.mean(rescaled < np.log(level))
    assert abs(rate - level) < 4 * np.sqrt(level * (1 - level) / draws), (level, rate)


def test_no_rollout_by_class_tensor_is_built():
  """Nothing of shape [M, n_max, C] appears in the traced computation."""
  num_prompts, num_classes, width = 8, 11, 16
  logits = jnp.zeros((num_prompts, num_classes))
  labels = jnp.zeros(num_prompts, jnp.int32)
  alloc = allocate(oracle_log_p(logits, labels), baseline_n=4, n_min=2, n_max=width)
  jaxpr = jax.make_jaxpr(lambda k, lg: gradients.estimate_logit_grad(
      k, lg, labels, alloc, baseline_n=4, max_rollouts=width))(jax.random.key(0), logits)
  forbidden = (num_prompts, width, num_classes)

  def shapes(jaxpr):
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        yield tuple(getattr(var.aval, "shape", ()))
      for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
          inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
          if hasattr(inner, "eqns"):
            yield from shapes(inner)

  seen = list(shapes(jaxpr.jaxpr))
  assert (num_prompts, width) in seen  # the padded rollouts are there...
  assert not [s for s in seen if s[-3:] == forbidden or s == forbidden[1:]]  # ...one-hots not


@pytest.mark.slow
@pytest.mark.parametrize("num_grads", [2, 5, 6, 7, 20])
def test_gram_matrix_is_the_float64_gram_of_the_flattened_gradients(num_grads):
  """Both paths (pairwise reductions of large leaves for k <= 6, products otherwise) agree.

  The large kernel comes out of a vmapped VJP, in the layout the training step sees.
  """
  keys = jax.random.split(jax.random.key(num_grads), 4)
  inputs = jax.random.normal(keys[0], (32, 300))
  params = {"kernel": jax.random.normal(keys[1], (300, 260)) / 20,  # 78,000 >= 2^16
            "bias": jax.random.normal(keys[2], (260,))}
  forward = lambda p: jnp.tanh(inputs @ p["kernel"] + p["bias"])  # noqa: E731
  _, vjp_fn = jax.vjp(forward, params)
  (grads,) = jax.vmap(vjp_fn)(jax.random.normal(keys[3], (num_grads, 32, 260)))
  gram = jax.jit(gradients.gram_matrix)(grads)
  flat = np.concatenate([np.asarray(leaf, np.float64).reshape(num_grads, -1)
                         for leaf in jax.tree.leaves(grads)], axis=1)
  want = flat @ flat.T
  scale = np.sqrt(np.outer(np.diag(want), np.diag(want)))  # errors relative to |g_i| |g_j|
  np.testing.assert_allclose(gram / scale, want / scale, atol=1e-6)
  np.testing.assert_array_equal(gram, np.asarray(gram).T)


def test_bad_input():
  logits, labels, alloc = _problem()
  with pytest.raises(ValueError, match="logits must have rank 2"):
    gradients.exact_logit_grad(logits[0], labels)
  with pytest.raises(ValueError, match="one entry per row"):
    gradients.expected_logit_grad(logits, labels[:2], alloc, baseline_n=N0)
  with pytest.raises(ValueError, match="estimator must be one of"):
    gradients.estimate_logit_grad(jax.random.key(0), logits, labels, alloc, baseline_n=N0,
                                       estimator="ppo")


@pytest.mark.slow
def test_a_width_below_a_concrete_count_raises_instead_of_truncating():
  """counts [8 4 6 2 2 0 6 4] at max_rollouts = 4 would drop rollouts of three groups."""
  counts = jnp.asarray([8, 4, 6, 2, 2, 0, 6, 4], jnp.int32)
  logits = jax.random.normal(jax.random.key(1), (8, 5))
  labels = jnp.arange(8, dtype=jnp.int32) % 5
  alloc = allocate(oracle_log_p(logits, labels), baseline_n=4, n_min=2, n_max=8)._replace(
      counts=counts)
  key = jax.random.key(0)
  for call in (
      lambda: gradients.estimate_logit_grad(key, logits, labels, alloc, baseline_n=4,
                                            max_rollouts=4),
      lambda: gradients.expected_logit_grad(logits, labels, alloc, baseline_n=4, max_rollouts=4),
      lambda: gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=4)):
    with pytest.raises(ValueError, match=r"max_rollouts = 4 is smaller than max\(counts\) = 8"):
      call()
  rollouts = gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=8)
  np.testing.assert_array_equal(rollouts.mask.sum(axis=1), counts)


def test_a_static_width_compiles_once_for_every_count_pattern():
  logits = jax.random.normal(jax.random.key(1), (6, 5))
  labels = jnp.arange(6, dtype=jnp.int32) % 5
  log_p = oracle_log_p(logits, labels)
  before = estimators._expected_scale._cache_size()
  for largest in (3, 5, 9, 16):
    counts = jnp.asarray([2, largest, 2, 3, 0, 4], jnp.int32)
    estimators.expected_scale("maxrl", log_p, counts, max_n=16)
  assert estimators._expected_scale._cache_size() == before + 1


@pytest.mark.slow
def test_a_slot_draws_the_same_whatever_the_width():
  """Rollout j of prompt q depends on (key, q, j) only: a wider padding draws a superset."""
  logits = jax.random.normal(jax.random.key(1), (6, 7))
  labels = jnp.arange(6, dtype=jnp.int32)
  counts = jnp.asarray([8, 3, 0, 8, 5, 1], jnp.int32)
  key = jax.random.key(4)
  narrow = gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=8)
  wide = gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=40)
  np.testing.assert_array_equal(wide.actions[:, :8], narrow.actions)
  np.testing.assert_array_equal(wide.rewards[:, :8], narrow.rewards)
  with jax.threefry_partitionable(False):  # whatever the global setting
    legacy = gradients.sample_rollouts(key, logits, labels, counts, max_rollouts=8)
  np.testing.assert_array_equal(legacy.actions, narrow.actions)
  # A prompt's draws do not depend on the other prompts either.
  alone = gradients.sample_rollouts(key, logits, labels, counts.at[1:].set(0), max_rollouts=8)
  np.testing.assert_array_equal(alone.actions[0], narrow.actions[0])


@pytest.mark.parametrize("platform,slices", [("cpu", True), ("cuda", False), ("tpu", False)])
def test_a_vmap_over_many_rollout_slots_samples_one_slice_after_another_on_the_cpu(
    platform, slices):
  """Above 2^18 rollout slots in all a vmap of the sampling loops over its slices on the CPU
  (and not at 2^18 or below, nor on other platforms); every slice is its own sampling."""
  runs, num_prompts, num_classes = 3, 8, 5
  logits = 2.0 * jax.random.normal(jax.random.key(0), (runs, num_prompts, num_classes))
  labels = jnp.arange(num_prompts, dtype=jnp.int32) % num_classes
  allocations = [allocate(oracle_log_p(logits[r], labels), baseline_n=N0, n_min=2,
                          n_max=4 * N0) for r in range(runs)]
  alloc = jax.tree.map(lambda *leaves: jnp.stack(leaves), *allocations)
  keys = jax.random.split(jax.random.key(1), runs)
  bound = gradients._SLICED_MIN_SLOTS // (runs * num_prompts)  # widths up to it vmap

  def mapped(sample, width):
    return jax.jit(jax.vmap(lambda key, logits, alloc: sample(
        key, logits, labels, alloc, baseline_n=N0, estimator="maxrl", max_rollouts=width)))

  def loops(sample, width):
    program = mapped(sample, width).trace(keys, logits, alloc).lower(
        lowering_platforms=(platform,)).as_text()
    return program.count("stablehlo.while")

  for width, many in ((bound, False), (bound + 1, True)):
    assert (loops(gradients.sample_and_score_in_slices, width)
            > loops(gradients.sample_and_score, width)) == (many and slices)
  if platform != "cpu":
    return
  together = mapped(gradients.sample_and_score_in_slices, bound + 1)(keys, logits, alloc)
  for r in range(runs):
    alone = gradients.sample_and_score(keys[r], logits[r], labels, allocations[r],
                                       baseline_n=N0, estimator="maxrl", max_rollouts=bound + 1)
    run = jax.tree.map(lambda x, r=r: x[r], together)
    jax.tree.map(np.testing.assert_array_equal, run[1], alone[1])  # the rollouts
    np.testing.assert_allclose(run[0], alone[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(run[2], alone[2], rtol=1e-6, atol=1e-7)
  assert int(jnp.sum(together[1].mask)) == int(sum(jnp.sum(a.counts) for a in allocations))
