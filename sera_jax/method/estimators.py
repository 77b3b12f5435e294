"""Group advantage estimators for binary rewards, their exact scales, and the loss.

Every estimator here gives rollout j of a group an advantage that depends only
on its own reward r_j, the group size n and the group's success count K
(docs/method.md#the-estimator-and-its-scale). That one per-rollout formula,
`rollout_advantage(r, n, K)`, is shared by

* `advantages`, which evaluates it on padded reward tensors [M, N],
* `expected_scale`, which evaluates it at r = 1 (a_s(K)) and r = 0 (a_f(K)) to
  sum the closed form c(p, n) of docs/method.md#the-estimator-and-its-scale exactly, and
* `sera_jax.method.flat.flat_advantages`, on a flat buffer with segment ids,

so they cannot drift apart. `policy_loss` is the surrogate loss of
docs/method.md#weights-and-the-loss.
"""

import functools
from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln

from sera_jax.method import validation
from sera_jax.method.scaling import log1mexp

ESTIMATORS = ("maxrl", "maxrl_plain", "grpo", "grpo_sample_std", "rloo", "reinforce")


def _safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """numerator / denominator, and 0 where the denominator is 0 (no NaN, even in grads)."""
  nonzero = denominator != 0
  return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def _maxrl(r, n, k, mean, eps):
  # Centered MaxRL (docs/method.md#the-estimator-and-its-scale): (r - mu) / (mu + eps), silenced
  # when no rollout succeeded.
  return jnp.where(k > 0, _safe_divide(r - mean, mean + eps), 0)


def _maxrl_plain(r, n, k, mean, eps):
  # Plain MaxRL: r / (mu + eps) = (1/K) r n at eps = 0, its scale is pass@n.
  return jnp.where(k > 0, _safe_divide(r, mean + eps), 0)


def _grpo(r, n, k, mean, eps):
  # Population std of 0/1 rewards is sqrt(mu (1 - mu)); exact for binary rewards.
  std = jnp.sqrt(jnp.maximum(mean * (1 - mean), 0))
  return _safe_divide(r - mean, std + eps)


def _grpo_sample_std(r, n, k, mean, eps):
  # Sample std (ddof = 1) of 0/1 rewards: sqrt(n mu (1 - mu) / (n - 1)), 0 for one rollout.
  std = jnp.sqrt(jnp.maximum(_safe_divide(n * mean * (1 - mean), n - 1), 0))
  return _safe_divide(r - mean, std + eps)


def _rloo(r, n, k, mean, eps):
  # Leave-one-out baseline: the mean reward of the other n - 1 rollouts.
  return jnp.where(n >= 2, r - _safe_divide(k - r, n - 1), 0)


def _reinforce(r, n, k, mean, eps):
  return r - mean


_ADVANTAGE_OF: dict[str, Callable[..., jax.Array]] = {
    "maxrl": _maxrl,
    "maxrl_plain": _maxrl_plain,
    "grpo": _grpo,
    "grpo_sample_std": _grpo_sample_std,
    "rloo": _rloo,
    "reinforce": _reinforce,
}


def rollout_advantage(estimator: str, reward, group_size, successes, eps: float = 1e-6
                      ) -> jax.Array:
  """Advantage of one rollout with reward r in a group of n with K successes.

  See docs/method.md#the-estimator-and-its-scale.

  The one formula behind `advantages` (padded groups), `expected_scale` (at r = 1
  and r = 0) and `sera_jax.method.flat.flat_advantages` (flat buffers); 0 when n = 0.
  Arguments broadcast; `estimator` is static and not checked here.
  """
  mean = _safe_divide(successes, group_size)
  value = _ADVANTAGE_OF[estimator](reward, group_size, successes, mean, eps)
  return jnp.where(group_size > 0, value, 0)


def _group_advantages(rewards: jax.Array, mask: jax.Array, *, estimator: str,
                      eps: float) -> jax.Array:
  """Advantages of one group: rewards [N] (0/1), mask [N] bool -> [N], 0 on masked slots."""
  chex.assert_rank([rewards, mask], 1)
  chex.assert_equal_shape([rewards, mask])
  valid = mask.astype(rewards.dtype)
  group_size = jnp.sum(valid)
  successes = jnp.sum(rewards * valid)
  value = rollout_advantage(estimator, rewards, group_size, successes, eps)
  return jnp.where(mask, value, 0)


def _float_array(x) -> jax.Array:
  arr = jnp.asarray(x)
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    arr = arr.astype(jnp.result_type(float))
  return arr


