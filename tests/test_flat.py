"""Flat rollout buffers equal the padded forms on the same rollouts.

See docs/method.md#llm-post-training.
"""

import functools

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

import sera_jax
from sera_jax.method import estimators, flat, success

NUM_PROMPTS, BUDGET = 5, 20  # one shape, so examples do not recompile


@st.composite
def ragged_batches(draw):
  """(counts [5] summing to B = 20, empty groups and a group of all 20 included, rewards [20])."""
  cuts = sorted(draw(st.lists(st.integers(0, BUDGET), min_size=NUM_PROMPTS - 1,
                              max_size=NUM_PROMPTS - 1)))
  counts = np.diff([0, *cuts, BUDGET]).astype(np.int32)
  rewards = draw(hnp.arrays(np.float32, BUDGET, elements=st.sampled_from([0.0, 1.0])))
  return counts, rewards


def _padded(counts, flat_values, width):
  """[M, width] view of a flat buffer and its mask."""
  out = np.zeros((len(counts), width), flat_values.dtype)
  mask = np.zeros((len(counts), width), bool)
  start = 0
  for q, n in enumerate(counts):
    out[q, :n], mask[q, :n] = flat_values[start:start + n], True
    start += n
  return out, mask


@settings(max_examples=40, deadline=None)
@given(batch=ragged_batches())
def test_flat_advantages_equal_the_padded_ones_for_every_estimator(batch):
  counts, rewards = batch
  segments = sera_jax.rollout_segments(counts, int(counts.sum()))
  np.testing.assert_array_equal(segments, np.repeat(np.arange(len(counts)), counts))
  padded_rewards, mask = _padded(counts, rewards, BUDGET)
  for estimator in sera_jax.ESTIMATORS:
    got = sera_jax.flat_advantages(rewards, segments, num_prompts=len(counts),
                                   estimator=estimator)
    want = np.asarray(sera_jax.advantages(padded_rewards, mask, estimator=estimator))[mask]
    # The same formula on the same n and K; XLA may divide by a denominator broadcast
    # over a padded group as a multiplication by its reciprocal: 1 ulp apart at most.
    np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=1e-7, err_msg=estimator)


@settings(max_examples=40, deadline=None)
@given(batch=ragged_batches(), seed=st.integers(0, 2**31 - 1))
def test_flat_loss_and_its_gradient_equal_the_padded_ones(batch, seed):
  counts, rewards = batch
  rng = np.random.default_rng(seed)
  budget, num_prompts = int(counts.sum()), len(counts)
  log_probs = -rng.exponential(size=budget).astype(np.float32)
  weights = rng.uniform(0, 2, num_prompts).astype(np.float32)
  segments = sera_jax.rollout_segments(counts, budget)
  adv = sera_jax.flat_advantages(rewards, segments, num_prompts=num_prompts)
  loss, grad = jax.value_and_grad(sera_jax.flat_policy_loss)(log_probs, adv, segments, weights,
                                                             baseline_n=4)
  padded_log_probs, mask = _padded(counts, log_probs, BUDGET)
  padded_adv, _ = _padded(counts, np.asarray(adv), BUDGET)
  want, want_grad = jax.value_and_grad(sera_jax.policy_loss)(padded_log_probs, padded_adv, mask,
                                                            weights, 4)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, np.asarray(want_grad)[mask], rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(
      -grad, sera_jax.rollout_weights(weights, segments, baseline_n=4) * adv, rtol=1e-6)


class FlatUnderTransformsTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*estimators.ESTIMATORS)
  def test_counts_change_without_retracing_and_match_padded(self, estimator):
    """One static budget, several allocations: jitted, and vmapped over a batch of buffers."""
    budget, num_prompts = 12, 4
    all_counts = np.array([[3, 3, 3, 3], [0, 7, 1, 4], [12, 0, 0, 0], [2, 2, 0, 8]], np.int32)
    rewards = (np.random.default_rng(0).uniform(size=(4, budget)) < 0.4).astype(np.float32)
    traces = []

    @self.variant
    def advantages_of(counts, rewards):
      traces.append(None)
      segments = flat._segments(counts, budget=budget)
      return flat._flat_advantages(rewards, segments, num_prompts=num_prompts,
                                   estimator=estimator, eps=1e-6)

    for counts, row in zip(all_counts, rewards, strict=True):
      got = advantages_of(jnp.asarray(counts), jnp.asarray(row))
      padded, mask = _padded(counts, row, budget)
      want = np.asarray(sera_jax.advantages(padded, mask, estimator=estimator))[mask]
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    batched = jax.vmap(functools.partial(advantages_of))(jnp.asarray(all_counts),
                                                         jnp.asarray(rewards))
    for counts, row, got in zip(all_counts, rewards, batched, strict=True):
      padded, mask = _padded(counts, row, budget)
      want = np.asarray(sera_jax.advantages(padded, mask, estimator=estimator))[mask]
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if len(traces) > 2:  # jitted: one trace for the loop, one for vmap
      assert len(traces) == len(all_counts) + 1  # un-jitted: traced on every call


