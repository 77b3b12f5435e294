"""Classification as RL: exact, estimated and expected logit gradients.

See docs/method.md#classification-as-rl.

An image is a prompt, a sampled label a rollout, reward 1 iff the label is the
true class y. The score of label a in logit space is onehot(a) - pi, so every
estimator's parameter gradient is one vector-Jacobian product of the network
with an [M, C] logit cotangent (ascent convention):

    exact:      (1/M) (onehot(y_q) - pi_q)
    estimated:  (1/(M N0)) w_q sum_j A_qj (onehot(a_qj) - pi_q)
    expected:   (1/M) (w_q n_q / N0) c(p_q, n_q) (onehot(y_q) - pi_q)

Rollouts are sampled exactly in law in log space: a success is the event
log U < log p with log U resolved down to U = 2^-128, and a failure's label is
drawn from pi restricted to the wrong classes by inverse CDF. Rollouts are
[M, N] label indices, never [M, N, C] one-hots.
"""

from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from sera_jax.common import batching
from sera_jax.method import estimators, success, validation
from sera_jax.method.allocation import Allocation

# What `estimators.advantages` takes: a registered name, a function a(r, n, K), or an
# `estimators.Estimator` with its parameters.
EstimatorLike = str | Callable | estimators.Estimator

_TAIL_WORDS = 3  # drawn after an all-zero first word: U resolved to 2^-128 in all.
# `gram_matrix` reduces pairs of gradients for at most this many gradients (the training
# step's five or six) in leaves of at least this many parameters.
_PAIRWISE_MAX_GRADS = 6
_PAIRWISE_MIN_SIZE = 2**16
# `sample_and_score_in_slices` samples one vmapped slice after another on the CPU above this
# many rollout slots in all (measured: docs/benchmarks.md#a-loop-over-the-runs-inside-the-program).
_SLICED_MIN_SLOTS = 2**18


class Rollouts(NamedTuple):
  """Sampled labels of M prompts, padded to N rollouts.

  Attributes:
    actions: int32 [M, N] sampled labels.
    rewards: [M, N] 1.0 where the label is the true class.
    mask: bool [M, N], True on the first counts[q] slots of row q.
  """
  actions: jax.Array
  rewards: jax.Array
  mask: jax.Array


def _leading_zeros(words: jax.Array) -> jax.Array:
  """Leading zero bits of the bit string that concatenates `words` along the last axis."""
  all_zero_before = jnp.cumprod(words == 0, axis=-1)
  reached = jnp.concatenate(
      [jnp.ones_like(all_zero_before[..., :1]), all_zero_before[..., :-1]], axis=-1)
  return jnp.sum(jnp.where(reached, jax.lax.clz(words), 0), axis=-1).astype(jnp.int32)