def advantages(rewards: jax.Array, mask: jax.Array, *, estimator: str = "maxrl",
               eps: float = 1e-6) -> jax.Array:
  """Per-rollout advantages of M padded groups of binary rewards.

  See docs/method.md#the-estimator-and-its-scale.

  For group q, n = sum_j mask_qj, K = sum_j r_qj mask_qj and mu = K / n:

  * "maxrl"       (r - mu) / (mu + eps); 0 for the whole group when K = 0.
  * "maxrl_plain" r / (mu + eps); 0 when K = 0.
  * "grpo"        (r - mu) / (std + eps), std the population std sqrt(mu (1 - mu))
                    (the MaxRL paper's GRPO).
  * "grpo_sample_std"  (r - mu) / (std + eps), std the sample std (ddof = 1)
                    sqrt(n mu (1 - mu) / (n - 1)), 0 when n = 1 (Tunix's, verl's
                    and TRL's GRPO; Tunix adds eps = 1e-6 too).
  * "rloo"        r_j - (K - r_j) / (n - 1); 0 when n < 2.
  * "reinforce"   r - mu.

  Masked slots and groups with n = 0 get 0. Runs under `jax.jit` with
  `estimator` static; value checks run only on concrete inputs. It compiles once
  per padded width N: pad every step to one static width
  (`allocation.max_count(mode, baseline_n=N0, n_max=n_max)`), not to max(counts),
  which would compile anew whenever the largest group grows.

  Args:
    rewards: [M, N] rewards, each 0 or 1 (padded slots may hold either).
    mask: [M, N] boolean-like, True on real rollouts.
    estimator: one of `ESTIMATORS`.
    eps: the stabiliser in the denominators of "maxrl", "maxrl_plain" and both GRPOs.

  Returns:
    [M, N] advantages in the floating dtype of `rewards` (float32 by default).
  """
  validation.choice("estimator", estimator, ESTIMATORS)
  rewards = _float_array(validation.binary("rewards", rewards))
  mask = validation.mask("mask", mask)
  validation.rank("rewards", rewards, 2)
  validation.same_shape(("rewards", "mask"), rewards, mask)
  return _batched_advantages(rewards, mask, estimator=estimator, eps=eps)


@functools.partial(jax.jit, static_argnames="estimator")
def _batched_advantages(rewards, mask, *, estimator, eps):
  per_group = functools.partial(_group_advantages, estimator=estimator, eps=eps)
  return jax.vmap(per_group)(rewards, mask)


def _rollout_counts(n, dtype, max_n: int | None) -> tuple[jax.Array, int]:
  """Validates n (integers >= 0) and returns it as `dtype` with the static grid size."""
  n = jnp.asarray(n)
  if validation.is_concrete(n):
    values = np.asarray(n)
    bad = ~((values >= 0) & (values == np.round(values)))
    if bad.any():
      raise ValueError(f"n must hold integers >= 0; found {validation._first_bad(bad, values)}.")
  return n.astype(dtype), validation.static_width("n", n, "max_n", max_n)


def expected_scale(estimator: str, log_p: jax.Array, n: jax.Array, *, eps: float = 1e-6,
                   max_n: int | None = None) -> jax.Array:
  """Exact scale c(p, n) with E[g] = c(p, n) grad log p for a group of n rollouts.

  docs/method.md#the-estimator-and-its-scale gives

      c(p, n) = (1/n) sum_{K=0..n} Binom(K; n, p) [K a_s(K) - (n - K) a_f(K) p / (1 - p)],

  with a_s(K), a_f(K) the advantages `advantages` gives a success and a
  failure in a group of n with K successes. The identities
  K Binom(K; n, p) = n p Binom(K - 1; n - 1, p) and
  (n - K) Binom(K; n, p) p / (1 - p) = n p Binom(K; n - 1, p) turn it, term by
  term and exactly, into

      c(p, n) = p * sum_{k=0..n-1} Binom(k; n - 1, p) [a_s(k + 1) - a_f(k)],

  which never forms p / (1 - p) (finite at p -> 1, no cancellation of huge
  terms) and is what is summed here, with the binomial pmf in log space.
  At eps = 0 it equals kappa (maxrl), coverage (maxrl_plain), (1 - 1/n) p
  (reinforce) and p (rloo, n >= 2); it is exact for any eps.

  Args:
    estimator: one of `ESTIMATORS`.
    log_p: log success probabilities, finite and <= 0.
    n: rollout counts (integers >= 0), broadcastable against `log_p`; n = 0 gives 0.
    eps: as in `advantages`.
    max_n: static upper bound on n (the size of the K grid); a concrete n above
      it raises. Defaults to max(n) when n is concrete, which compiles anew for
      every new max(n): training loops should pass one static bound
      (`allocation.max_count(mode, baseline_n=N0, n_max=n_max)`). Required under
      `jax.jit`, where n above max_n cannot be detected and would truncate the sum.

  In float32 the result is accurate to about 1e-4 relative for n in the
  hundreds (rounding of gammaln); in float64 to about 1e-12.

  Returns:
    c(p, n) with the broadcast shape of `log_p` and `n`, in the dtype of `log_p`
    (float32 for 16-bit `log_p`).
  """
  validation.choice("estimator", estimator, ESTIMATORS)
  log_p = validation.log_probabilities("log_p", log_p)
  n, max_n = _rollout_counts(n, log_p.dtype, max_n)
  return _expected_scale(log_p, n, estimator=estimator, eps=eps, max_n=max_n)


