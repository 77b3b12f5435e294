"""The alignment evaluator (sera_jax.settings.classification.alignment): one jitted call
over every seed and method equals a loop that recomputes each seed on its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sera_jax.settings.classification import alignment, gradients


@pytest.mark.slow
def test_vmapped_seeds_equal_a_loop_over_seeds(digits_problem):
  task, state, batch = digits_problem
  bounds = dict(baseline_n=4, n_min=2, n_max=16)
  methods = {"sera": alignment.oracle_method(mode="sera", **bounds),
             "pilot": alignment.pilot_method(2, **bounds)}
  keys = alignment.seed_keys(3, 5)
  vmapped = jax.device_get(
      alignment.make_evaluator(task, methods)(state, batch.images, batch.labels, keys))

  labels = jnp.asarray(batch.labels)

  def one_seed(method, key):
    """Cosines of one seed, without vmap: its own allocation, sampling and VJPs."""
    forward = lambda p: task.model.apply(p, state.batch_stats, batch.images, train=True)[0]  # noqa: E731
    logits, vjp_fn = jax.vjp(forward, state.params)
    flat = lambda cotangent: jnp.concatenate(  # noqa: E731
        [g.ravel() for g in jax.tree.leaves(vjp_fn(cotangent))])
    cosine = lambda a, b: a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))  # noqa: E731
    exact = flat(gradients.exact_logit_grad(logits, labels))
    allocation_key, sample_key = jax.random.split(key)
    alloc = method.allocate(allocation_key, logits, labels, {})
    realized = gradients.estimate_logit_grad(
        sample_key, logits, labels, alloc, baseline_n=method.baseline_n,
        max_rollouts=method.max_rollouts)
    expected = gradients.expected_logit_grad(
        logits, labels, alloc, baseline_n=method.baseline_n, max_rollouts=method.max_rollouts)
    return cosine(flat(realized), exact), cosine(flat(expected), exact)

  for name, method in methods.items():
    loop = jax.jit(functools.partial(one_seed, method))
    for seed, key in enumerate(keys):
      realized, expected = loop(key)
      np.testing.assert_allclose(vmapped[name].realized[seed], realized, atol=2e-5)
      np.testing.assert_allclose(vmapped[name].expected[seed], expected, atol=2e-5)
  # The oracle allocation does not depend on the seed, so neither does its expected gradient.
  assert np.ptp(vmapped["sera"].expected) == 0


@pytest.mark.slow
def test_a_methods_numbers_do_not_depend_on_the_methods_beside_it(digits_problem):
  """Common random numbers: uniform MaxRL computed alone or padded beside SERA (a wider
  width, one vmap over both) draws the same rollouts, so its cosines are the same."""
  task, state, batch = digits_problem
  bounds = dict(baseline_n=4, n_min=2, n_max=32)
  uniform = alignment.oracle_method(mode="uniform", **bounds)
  sera = alignment.oracle_method(mode="sera", **bounds)
  keys = alignment.seed_keys(0, 3)
  alone = alignment.make_evaluator(task, {"uniform": uniform})(
      state, batch.images, batch.labels, keys)
  beside = alignment.make_evaluator(task, {"uniform": uniform, "sera": sera})(
      state, batch.images, batch.labels, keys)
  np.testing.assert_allclose(alone["uniform"].realized, beside["uniform"].realized, atol=1e-5)
  np.testing.assert_allclose(alone["uniform"].expected, beside["uniform"].expected, atol=1e-5)