def log_uniform(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """log U for U ~ Uniform(0, 1), exact in law down to U = 2^-128.

  jax.random.uniform has a resolution of 2^-23, so P(U < 1e-9) would be 0;
  here U = 2^-Z v with Z the leading zeros of U's random binary expansion
  (geometric, as for a uniform) and v uniform on [1/2, 1) from 23 more bits
  (float32's whole significand, its leading bit the 1/2).
  Z comes from one 32-bit word; only when some word is all zeros (probability
  2^-32 each) are three more drawn, so a draw costs two words.
  """
  head_key, tail_key = jax.random.split(key)
  leading, mantissa = jax.random.bits(head_key, (2, *shape), jnp.uint32)
  draw_tail = lambda tail_key: jax.random.bits(  # noqa: E731
      tail_key, (*shape, _TAIL_WORDS), jnp.uint32)
  return _log_uniform_from_bits(leading, mantissa, draw_tail, tail_key, dtype)


def _log_uniform_from_bits(leading, mantissa, draw_tail, tail_keys, dtype):
  """`log_uniform` from U's first 32 bits and 32 mantissa bits.

  `draw_tail(tail_keys)` gives [..., _TAIL_WORDS] more words of U's expansion; it is
  called (its draws made) only when some first word is all zeros, and in a batch of
  runs only when some run's is (`batching.cond_any`).
  """
  exhausted = leading == 0
  tail = batching.cond_any(exhausted, lambda keys: _leading_zeros(draw_tail(keys)),
                           lambda keys: jnp.zeros(leading.shape, jnp.int32), tail_keys)
  zeros = (jax.lax.clz(leading).astype(jnp.int32) + jnp.where(exhausted, tail, 0)).astype(dtype)
  # v = 1/2 + m 2^-24 is exact in the dtype, so log v < 0 keeps every digit near U = 1.
  halves = 0.5 + (mantissa >> 9).astype(dtype) * (2.0**-24)
  return jnp.log(halves) - zeros * np.log(2.0).astype(dtype)


def _slot_words(prompt_keys: jax.Array, width: int, words: int) -> jax.Array:
  """uint32 [M, width, words] for the slots of M prompts: row j of prompt q depends on
  (prompt_keys[q], j) only.

  Under partitionable threefry (forced here) the rows of a [width, words] draw are
  counted in order, so a narrower width draws a prefix of a wider one's rows.
  """
  with jax.threefry_partitionable(True):
    return jax.vmap(lambda key: jax.random.bits(key, (width, words), jnp.uint32))(prompt_keys)


def _sample_group(log_probs, label, count, log_u, label_u):
  """One prompt's rollouts from its uniforms: success iff log U < log p.

  See docs/method.md#classification-as-rl.

  A failure's label inverts the CDF of pi restricted to the wrong classes
  (mass 1 - p) at `label_u`; the first `count` slots are real.
  """
  chex.assert_rank(log_probs, 1)
  mask = jnp.arange(log_u.shape[0]) < count
  success_ = log_u < log_probs[label]
  wrong = jnp.exp(log_probs).at[label].set(0.0)
  cdf = jnp.cumsum(wrong)
  wrong_labels = jnp.minimum(jnp.searchsorted(cdf, label_u * cdf[-1], side="right"),
                             wrong.shape[0] - 1)
  actions = jnp.where(success_, label, wrong_labels).astype(jnp.int32)
  return Rollouts(actions, (success_ & mask).astype(log_probs.dtype), mask)


def sample_rollouts(key: jax.Array, logits: jax.Array, labels: jax.Array, counts: jax.Array,
                    *, max_rollouts: int) -> Rollouts:
  """Samples counts[q] labels from softmax(logits_q) for every prompt.

  See docs/method.md#classification-as-rl.

  Args:
    key: PRNG key.
    logits: [M, C] logits.
    labels: [M] true classes.
    counts: int [M] rollouts per prompt, each <= max_rollouts.
    max_rollouts: static N, the padded width.

  Returns:
    `Rollouts` of shape [M, N].

  Raises:
    ValueError: concrete counts above max_rollouts (their groups would be truncated).
  """
  max_rollouts = validation.static_width("counts", counts, "max_rollouts", max_rollouts,
                                         minimum=1)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  # Prompt q draws from fold_in(key, q), slot j from row j of that prompt's words: a
  # (prompt, slot)'s randomness depends neither on the width nor on the other prompts
  # (the figures' common random numbers rely on it), whatever the global threefry flag.
  with jax.threefry_partitionable(True):
    prompt_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        key, jnp.arange(logits.shape[0]))
    head_keys, tail_keys = jax.vmap(jax.random.split, out_axes=1)(prompt_keys)
  leading, mantissa, label_bits = jnp.moveaxis(_slot_words(head_keys, max_rollouts, 3), -1, 0)
  draw_tail = lambda tail_keys: _slot_words(tail_keys, max_rollouts, _TAIL_WORDS)  # noqa: E731
  log_u = _log_uniform_from_bits(leading, mantissa, draw_tail, tail_keys, log_probs.dtype)
  label_u = (label_bits >> 8).astype(log_probs.dtype) * (2.0**-24)  # Uniform[0, 1), 24 bits
  return jax.vmap(_sample_group)(log_probs, labels, counts, log_u, label_u)


def rollout_logit_grad(logits: jax.Array, rollouts: Rollouts, advantages: jax.Array,
                       weights: jax.Array, *, baseline_n: int) -> jax.Array:
  """(1/(M N0)) w_q sum_j A_qj (onehot(a_qj) - pi_q): minus d loss / d logits.

  See docs/method.md#weights-and-the-loss and docs/method.md#classification-as-rl.

  Equals the negative gradient of `estimators.policy_loss` over the same
  rollouts with respect to the logits, without forming one-hots.
  """
  num_prompts = logits.shape[0]
  advantages = jnp.where(rollouts.mask, advantages, 0.0)
  rows = jnp.broadcast_to(jnp.arange(num_prompts)[:, None], rollouts.actions.shape)
  chosen = jnp.zeros_like(logits).at[rows, rollouts.actions].add(advantages)
  centred = chosen - jnp.sum(advantages, axis=1, keepdims=True) * jax.nn.softmax(logits, axis=-1)
  return (weights / (num_prompts * baseline_n))[:, None] * centred