@functools.partial(jax.jit, static_argnames=("estimator", "max_n"))
def _expected_scale(log_p, n, *, estimator, eps, max_n):
  log_p, n = jnp.broadcast_arrays(log_p, n)
  others = jnp.maximum(n - 1, 0)[..., None]  # the n - 1 rollouts besides the one scored
  k = jnp.arange(max_n, dtype=log_p.dtype)  # successes among them: 0..max_n - 1
  in_range = k <= others
  failures = jnp.where(in_range, others - k, 0)
  log_p_ = log_p[..., None]
  # k log p + (others - k) log(1 - p) with 0 * log 0 = 0 so that p = 1 stays finite.
  log_powers = k * log_p_ + jnp.where(failures > 0, failures * log1mexp(log_p_), 0)
  log_choose = gammaln(others + 1) - gammaln(k + 1) - gammaln(failures + 1)
  pmf = jnp.where(in_range, jnp.exp(log_choose + log_powers), 0)
  # The pmf sums to 1 exactly; renormalising removes the rounding shared by every term
  # (gammaln(n) is ~n log n large), which is most of the float error at n in the hundreds.
  pmf = _safe_divide(pmf, jnp.sum(pmf, axis=-1, keepdims=True))
  group_size = n[..., None]
  a_success = rollout_advantage(estimator, 1.0, group_size, k + 1, eps)
  a_failure = rollout_advantage(estimator, 0.0, group_size, k, eps)
  scale = jnp.exp(log_p) * jnp.sum(pmf * (a_success - a_failure), axis=-1)
  return jnp.where(n > 0, scale, 0)


def policy_loss(log_probs: jax.Array, advantages: jax.Array, mask: jax.Array,
                weights: jax.Array, baseline_n: int) -> jax.Array:
  """Surrogate loss of docs/method.md#weights-and-the-loss (descent convention).

      loss = -(1 / (M N0)) sum_q w_q sum_j mask_qj * stop_gradient(A_qj) * log pi(z_qj | x_q)

  so d loss / d log_probs_qj = -(w_q / (M N0)) A_qj mask_qj. Padded slots
  contribute nothing (not even NaN from garbage log-probabilities there).

  Args:
    log_probs: [M, N] log pi(z_qj | x_q) of each rollout (differentiable).
    advantages: [M, N] advantages (gradient stopped).
    mask: [M, N] boolean-like, True on real rollouts.
    weights: [M] prompt weights w_q (e.g. `Allocation.weights`, N0 / n_q).
    baseline_n: N0, the per-prompt baseline of the budget M * N0.

  Returns:
    The scalar loss, in the dtype of `log_probs`.
  """
  baseline_n = validation.integer("baseline_n", baseline_n, minimum=1)
  mask = validation.mask("mask", mask)
  validation.rank("log_probs", log_probs, 2)
  validation.same_shape(("log_probs", "advantages", "mask"), log_probs, advantages, mask)
  validation.rank("weights", weights, 1)
  if jnp.shape(weights)[0] != jnp.shape(log_probs)[0]:
    raise ValueError(
        f"weights must have shape [M] = [{jnp.shape(log_probs)[0]}] to match log_probs "
        f"{tuple(jnp.shape(log_probs))}; got {tuple(jnp.shape(weights))}.")
  num_prompts = jnp.shape(log_probs)[0]
  per_rollout = jnp.where(mask, jax.lax.stop_gradient(advantages) * log_probs, 0)
  per_prompt = jnp.sum(per_rollout, axis=1)
  return -jnp.sum(weights * per_prompt) / (num_prompts * baseline_n)
