"""Flat rollout buffers: a step's B rollouts in one buffer with segment ids.

See docs/method.md#llm-post-training.

An LLM rollout is a sequence, so padding every group to n_max would cost
n_max / N0 times the compute. Here the B = M * N0 rollouts of a step fill one
buffer: prompt q owns counts[q] consecutive slots and `segment_ids[i]` is the
prompt of slot i. Shapes depend on B only, so changing counts never retraces.
Per prompt n_q and K_q are segment sums, and every rollout's advantage is the
same `estimators.rollout_advantage(r, n, K)` the padded form uses, so flat and
padded agree exactly.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.method import estimators, validation


def rollout_segments(counts: jax.Array, budget: int) -> jax.Array:
  """The prompt of each slot of a flat buffer where prompt q owns counts[q] consecutive slots.

  Args:
    counts: int [M] rollouts of each prompt (e.g. `Allocation.counts`), summing to
      `budget` (checked when concrete; under jit slots past sum(counts) get id M, which
      the functions below treat as padding: advantage 0, weight 0).
    budget: B, the buffer length (static).

  Returns:
    int32 [B] segment ids, non-decreasing.
  """
  budget = validation.integer("budget", budget, minimum=0)
  counts = jnp.asarray(counts)
  validation.rank("counts", counts, 1)
  if not jnp.issubdtype(counts.dtype, jnp.integer):
    raise TypeError(f"counts must be an integer array; got dtype {counts.dtype}.")
  if validation.is_concrete(counts):
    values = np.asarray(counts)
    if (values < 0).any() or values.sum() != budget:
      raise ValueError(f"counts must be >= 0 and sum to the budget {budget}; got sum "
                       f"{values.sum()} (min {values.min(initial=0)}).")
  return _segments(counts, budget=budget)


@functools.partial(jax.jit, static_argnames="budget")
def _segments(counts, *, budget):
  ends = jnp.cumsum(counts)
  return jnp.searchsorted(ends, jnp.arange(budget), side="right").astype(jnp.int32)


def _check_buffer(segment_ids, num_prompts: int, **per_slot) -> None:
  num_prompts = validation.integer("num_prompts", num_prompts, minimum=1)
  validation.rank("segment_ids", segment_ids, 1)
  validation.indices("segment_ids", jnp.asarray(segment_ids), num_prompts)
  for name, array in per_slot.items():
    validation.rank(name, array, 1)
  validation.same_shape(("segment_ids", *per_slot), segment_ids, *per_slot.values())


def flat_advantages(rewards: jax.Array, segment_ids: jax.Array, *, num_prompts: int,
                    estimator: "str | Callable | estimators.Estimator" = "maxrl",
                    eps: float = 1e-6, **params) -> jax.Array:
  """Per-rollout advantages of a flat buffer.

  See docs/method.md#the-estimator-and-its-scale and docs/method.md#llm-post-training.

  For the rollouts i of prompt q: n_q = #{i : segment_ids[i] = q},
  K_q = sum of their rewards, and A_i = rollout_advantage(r_i, n_q, K_q): the
  values `sera_jax.advantages` gives the same rollouts padded to [M, N].

  Args:
    rewards: [B] rewards, each 0 or 1.
    segment_ids: int [B], the prompt of each rollout, in [0, num_prompts) (any order);
      under jit an id num_prompts marks a padding slot (`rollout_segments`), whose
      advantage is 0.
    num_prompts: M (static).
    estimator: as in `sera_jax.advantages`: a registered name, a function
      a(reward, group_size, successes), or an `Estimator`.
    eps: as in `sera_jax.advantages`.
    **params: the estimator's keyword parameters (static), as in `sera_jax.advantages`.

  Returns:
    [B] advantages in the floating dtype of `rewards` (float32 by default).
  """
  estimator = estimators.estimator_spec(estimator, **params)
  rewards = jnp.asarray(validation.binary("rewards", rewards))
  if not jnp.issubdtype(rewards.dtype, jnp.floating):
    rewards = rewards.astype(jnp.result_type(float))
  segment_ids = jnp.asarray(segment_ids)
  _check_buffer(segment_ids, num_prompts, rewards=rewards)
  return _flat_advantages(rewards, segment_ids, num_prompts=num_prompts, estimator=estimator,
                          eps=eps)


@functools.partial(jax.jit, static_argnames=("num_prompts", "estimator"))
def _flat_advantages(rewards, segment_ids, *, num_prompts, estimator, eps):
  group_size = jax.ops.segment_sum(jnp.ones_like(rewards), segment_ids, num_prompts)
  successes = jax.ops.segment_sum(rewards, segment_ids, num_prompts)
  advantages = estimators.rollout_advantage(estimator, rewards, group_size[segment_ids],
                                            successes[segment_ids], eps)
  # A gather clamps an out-of-range id to the last prompt: padding slots read as prompt M - 1.
  return jnp.where(segment_ids < num_prompts, advantages, 0)


def rollout_weights(weights: jax.Array, segment_ids: jax.Array, *, baseline_n: int
                    ) -> jax.Array:
  """Each rollout's weight w_q(i) / (M * N0) in the loss of docs/method.md#weights-and-the-loss.

  Args:
    weights: [M] prompt weights w_q (`Allocation.weights`).
    segment_ids: int [B], the prompt of each rollout (M: a padding slot, weight 0).
    baseline_n: N0.

  Returns:
    [B] weights in the dtype of `weights`: the loss is -sum_i weight_i A_i log pi_i.
  """
  baseline_n = validation.integer("baseline_n", baseline_n, minimum=1)
  weights, segment_ids = jnp.asarray(weights), jnp.asarray(segment_ids)
  validation.rank("weights", weights, 1)
  _check_buffer(segment_ids, weights.shape[0])
  num_prompts = weights.shape[0]
  return jnp.where(segment_ids < num_prompts, weights[segment_ids], 0) / (num_prompts * baseline_n)


def flat_policy_loss(log_probs: jax.Array, advantages: jax.Array, segment_ids: jax.Array,
                     weights: jax.Array, *, baseline_n: int) -> jax.Array:
  """The surrogate loss on a flat buffer (descent convention).

  The loss is that of docs/method.md#weights-and-the-loss.

      loss = -(1 / (M N0)) sum_i w_q(i) * stop_gradient(A_i) * log pi_i

  equal to `sera_jax.policy_loss` on the same rollouts padded to [M, N].

  Args:
    log_probs: [B] log pi of each rollout (differentiable).
    advantages: [B] advantages (gradient stopped).
    segment_ids: int [B], the prompt of each rollout.
    weights: [M] prompt weights w_q.
    baseline_n: N0.

  Returns:
    The scalar loss in the dtype of `log_probs`.
  """
  per_rollout = rollout_weights(weights, segment_ids, baseline_n=baseline_n)
  validation.same_shape(("log_probs", "advantages", "segment_ids"), log_probs, advantages,
                        segment_ids)
  return -jnp.sum(per_rollout * jax.lax.stop_gradient(advantages) * log_probs)
