"""Scale factors of finite-sample MaxRL estimators, in log space.

For a prompt with success probability p (given as log p) and n rollouts
(docs/method.md#the-estimator-and-its-scale):

* `fidelity`  kappa(p, n) = 1 - (1 - p)^(n - 1)    (centered MaxRL)
* `coverage`  pass@n      = 1 - (1 - p)^n          (plain MaxRL)
* `mixed_probability`     = 1 - (1 - p)^n - p^n    (a group is mixed, docs/method.md#the-active-set)
* `truncated_objective`   J_n = -sum_{k=1..n} (1 - p)^k / k, the order-n
  truncation of log p = -sum_k (1 - p)^k / k, whose gradient is
  coverage(p, n) * grad log p.

All functions take log p so that p far below float precision (log p = -1000)
and p a hair below one (log p = -1e-12) stay accurate: 1 - p is formed as
-expm1(log p) and log(1 - p) as log1mexp(log p), never as 1 - exp(log p).
"""

import jax
import jax.numpy as jnp

from sera_jax.method import validation

_LOG_HALF = -0.6931471805599453
_LOG_QUARTER = -1.3862943611198906


def log1mexp(x: jax.Array) -> jax.Array:
  """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012).

  Three branches, not Maechler's two: XLA's float64 log1p on the CPU loses
  ~100 ulp for arguments in (-0.5, -0.25), so there 1 - exp(x), which is
  exact to half an ulp, goes through log instead.
  """
  x = jnp.asarray(x)
  near_zero = x > _LOG_HALF
  middle = ~near_zero & (x > _LOG_QUARTER)
  safe = lambda cond, fallback: jnp.where(cond, x, fallback)  # noqa: E731
  return jnp.select(
      [near_zero, middle],
      [jnp.log(-jnp.expm1(safe(near_zero, _LOG_HALF))),
       jnp.log(1 - jnp.exp(safe(middle, _LOG_HALF)))],
      jnp.log1p(-jnp.exp(safe(~near_zero & ~middle, _LOG_QUARTER))))


def failure_rate(log_p: jax.Array) -> jax.Array:
  """lambda = -log(1 - p) (docs/method.md#the-waterline), computed from log p."""
  return -log1mexp(log_p)


def log_power(log_x: jax.Array, n: jax.Array) -> jax.Array:
  """log(x^n) = n log x, with 0 * log(0) = 0 so that x = 0, n = 0 gives 1."""
  return jnp.where(n == 0, 0.0, n * log_x)


def _broadcast(log_p, n):
  log_p = jnp.asarray(log_p)
  n = jnp.asarray(n, dtype=log_p.dtype)
  return jnp.broadcast_arrays(log_p, n)


# The formulas, on log p and log q = log(1 - p) computed once by the caller
# (the allocator evaluates them for many n on the same prompts).


def fidelity_from_logs(log_q: jax.Array, n: jax.Array) -> jax.Array:
  """kappa from log q = log(1 - p); see `fidelity`."""
  return jnp.where(n >= 1, -jnp.expm1(log_power(log_q, jnp.maximum(n - 1, 0))), 0.0)


def coverage_from_logs(log_q: jax.Array, n: jax.Array) -> jax.Array:
  """pass@n from log q = log(1 - p); see `coverage`."""
  return -jnp.expm1(log_power(log_q, n))


def mixed_from_logs(log_p: jax.Array, log_q: jax.Array, n: jax.Array) -> jax.Array:
  """mixed from log p and log q = log(1 - p); see `mixed_probability`."""
  log_q_n, log_p_n = log_power(log_q, n), n * log_p
  small_p = log_p < _LOG_HALF
  # small p: (1 - (1-p)^n) - p^n ; large p: (1 - p^n) - (1-p)^n.
  big, small = jnp.where(small_p, log_q_n, log_p_n), jnp.where(small_p, log_p_n, log_q_n)
  value = -jnp.expm1(big) - jnp.exp(small)
  return jnp.where(n > 1, jnp.clip(value, 0.0, 1.0), 0.0)


def log_unmixed_from_logs(log_p: jax.Array, log_q: jax.Array, n: jax.Array) -> jax.Array:
  """log(1 - mixed) from log p and log q = log(1 - p); see `log_unmixed_probability`."""
  return jnp.logaddexp(log_power(log_q, n), n * log_p)


def _logs(log_p, n):
  log_p, n = _broadcast(validation.log_probabilities("log_p", log_p), n)
  return log_p, log1mexp(log_p), n


def fidelity(log_p: jax.Array, n: jax.Array) -> jax.Array:
  """kappa(p, n) = 1 - (1 - p)^(n - 1), and 0 at n = 0 (docs/method.md#the-estimator-and-its-scale).

  E[g] = kappa(p, n) grad log p for the centered MaxRL estimator with n
  rollouts; kappa(p, 1) = 0 (one rollout carries no signal).

  Args:
    log_p: log success probabilities, finite and <= 0.
    n: rollout counts (>= 0), broadcastable against `log_p`.

  Returns:
    kappa with the broadcast shape, in the floating dtype of `log_p`.
  """
  _, log_q, n = _logs(log_p, n)
  return fidelity_from_logs(log_q, n)


def coverage(log_p: jax.Array, n: jax.Array) -> jax.Array:
  """pass@n = 1 - (1 - p)^n, the scale of the plain MaxRL estimator.

  See docs/method.md#the-estimator-and-its-scale.
  """
  _, log_q, n = _logs(log_p, n)
  return coverage_from_logs(log_q, n)


def mixed_probability(log_p: jax.Array, n: jax.Array) -> jax.Array:
  """P(0 < K < n) = 1 - (1 - p)^n - p^n for n > 0, else 0 (docs/method.md#the-active-set).

  Exactly 0 for n <= 1 (a single rollout is never mixed).

  Whichever of (1 - p)^n and p^n is the larger is taken out through expm1 so
  that the difference keeps its digits for p near 0 and near 1.
  """
  return mixed_from_logs(*_logs(log_p, n))


def log_unmixed_probability(log_p: jax.Array, n: jax.Array) -> jax.Array:
  """log P(K = 0 or K = n) = log((1 - p)^n + p^n): the log of 1 - mixed.

  See docs/method.md#the-active-set.

  Ranks prompts by how mixed their groups are without saturating where
  mixed rounds to 1 (p = 0.5, n = 512 has 1 - mixed = 2^-511).
  """
  return log_unmixed_from_logs(*_logs(log_p, n))


def truncated_objective(log_p: jax.Array, n: int) -> jax.Array:
  """J_n(p) = -sum_{k=1..n} (1 - p)^k / k, the order-n truncation of log p.

  dJ_n/dp = (1 - (1-p)^n) / p, so grad J_n = coverage(p, n) grad log p: the
  plain MaxRL estimator with n rollouts is unbiased for J_n, and centered
  MaxRL with n rollouts for J_{n-1}. J_n -> log p as n -> infinity.

  Args:
    log_p: log success probabilities, finite and <= 0.
    n: the truncation order, a static Python int >= 0 (J_0 = 0).
  """
  log_p = validation.log_probabilities("log_p", log_p)
  n = validation.integer("n", n, minimum=0)
  k = jnp.arange(1, n + 1, dtype=log_p.dtype)
  log_q = log1mexp(log_p)[..., None]
  return -jnp.sum(jnp.exp(k * log_q) / k, axis=-1)