def exact_logit_grad(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """(1/M) (onehot(y_q) - pi_q) = d/dlogits of (1/M) sum_q log p_q.

  See docs/method.md#classification-as-rl.
  """
  _check_logits_labels(logits, labels)
  num_classes = logits.shape[-1]
  onehot = jax.nn.one_hot(labels, num_classes, dtype=logits.dtype)
  return (onehot - jax.nn.softmax(logits, axis=-1)) / logits.shape[0]


def estimate_logit_grad(key: jax.Array, logits: jax.Array, labels: jax.Array,
                        allocation: Allocation, *, baseline_n: int,
                        estimator: EstimatorLike = "maxrl", max_rollouts: int | None = None,
                        eps: float = 1e-6) -> jax.Array:
  """The realized ascent gradient of the loss in logit space.

  See docs/method.md#weights-and-the-loss and docs/method.md#classification-as-rl.

  Samples allocation.counts[q] labels per prompt, scores them with
  `estimator`, and returns (1/(M N0)) w_q sum_j A_qj (onehot(a_qj) - pi_q).

  Args:
    key: PRNG key.
    logits: [M, C] logits.
    labels: [M] true classes.
    allocation: counts and weights (from `sera_jax.allocate`).
    baseline_n: N0.
    estimator: a registered name, a function a(reward, group_size, successes) or an
      `estimators.Estimator` with its parameters (`estimators.estimator_spec`).
    max_rollouts: static padded width, >= every count (a concrete count above it
      raises rather than truncate its group). Defaults to max(counts) when the
      counts are concrete, which compiles anew for every new maximum: loops
      should pass `allocation.max_count(mode, baseline_n=N0, n_max=n_max)`.
    eps: the advantage stabiliser.

  Returns:
    [M, C] logit cotangent.
  """
  _check_logits_labels(logits, labels)
  max_rollouts = validation.static_width("counts", allocation.counts, "max_rollouts",
                                        max_rollouts, minimum=1)
  cotangent, _, _ = sample_and_score(key, logits, labels, allocation, baseline_n=baseline_n,
                                     estimator=estimator, max_rollouts=max_rollouts, eps=eps)
  return cotangent


def sample_and_score(key: jax.Array, logits: jax.Array, labels: jax.Array,
                     allocation: Allocation, *, baseline_n: int, estimator: EstimatorLike,
                     max_rollouts: int, eps: float = 1e-6
                     ) -> tuple[jax.Array, Rollouts, jax.Array]:
  """`estimate_logit_grad` that also returns the rollouts and their advantages."""
  rollouts = sample_rollouts(key, logits, labels, allocation.counts, max_rollouts=max_rollouts)
  advantages = estimators.advantages(rollouts.rewards, rollouts.mask, estimator=estimator,
                                     eps=eps)
  cotangent = rollout_logit_grad(logits, rollouts, advantages, allocation.weights,
                                 baseline_n=baseline_n)
  return cotangent, rollouts, advantages


def sample_and_score_in_slices(key: jax.Array, logits: jax.Array, labels: jax.Array,
                               allocation: Allocation, *, baseline_n: int,
                               estimator: EstimatorLike, max_rollouts: int, eps: float = 1e-6
                               ) -> tuple[jax.Array, Rollouts, jax.Array]:
  """`sample_and_score`, whose vmap over more than 2^18 rollout slots in all (the axis size
  times M times max_rollouts, as in a batch of runs at a large budget) samples one slice
  after another in the program lowered for the CPU (`batching.sliced_on_cpu`).

  The sampling is memory-bound: vmapped, its working set is the axis size times a slice's,
  which on the CPU outgrows the caches; in slices it stays one slice's. Below the bound a vmap
  is the faster (docs/benchmarks.md#a-loop-over-the-runs-inside-the-program). Either way a
  slice's values are `sample_and_score`'s.
  """

  def sample(key, logits, labels, allocation):
    return sample_and_score(key, logits, labels, allocation, baseline_n=baseline_n,
                            estimator=estimator, max_rollouts=max_rollouts, eps=eps)

  def many_slots(axis_size, in_batched, key, logits, *rest):
    return axis_size * logits.shape[-2] * max_rollouts > _SLICED_MIN_SLOTS

  return batching.sliced_on_cpu(sample, many_slots)(key, logits, labels, allocation)


def expected_logit_grad(logits: jax.Array, labels: jax.Array, allocation: Allocation, *,
                        baseline_n: int, estimator: EstimatorLike = "maxrl",
                        max_rollouts: int | None = None, eps: float = 1e-6) -> jax.Array:
  """E[estimate_logit_grad] = (1/M) (w_q n_q / N0) c(p_q, n_q) (onehot(y_q) - pi_q).

  See docs/method.md#classification-as-rl.

  c is `estimators.expected_scale`, exact for any eps. Arguments as in
  `estimate_logit_grad` (the same static `max_rollouts`).
  """
  _check_logits_labels(logits, labels)
  max_rollouts = validation.static_width("counts", allocation.counts, "max_rollouts",
                                        max_rollouts, minimum=1)
  log_p = success.oracle_log_p(logits, labels)
  scale = estimators.expected_scale(estimator, log_p, allocation.counts, eps=eps,
                                    max_n=max_rollouts)
  prompt_scale = allocation.weights * allocation.counts / baseline_n * scale
  return prompt_scale[:, None] * exact_logit_grad(logits, labels)


def stacked_vjp(vjp_fn, cotangents):
  """`vjp_fn` of each cotangent (one forward pass, several backward passes), stacked.

  One backward pass per cotangent rather than `jax.vmap(vjp_fn)`: vmap folds the
  cotangent axis into every convolution's batch axis, in front of it, and on a
  device mesh the batch sharding does not survive that reshape, so XLA runs the
  backward pass of the whole global batch on every device (ResNet-50, 32 prompts a
  device on 8 devices: 25.4 GiB a device instead of 5.4). Separate passes stay
  split; on one device they take the vmapped pass's time and less memory
  (ResNet-50, 256 prompts: 36.6 GiB against 48.0). `benchmarks/memory.py` measures it.

  Args:
    vjp_fn: the function `jax.vjp` returned.
    cotangents: k cotangents of the forward pass's output.

  Returns:
    `vjp_fn`'s output structure with each leaf stacked to [k, ...].
  """
  return jax.tree.map(lambda *grads: jnp.stack(grads), *(vjp_fn(c) for c in cotangents))


def gram_matrix(stacked_grads) -> jax.Array:
  """[k, k] inner products of k gradients stacked on the leading axis of each leaf.

  Small leaves, and every leaf when k is large, are flattened to [k, P] and
  multiplied by their transpose. For the training step's handful of gradients,
  a large leaf's entries are instead k (k + 1) / 2 multiply-reduce passes over
  the leaf as the backward pass laid it out: flattening a kernel gradient laid
  out transposed costs a copy of all k gradients, and a
  [k, P] x [P, k] product with tiny k and P in the millions is slow on XLA's CPU
  backend (`benchmarks/alignment_step.py` measures the step with this Gram).
  """
  leaves = [leaf.astype(jnp.float32) for leaf in jax.tree.leaves(stacked_grads)]
  num_grads = leaves[0].shape[0]
  in_pairs = lambda leaf: (num_grads <= _PAIRWISE_MAX_GRADS  # noqa: E731
                           and leaf.size // num_grads >= _PAIRWISE_MIN_SIZE)
  pairwise = [leaf for leaf in leaves if in_pairs(leaf)]
  flat = [leaf.reshape(num_grads, -1) for leaf in leaves if not in_pairs(leaf)]
  gram = sum(f @ f.T for f in flat)
  if pairwise:
    upper = {(i, j): sum(jnp.sum(leaf[i] * leaf[j]) for leaf in pairwise)
             for i in range(num_grads) for j in range(i, num_grads)}
    gram = gram + jnp.stack([jnp.stack([upper[min(i, j), max(i, j)] for j in range(num_grads)])
                             for i in range(num_grads)])
  return gram


def cosines(gram: jax.Array) -> jax.Array:
  """Cosine similarities from a Gram matrix (0 where a norm is 0)."""
  norms = jnp.sqrt(jnp.diag(gram))
  denominator = norms[:, None] * norms[None, :]
  return jnp.where(denominator > 0, gram / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def _check_logits_labels(logits, labels):
  validation.rank("logits", logits, 2)
  validation.rank("labels", labels, 1)
  if jnp.shape(labels)[0] != jnp.shape(logits)[0]:
    raise ValueError(f"labels {jnp.shape(labels)} must have one entry per row of logits "
                     f"{jnp.shape(logits)}.")