@pytest.mark.parametrize(("call", "match"), [
    (lambda: sera_jax.rollout_segments(np.array([2, 3]), 6), r"sum to the budget 6; got sum 5"),
    (lambda: sera_jax.rollout_segments(np.array([2.0, 3.0]), 5), r"counts must be an integer"),
    (lambda: sera_jax.rollout_segments(np.array([[5]]), 5), r"counts must have rank 1"),
    (lambda: sera_jax.flat_advantages([1.0, 0.5], [0, 0], num_prompts=1), r"rewards must be bin"),
    (lambda: sera_jax.flat_advantages([1.0, 0.0], [0, 2], num_prompts=2),
     r"segment_ids must lie in \[0, 2\); found 2"),
    (lambda: sera_jax.flat_advantages([1.0, 0.0], [0, 0, 0], num_prompts=1),
     r"shape mismatch: segment_ids \(3,\), rewards \(2,\)"),
    (lambda: sera_jax.flat_advantages([1.0], [0], num_prompts=1, estimator="ppo"),
     r"estimator must be one of"),
    (lambda: sera_jax.rollout_weights(np.ones(2), [0, 1], baseline_n=0), r"baseline_n must be"),
])
def test_bad_buffers_are_rejected_with_a_clear_message(call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    call()


@pytest.mark.parametrize("estimator", ["reinforce", "maxrl"])
def test_padding_slots_of_a_buffer_built_under_jit_take_no_part(estimator):
  """Under jit `rollout_segments` gives the slots past sum(counts) the id M: their advantage and
  weight are 0 and the other slots' are the buffer's without them (a gather would have read
  them as the last prompt's)."""
  counts, weights = jnp.array([1, 2]), jnp.array([1.0, 2.0])
  rewards = jnp.array([1.0, 0.0, 1.0, 1.0])

  @jax.jit
  def loss_parts(counts, rewards, log_probs):
    segments = sera_jax.rollout_segments(counts, 4)
    advantages = sera_jax.flat_advantages(rewards, segments, num_prompts=2, estimator=estimator)
    per_rollout = sera_jax.rollout_weights(weights, segments, baseline_n=2)
    gradient = jax.grad(sera_jax.flat_policy_loss)(log_probs, advantages, segments, weights,
                                                   baseline_n=2)
    return segments, advantages, per_rollout, gradient

  segments, advantages, per_rollout, gradient = loss_parts(counts, rewards, jnp.zeros(4))
  np.testing.assert_array_equal(segments, [0, 1, 1, 2])
  assert advantages[3] == per_rollout[3] == gradient[3] == 0
  whole = sera_jax.flat_advantages(rewards[:3], jnp.array([0, 1, 1]), num_prompts=2,
                                   estimator=estimator)
  np.testing.assert_array_equal(advantages[:3], whole)
  np.testing.assert_allclose(per_rollout[:3], np.array([1.0, 2.0, 2.0]) / 4)


def test_flat_staging_equals_padded_staging():
  counts = np.array([3, 0, 2, 4], np.int32)
  rewards = np.array([1, 0, 1, 0, 0, 1, 1, 0, 1], np.float32)
  ids = np.array([5, 2, 5, 0], np.int32)  # a repeated prompt accumulates
  state = sera_jax.historical_init(6)
  segments = sera_jax.rollout_segments(counts, 9)
  np.testing.assert_array_equal(segments, [0, 0, 0, 2, 2, 3, 3, 3, 3])
  padded, mask = _padded(counts, rewards, 4)
  got = success.historical_stage_flat(state, ids, rewards, segments)
  want = sera_jax.historical_stage(state, ids, padded, mask)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(got.staged_successes, [3, 0, 0, 0, 0, 2 + 0])
  with pytest.raises(ValueError, match=r"segment_ids must lie in \[0, 4\)"):
    success.historical_stage_flat(state, ids, rewards, segments + 1)
