"""The baseline allocators in the controlled setting (sera_jax.settings.classification.allocations):
their inputs, the training step with each mode, and adaptive sampling's Monte Carlo expectation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sera_jax.harness.configs.base import classification as base_config
from sera_jax.method import allocators, registry
from sera_jax.settings.classification import alignment, allocations, gradients
from sera_jax.settings.classification.task import ClassificationTask


def _logits(num_prompts=12, num_classes=7, seed=0):
  key_logits, key_labels = jax.random.split(jax.random.PRNGKey(seed))
  logits = 3 * jax.random.normal(key_logits, (num_prompts, num_classes))
  return logits, jax.random.randint(key_labels, (num_prompts,), 0, num_classes)


def test_gvm_reads_the_norm_of_each_prompts_log_likelihood_gradient():
  logits, labels = _logits()
  want = [jnp.linalg.norm(jax.grad(lambda z, y=y: jax.nn.log_softmax(z)[y])(row))
          for row, y in zip(logits, labels, strict=True)]
  np.testing.assert_allclose(allocations.log_p_grad_norm(logits, labels), want, rtol=1e-5)
  config = registry.AllocationConfig(mode="gvm", baseline_n=4, n_min=2, n_max=16)
  batch = allocations.inputs(config, logits, labels, jax.random.PRNGKey(0))
  got = registry.allocate_with(config, batch)
  np.testing.assert_array_equal(
      got.counts, allocators.gvm(batch.log_p, jnp.asarray(want), baseline_n=4, n_min=2,
                                 n_max=16).counts)


@pytest.mark.slow
def test_adaptive_counts_are_decided_by_the_rollouts_the_gradient_samples():
  """The outcomes adaptive reads are the successes of the gradient's own rollouts: every
  group it stopped early is mixed, and the slots match sample_rollouts with the same key."""
  logits, labels = _logits(num_prompts=32)
  key = jax.random.PRNGKey(5)
  config = registry.AllocationConfig(mode="adaptive", baseline_n=4, n_min=2, n_max=16)
  batch = allocations.inputs(config, logits, labels, key)
  alloc = registry.allocate_with(config, batch)
  assert int(alloc.counts.sum()) == 32 * 4
  rollouts = gradients.sample_rollouts(key, logits, labels, alloc.counts, max_rollouts=16)
  np.testing.assert_array_equal(rollouts.rewards > 0, batch.outcomes & rollouts.mask)
  successes = np.asarray(rollouts.rewards.sum(axis=1))
  counts = np.asarray(alloc.counts)
  mixed = (successes > 0) & (successes < counts)
  assert mixed.any() and not mixed.all()
  # A group the rounds stopped below the others' counts stopped because it was mixed
  # (the left-over pass only adds to the hardest prompts).
  stopped_early = counts < np.median(counts)
  assert np.all(mixed[stopped_early])


def test_unknown_mode_is_rejected():
  with pytest.raises(ValueError, match="mode must be one of"):
    allocations.allocation_config(base_config(), "greedy")


@pytest.mark.slow
def test_the_monte_carlo_expectation_equals_the_closed_form_of_a_fixed_allocation(digits_problem):
  """SERA's allocation marked outcome-dependent: its Monte Carlo expected gradient agrees with
  the closed form, the check of the machinery adaptive sampling's expectation rests on."""
  task, state, batch = digits_problem
  bounds = dict(baseline_n=4, n_min=2, n_max=16)
  sera = alignment.oracle_method(mode="sera", **bounds)
  methods = {"closed": sera, "monte_carlo": sera._replace(outcome_dependent=True),
             "adaptive": alignment.oracle_method(mode="adaptive", **bounds)}
  assert methods["adaptive"].outcome_dependent
  results = jax.device_get(alignment.make_evaluator(task, methods)(
      state, batch.images, batch.labels, alignment.seed_keys(0, 4)))
  closed, monte_carlo = results["closed"].expected[0], results["monte_carlo"].expected[0]
  assert abs(monte_carlo - closed) < 0.02, (monte_carlo, closed)
  assert closed < monte_carlo + 0.02 and 0 < results["adaptive"].expected[0] <= 1
  np.testing.assert_array_equal(results["monte_carlo"].realized, results["closed"].realized)


@pytest.mark.slow
@pytest.mark.parametrize("mode", allocators.MODES)
def test_a_run_trains_with_each_baseline_allocator(mode):
  config = base_config()
  config.update(method=mode, batch_size=16, num_steps=3)
  task = ClassificationTask(config)
  state = task.init_state(jax.random.PRNGKey(0))
  for step in range(2):
    state, metrics = task.train_step(state, step)
  metrics = jax.device_get(metrics)
  assert all(np.isfinite(value) for value in metrics.values()), metrics
  assert metrics["rollouts/max"] <= config.n_max and metrics["rollouts/min"] >= config.n_min
